//! One delivery attempt: the POST a receiver gets, signed (`webhook-id`, `webhook-timestamp`,
//! `webhook-signature`), through a client that connects only where the egress rules allow
//! (`shared::egress`: an address is checked after it is resolved, and the connection goes to the
//! checked address), follows no redirect and waits at most `--webhook-timeout`.

use std::sync::Arc;
use std::time::Duration;

use shared::egress::{CheckedResolver, EgressPolicy, Flags, Refused, system_lookup};

use crate::config::WebhookSettings;
use crate::domain::webhook::{Attempt, signature};

/// The flags that widen where webhooks may go.
const FLAGS: Flags = Flags {
    cidr: "--webhook-allow-cidr",
    port: "--webhook-allow-port",
};

/// See the module docs.
pub(crate) struct Sender {
    /// Built at the first attempt (an error then fails every attempt, saying why).
    client: std::sync::OnceLock<Result<reqwest::Client, String>>,
    policy: EgressPolicy,
    timeout: Duration,
}

/// What one attempt sends.
pub(crate) struct Post<'a> {
    pub url: &'a str,
    pub secret: &'a str,
    pub id: &'a str,
    pub timestamp_s: u64,
    pub body: &'a str,
    /// The webhook's own headers.
    pub headers: &'a std::collections::BTreeMap<String, String>,
}

impl Sender {
    /// A sender under `settings`' egress rules and timeout.
    pub(crate) fn new(settings: &WebhookSettings) -> Self {
        let policy = EgressPolicy::new(
            settings.webhook_allow_cidrs.clone(),
            settings.webhook_allow_ports.clone(),
            FLAGS,
        );
        Self {
            client: std::sync::OnceLock::new(),
            policy,
            timeout: settings.webhook_timeout,
        }
    }

    /// The HTTP client: connects only where the policy allows, follows no redirect.
    fn client(&self) -> Result<&reqwest::Client, String> {
        let built = self.client.get_or_init(|| {
            let resolver = CheckedResolver {
                policy: self.policy.clone(),
                lookup: system_lookup(),
            };
            reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .dns_resolver(Arc::new(resolver))
                .no_proxy()
                .timeout(self.timeout)
                .connect_timeout(self.timeout.min(Duration::from_secs(5)))
                .user_agent(concat!("orchestrator-webhooks/", env!("CARGO_PKG_VERSION")))
                .build()
                .map_err(|e| format!("cannot build the HTTP client for webhooks: {e}"))
        });
        built.as_ref().map_err(Clone::clone)
    }

    /// Why `url` may not be a webhook's address, if it may not: not http(s), or a port or
    /// literal address the egress rules refuse. (A name is checked each time it is resolved.)
    pub(crate) fn refusal(&self, url: &str) -> Option<String> {
        let parsed = match reqwest::Url::parse(url) {
            Ok(parsed) => parsed,
            Err(e) => return Some(format!("{url:?} is not a URL: {e}")),
        };
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Some(format!("{url:?} is not an http(s) URL with a host"));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Some("a webhook URL may not carry credentials; the signature proves the sender".into());
        }
        self.policy.check_url(&parsed).err().map(|Refused(why)| why)
    }

    /// Makes one attempt.
    pub(crate) async fn post(&self, post: Post<'_>) -> Attempt {
        if let Some(why) = self.refusal(post.url) {
            return Attempt::NoAnswer(why);
        }
        let signed = match signature(post.secret, post.id, post.timestamp_s, post.body) {
            Ok(signed) => signed,
            Err(e) => return Attempt::NoAnswer(e.to_string()),
        };
        let client = match self.client() {
            Ok(client) => client,
            Err(why) => return Attempt::NoAnswer(why),
        };
        let mut request = client.post(post.url);
        for (name, value) in post.headers {
            request = request.header(name.as_str(), value.as_str());
        }
        let sent = request
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header("webhook-id", post.id)
            .header("webhook-timestamp", post.timestamp_s.to_string())
            .header("webhook-signature", signed)
            .body(post.body.to_owned())
            .send()
            .await;
        match sent {
            Ok(answer) => Attempt::Answered(answer.status().as_u16()),
            Err(e) => Attempt::NoAnswer(why_not_sent(&e)),
        }
    }
}

/// What a failed request says, the egress refusal first when there is one.
fn why_not_sent(e: &reqwest::Error) -> String {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(Refused(why)) = cause.downcast_ref::<Refused>() {
            return why.clone();
        }
        source = cause.source();
    }
    if e.is_timeout() {
        return "the receiver did not answer in time (--webhook-timeout)".into();
    }
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        message = format!("{message}: {cause}");
        source = cause.source();
    }
    message
}
