//! The run fence the two services share: the newest epoch in which any orchestrator replica
//! claimed a durable run, kept under a key of its own in the run store's key-value bucket.
//!
//! A replica that takes a run over raises the fence to its new epoch *before* it claims the
//! run's record, so the run's first call in the new epoch is sent only after the fence holds it.
//! A tool-runner reads the fence before a durable call's tool starts and refuses a call whose
//! epoch is older ([`stale`]): a replaced owner's call, however late it arrives and whichever
//! runner it reaches, runs nothing.
//!
//! The fence key is written at takeovers and expires with the bucket's age limit, so it is never
//! read alone: the run's record (under `run.<id>`, renewed as long as the run lives) carries the
//! epoch of its current claim too ([`RecordEpoch`]), and the run's epoch is the higher of the two.
//! A durable call of a run neither holds is refused; so is a call that carries no epoch for a run
//! the record shows is durable.
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

/// The key of `run_id`'s record in the run store's bucket.
pub fn record_key(run_id: &str) -> String {
    escaped_key("run.", run_id)
}

/// The one field of a run's record a tool-runner reads: the epoch of the run's current claim.
/// The orchestrator's record keeps it under this tag (its tests hold the two together); every
/// other field is skipped unread.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RecordEpoch {
    /// The claim's epoch (1 at admission, one more at each takeover).
    #[prost(uint64, tag = "10")]
    pub epoch: u64,
}

/// The key under which the orchestrators keep their fence grace (milliseconds, decimal): how
/// long a new owner waits after raising a run's fence before its first call. A runner's fence
/// read must end before it, or a read answered before a raise could let a replaced owner's call
/// start after the new owner's; each runner checks its read timeout against it ([`check_grace`]).
pub const GRACE_KEY: &str = "fence.grace_ms";

/// The orchestrators' fence grace unless set (`--run-fence-grace`): what a runner checks its
/// read timeout against when the bucket holds no grace (the key aged out, or no orchestrator of
/// this version has started).
pub const DEFAULT_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// A runner's fence read timeout unless set (`--run-store-timeout`): within [`DEFAULT_GRACE`].
pub const DEFAULT_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Whether a runner's fence read timeout `read_timeout` ends within the orchestrators' fence
/// `grace`: a clear error naming both settings when it does not.
pub fn check_grace(read_timeout: std::time::Duration, grace: std::time::Duration) -> Result<(), String> {
    if read_timeout < grace {
        return Ok(());
    }
    Err(format!(
        "the tool-runner's --run-store-timeout ({}) must be shorter than the orchestrators' --run-fence-grace ({}): a fence read answered before a takeover could let a replaced owner's call start after the new owner's first call; durable calls are refused until one of them is changed",
        humantime::format_duration(read_timeout),
        humantime::format_duration(grace)
    ))
}

impl RecordEpoch {
    /// The bytes of a record holding only the epoch (a run's record as a runner reads it; tests
    /// write it to stand for an orchestrator's claim).
    pub fn to_bytes(&self) -> Vec<u8> {
        prost::Message::encode_to_vec(self)
    }
}

/// The epoch a run's record holds.
pub fn record_epoch(record: &[u8]) -> Result<u64, String> {
    <RecordEpoch as prost::Message>::decode(record)
        .map(|r| r.epoch)
        .map_err(|e| format!("the run's record cannot be read: {e}"))
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

    /// A read timeout as long as the grace, or longer, is refused, naming both settings.
    #[test]
    fn a_runner_read_must_end_within_the_grace() {
        use std::time::Duration;
        assert!(check_grace(Duration::from_secs(1), Duration::from_secs(2)).is_ok());
        assert!(
            check_grace(DEFAULT_READ_TIMEOUT, DEFAULT_GRACE).is_ok(),
            "the defaults fit"
        );
        for timeout in [2, 3] {
            let refused = check_grace(Duration::from_secs(timeout), Duration::from_secs(2)).unwrap_err();
            assert!(
                refused.contains("--run-store-timeout") && refused.contains("--run-fence-grace"),
                "{refused}"
            );
        }
    }

    #[test]
    fn a_records_epoch_is_read_from_its_tag() {
        let bytes = prost::Message::encode_to_vec(&RecordEpoch { epoch: 9 });
        assert_eq!(record_epoch(&bytes), Ok(9));
        assert!(record_epoch(b"\xff\xff").is_err());
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
