//! Webhooks: where a caller asked to be told that its runs started, wait for a person or
//! finished, and the rules of a delivery — which registrations a happening reaches, what the
//! receiver is sent, the signature it checks (the Standard Webhooks scheme: HMAC-SHA256 over
//! `id.timestamp.body`, so a receiver can refuse a forged or replayed delivery), and how a
//! delivery is retried and when it is given up.

use std::collections::BTreeMap;
use std::time::Duration;

use base64::Engine as _;

/// What a webhook is told of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum Topic {
    /// `run.started`: the run was let in and began.
    Started,
    /// `run.awaiting`: a call waits for a person (an approval, or an answer to its questions).
    Awaiting,
    /// `run.finished`: the run ended (completed, failed or canceled).
    Finished,
}

impl Topic {
    /// Every topic.
    pub const ALL: [Topic; 3] = [Topic::Started, Topic::Awaiting, Topic::Finished];

    /// Its name in payloads and registrations.
    pub fn name(self) -> &'static str {
        match self {
            Topic::Started => "run.started",
            Topic::Awaiting => "run.awaiting",
            Topic::Finished => "run.finished",
        }
    }

    /// The topic named `name`.
    pub fn named(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }
}

/// Whose runs a webhook hears of (always the registering principal's own).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Scope {
    /// One run.
    Run(String),
    /// The runs of one thread.
    Thread(String),
    /// Every run of the principal.
    Principal,
}

/// The shape of a webhook's body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Format {
    /// Standard Webhooks: `{"type", "timestamp", "data"}`.
    #[default]
    Standard,
    /// An A2A push notification: a `StreamResponse` holding the task's status update.
    A2a,
}

/// A registration: where to deliver which happenings of whose runs.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Webhook {
    /// `wh_` and 24 hex digits.
    pub id: String,
    /// Who registered it: it hears of this principal's runs only.
    pub principal: String,
    /// Which of those runs.
    pub scope: Scope,
    /// Where deliveries are POSTed.
    pub url: String,
    /// What it is told of (empty: everything).
    pub topics: Vec<Topic>,
    /// The signing secret, `whsec_` and base64.
    pub secret: String,
    /// Unix ms.
    pub created_unix_ms: u64,
    /// The body's shape.
    #[serde(default)]
    pub format: Format,
    /// Headers sent with every delivery (a receiver's token: what an A2A push config carries).
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

/// Most headers a webhook may add.
pub const MAX_HEADERS: usize = 8;

/// Why `headers` may not be a webhook's own, if they may not.
pub fn headers_refusal(headers: &BTreeMap<String, String>) -> Option<String> {
    if headers.len() > MAX_HEADERS {
        return Some(format!("headers: at most {MAX_HEADERS}"));
    }
    headers.iter().find_map(|(name, value)| {
        let lower = name.to_ascii_lowercase();
        let refusal = match () {
            () if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') => {
                "a name is letters, digits and '-'"
            }
            () if lower.starts_with("webhook-")
                || ["content-type", "content-length", "host"].contains(&lower.as_str()) =>
            {
                "the server sets this one"
            }
            () if value.len() > 1024 || !value.chars().all(|c| c == ' ' || c.is_ascii_graphic()) => {
                "a value is at most 1 KiB of printable ASCII"
            }
            () => return None,
        };
        Some(format!("headers: {name:?}: {refusal}"))
    })
}

/// Something that happened to a run, which webhooks may be told of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Happening {
    /// What kind.
    pub topic: Topic,
    /// The event's seq in the run's stream: with the run id, it names the happening, so the
    /// same event noticed twice (a run taken over) is delivered once.
    pub seq: u64,
    /// The run.
    pub run_id: String,
    /// The run's principal.
    pub principal: String,
    /// The run's thread, if any.
    pub thread_id: Option<String>,
    /// The named agent it runs as, if any.
    pub agent: Option<String>,
    /// The run's labels.
    pub labels: BTreeMap<String, String>,
    /// What the happening says beside the run (a call waiting: its id, tool and why; a finished
    /// run: its status and reason).
    pub detail: serde_json::Map<String, serde_json::Value>,
}

impl Webhook {
    /// Whether `happening` is told to this webhook.
    pub fn reaches(&self, happening: &Happening) -> bool {
        let in_scope = match &self.scope {
            Scope::Run(run_id) => *run_id == happening.run_id,
            Scope::Thread(thread_id) => happening.thread_id.as_ref() == Some(thread_id),
            Scope::Principal => true,
        };
        self.principal == happening.principal
            && in_scope
            && (self.topics.is_empty() || self.topics.contains(&happening.topic))
    }
}

/// The id of `webhook_id`'s delivery of the happening `seq` of `run_id` (`msg_` and 32 hex
/// digits): the same whoever notices it, so the store keeps it once and a receiver deduplicates
/// by it.
pub fn delivery_id(webhook_id: &str, run_id: &str, seq: u64) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(format!("{webhook_id}\n{run_id}\n{seq}"));
    let hex: String = digest.iter().take(16).map(|b| format!("{b:02x}")).collect();
    format!("msg_{hex}")
}

/// The body a receiver is sent: `{"type", "timestamp", "data"}`, `data` naming the run.
pub fn payload(happening: &Happening, at_unix_ms: u64) -> String {
    let mut data = serde_json::Map::new();
    data.insert("run_id".into(), happening.run_id.clone().into());
    data.insert("principal".into(), happening.principal.clone().into());
    if let Some(thread_id) = &happening.thread_id {
        data.insert("thread_id".into(), thread_id.clone().into());
    }
    if let Some(agent) = &happening.agent {
        data.insert("agent".into(), agent.clone().into());
    }
    data.insert("labels".into(), serde_json::json!(happening.labels));
    data.extend(happening.detail.clone());
    let body = serde_json::json!({
        "type": happening.topic.name(),
        "timestamp": rfc3339(at_unix_ms),
        "data": data,
    });
    body.to_string()
}

/// The body of `happening` for a webhook of `format`.
pub fn body(format: Format, happening: &Happening, at_unix_ms: u64) -> String {
    match format {
        Format::Standard => payload(happening, at_unix_ms),
        Format::A2a => a2a_payload(happening, at_unix_ms),
    }
}

/// An A2A push notification: the `StreamResponse` JSON (`statusUpdate`) of the run's task (a
/// task is a run, its context the run's thread, or the run when it has none), the happening's
/// type and data in its metadata.
pub fn a2a_payload(happening: &Happening, at_unix_ms: u64) -> String {
    let state = match (happening.topic, happening.detail.get("status").and_then(|s| s.as_str())) {
        (Topic::Started, _) => "TASK_STATE_WORKING",
        (Topic::Awaiting, _) => "TASK_STATE_INPUT_REQUIRED",
        (Topic::Finished, Some("COMPLETED")) => "TASK_STATE_COMPLETED",
        (Topic::Finished, Some("CANCELED")) => "TASK_STATE_CANCELED",
        (Topic::Finished, _) => "TASK_STATE_FAILED",
    };
    let mut metadata = happening.detail.clone();
    metadata.insert("type".into(), happening.topic.name().into());
    let body = serde_json::json!({
        "statusUpdate": {
            "taskId": happening.run_id,
            "contextId": happening.thread_id.as_deref().unwrap_or(&happening.run_id),
            "status": {"state": state, "timestamp": rfc3339(at_unix_ms)},
            "metadata": metadata,
        }
    });
    body.to_string()
}

/// `at_unix_ms` as RFC 3339 in UTC, to the millisecond.
fn rfc3339(at_unix_ms: u64) -> String {
    humantime::format_rfc3339_millis(std::time::UNIX_EPOCH + Duration::from_millis(at_unix_ms)).to_string()
}

/// Why a secret is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a webhook secret is `whsec_` then the base64 of 24 to 64 random bytes")]
pub struct BadSecret;

/// The key bytes of `secret` (`whsec_` and base64).
fn secret_key(secret: &str) -> Result<Vec<u8>, BadSecret> {
    let encoded = secret.strip_prefix("whsec_").ok_or(BadSecret)?;
    let key = base64::engine::general_purpose::STANDARD
        .decode(encoded)
        .map_err(|_| BadSecret)?;
    if (24..=64).contains(&key.len()) {
        Ok(key)
    } else {
        Err(BadSecret)
    }
}

/// Checks a secret a caller chose.
pub fn check_secret(secret: &str) -> Result<(), BadSecret> {
    secret_key(secret).map(|_| ())
}

/// A new secret from 32 random bytes.
pub fn new_secret(random: [u8; 32]) -> String {
    format!("whsec_{}", base64::engine::general_purpose::STANDARD.encode(random))
}

/// The `webhook-signature` header of the delivery `id` sent at `timestamp_s` with `body`:
/// `v1,` and the base64 of HMAC-SHA256 under the secret's key over `id.timestamp.body`.
pub fn signature(secret: &str, id: &str, timestamp_s: u64, body: &str) -> Result<String, BadSecret> {
    use aws_lc_rs::hmac;
    let key = hmac::Key::new(hmac::HMAC_SHA256, &secret_key(secret)?);
    let tag = hmac::sign(&key, format!("{id}.{timestamp_s}.{body}").as_bytes());
    Ok(format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(tag.as_ref())
    ))
}

/// Where a delivery stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum DeliveryState {
    /// To be tried (again).
    Pending,
    /// The receiver answered 2xx.
    Delivered,
    /// Every attempt failed.
    Failed,
    /// Never tried: the webhook had as many deliveries waiting as it may.
    Dropped,
    /// Never tried again: the webhook was deleted.
    Canceled,
}

impl DeliveryState {
    /// Its name, for people and the contract.
    pub fn name(self) -> &'static str {
        match self {
            DeliveryState::Pending => "pending",
            DeliveryState::Delivered => "delivered",
            DeliveryState::Failed => "failed",
            DeliveryState::Dropped => "dropped",
            DeliveryState::Canceled => "canceled",
        }
    }
}

/// One happening on its way to one webhook, and the record of its attempts.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WebhookDelivery {
    /// [`delivery_id`]: the `webhook-id` header.
    pub id: String,
    /// Where it goes.
    pub webhook_id: String,
    /// The webhook's principal (whose listing shows it).
    pub principal: String,
    /// What it tells.
    pub topic: Topic,
    /// The run it is about.
    pub run_id: String,
    /// The body, as first made (every attempt sends the same).
    pub body: String,
    /// Where it stands.
    pub state: DeliveryState,
    /// Attempts made.
    pub attempts: u32,
    /// The receiver's last HTTP status, if it answered.
    pub last_status: Option<u16>,
    /// Why the last attempt failed, if it did.
    pub last_error: Option<String>,
    /// Unix ms: not tried before then.
    pub next_attempt_unix_ms: u64,
    /// Unix ms: a replica trying it holds it until then (0: nobody holds it), so two replicas
    /// do not try it at once, and one that died holding it lets go when the time passes.
    pub held_until_unix_ms: u64,
    /// Unix ms.
    pub created_unix_ms: u64,
    /// Unix ms of its last attempt (0: none yet).
    pub last_attempt_unix_ms: u64,
}

/// How one attempt went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// The receiver answered this status.
    Answered(u16),
    /// No answer: refused by the egress rules, unreachable, timed out.
    NoAnswer(String),
}

/// How long after failed attempt number `attempts` the next one is made: 1 s, doubling, at most
/// `max`.
pub fn backoff(attempts: u32, max: Duration) -> Duration {
    let exponent = attempts.saturating_sub(1).min(20);
    Duration::from_secs(1u64 << exponent).min(max)
}

impl WebhookDelivery {
    /// Whether a replica may try it at `now_ms`: pending, due, and held by nobody.
    pub fn due(&self, now_ms: u64) -> bool {
        self.state == DeliveryState::Pending && self.next_attempt_unix_ms <= now_ms && self.held_until_unix_ms <= now_ms
    }

    /// Records `attempt` made at `now_ms`: delivered on a 2xx; else failed after `max_attempts`,
    /// or pending again after the backoff.
    pub fn record(&mut self, attempt: Attempt, now_ms: u64, max_attempts: u32, max_backoff: Duration) {
        self.attempts += 1;
        self.last_attempt_unix_ms = now_ms;
        self.held_until_unix_ms = 0;
        let ok = match attempt {
            Attempt::Answered(status) => {
                self.last_status = Some(status);
                self.last_error = (!(200..300).contains(&status)).then(|| format!("the receiver answered {status}"));
                self.last_error.is_none()
            }
            Attempt::NoAnswer(why) => {
                self.last_error = Some(why);
                false
            }
        };
        self.state = match () {
            () if ok => DeliveryState::Delivered,
            () if self.attempts >= max_attempts => DeliveryState::Failed,
            () => DeliveryState::Pending,
        };
        let wait = u64::try_from(backoff(self.attempts, max_backoff).as_millis()).unwrap_or(u64::MAX);
        self.next_attempt_unix_ms = now_ms.saturating_add(wait);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn happening(topic: Topic) -> Happening {
        Happening {
            topic,
            seq: 7,
            run_id: "r1".into(),
            principal: "billing".into(),
            thread_id: Some("t1".into()),
            agent: None,
            labels: BTreeMap::new(),
            detail: serde_json::Map::new(),
        }
    }

    fn webhook(scope: Scope, topics: Vec<Topic>) -> Webhook {
        Webhook {
            id: "wh_1".into(),
            principal: "billing".into(),
            scope,
            url: "https://example.com/hook".into(),
            topics,
            secret: new_secret([7; 32]),
            created_unix_ms: 0,
            format: Format::Standard,
            headers: BTreeMap::new(),
        }
    }

    #[test]
    fn a_webhook_hears_of_its_principals_runs_in_its_scope_and_topics() {
        let finished = happening(Topic::Finished);
        assert!(webhook(Scope::Principal, vec![]).reaches(&finished));
        assert!(webhook(Scope::Run("r1".into()), vec![Topic::Finished]).reaches(&finished));
        assert!(webhook(Scope::Thread("t1".into()), vec![]).reaches(&finished));
        assert!(!webhook(Scope::Run("r2".into()), vec![]).reaches(&finished));
        assert!(!webhook(Scope::Thread("t2".into()), vec![]).reaches(&finished));
        assert!(!webhook(Scope::Principal, vec![Topic::Started]).reaches(&finished));
        let other = Happening {
            principal: "support".into(),
            ..finished
        };
        assert!(!webhook(Scope::Principal, vec![]).reaches(&other));
    }

    #[test]
    fn the_signature_is_the_standard_webhooks_one_and_a_changed_byte_changes_it() {
        // The example of the Standard Webhooks specification.
        let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        let body = r#"{"test": 2432232314}"#;
        let signed = signature(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body).unwrap();
        assert_eq!(signed, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        let forged = signature(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265331, body).unwrap();
        assert_ne!(signed, forged);
        assert_eq!(signature("not-a-secret", "m", 1, body), Err(BadSecret));
        assert_eq!(check_secret("whsec_c2hvcnQ="), Err(BadSecret));
        assert_eq!(check_secret(&new_secret([1; 32])), Ok(()));
    }

    #[test]
    fn a_delivery_backs_off_doubling_and_gives_up_after_its_attempts() {
        let mut delivery = WebhookDelivery {
            id: delivery_id("wh_1", "r1", 7),
            webhook_id: "wh_1".into(),
            principal: "billing".into(),
            topic: Topic::Finished,
            run_id: "r1".into(),
            body: "{}".into(),
            state: DeliveryState::Pending,
            attempts: 0,
            last_status: None,
            last_error: None,
            next_attempt_unix_ms: 0,
            held_until_unix_ms: 0,
            created_unix_ms: 0,
            last_attempt_unix_ms: 0,
        };
        let max = Duration::from_secs(4);
        assert_eq!([1, 2, 3, 4, 9].map(|a| backoff(a, max).as_secs()), [1, 2, 4, 4, 4]);
        delivery.record(Attempt::Answered(503), 1_000, 3, max);
        assert_eq!(
            (delivery.state, delivery.next_attempt_unix_ms),
            (DeliveryState::Pending, 2_000)
        );
        assert!(!delivery.due(1_999) && delivery.due(2_000));
        delivery.record(Attempt::NoAnswer("refused".into()), 2_000, 3, max);
        assert_eq!(delivery.next_attempt_unix_ms, 4_000);
        delivery.record(Attempt::Answered(500), 4_000, 3, max);
        assert_eq!(delivery.state, DeliveryState::Failed);
        assert!(!delivery.due(u64::MAX));
        let mut ok = WebhookDelivery {
            state: DeliveryState::Pending,
            attempts: 0,
            ..delivery
        };
        ok.record(Attempt::Answered(204), 5_000, 3, max);
        assert_eq!((ok.state, ok.last_error), (DeliveryState::Delivered, None));
        assert_eq!(delivery_id("wh_1", "r1", 7), delivery_id("wh_1", "r1", 7));
        assert_ne!(delivery_id("wh_1", "r1", 7), delivery_id("wh_1", "r1", 8));
    }

    #[test]
    fn the_payload_names_the_type_the_run_and_what_happened() {
        let mut awaiting = happening(Topic::Awaiting);
        awaiting.detail.insert("call_id".into(), "c1".into());
        let body: serde_json::Value = serde_json::from_str(&payload(&awaiting, 1_614_265_330_000)).unwrap();
        assert_eq!(body["type"], "run.awaiting");
        assert_eq!(body["timestamp"], "2021-02-25T15:02:10.000Z");
        assert_eq!(body["data"]["run_id"], "r1");
        assert_eq!(body["data"]["thread_id"], "t1");
        assert_eq!(body["data"]["call_id"], "c1");
        assert_eq!(Topic::named("run.finished"), Some(Topic::Finished));
        assert_eq!(Topic::named("run.exploded"), None);
        let finished = Happening {
            detail: serde_json::from_str(r#"{"status": "CANCELED"}"#).unwrap(),
            ..happening(Topic::Finished)
        };
        let a2a: serde_json::Value = serde_json::from_str(&super::body(Format::A2a, &finished, 0)).unwrap();
        let update = &a2a["statusUpdate"];
        assert_eq!(
            (update["taskId"].as_str(), update["contextId"].as_str()),
            (Some("r1"), Some("t1"))
        );
        assert_eq!(update["status"]["state"], "TASK_STATE_CANCELED");
        assert_eq!(update["metadata"]["type"], "run.finished");
    }

    #[test]
    fn a_webhooks_own_headers_are_bounded_and_never_the_servers() {
        let headers = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect()
        };
        assert_eq!(
            headers_refusal(&headers(&[
                ("X-A2A-Notification-Token", "t"),
                ("Authorization", "Bearer x")
            ])),
            None
        );
        for bad in [
            ("Webhook-Signature", "v1,x"),
            ("Content-Type", "text/plain"),
            ("a b", "x"),
            ("X", "line\nbreak"),
        ] {
            assert!(headers_refusal(&headers(&[bad])).is_some(), "{bad:?}");
        }
        let long = "x".repeat(1025);
        assert!(headers_refusal(&headers(&[("X", long.as_str())])).is_some());
        let many: Vec<(String, String)> = (0..9).map(|i| (format!("X-{i}"), "v".to_owned())).collect();
        assert!(headers_refusal(&many.into_iter().collect()).is_some());
    }
}
