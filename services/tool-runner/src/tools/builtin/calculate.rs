//! `calculate`: evaluates an arithmetic expression. The expression is tokenized and parsed by a
//! small recursive-descent parser into numbers; nothing is ever evaluated as code.
//!
//! Grammar (usual precedence, `^` right-associative and binding tighter than unary minus):
//! ```text
//! expr    = term (("+" | "-") term)*
//! term    = unary (("*" | "/" | "%") unary)*
//! unary   = ("-" | "+") unary | power
//! power   = primary ("^" unary)?
//! primary = number | constant | function "(" expr ("," expr)* ")" | "(" expr ")"
//! ```

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::{Value, json};

use super::{Builtin, spec};
use crate::tools::{Args, CallContext, Tool, ToolError, ToolResult, str_arg};

/// Longest expression accepted, in characters (also the schema's `maxLength`).
const MAX_EXPRESSION_CHARS: usize = 4096;
/// Deepest nesting of parentheses / unary operators; guards the parser's stack.
const MAX_NESTING: usize = 64;

struct Calculate;

impl Tool for Calculate {
    fn call(&self, args: Args, _ctx: &CallContext) -> BoxFuture<'static, ToolResult> {
        let expression = str_arg(&args, "expression").unwrap_or_default().to_owned();
        let result = evaluate(&expression)
            .map(|value| json!({ "expression": expression, "value": number_json(value) }))
            .map_err(ToolError::invalid);
        futures::future::ready(result).boxed()
    }
}

pub(super) fn builtin() -> Builtin {
    let schema = json!({
        "type": "object",
        "properties": {
            "expression": {
                "type": "string",
                "minLength": 1,
                "maxLength": MAX_EXPRESSION_CHARS,
                "description": "Arithmetic, e.g. \"(2 + 3) * 4 ^ 2 / sqrt(16)\". Operators + - * / % ^, parentheses, functions sqrt abs ln log10 log2 exp sin cos tan asin acos atan floor ceil round min max pow, constants pi e tau."
            }
        },
        "required": ["expression"],
        "additionalProperties": false
    });
    Builtin::Enabled(
        spec(
            "calculate",
            "Evaluates an arithmetic expression exactly as a calculator would.",
            schema,
            Duration::from_secs(5),
        ),
        Arc::new(Calculate),
    )
}

/// Integral results print as integers (`6`, not `6.0`) where that is exact.
fn number_json(value: f64) -> Value {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53
    if value.fract() == 0.0 && value.abs() < EXACT {
        #[allow(clippy::cast_possible_truncation)]
        return json!(value as i64);
    }
    json!(value)
}

/// Parses and evaluates `input`; the error says what is wrong and where.
pub(super) fn evaluate(input: &str) -> Result<f64, String> {
    let tokens = tokenize(input)?;
    let mut parser = Parser {
        tokens,
        pos: 0,
        depth: 0,
    };
    let value = parser.expr()?;
    if let Some((token, at)) = parser.tokens.get(parser.pos) {
        return Err(format!("unexpected {token} at character {}", at + 1));
    }
    if !value.is_finite() {
        return Err("the result is not a finite number (overflow or an undefined operation)".into());
    }
    Ok(value)
}

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Num(f64),
    Ident(String),
    Op(char),
    Open,
    Close,
    Comma,
}

impl std::fmt::Display for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Token::Num(n) => write!(f, "number {n}"),
            Token::Ident(s) => write!(f, "name {s:?}"),
            Token::Op(c) => write!(f, "operator '{c}'"),
            Token::Open => f.write_str("'('"),
            Token::Close => f.write_str("')'"),
            Token::Comma => f.write_str("','"),
        }
    }
}

fn tokenize(input: &str) -> Result<Vec<(Token, usize)>, String> {
    let chars: Vec<char> = input.chars().collect();
    let mut tokens = Vec::new();
    let mut i = 0;
    while let Some(&c) = chars.get(i) {
        let start = i;
        match c {
            c if c.is_whitespace() => i += 1,
            '0'..='9' | '.' => {
                while chars.get(i).is_some_and(|c| c.is_ascii_digit() || *c == '.') {
                    i += 1;
                }
                // Exponent: 1e3, 2.5E-4
                if chars.get(i).is_some_and(|c| *c == 'e' || *c == 'E')
                    && (chars.get(i + 1).is_some_and(char::is_ascii_digit)
                        || (chars.get(i + 1).is_some_and(|c| *c == '+' || *c == '-')
                            && chars.get(i + 2).is_some_and(char::is_ascii_digit)))
                {
                    i += 2;
                    while chars.get(i).is_some_and(char::is_ascii_digit) {
                        i += 1;
                    }
                }
                let text: String = chars[start..i].iter().collect();
                let n = text
                    .parse::<f64>()
                    .map_err(|_| format!("malformed number {text:?} at character {}", start + 1))?;
                tokens.push((Token::Num(n), start));
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                while chars.get(i).is_some_and(|c| c.is_ascii_alphanumeric() || *c == '_') {
                    i += 1;
                }
                tokens.push((
                    Token::Ident(chars[start..i].iter().collect::<String>().to_ascii_lowercase()),
                    start,
                ));
            }
            '+' | '-' | '*' | '/' | '%' | '^' => {
                i += 1;
                // Accept `**` as power, as in many languages.
                if c == '*' && chars.get(i) == Some(&'*') {
                    i += 1;
                    tokens.push((Token::Op('^'), start));
                } else {
                    tokens.push((Token::Op(c), start));
                }
            }
            '(' => {
                i += 1;
                tokens.push((Token::Open, start));
            }
            ')' => {
                i += 1;
                tokens.push((Token::Close, start));
            }
            ',' => {
                i += 1;
                tokens.push((Token::Comma, start));
            }
            other => return Err(format!("unexpected character {other:?} at character {}", start + 1)),
        }
    }
    if tokens.is_empty() {
        return Err("the expression is empty".into());
    }
    Ok(tokens)
}

struct Parser {
    tokens: Vec<(Token, usize)>,
    pos: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.pos).map(|(t, _)| t)
    }

    fn next(&mut self) -> Result<(Token, usize), String> {
        let token = self
            .tokens
            .get(self.pos)
            .cloned()
            .ok_or("the expression ends too early")?;
        self.pos += 1;
        Ok(token)
    }

    fn nest(&mut self) -> Result<(), String> {
        self.depth += 1;
        if self.depth > MAX_NESTING {
            return Err(format!("the expression nests deeper than {MAX_NESTING} levels"));
        }
        Ok(())
    }

    fn expr(&mut self) -> Result<f64, String> {
        let mut value = self.term()?;
        while let Some(Token::Op(op @ ('+' | '-'))) = self.peek().cloned() {
            self.pos += 1;
            let rhs = self.term()?;
            value = if op == '+' { value + rhs } else { value - rhs };
        }
        Ok(value)
    }

    fn term(&mut self) -> Result<f64, String> {
        let mut value = self.unary()?;
        while let Some(Token::Op(op @ ('*' | '/' | '%'))) = self.peek().cloned() {
            self.pos += 1;
            let rhs = self.unary()?;
            value = match op {
                '*' => value * rhs,
                _ if rhs == 0.0 => return Err("division by zero".into()),
                '/' => value / rhs,
                _ => value % rhs,
            };
        }
        Ok(value)
    }

    fn unary(&mut self) -> Result<f64, String> {
        let Some(Token::Op(sign @ ('-' | '+'))) = self.peek().cloned() else {
            return self.power();
        };
        self.pos += 1;
        self.nest()?;
        let value = self.unary()?;
        self.depth -= 1;
        Ok(if sign == '-' { -value } else { value })
    }

    fn power(&mut self) -> Result<f64, String> {
        let base = self.primary()?;
        if self.peek() == Some(&Token::Op('^')) {
            self.pos += 1;
            let exponent = self.unary()?;
            return Ok(base.powf(exponent));
        }
        Ok(base)
    }

    fn primary(&mut self) -> Result<f64, String> {
        let (token, at) = self.next()?;
        match token {
            Token::Num(n) => Ok(n),
            Token::Open => {
                self.nest()?;
                let value = self.expr()?;
                self.expect_close(at)?;
                self.depth -= 1;
                Ok(value)
            }
            Token::Ident(name) => {
                if self.peek() == Some(&Token::Open) {
                    self.pos += 1;
                    self.nest()?;
                    let mut args = vec![self.expr()?];
                    while self.peek() == Some(&Token::Comma) {
                        self.pos += 1;
                        args.push(self.expr()?);
                    }
                    self.expect_close(at)?;
                    self.depth -= 1;
                    apply(&name, &args)
                } else {
                    constant(&name).ok_or_else(|| format!("unknown name {name:?} at character {}", at + 1))
                }
            }
            other => Err(format!("unexpected {other} at character {}", at + 1)),
        }
    }

    fn expect_close(&mut self, opened_at: usize) -> Result<(), String> {
        match self.next() {
            Ok((Token::Close, _)) => Ok(()),
            Ok((other, at)) => Err(format!("expected ')' but found {other} at character {}", at + 1)),
            Err(_) => Err(format!("the '(' at character {} is never closed", opened_at + 1)),
        }
    }
}

fn constant(name: &str) -> Option<f64> {
    match name {
        "pi" => Some(std::f64::consts::PI),
        "e" => Some(std::f64::consts::E),
        "tau" => Some(std::f64::consts::TAU),
        _ => None,
    }
}

fn apply(name: &str, args: &[f64]) -> Result<f64, String> {
    let one = |f: fn(f64) -> f64| match args {
        [x] => Ok(f(*x)),
        _ => Err(format!("{name}() takes 1 argument, got {}", args.len())),
    };
    match name {
        "sqrt" => match args {
            [x] if *x < 0.0 => Err("sqrt() of a negative number".into()),
            _ => one(f64::sqrt),
        },
        "abs" => one(f64::abs),
        "ln" => one(f64::ln),
        "log10" | "log" => one(f64::log10),
        "log2" => one(f64::log2),
        "exp" => one(f64::exp),
        "sin" => one(f64::sin),
        "cos" => one(f64::cos),
        "tan" => one(f64::tan),
        "asin" => one(f64::asin),
        "acos" => one(f64::acos),
        "atan" => one(f64::atan),
        "floor" => one(f64::floor),
        "ceil" => one(f64::ceil),
        "round" => one(f64::round),
        "pow" => match args {
            [b, e] => Ok(b.powf(*e)),
            _ => Err(format!("pow() takes 2 arguments, got {}", args.len())),
        },
        "min" => args
            .iter()
            .copied()
            .reduce(f64::min)
            .ok_or_else(|| "min() needs arguments".into()),
        "max" => args
            .iter()
            .copied()
            .reduce(f64::max)
            .ok_or_else(|| "max() needs arguments".into()),
        other => Err(format!("unknown function {other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::evaluate;

    fn ok(expr: &str) -> f64 {
        match evaluate(expr) {
            Ok(v) => v,
            Err(e) => panic!("{expr}: {e}"),
        }
    }

    #[test]
    fn precedence_and_associativity() {
        assert_eq!(ok("1 + 2 * 3"), 7.0);
        assert_eq!(ok("(1 + 2) * 3"), 9.0);
        assert_eq!(ok("2 ^ 3 ^ 2"), 512.0);
        assert_eq!(ok("-2 ^ 2"), -4.0);
        assert_eq!(ok("2 ** -1"), 0.5);
        assert_eq!(ok("10 - 4 - 3"), 3.0);
        assert_eq!(ok("7 % 4"), 3.0);
        assert_eq!(ok("1.5e3 + 2E-1"), 1500.2);
    }

    #[test]
    fn functions_and_constants() {
        assert_eq!(ok("sqrt(16) + abs(-2)"), 6.0);
        assert_eq!(ok("max(1, 5, 3) - min(4, 2)"), 3.0);
        assert_eq!(ok("pow(2, 10)"), 1024.0);
        assert!((ok("2 * pi") - std::f64::consts::TAU).abs() < 1e-12);
        assert_eq!(ok("round(2.5)"), 3.0);
    }

    #[test]
    fn errors_say_what_and_where() {
        assert_eq!(evaluate("1 / 0").unwrap_err(), "division by zero");
        assert_eq!(evaluate("2 +").unwrap_err(), "the expression ends too early");
        assert_eq!(
            evaluate("(1 + 2").unwrap_err(),
            "the '(' at character 1 is never closed"
        );
        assert_eq!(evaluate("1 + x").unwrap_err(), "unknown name \"x\" at character 5");
        assert_eq!(
            evaluate("1; rm -rf /").unwrap_err(),
            "unexpected character ';' at character 2"
        );
        assert_eq!(
            evaluate("__import__('os')").unwrap_err(),
            "unexpected character '\\'' at character 12"
        );
        assert_eq!(evaluate("1 2").unwrap_err(), "unexpected number 2 at character 3");
        assert!(evaluate("sqrt(-1)").unwrap_err().contains("negative"));
        assert!(evaluate("10 ^ 400").unwrap_err().contains("not a finite number"));
        assert!(evaluate("  ").unwrap_err().contains("empty"));
        assert!(evaluate("sqrt(1, 2)").unwrap_err().contains("takes 1 argument"));
    }

    #[test]
    fn nesting_is_bounded_on_both_sides_of_the_limit() {
        let nested = |n: usize| format!("{}1{}", "(".repeat(n), ")".repeat(n));
        assert_eq!(ok(&nested(super::MAX_NESTING - 1)), 1.0);
        assert!(
            evaluate(&nested(super::MAX_NESTING + 1))
                .unwrap_err()
                .contains("nests deeper")
        );
        assert!(evaluate(&"-".repeat(10_000)).unwrap_err().contains("nests deeper"));
    }
}
