//! The contract's JSON mapping (protobuf's canonical JSON: fields in lowerCamelCase, 64-bit
//! integers as strings, enums by name), read off the contract's own descriptors: what the command
//! line prints with `--json` and what the console's pages send and read.

use std::sync::OnceLock;

use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage, MessageDescriptor, SerializeOptions};

/// The contract's descriptors, decoded once.
fn pool() -> Option<&'static DescriptorPool> {
    static POOL: OnceLock<Option<DescriptorPool>> = OnceLock::new();
    POOL.get_or_init(|| DescriptorPool::decode(proto::FILE_DESCRIPTOR_SET).ok())
        .as_ref()
}

fn descriptor(name: &str) -> Result<MessageDescriptor, String> {
    pool()
        .and_then(|p| p.get_message_by_name(name))
        .ok_or_else(|| format!("{name} is not a message of the contract"))
}

/// `message` (of the contract's type `name`, e.g. `orchestrator.v1.RunResult`) as JSON, every
/// field named (default values included), on one line.
pub(crate) fn to_json<M: prost::Message>(message: &M, name: &str) -> Result<String, String> {
    let dynamic = DynamicMessage::decode(descriptor(name)?, message.encode_to_vec().as_slice())
        .map_err(|e| format!("{name} cannot be read back: {e}"))?;
    let mut out = serde_json::Serializer::new(Vec::new());
    let options = SerializeOptions::new().skip_default_fields(false);
    dynamic
        .serialize_with_options(&mut out, &options)
        .map_err(|e| format!("{name} cannot be written as JSON: {e}"))?;
    Ok(String::from_utf8_lossy(&out.into_inner()).into_owned())
}

/// `message` (of the contract's type `name`) as JSON without the fields that hold their default
/// (what A2A's peers send and expect).
pub(crate) fn to_sparse_json<M: prost::Message>(message: &M, name: &str) -> Result<serde_json::Value, String> {
    let dynamic = DynamicMessage::decode(descriptor(name)?, message.encode_to_vec().as_slice())
        .map_err(|e| format!("{name} cannot be read back: {e}"))?;
    dynamic
        .serialize_with_options(serde_json::value::Serializer, &SerializeOptions::new())
        .map_err(|e| format!("{name} cannot be written as JSON: {e}"))
}

/// The message of type `name` that the JSON `value` writes, fields this contract does not know
/// left out (a peer of a later minor version may send more).
pub(crate) fn from_json_lenient<M: prost::Message + Default>(
    value: serde_json::Value,
    name: &str,
) -> Result<M, String> {
    let options = prost_reflect::DeserializeOptions::new().deny_unknown_fields(false);
    let dynamic = DynamicMessage::deserialize_with_options(descriptor(name)?, value, &options)
        .map_err(|e| format!("{name}: {e}"))?;
    M::decode(dynamic.encode_to_vec().as_slice()).map_err(|e| format!("{name}: {e}"))
}

/// The message of the contract's type `name` that the JSON `text` writes (unknown fields
/// refused, as the mapping asks).
pub(crate) fn from_json<M: prost::Message + Default>(text: &[u8], name: &str) -> Result<M, String> {
    let mut reader = serde_json::Deserializer::from_slice(text);
    let dynamic = DynamicMessage::deserialize(descriptor(name)?, &mut reader).map_err(|e| format!("{name}: {e}"))?;
    reader.end().map_err(|e| format!("{name}: {e}"))?;
    M::decode(dynamic.encode_to_vec().as_slice()).map_err(|e| format!("{name}: {e}"))
}

#[cfg(test)]
mod tests {
    use proto::orchestrator::v1 as pb;

    use super::*;

    #[test]
    fn a_message_is_one_line_of_canonical_json_with_every_field() {
        let result = pb::RunResult {
            run_id: "r-1".into(),
            status: pb::RunStatus::Completed.into(),
            ..Default::default()
        };
        let json = to_json(&result, "orchestrator.v1.RunResult").unwrap();
        assert!(!json.contains('\n'));
        let value: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(value["runId"], "r-1");
        assert_eq!(value["status"], "RUN_STATUS_COMPLETED");
        assert_eq!(value["failureDetail"], "", "default values are written too");
    }

    #[test]
    fn json_reads_back_into_the_message_and_refuses_what_the_message_lacks() {
        let text = br#"{"runId": "r-1", "decisions": [{"callId": "c", "kind": "DECISION_KIND_APPROVE"}]}"#;
        let read: pb::DecideToolCallsRequest = from_json(text, "orchestrator.v1.DecideToolCallsRequest").unwrap();
        assert_eq!(read.run_id, "r-1");
        assert_eq!(read.decisions.len(), 1);
        let unknown = from_json::<pb::GetRunRequest>(br#"{"runId": "r", "nope": 1}"#, "orchestrator.v1.GetRunRequest");
        assert!(unknown.is_err());
        let trailing = from_json::<pb::GetRunRequest>(br#"{"runId": "r"} x"#, "orchestrator.v1.GetRunRequest");
        assert!(trailing.is_err());
    }

    #[test]
    fn an_unknown_message_name_is_an_error_not_a_panic() {
        assert!(to_json(&pb::RunResult::default(), "orchestrator.v1.Nope").is_err());
    }
}
