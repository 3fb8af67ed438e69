//! Rules about tools that both services enforce: valid names and usable argument schemas; and
//! how a tool's question for a person is answered ([`InputMode`]), named alike on both sides.

use serde_json::Value;

/// Longest valid tool name, in bytes.
pub const MAX_TOOL_NAME_LEN: usize = 64;

/// Whether `name` is a valid tool name: 1–64 of `[A-Za-z0-9_-]` (what OpenAI-style APIs accept).
pub fn valid_tool_name(name: &str) -> bool {
    (1..=MAX_TOOL_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Checks that `schema` is a usable arguments schema: a valid JSON Schema describing an object.
pub fn check_schema(schema: &Value) -> Result<(), String> {
    if !schema.is_object() {
        return Err("parameters must be a JSON Schema object".into());
    }
    if let Some(t) = schema.get("type").filter(|t| *t != "object") {
        return Err(format!(
            "parameters must describe an object (type = \"object\"), not type = {t}"
        ));
    }
    jsonschema::meta::validate(schema)
        .map_err(|e| format!("parameters is not a valid JSON Schema: {e} (at {})", e.instance_path()))?;
    jsonschema::validator_for(schema).map_err(|e| format!("parameters is not a usable JSON Schema: {e}"))?;
    Ok(())
}

/// Checks that `arguments` is a JSON object that `schema` accepts; the error says what is wrong
/// (the first violation, with where it is).
pub fn check_arguments(schema: &Value, arguments: &str) -> Result<(), String> {
    let value: Value = serde_json::from_str(arguments).map_err(|e| format!("not valid JSON: {e}"))?;
    if !value.is_object() {
        return Err("not a JSON object".into());
    }
    let validator = jsonschema::validator_for(schema).map_err(|e| format!("the tool's schema is not usable: {e}"))?;
    match validator.iter_errors(&value).next() {
        None => Ok(()),
        Some(e) => Err(format!("{e} (at {:?})", e.instance_path().to_string())),
    }
}

/// How a tool's question for a person is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum InputMode {
    /// With content its schema takes.
    Form,
    /// By visiting its page (consent, payment), out of the model's sight.
    Url,
}

impl InputMode {
    /// Its name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Form => "form",
            Self::Url => "url",
        }
    }

    /// The mode named `name` on the wire.
    pub fn named(name: &str) -> Option<Self> {
        match name {
            "form" => Some(Self::Form),
            "url" => Some(Self::Url),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_names() {
        assert!(valid_tool_name("get_weather-v2"));
        assert!(!valid_tool_name(""));
        assert!(!valid_tool_name(&"x".repeat(65)));
        assert!(valid_tool_name(&"x".repeat(64)));
        assert!(!valid_tool_name("a.b"));
    }

    #[test]
    fn schemas() {
        assert!(check_schema(&serde_json::json!({"type": "object", "properties": {"a": {"type": "string"}}})).is_ok());
        assert!(
            check_schema(&serde_json::json!({"type": "array"}))
                .unwrap_err()
                .contains("must describe an object")
        );
        assert!(
            check_schema(&serde_json::json!({"type": "object", "required": "a"}))
                .unwrap_err()
                .contains("not a valid JSON Schema")
        );
        assert!(check_schema(&serde_json::json!([1])).is_err());
    }

    #[test]
    fn arguments_against_a_schema() {
        let schema = serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
        assert!(check_arguments(&schema, r#"{"n": 1}"#).is_ok());
        assert!(
            check_arguments(&schema, r#"{"n": "x"}"#)
                .unwrap_err()
                .contains("\"/n\"")
        );
        assert!(check_arguments(&schema, "{}").is_err());
        assert!(
            check_arguments(&schema, "[]")
                .unwrap_err()
                .contains("not a JSON object")
        );
        assert!(check_arguments(&schema, "{").unwrap_err().contains("not valid JSON"));
    }
}
