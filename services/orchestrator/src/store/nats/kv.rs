//! What the key-value adapters share: a subject token for any text (a principal, a thread), and
//! a write conditional on what the writer read (created when absent, or over the revision read).

use base64::Engine as _;
use shared::jetstream::{Bucket, Error};

use crate::domain::ports::StoreError;
use crate::store::unavailable;

/// A subject (and key) token for `value`: any text, even empty.
pub(crate) fn token(value: &str) -> String {
    match value {
        "" => "_".to_owned(),
        value => format!("x{}", base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(value)),
    }
}

/// Writes `value` under `key` if it is still as read: created when `revision` is `None`, else
/// over `revision`; `Ok(false)` when another write came first.
pub(crate) async fn write_at(
    store: &dyn Bucket,
    key: &str,
    value: bytes::Bytes,
    revision: Option<u64>,
) -> Result<bool, StoreError> {
    match revision {
        None => match store.create(key, value).await {
            Ok(_) => Ok(true),
            Err(Error::Exists) => Ok(false),
            Err(e) => Err(unavailable("KV create", key, e)),
        },
        Some(revision) => match store.update(key, value, revision).await {
            Ok(_) => Ok(true),
            Err(Error::WrongRevision) => Ok(false),
            Err(e) => Err(unavailable("KV update", key, e)),
        },
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tokens_are_valid_subject_tokens_and_distinct() {
        for value in ["", "a.b", "*", ">", "billing team", "ü"] {
            let token = super::token(value);
            assert!(!token.is_empty());
            assert!(
                token.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'),
                "{token}"
            );
        }
        assert_ne!(super::token(""), super::token("_"));
        assert_ne!(super::token("a"), super::token("b"));
    }
}
