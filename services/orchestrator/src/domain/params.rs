//! The model parameters a caller (or the server's defaults) sets for a run, and their rules:
//! ranges, `tool_choice` that forces a call on the first turn only, and `extra_body` merged into
//! the request without touching what the orchestrator owns.

use std::fmt;

use serde_json::{Map, Value};

/// Below this many tokens left in its budget, a run's model request asks for at most that many
/// even when nothing else set `max_tokens`.
pub const UNASKED_MAX_TOKENS_BOUND: u64 = 16_384;

/// Fields of the request body the orchestrator writes itself: `extra_body` may not set them.
pub const RESERVED_FIELDS: [&str; 5] = ["model", "messages", "tools", "stream", "stream_options"];

/// Fields that set or multiply what one model request may spend: the orchestrator writes
/// `max_tokens` within the run's and its caller's budgets, and asks for one choice of one
/// sequence. `extra_body` may not set them (servers take the last of a field sent twice, or
/// generate `n` and `best_of` choices each up to `max_tokens`).
pub const SPEND_FIELDS: [&str; 6] = [
    "max_tokens",
    "max_completion_tokens",
    "max_new_tokens",
    "n",
    "best_of",
    "use_beam_search",
];

/// Longest `reasoning_effort` accepted (servers use `minimal` … `high`).
const MAX_REASONING_EFFORT_LEN: usize = 32;

/// Whether and which tool the model must call (`tool_choice`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum ToolChoice {
    /// The model decides (the servers' default).
    Auto,
    /// No tool call.
    None,
    /// At least one tool call (first turn only).
    Required,
    /// This tool (first turn only).
    Tool(String),
}

impl ToolChoice {
    /// The choice for `turn`: `required` and a named tool force the first turn only, so the loop
    /// can end; later turns are `auto`.
    pub fn for_turn(&self, turn: u32) -> Self {
        match self {
            Self::Required | Self::Tool(_) if turn > 1 => Self::Auto,
            other => other.clone(),
        }
    }

    /// The named tool, if any.
    pub fn tool(&self) -> Option<&str> {
        match self {
            Self::Tool(name) => Some(name),
            _ => None,
        }
    }
}

impl std::str::FromStr for ToolChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(Self::Auto),
            "none" => Ok(Self::None),
            "required" => Ok(Self::Required),
            name if shared::tools::valid_tool_name(name) => Ok(Self::Tool(name.to_owned())),
            other => Err(format!(
                "tool_choice {other:?}: use auto, none, required or a tool name (1-64 letters, digits, '_' or '-')"
            )),
        }
    }
}

impl fmt::Display for ToolChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::None => "none",
            Self::Required => "required",
            Self::Tool(name) => name,
        })
    }
}

/// Sampling and behaviour parameters; `None` fields are not sent.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// Temperature.
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// Most tokens per turn.
    pub max_tokens: Option<u32>,
    /// Stop sequences.
    pub stop: Vec<String>,
    /// Seed.
    pub seed: Option<i64>,
    /// Presence penalty, -2..=2.
    pub presence_penalty: Option<f32>,
    /// Frequency penalty, -2..=2.
    pub frequency_penalty: Option<f32>,
    /// `tool_choice`, as asked for the run (see [`SamplingParams::for_turn`]).
    pub tool_choice: Option<ToolChoice>,
    /// Whether the model may call several tools in one turn.
    pub parallel_tool_calls: Option<bool>,
    /// `reasoning_effort`, passed as it is.
    pub reasoning_effort: Option<String>,
    /// Server-specific fields merged into the request (never a [`RESERVED_FIELDS`] one, never one
    /// set above).
    pub extra_body: Map<String, Value>,
}

impl SamplingParams {
    /// The parameters of `turn` (only `tool_choice` changes from turn to turn).
    pub fn for_turn(&self, turn: u32) -> Self {
        Self {
            tool_choice: self.tool_choice.as_ref().map(|c| c.for_turn(turn)),
            ..self.clone()
        }
    }

    /// These parameters with `max_tokens` at most `left`, the tokens a run's budget has left:
    /// a `max_tokens` asked for is lowered to it; none asked is set to it only when fewer than
    /// [`UNASKED_MAX_TOKENS_BOUND`] are left (a larger one could pass the model's context, which
    /// servers refuse). At least 1: servers refuse a request for nothing.
    pub fn within_tokens(mut self, left: u64) -> Self {
        let left32 = u32::try_from(left).unwrap_or(u32::MAX).max(1);
        self.max_tokens = match self.max_tokens {
            Some(asked) => Some(asked.min(left32)),
            None if left < UNASKED_MAX_TOKENS_BOUND => Some(left32),
            None => None,
        };
        self
    }

    /// These parameters with `max_tokens` set, at most `left` (a `max_tokens` asked for is
    /// lowered to it, none asked becomes it): for a turn whose tokens are held in a budget, which
    /// must not spend more than it held. At least 1.
    pub fn bounded_to(mut self, left: u64) -> Self {
        let left32 = u32::try_from(left).unwrap_or(u32::MAX).max(1);
        self.max_tokens = Some(self.max_tokens.map_or(left32, |asked| asked.min(left32)));
        self
    }

    /// These parameters, with each one left unset taken from `defaults`; `extra_body` keys
    /// merge, these winning (a default extra key that a typed parameter here sets is dropped,
    /// and a typed default gives way to this `extra_body` setting the same field).
    pub fn or(mut self, defaults: &Self) -> Self {
        let mut defaults = defaults.clone();
        for key in self.extra_body.keys() {
            defaults.unset(key);
        }
        self.temperature = self.temperature.or(defaults.temperature);
        self.top_p = self.top_p.or(defaults.top_p);
        self.max_tokens = self.max_tokens.or(defaults.max_tokens);
        if self.stop.is_empty() {
            self.stop.clone_from(&defaults.stop);
        }
        self.seed = self.seed.or(defaults.seed);
        self.presence_penalty = self.presence_penalty.or(defaults.presence_penalty);
        self.frequency_penalty = self.frequency_penalty.or(defaults.frequency_penalty);
        self.tool_choice = self.tool_choice.or_else(|| defaults.tool_choice.clone());
        self.parallel_tool_calls = self.parallel_tool_calls.or(defaults.parallel_tool_calls);
        self.reasoning_effort = self.reasoning_effort.or_else(|| defaults.reasoning_effort.clone());
        for (key, value) in &defaults.extra_body {
            if !self.sets(key) {
                self.extra_body.entry(key.clone()).or_insert_with(|| value.clone());
            }
        }
        self
    }

    /// Checks ranges and that `extra_body` sets no field the orchestrator or these parameters
    /// set; the error names the field.
    pub fn check(&self) -> Result<(), String> {
        check_range("temperature", self.temperature, 0.0, 2.0)?;
        check_range("top_p", self.top_p, 0.0, 1.0)?;
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        if self.max_tokens == Some(0) {
            return Err("max_tokens must be at least 1".to_owned());
        }
        if let Some(effort) = &self.reasoning_effort {
            check_reasoning_effort(effort)?;
        }
        for key in self.extra_body.keys() {
            if RESERVED_FIELDS.contains(&key.as_str()) {
                return Err(format!(
                    "extra_body_json may not set {key:?}: the orchestrator writes model, messages, tools and stream"
                ));
            }
            if SPEND_FIELDS.contains(&key.as_str()) {
                return Err(format!(
                    "extra_body_json may not set {key:?}: what a request may spend is the orchestrator's (set params.max_tokens; it is lowered to the budgets left)"
                ));
            }
            if self.sets(key) {
                return Err(format!("{key} is set twice: in params and in extra_body_json"));
            }
        }
        Ok(())
    }

    /// Unsets the typed parameter writing the named request field, if there is one.
    fn unset(&mut self, field: &str) {
        match field {
            "temperature" => self.temperature = None,
            "top_p" => self.top_p = None,
            "max_tokens" => self.max_tokens = None,
            "stop" => self.stop.clear(),
            "seed" => self.seed = None,
            "presence_penalty" => self.presence_penalty = None,
            "frequency_penalty" => self.frequency_penalty = None,
            "tool_choice" => self.tool_choice = None,
            "parallel_tool_calls" => self.parallel_tool_calls = None,
            "reasoning_effort" => self.reasoning_effort = None,
            _ => {}
        }
    }

    /// Whether the named request field is set by one of the typed parameters.
    fn sets(&self, field: &str) -> bool {
        match field {
            "temperature" => self.temperature.is_some(),
            "top_p" => self.top_p.is_some(),
            "max_tokens" => self.max_tokens.is_some(),
            "stop" => !self.stop.is_empty(),
            "seed" => self.seed.is_some(),
            "presence_penalty" => self.presence_penalty.is_some(),
            "frequency_penalty" => self.frequency_penalty.is_some(),
            "tool_choice" => self.tool_choice.is_some(),
            "parallel_tool_calls" => self.parallel_tool_calls.is_some(),
            "reasoning_effort" => self.reasoning_effort.is_some(),
            _ => false,
        }
    }
}

fn check_range(name: &str, value: Option<f32>, min: f32, max: f32) -> Result<(), String> {
    match value {
        Some(v) if !(min..=max).contains(&v) => Err(format!("{name} = {v} is outside {min}..={max}")),
        _ => Ok(()),
    }
}

fn check_reasoning_effort(effort: &str) -> Result<(), String> {
    let ok = !effort.is_empty()
        && effort.len() <= MAX_REASONING_EFFORT_LEN
        && effort.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "reasoning_effort {:?}: 1-{MAX_REASONING_EFFORT_LEN} lowercase letters or '_' (e.g. low, medium, high)",
            shared::text::excerpt(effort)
        ))
    }
}

/// A JSON object for `extra_body` (empty text: none); the error says what is wrong, the caller
/// names the field.
pub fn parse_extra_body(text: &str) -> Result<Map<String, Value>, String> {
    if text.trim().is_empty() {
        return Ok(Map::new());
    }
    match serde_json::from_str::<Value>(text) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err("must be a JSON object".to_owned()),
        Err(e) => Err(format!("is not valid JSON: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_token_budget_bounds_max_tokens_on_both_sides_of_its_rules() {
        let asked = |max_tokens| SamplingParams {
            max_tokens,
            ..SamplingParams::default()
        };
        assert_eq!(asked(Some(500)).within_tokens(100).max_tokens, Some(100));
        assert_eq!(asked(Some(50)).within_tokens(100).max_tokens, Some(50));
        assert_eq!(
            asked(None).within_tokens(UNASKED_MAX_TOKENS_BOUND - 1).max_tokens,
            Some(16_383)
        );
        assert_eq!(asked(None).within_tokens(UNASKED_MAX_TOKENS_BOUND).max_tokens, None);
        assert_eq!(
            asked(None).within_tokens(0).max_tokens,
            Some(1),
            "never a request for nothing"
        );
        assert_eq!(asked(Some(7)).within_tokens(u64::MAX).max_tokens, Some(7));
    }

    #[test]
    fn required_and_named_choices_force_the_first_turn_only() {
        let named: ToolChoice = "calculate".parse().unwrap();
        assert_eq!(named.for_turn(1), ToolChoice::Tool("calculate".into()));
        assert_eq!(named.for_turn(2), ToolChoice::Auto);
        assert_eq!(ToolChoice::Required.for_turn(2), ToolChoice::Auto);
        assert_eq!(ToolChoice::None.for_turn(5), ToolChoice::None);
        assert!("bad name".parse::<ToolChoice>().is_err());
    }

    #[test]
    fn ranges_and_reasoning_effort_are_checked_on_both_sides() {
        let with = |p: SamplingParams| p.check();
        for (ok, params) in [
            (
                true,
                SamplingParams {
                    presence_penalty: Some(-2.0),
                    frequency_penalty: Some(2.0),
                    ..Default::default()
                },
            ),
            (
                false,
                SamplingParams {
                    presence_penalty: Some(-2.01),
                    ..Default::default()
                },
            ),
            (
                false,
                SamplingParams {
                    frequency_penalty: Some(2.01),
                    ..Default::default()
                },
            ),
            (
                true,
                SamplingParams {
                    temperature: Some(2.0),
                    top_p: Some(1.0),
                    ..Default::default()
                },
            ),
            (
                false,
                SamplingParams {
                    temperature: Some(2.5),
                    ..Default::default()
                },
            ),
            (
                false,
                SamplingParams {
                    max_tokens: Some(0),
                    ..Default::default()
                },
            ),
            (
                true,
                SamplingParams {
                    reasoning_effort: Some("high".into()),
                    ..Default::default()
                },
            ),
            (
                false,
                SamplingParams {
                    reasoning_effort: Some("x".repeat(33)),
                    ..Default::default()
                },
            ),
            (
                false,
                SamplingParams {
                    reasoning_effort: Some("High!".into()),
                    ..Default::default()
                },
            ),
        ] {
            assert_eq!(with(params.clone()).is_ok(), ok, "{params:?}");
        }
    }

    #[test]
    fn extra_body_cannot_override_what_the_orchestrator_or_a_parameter_sets() {
        let params = |extra: Value, temperature: Option<f32>| SamplingParams {
            temperature,
            extra_body: extra.as_object().cloned().unwrap(),
            ..Default::default()
        };
        assert!(
            params(
                json!({"top_k": 20, "chat_template_kwargs": {"enable_thinking": false}}),
                None
            )
            .check()
            .is_ok()
        );
        assert!(params(json!({"temperature": 0.1}), None).check().is_ok());
        for spend in SPEND_FIELDS {
            let error = params(json!({spend: 100_000}), None).check().unwrap_err();
            assert!(error.contains("orchestrator's"), "{spend}: {error}");
        }
        for reserved in RESERVED_FIELDS {
            let error = params(json!({reserved: 1}), None).check().unwrap_err();
            assert!(error.contains(reserved), "{error}");
        }
        let twice = params(json!({"temperature": 0.1}), Some(0.2)).check().unwrap_err();
        assert!(twice.contains("temperature is set twice"), "{twice}");
        assert!(parse_extra_body("[1]").is_err() && parse_extra_body("{").is_err());
        assert!(parse_extra_body(" ").unwrap().is_empty());
    }

    #[test]
    fn request_values_win_over_defaults_key_by_key() {
        let defaults = SamplingParams {
            temperature: Some(0.7),
            max_tokens: Some(512),
            tool_choice: Some(ToolChoice::Required),
            extra_body: json!({"top_k": 40, "min_p": 0.05}).as_object().cloned().unwrap(),
            ..Default::default()
        };
        let asked = SamplingParams {
            temperature: Some(0.0),
            extra_body: json!({"top_k": 1}).as_object().cloned().unwrap(),
            ..Default::default()
        }
        .or(&defaults);
        assert_eq!(asked.temperature, Some(0.0));
        assert_eq!(asked.max_tokens, Some(512));
        assert_eq!(asked.tool_choice, Some(ToolChoice::Required));
        assert_eq!(Value::Object(asked.extra_body), json!({"top_k": 1, "min_p": 0.05}));
    }

    #[test]
    fn a_typed_default_gives_way_to_the_requests_extra_body() {
        let defaults = SamplingParams {
            temperature: Some(0.7),
            max_tokens: Some(512),
            ..Default::default()
        };
        let asked = SamplingParams {
            extra_body: json!({"temperature": 0.2}).as_object().cloned().unwrap(),
            ..Default::default()
        }
        .or(&defaults);
        assert_eq!(asked.check(), Ok(()));
        assert_eq!(asked.temperature, None);
        assert_eq!(asked.max_tokens, Some(512));
        assert_eq!(Value::Object(asked.extra_body), json!({"temperature": 0.2}));
    }
}
