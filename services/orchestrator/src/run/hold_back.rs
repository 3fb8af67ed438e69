//! The hold-back (docs/architecture.md, "Fallback directives and the hold-back"): streamed text is
//! released as it comes, except from the first character that could still open a directive.
//!
//! Held text is released the moment it cannot become a directive:
//! * a fence whose info string is neither empty nor `json` (any case) is a code block: it streams;
//! * a fenced body, or a message, whose first non-blank character is not `{` streams;
//! * an object whose first key is not `name` or `tool` streams;
//! * `<tool_call>` followed by anything but `{` (or the `<function=` markup of servers that parse
//!   tool calls themselves, dropped when they do) streams.
//!
//! What can still be a directive is held until it resolves: a fenced block until its closing
//! fence, a `<tool_call>` or a whole-message object until the end of the turn. The gate scans each
//! byte once (a cursor per state), so a turn costs O(n) however it arrives.

use super::fallback::{
    FENCE, OBJECT_OPEN, OPEN_TAG, Resolution, XML_FUNCTION, fenced_directive, first_key_names_a_tool, resolve_held,
};

/// Where the scan is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scan {
    /// Only blanks so far: the message may be one JSON object (a standalone directive).
    Start,
    /// Text; the next opening is searched from `at`.
    Free { at: usize },
    /// Inside a code block that holds no directive: it streams until its closing fence, searched
    /// from `at`.
    Code { at: usize },
    /// A possible directive opened at `start`; `at` is how far it has been read.
    Opening {
        start: usize,
        kind: Kind,
        stage: Stage,
        at: usize,
    },
    /// A fenced block whose body starts like a directive, held until its closing fence (searched
    /// from `at`).
    Fenced { start: usize, at: usize },
    /// A directive (or what must stay with one): held until the turn ends.
    Directive { start: usize },
}

/// What opened a possible directive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Tag,
    Fence,
    Whole,
}

/// How far an opening has been read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// The fence's info string, up to the end of its line.
    Info,
    /// Blanks before the object.
    Blank,
    /// The object's first key.
    Key,
}

/// What the text read so far says.
enum Look {
    /// The stage is read; the next one starts here.
    Next(usize),
    /// It is a directive (or markup that goes with one).
    Directive,
    /// It still may be a directive; read on from here once more text arrives.
    More(usize),
    /// It cannot be one.
    No,
}

/// Splits a turn's streamed text into what can be shown now and what must wait.
#[derive(Debug)]
pub struct TextGate {
    /// All text of the turn.
    buf: String,
    /// How much of `buf` has been released.
    released: usize,
    scan: Scan,
}

impl Default for TextGate {
    fn default() -> Self {
        Self {
            buf: String::new(),
            released: 0,
            scan: Scan::Start,
        }
    }
}

/// Longest fence info string looked at before the fence counts as a code block.
const MAX_INFO: usize = 64;

impl TextGate {
    /// Adds streamed text; returns the part that is safe to show now (may be empty).
    pub fn push(&mut self, delta: &str) -> String {
        self.buf.push_str(delta);
        while let Some(next) = self.advance() {
            self.scan = next;
        }
        let hold_from = self.hold_from().max(self.released);
        let out = self.buf[self.released..hold_from].to_owned();
        self.released = hold_from;
        out
    }

    /// All text of the turn so far, released or not.
    pub fn text(&self) -> &str {
        &self.buf
    }

    /// The text held back so far.
    pub fn held(&self) -> &str {
        &self.buf[self.released..]
    }

    /// Releases what is held as it is (a run ending mid-turn keeps every byte).
    pub fn release_all(&mut self) -> String {
        let out = self.buf[self.released..].to_owned();
        self.released = self.buf.len();
        self.scan = Scan::Free { at: self.buf.len() };
        out
    }

    /// Resolves the held text at the end of the turn (see [`resolve_held`]).
    pub fn finish(self, has_structured_calls: bool) -> Resolution {
        resolve_held(&self.buf[self.released..], self.released == 0, has_structured_calls)
    }

    /// Where held text starts.
    fn hold_from(&self) -> usize {
        match self.scan {
            Scan::Start => 0,
            Scan::Free { at } | Scan::Code { at } => at,
            Scan::Opening { start, .. } | Scan::Fenced { start, .. } | Scan::Directive { start } => start,
        }
    }

    /// One step of the scan with the text there is; `None` when it needs more text.
    fn advance(&self) -> Option<Scan> {
        let next = match self.scan {
            Scan::Start => self.start(),
            Scan::Free { at } => self.free(at),
            Scan::Code { at } => self.code(at),
            Scan::Opening { start, kind, stage, at } => Some(self.opening(start, kind, stage, at)),
            Scan::Fenced { start, at } => self.fenced(start, at),
            Scan::Directive { .. } => None,
        };
        next.filter(|n| *n != self.scan)
    }

    /// The first non-blank character of the message: `{` may open a standalone directive.
    fn start(&self) -> Option<Scan> {
        let at = self.buf.find(|c: char| !c.is_whitespace())?;
        Some(if self.buf[at..].starts_with(OBJECT_OPEN) {
            Scan::Opening {
                start: 0,
                kind: Kind::Whole,
                stage: Stage::Key,
                at: at + 1,
            }
        } else {
            Scan::Free { at: 0 }
        })
    }

    /// Text: finds the next `<tool_call>` or fence; stops before a partial one at the end.
    fn free(&self, mut at: usize) -> Option<Scan> {
        while let Some(offset) = self.buf[at..].find(['<', '`']) {
            let p = at + offset;
            let rest = &self.buf[p..];
            let (opener, kind) = if rest.starts_with('<') {
                (OPEN_TAG, Kind::Tag)
            } else {
                (FENCE, Kind::Fence)
            };
            if rest.starts_with(opener) {
                let stage = if kind == Kind::Tag { Stage::Blank } else { Stage::Info };
                return Some(Scan::Opening {
                    start: p,
                    kind,
                    stage,
                    at: p + opener.len(),
                });
            }
            if opener.starts_with(rest) {
                return Some(Scan::Free { at: p });
            }
            at = p + 1;
        }
        Some(Scan::Free { at: self.buf.len() })
    }

    /// A code block streams up to its closing fence, then text again.
    fn code(&self, at: usize) -> Option<Scan> {
        match self.buf[at..].find(FENCE) {
            Some(close) => Some(Scan::Free {
                at: at + close + FENCE.len(),
            }),
            None => Some(Scan::Code {
                at: partial_fence_at_end(&self.buf, at),
            }),
        }
    }

    /// Reads an opening as far as the text goes: on to its next stage, decided, or still open.
    fn opening(&self, start: usize, kind: Kind, stage: Stage, at: usize) -> Scan {
        let look = match stage {
            Stage::Info => self.info(at),
            Stage::Blank => self.blank(kind, at),
            Stage::Key => self.key(at),
        };
        match (look, stage) {
            (Look::Next(at), Stage::Info) => Scan::Opening {
                start,
                kind,
                stage: Stage::Blank,
                at,
            },
            (Look::Next(at), Stage::Blank) => Scan::Opening {
                start,
                kind,
                stage: Stage::Key,
                at,
            },
            (Look::Next(at), Stage::Key) if kind == Kind::Fence => Scan::Fenced { start, at },
            (Look::Next(_) | Look::Directive, _) => Scan::Directive { start },
            (Look::More(at), _) => Scan::Opening { start, kind, stage, at },
            (Look::No, _) => self.not_a_directive(start, kind, at),
        }
    }

    /// Released: the opening is text (a fence starts a code block).
    fn not_a_directive(&self, start: usize, kind: Kind, at: usize) -> Scan {
        match kind {
            Kind::Tag => Scan::Free {
                at: start + OPEN_TAG.len(),
            },
            Kind::Fence => Scan::Code {
                at: at.max(start + FENCE.len()),
            },
            Kind::Whole => Scan::Free { at: 0 },
        }
    }

    /// The info string of a fence: empty or `json` (any case) may hold a directive; `{` right
    /// after the fence is a one-line block.
    fn info(&self, at: usize) -> Look {
        let rest = &self.buf[at..];
        let line = rest.split('\n').next().unwrap_or_default();
        let word = line.trim_matches([' ', '\t', '\r']);
        if word.starts_with(OBJECT_OPEN) {
            return Look::Next(at + (line.len() - line.trim_start().len()));
        }
        let json_so_far = word.len() <= 4 && "json"[..word.len()].eq_ignore_ascii_case(word);
        match rest.find('\n') {
            Some(_) if json_so_far && (word.is_empty() || word.len() == 4) => Look::Next(at + line.len() + 1),
            None if json_so_far && rest.len() <= MAX_INFO => Look::More(at),
            _ => Look::No,
        }
    }

    /// Blanks, then `{` (or, after `<tool_call>`, the `<function=` markup of servers that parse
    /// tool calls themselves).
    fn blank(&self, kind: Kind, at: usize) -> Look {
        let rest = &self.buf[at..];
        let trimmed = rest.trim_start();
        let p = at + (rest.len() - trimmed.len());
        if trimmed.is_empty() {
            Look::More(p)
        } else if trimmed.starts_with(OBJECT_OPEN) {
            Look::Next(p + 1)
        } else if kind == Kind::Tag && trimmed.starts_with(XML_FUNCTION) {
            Look::Directive
        } else if kind == Kind::Tag && XML_FUNCTION.starts_with(trimmed) {
            Look::More(p)
        } else {
            Look::No
        }
    }

    /// The object's first key (`at` is just after its `{`): `name` or `tool` may be a directive.
    fn key(&self, at: usize) -> Look {
        match first_key_names_a_tool(&self.buf[at - OBJECT_OPEN.len_utf8()..]) {
            Some(true) => Look::Next(at),
            Some(false) => Look::No,
            None if self.buf.len() - at > MAX_INFO => Look::No,
            None => Look::More(at),
        }
    }

    /// A fenced block that starts like a directive, once it closes: a directive, or text.
    fn fenced(&self, start: usize, at: usize) -> Option<Scan> {
        let body_from = start + FENCE.len();
        let Some(close) = self.buf[at..].find(FENCE) else {
            return Some(Scan::Fenced {
                start,
                at: partial_fence_at_end(&self.buf, at),
            });
        };
        let close = at + close;
        Some(match fenced_directive(&self.buf[body_from..close]) {
            Some(_) => Scan::Directive { start },
            None => Scan::Free {
                at: close + FENCE.len(),
            },
        })
    }
}

/// Where the search for a fence resumes after `buf[from..]` held none: before a trailing "`" or
/// "``", which the next text may complete.
fn partial_fence_at_end(buf: &str, from: usize) -> usize {
    let trailing = buf[from..].bytes().rev().take_while(|b| *b == b'`').count().min(2);
    buf.len() - trailing
}

#[cfg(test)]
mod tests {
    use super::super::fallback::TextCall;
    use super::*;

    /// Feeds `parts`, returns (streamed text, resolution).
    fn run(parts: &[&str], structured: bool) -> (String, Resolution) {
        let mut gate = TextGate::default();
        let streamed: String = parts.iter().map(|p| gate.push(p)).collect();
        (streamed, gate.finish(structured))
    }

    /// Streamed text, fed one character at a time.
    fn streamed_by_char(text: &str) -> String {
        let mut gate = TextGate::default();
        text.chars().map(|c| gate.push(&c.to_string())).collect()
    }

    fn call(name: &str, arguments: &str) -> TextCall {
        TextCall {
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn plain_text_streams_through_even_with_angle_brackets_and_code() {
        let (streamed, end) = run(
            &["a < b and <b>bold</b> ", "`x` and ```rust\nfn f() {}\n```", " done"],
            false,
        );
        assert_eq!(streamed, "a < b and <b>bold</b> `x` and ```rust\nfn f() {}\n``` done");
        assert_eq!(end, Resolution::Text(String::new()));
    }

    #[test]
    fn code_blocks_stream_as_they_are_written() {
        let mut gate = TextGate::default();
        assert_eq!(gate.push("Here:\n```js"), "Here:\n", "may still be `json`");
        assert_eq!(gate.push("x\nlet a"), "```jsx\nlet a", "released once `jsx` is read");
        assert_eq!(gate.push(" = 1;\n``"), " = 1;\n");
        assert_eq!(gate.push("`\nafter"), "```\nafter");
        // A json block that is not a directive streams once its first key is read.
        let mut gate = TextGate::default();
        assert_eq!(gate.push("x\n```json\n{\"na"), "x\n");
        assert_eq!(gate.push("mes\": 1,\n"), "```json\n{\"names\": 1,\n");
        // A block whose body does not start with `{`.
        assert_eq!(streamed_by_char("y\n```\nls -la\n"), "y\n```\nls -la\n");
    }

    #[test]
    fn openings_that_cannot_be_directives_are_released_at_once() {
        assert_eq!(streamed_by_char("say <tool_call> please"), "say <tool_call> please");
        assert_eq!(
            streamed_by_char("{\"answer\": 42, \"name\": 1}"),
            "{\"answer\": 42, \"name\": 1}"
        );
        assert_eq!(streamed_by_char("  hello {\"name\": 1}"), "  hello {\"name\": 1}");
        assert_eq!(
            streamed_by_char("<tool_call>{\"arguments\": {}}"),
            "<tool_call>{\"arguments\": {}}"
        );
        // What can still be a directive stays held.
        assert_eq!(streamed_by_char("ok <tool_call>{\"name\": \"x\""), "ok ");
        assert_eq!(streamed_by_char("ok <tool_call>\n<function=x"), "ok ");
        assert_eq!(streamed_by_char("  {\"tool\": \"x\""), "");
        assert_eq!(streamed_by_char("a\n```JSON\n{ \"name\": 1"), "a\n");
    }

    #[test]
    fn a_split_tool_call_tag_is_held_and_becomes_a_call() {
        let (streamed, end) = run(
            &[
                "Let me check.\n<tool",
                "_call>{\"name\": \"get\", \"arguments\": {\"q\": 1}}</tool_call>",
            ],
            false,
        );
        assert_eq!(streamed, "Let me check.\n");
        assert_eq!(
            end,
            Resolution::Calls {
                calls: vec![call("get", r#"{"q":1}"#)],
                stripped: String::new(),
                raw: "<tool_call>{\"name\": \"get\", \"arguments\": {\"q\": 1}}</tool_call>".into()
            }
        );
    }

    #[test]
    fn several_blocks_are_several_calls_and_text_between_is_kept() {
        let text = "<tool_call>{\"tool\":\"a\",\"parameters\":{}}</tool_call> and <tool_call>{\"name\":\"b\",\"arguments\":\"{\\\"x\\\":2}\"}</tool_call>";
        let (streamed, end) = run(&[text], false);
        assert_eq!(streamed, "");
        let Resolution::Calls { calls, stripped, .. } = end else {
            panic!("{end:?}")
        };
        assert_eq!(calls, vec![call("a", "{}"), call("b", r#"{"x":2}"#)]);
        assert_eq!(stripped, " and ");
    }

    #[test]
    fn standalone_json_and_fenced_json_directives() {
        let (streamed, end) = run(&["  {\"tool\": \"finish\", ", "\"arguments\": {\"ok\": true}}"], false);
        assert_eq!(streamed, "");
        assert!(
            matches!(end, Resolution::Calls { ref calls, .. } if calls == &vec![call("finish", r#"{"ok":true}"#)]),
            "{end:?}"
        );
        let (streamed, end) = run(
            &["Here:\n```json\n{\"name\": \"get\", \"arguments\": {}}\n```\n"],
            false,
        );
        assert_eq!(streamed, "Here:\n");
        assert!(
            matches!(end, Resolution::Calls { ref stripped, .. } if stripped == "\n"),
            "{end:?}"
        );
        let (streamed, end) = run(&["one line: ```{\"name\": \"get\", \"arguments\": {}}```"], false);
        assert_eq!(streamed, "one line: ");
        assert!(matches!(end, Resolution::Calls { .. }), "{end:?}");
    }

    #[test]
    fn json_that_is_not_a_directive_is_just_text() {
        let (streamed, end) = run(&["{\"name\": \"Bob\", \"age\": 3}"], false);
        assert_eq!(streamed, "", "held: its first key is `name`");
        assert_eq!(end, Resolution::Text("{\"name\": \"Bob\", \"age\": 3}".into()));
        let (streamed, end) = run(&["x ```json\n{\"name\": 1}\n``` y"], false);
        assert_eq!(
            streamed, "x ```json\n{\"name\": 1}\n``` y",
            "released when its fence closes"
        );
        assert_eq!(end, Resolution::Text(String::new()));
    }

    #[test]
    fn malformed_directives_keep_the_text() {
        let (_, end) = run(&["<tool_call>{\"name\": \"get\", \"arguments\": {"], false);
        assert!(
            matches!(end, Resolution::Malformed { ref detail, .. } if detail.contains("never closed")),
            "{end:?}"
        );
        let (streamed, end) = run(&["<tool_call>not json</tool_call>"], false);
        assert_eq!(
            (streamed.as_str(), end),
            ("<tool_call>not json</tool_call>", Resolution::Text(String::new())),
            "not a directive: text"
        );
        let (_, end) = run(
            &["<tool_call>{\"name\": \"get\", \"arguments\": [1]}</tool_call>"],
            false,
        );
        assert!(
            matches!(end, Resolution::Malformed { ref detail, .. } if detail.contains("must be a JSON object")),
            "{end:?}"
        );
    }

    #[test]
    fn with_structured_calls_leaked_markup_is_dropped() {
        let (streamed, end) = run(&["Checking.\n", "<tool_call>\n<function=get", "_weather"], true);
        assert_eq!(streamed, "Checking.\n");
        assert_eq!(end, Resolution::Text(String::new()));
        let (_, end) = run(&["a <tool_call>{\"name\": 1}</tool_call> b <tool_c"], true);
        assert_eq!(end, Resolution::Text(" b ".into()));
        // Without structured calls, the markup is text.
        let (_, end) = run(&["<tool_call>\n<function=get"], false);
        assert_eq!(end, Resolution::Text("<tool_call>\n<function=get".into()));
    }

    #[test]
    fn release_all_gives_what_is_held() {
        let mut gate = TextGate::default();
        assert_eq!(gate.push("a ```json\n{\"name\": \"x\", "), "a ");
        assert_eq!(gate.release_all(), "```json\n{\"name\": \"x\", ");
        assert_eq!(gate.held(), "");
    }

    /// The text a turn shows in the end: what streamed plus what its resolution releases.
    fn shown(streamed: &str, end: &Resolution) -> String {
        match end {
            Resolution::Text(t) => format!("{streamed}{t}"),
            Resolution::Calls { stripped, .. } => format!("{streamed}{stripped}"),
            Resolution::Malformed { raw, .. } => format!("{streamed}{raw}"),
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: std::env::var("HOLD_BACK_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(512),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// Released text is always a prefix of the turn's text, the hold-back resolves to the
        /// same visible text however the text is cut into deltas, and without directives the
        /// visible text is the text itself. (`HOLD_BACK_CASES=100000` for a long run.)
        #[test]
        fn released_text_is_a_prefix_and_cutting_changes_nothing(
            pieces in proptest::collection::vec(proptest::sample::select(vec![
                "a", " ", "\n", "{", "}", "\"name\"", "\"tool\"", "\"x\"", ":", ",", "`", "```", "```json\n",
                "```py\n", "<", "<tool_call>", "</tool_call>", "<function=", "\"arguments\": {}", "é", "json",
            ]), 0..40),
            cuts in proptest::collection::vec(0usize..400, 0..12),
        ) {
            let text: String = pieces.concat();
            let mut gate = TextGate::default();
            let mut streamed = String::new();
            let mut at = 0;
            let mut cuts: Vec<usize> = cuts.into_iter().filter(|c| *c < text.len() && text.is_char_boundary(*c)).collect();
            cuts.sort_unstable();
            cuts.push(text.len());
            for cut in cuts {
                if cut < at {
                    continue;
                }
                streamed.push_str(&gate.push(&text[at..cut]));
                at = cut;
                proptest::prop_assert!(text.starts_with(&streamed));
            }
            let end = gate.finish(false);
            let mut whole = TextGate::default();
            let whole_streamed = whole.push(&text);
            proptest::prop_assert_eq!(shown(&streamed, &end), shown(&whole_streamed, &whole.finish(false)));
            if matches!(end, Resolution::Text(_)) {
                proptest::prop_assert_eq!(shown(&streamed, &end), text);
            }
        }
    }
}
