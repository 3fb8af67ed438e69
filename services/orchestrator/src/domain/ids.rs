//! The one rule every id a caller names follows — a run id, a thread id, an affinity key, a
//! filter naming one — checked in the same words by every RPC and command: 1 to
//! [`MAX_ID_LEN`] printable ASCII characters, no spaces (ids travel in request headers, log
//! lines and store keys).

/// The longest id, in bytes.
pub const MAX_ID_LEN: usize = 128;

/// Checks `id` (named `what` in the error: `run_id`, `thread_id` …) against the rule.
pub fn check(what: &str, id: &str) -> Result<(), String> {
    if id.is_empty() {
        return Err(format!("{what} is empty: {}", rule()));
    }
    if id.len() > MAX_ID_LEN {
        return Err(format!("{what} is {} bytes long: {}", id.len(), rule()));
    }
    match id.chars().find(|c| !c.is_ascii_graphic()) {
        Some(' ') => Err(format!("{what} {id:?} holds a space: {}", rule())),
        Some(c) => Err(format!("{what} {id:?} holds {c:?}: {}", rule())),
        None => Ok(()),
    }
}

/// The rule, as the errors state it.
pub fn rule() -> String {
    format!("an id is 1-{MAX_ID_LEN} printable ASCII characters without spaces")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_id_follows_one_rule_named_in_its_error() {
        assert_eq!(check("thread_id", "support-42"), Ok(()));
        assert_eq!(check("thread_id", &"a".repeat(MAX_ID_LEN)), Ok(()));
        for (bad, says) in [
            ("", "is empty"),
            ("ünï", "holds 'ü'"),
            ("a b", "holds a space"),
            (&"a".repeat(MAX_ID_LEN + 1) as &str, "129 bytes"),
        ] {
            let error = check("thread_id", bad).unwrap_err();
            assert!(
                error.contains(says) && error.contains("printable ASCII"),
                "{bad:?}: {error}"
            );
        }
    }
}
