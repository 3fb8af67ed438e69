//! The run fence the two services share: the newest epoch in which any orchestrator replica
//! claimed a durable run, kept under a key of its own in the run store's key-value bucket.
//!
//! A replica that takes a run over raises the fence to its new epoch *before* it claims the
//! run's record, so the run's first call in the new epoch is sent only after the fence holds it.
//! A tool-runner reads the fence before a durable call's tool starts and refuses a call whose
//! epoch is older ([`stale`]): a replaced owner's call, however late it arrives and whichever
//! runner it reaches, runs nothing. No fence under the key reads as epoch 0: the run was never
//! taken over, so every epoch it has passes.
//!
//! The keys of the run store are made here too, one escaper for all of them, so both services
//! name a run the same way.

/// A valid NATS key-value key for `id` after `prefix`: keys allow `[-/_=.a-zA-Z0-9]`, and every
/// other byte of `id` (the dot included, so an id never adds a level) is hex-escaped as `=hh`.
pub fn escaped_key(prefix: &str, id: &str) -> String {
    let mut key = String::with_capacity(prefix.len() + id.len());
    key.push_str(prefix);
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            key.push(b as char);
        } else {
            key.push_str(&format!("={b:02x}"));
        }
    }
    key
}

/// The key of `run_id`'s fence in the run store's bucket.
pub fn key(run_id: &str) -> String {
    escaped_key("epoch.", run_id)
}

/// The fence's value for `epoch`: its decimal digits (readable with `nats kv get`).
pub fn encode(epoch: u64) -> Vec<u8> {
    epoch.to_string().into_bytes()
}

/// The epoch a fence's value holds.
pub fn decode(value: &[u8]) -> Result<u64, String> {
    std::str::from_utf8(value)
        .ok()
        .and_then(|text| text.trim().parse().ok())
        .ok_or_else(|| format!("the run fence holds {:?}, not an epoch", String::from_utf8_lossy(value)))
}

/// Whether a call sent in `epoch` comes from a replaced owner, the fence standing at `current`.
/// Epoch 0 is a run no other replica reads (the memory store): never stale.
pub fn stale(epoch: u64, current: u64) -> bool {
    epoch > 0 && epoch < current
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_valid_and_distinct() {
        assert_eq!(key("0193-abc_DEF"), "epoch.0193-abc_DEF");
        assert_eq!(escaped_key("run.", "a.b:c"), "run.a=2eb=3ac");
        assert_ne!(key("a.b"), key("a_b"));
    }

    #[test]
    fn a_fence_reads_back_and_bad_bytes_are_named() {
        assert_eq!(decode(&encode(17)), Ok(17));
        assert!(decode(b"seven").unwrap_err().contains("seven"));
    }

    /// An older epoch is stale, the same or a newer one is not, and a call of no durable run
    /// (epoch 0) never is.
    #[test]
    fn only_an_older_epoch_of_a_durable_run_is_stale() {
        assert!(stale(1, 2));
        assert!(!stale(2, 2) && !stale(3, 2) && !stale(1, 0));
        assert!(!stale(0, 5));
    }
}
