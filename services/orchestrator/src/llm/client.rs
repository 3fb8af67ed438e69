//! The HTTP client of one OpenAI-compatible server's `/v1/chat/completions` with `stream: true`:
//! one POST at a time ([`HttpLlm::attempt`]), saying whether its refusal is worth a retry (connect
//! errors, 429 and 5xx, before the first byte). The fleet (`super::fleet`) decides where and when
//! to retry; once a stream has started it is never retried, so no output is produced twice.
//!
//! Credentials (the API key as a bearer token, `--llm-header` values, a `user:password@` in the
//! base URL as basic auth) are sent as sensitive headers, never shown: logs and errors show the URL
//! without userinfo or query values, every error text is scrubbed of them (servers echo headers
//! back), and redirects are followed only within the base URL's origin.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use reqwest::StatusCode;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue, LOCATION, RETRY_AFTER};
use serde_json::Value;

use super::sse::{DecodeLimits, decode};
use crate::config::{LlmSettings, Reader};
use paced_http1::{Endpoint, Idle, SendError};
use shared::secrets::{Redactor, shown_url, url_secrets};
use shared::text::excerpt;

use crate::domain::model::{LlmError, LlmEvent, ReadPace};

/// Sent with every request.
const USER_AGENT: &str = concat!("orchestrator/", env!("CARGO_PKG_VERSION"));

/// Most bytes of an error body read for its message.
const MAX_ERROR_BODY: usize = 4096;

/// Longest `Retry-After` honoured; longer ones fall back to the configured backoff.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(30);

/// The streaming chat-completions client.
#[derive(Clone)]
pub struct HttpLlm {
    client: reqwest::Client,
    /// The `run` reader's connections, for a plain-http server without a proxy.
    direct: Option<Arc<paced_http1::Client>>,
    /// The endpoint, without userinfo (that became a basic-auth header).
    url: reqwest::Url,
    /// The endpoint as logs and errors show it (no credentials, no query values).
    shown: String,
    headers: HeaderMap,
    /// Scrubs the credentials sent from error messages (a server may echo them back).
    redactor: Redactor,
    config: LlmSettings,
}

/// An answer's status, headers and body, from either reader.
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: BoxStream<'static, Result<bytes::Bytes, String>>,
}

impl From<reqwest::Response> for Answer {
    fn from(response: reqwest::Response) -> Self {
        Self {
            status: response.status(),
            headers: response.headers().clone(),
            body: response
                .bytes_stream()
                .map(|c| c.map_err(|e| e.without_url().to_string()))
                .boxed(),
        }
    }
}

/// How one POST of a completion request went.
pub(super) enum Attempt {
    /// The server streams the completion.
    Streaming(BoxStream<'static, Result<LlmEvent, LlmError>>),
    /// Refused in a way worth retrying, after `retry_after` when the server said so.
    Retryable {
        retry_after: Option<Duration>,
        failure: LlmError,
    },
    /// Refused for good.
    Final(LlmError),
}

impl HttpLlm {
    /// Builds the client of the server at `base_url`, trusting the CA certificates `trusted`
    /// besides the system's (`--llm-ca-file`, read once by the fleet); fails on an unusable URL
    /// or header. Errors never show a credential.
    pub fn new(config: LlmSettings, base_url: &str, trusted: &[reqwest::Certificate]) -> Result<Self, String> {
        let endpoint = endpoint(base_url);
        let shown = shown_url(&endpoint);
        let url = reqwest::Url::parse(&endpoint)
            .map_err(|e| format!("--llm-base-url {:?} is not a valid URL: {e}", shown_url(base_url)))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!(
                "--llm-base-url {:?} must be an http or https URL",
                shown_url(base_url)
            ));
        }
        let mut builder = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .user_agent(USER_AGENT)
            .redirect(same_origin_redirects());
        for certificate in trusted {
            builder = builder.add_root_certificate(certificate.clone());
        }
        let client = builder
            .build()
            .map_err(|e| format!("cannot build the HTTP client: {e}"))?;
        let (url, basic_auth) = split_userinfo(&client, url)?;
        let headers = sensitive_headers(&config, basic_auth)?;
        let redactor = redactor(base_url, &headers);
        let direct = if read_by_the_run(&config, &url) {
            let idle = Idle {
                max: config.max_idle_connections,
                timeout: config.idle_connection_timeout,
            };
            Some(paced_http1::Client::new(
                run_reader_endpoint(&config, &url, &headers)?,
                idle,
            ))
        } else {
            None
        };
        Ok(Self {
            client,
            direct,
            url,
            shown,
            headers,
            redactor,
            config,
        })
    }

    /// The endpoint completions are posted to, as logs show it (no credentials, no query values).
    pub fn shown_url(&self) -> &str {
        &self.shown
    }

    /// One POST of the request: a stream of events on success; a refusal worth retrying (429, a
    /// server error, no connection) or a final one (no headers within the idle timeout, any
    /// other status or error).
    pub(super) async fn attempt(
        &self,
        body: bytes::Bytes,
        header: Option<&(HeaderName, HeaderValue)>,
        pace: &ReadPace,
    ) -> Attempt {
        let send = async {
            match &self.direct {
                Some(direct) => match self.send_direct(direct, body.clone(), header, pace).await {
                    // Redirects are the shared client's (followed within the origin only).
                    Ok(answer) if answer.status.is_redirection() => self.send_pooled(body, header).await,
                    other => other,
                },
                None => self.send_pooled(body, header).await,
            }
        };
        let answer = match tokio::time::timeout(self.config.idle_timeout, send).await {
            Err(_) => {
                return Attempt::Final(LlmError::Stalled(format!(
                    "{} (no response headers)",
                    humantime::format_duration(self.config.idle_timeout)
                )));
            }
            Ok(Err(failed)) => return failed,
            Ok(Ok(answer)) => answer,
        };
        if answer.status.is_success() {
            let limits = DecodeLimits {
                idle_timeout: self.config.idle_timeout,
                max_line_bytes: self.config.max_line_bytes,
                max_event_bytes: self.config.max_event_bytes,
            };
            let redactor = self.redactor.clone();
            let events = decode(answer.body, limits);
            return Attempt::Streaming(events.map(move |event| event.map_err(|e| scrub(&redactor, e))).boxed());
        }
        let status = answer.status;
        let retry_after = retry_after(&answer.headers);
        let failure = self.refusal(answer).await;
        if status.as_u16() == 429 || status.is_server_error() {
            Attempt::Retryable { retry_after, failure }
        } else {
            Attempt::Final(failure)
        }
    }

    /// The POST through the shared client (which follows same-origin redirects).
    async fn send_pooled(
        &self,
        body: bytes::Bytes,
        header: Option<&(HeaderName, HeaderValue)>,
    ) -> Result<Answer, Attempt> {
        let mut headers = self.headers.clone();
        if let Some((name, value)) = header {
            headers.insert(name.clone(), value.clone());
        }
        let sent = self
            .client
            .post(self.url.clone())
            .headers(headers)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(reqwest::header::ACCEPT, "text/event-stream")
            .body(body)
            .send()
            .await;
        match sent {
            Ok(response) => Ok(Answer::from(response)),
            Err(e) if e.is_connect() || e.is_timeout() => Err(self.unreachable(&e.without_url().to_string())),
            Err(e) => Err(Attempt::Final(
                self.http_error(format!("request to the LLM server failed: {}", e.without_url())),
            )),
        }
    }

    /// The POST on a connection the run reads itself.
    async fn send_direct(
        &self,
        direct: &Arc<paced_http1::Client>,
        body: bytes::Bytes,
        header: Option<&(HeaderName, HeaderValue)>,
        pace: &ReadPace,
    ) -> Result<Answer, Attempt> {
        match direct.send(&body, header, pace).await {
            Ok(answer) => Ok(Answer {
                status: answer.status,
                headers: answer.headers,
                body: answer.body.map(|c| c.map_err(|e| e.to_string())).boxed(),
            }),
            Err(SendError::Connect(e)) => Err(self.unreachable(&e)),
            Err(SendError::Request(e) | SendError::Unread(e)) => Err(Attempt::Final(
                self.http_error(format!("request to the LLM server failed: {e}")),
            )),
        }
    }

    /// No connection to the server: worth retrying.
    fn unreachable(&self, error: &str) -> Attempt {
        Attempt::Retryable {
            retry_after: None,
            failure: self.http_error(format!("cannot reach the LLM server at {}: {error}", self.shown)),
        }
    }

    /// The error for an answer that is not a stream: a redirect to another origin (never
    /// followed: the request carries credentials), or the server's own message.
    async fn refusal(&self, answer: Answer) -> LlmError {
        let status = answer.status;
        if status.is_redirection() {
            let target = answer
                .headers
                .get(LOCATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|location| self.url.join(location).ok())
                .map_or_else(
                    || "an unreadable Location".to_owned(),
                    |u| u.origin().ascii_serialization(),
                );
            return self.http_error(format!(
                "the LLM server answered {status}, redirecting to another origin ({target}); the request \
                 carries credentials, so redirects are followed only within {}: point --llm-base-url at the \
                 new address",
                self.url.origin().ascii_serialization()
            ));
        }
        let body = read_error_body(answer.body, self.config.idle_timeout).await;
        self.http_error(format!("the LLM server answered {status}: {body}"))
    }

    /// An HTTP-level error, its text scrubbed of the credentials this client sends.
    fn http_error(&self, message: String) -> LlmError {
        LlmError::Http(self.redactor.scrub(&message))
    }
}

/// Whether completions are read by the runs themselves: the `run` reader asked for, a plain-http
/// server, and no proxy configured (the shared client honours `HTTP_PROXY` and the like).
fn read_by_the_run(config: &LlmSettings, url: &reqwest::Url) -> bool {
    const PROXIES: [&str; 6] = [
        "HTTP_PROXY",
        "http_proxy",
        "ALL_PROXY",
        "all_proxy",
        "HTTPS_PROXY",
        "https_proxy",
    ];
    config.reader == Reader::Run
        && url.scheme() == "http"
        && !PROXIES
            .iter()
            .any(|v| std::env::var_os(v).is_some_and(|v| !v.is_empty()))
}

/// Where the `run` reader connects, and the head of every request it sends: the request
/// target, `Host`, what the body is and what is asked back, and the configured headers.
fn run_reader_endpoint(config: &LlmSettings, url: &reqwest::Url, headers: &HeaderMap) -> Result<Endpoint, String> {
    let host = HeaderValue::try_from(host_header(url))
        .map_err(|e| format!("--llm-base-url: the host is not a valid header value: {e}"))?;
    let target = http::Uri::try_from(origin_form(url))
        .map_err(|e| format!("--llm-base-url: its path is not a valid request target: {e}"))?;
    let mut head = headers.clone();
    head.insert(http::header::HOST, host);
    head.insert(http::header::USER_AGENT, HeaderValue::from_static(USER_AGENT));
    head.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    head.insert(http::header::ACCEPT, HeaderValue::from_static("text/event-stream"));
    Ok(Endpoint::new(&authority(url), &target.to_string(), &head)
        .connect_timeout(config.connect_timeout)
        .max_head_bytes(config.max_line_bytes))
}

/// `host:port` of an http URL (port 80 when it names none).
fn authority(url: &reqwest::Url) -> String {
    let host = url.host_str().unwrap_or_default();
    format!("{host}:{}", url.port_or_known_default().unwrap_or(80))
}

/// The `Host` header of `url`: its host, and its port unless it is the scheme's own.
fn host_header(url: &reqwest::Url) -> String {
    let host = url.host_str().unwrap_or_default();
    match url.port() {
        Some(port) => format!("{host}:{port}"),
        None => host.to_owned(),
    }
}

/// The request target of `url`: its path and query.
fn origin_form(url: &reqwest::Url) -> String {
    match url.query() {
        Some(query) => format!("{}?{query}", url.path()),
        None => url.path().to_owned(),
    }
}

/// `{base}/chat/completions`, keeping a query of the base URL (`…/v1?api-version=…`) at the end.
fn endpoint(base_url: &str) -> String {
    let (base, query) = base_url.split_once('?').map_or((base_url, None), |(b, q)| (b, Some(q)));
    let base = base.trim_end_matches('/');
    match query {
        Some(query) => format!("{base}/chat/completions?{query}"),
        None => format!("{base}/chat/completions"),
    }
}

/// Redirects are followed (at most 5) only to the origin they came from: a request carries the API
/// key and the extra headers, which must not reach another host.
fn same_origin_redirects() -> reqwest::redirect::Policy {
    reqwest::redirect::Policy::custom(|attempt| {
        let same_origin = attempt
            .previous()
            .first()
            .is_some_and(|first| first.origin() == attempt.url().origin());
        if !same_origin || attempt.previous().len() > 5 {
            attempt.stop()
        } else {
            attempt.follow()
        }
    })
}

/// `url` without its `user:password@`, and the basic-auth header reqwest makes of them (kept
/// with the other sensitive headers instead of in a URL that could be shown).
fn split_userinfo(client: &reqwest::Client, url: reqwest::Url) -> Result<(reqwest::Url, Option<HeaderValue>), String> {
    if url.username().is_empty() && url.password().is_none() {
        return Ok((url, None));
    }
    let request = client
        .post(url)
        .build()
        .map_err(|e| format!("--llm-base-url: {}", e.without_url()))?;
    Ok((request.url().clone(), request.headers().get(AUTHORIZATION).cloned()))
}

/// The headers sent with every request, all marked sensitive: `--llm-header`s, the basic auth of
/// the URL's userinfo, and the API key as a bearer token (which wins over basic auth).
fn sensitive_headers(config: &LlmSettings, basic_auth: Option<HeaderValue>) -> Result<HeaderMap, String> {
    let mut headers = HeaderMap::new();
    for header in &config.headers {
        let name =
            HeaderName::try_from(header.name.as_str()).map_err(|e| format!("--llm-header {:?}: {e}", header.name))?;
        let value = HeaderValue::try_from(header.value.expose()).map_err(|e| format!("--llm-header {name}: {e}"))?;
        headers.insert(name, value);
    }
    if let Some(basic) = basic_auth {
        headers.insert(AUTHORIZATION, basic);
    }
    if let Some(key) = config.api_key.as_ref().map(|k| k.expose()).filter(|k| !k.is_empty()) {
        let value = HeaderValue::try_from(format!("Bearer {key}"))
            .map_err(|_| "LLM_API_KEY contains characters not allowed in an HTTP header".to_owned())?;
        headers.insert(AUTHORIZATION, value);
    }
    for value in headers.values_mut() {
        value.set_sensitive(true);
    }
    Ok(headers)
}

/// A redactor for every credential the client sends: each header value whole and its token after
/// a scheme (`Bearer …`), and what the shown URL hides.
fn redactor(base_url: &str, headers: &HeaderMap) -> Redactor {
    let mut secrets = url_secrets(base_url);
    for value in headers.values().filter_map(|v| v.to_str().ok()) {
        secrets.push(value);
        secrets.extend(value.split_once(' ').map(|(_, token)| token));
    }
    Redactor::new(secrets)
}

/// `error` with the credentials scrubbed from its text.
fn scrub(redactor: &Redactor, error: LlmError) -> LlmError {
    match error {
        LlmError::Stalled(m) => LlmError::Stalled(redactor.scrub(&m)),
        LlmError::Http(m) => LlmError::Http(redactor.scrub(&m)),
        LlmError::Server(m) => LlmError::Server(redactor.scrub(&m)),
        LlmError::Protocol(m) => LlmError::Protocol(redactor.scrub(&m)),
        LlmError::Cut { endpoint, error } => LlmError::Cut {
            endpoint,
            error: Box::new(scrub(redactor, *error)),
        },
    }
}

/// A `Retry-After` in seconds, when short enough to honour.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
        .filter(|d| *d <= MAX_RETRY_AFTER)
}

/// At most a few KiB of an error response, for the message, read within `timeout`: a body that
/// never ends (or never comes) gives what arrived by then.
async fn read_error_body(mut stream: BoxStream<'static, Result<bytes::Bytes, String>>, timeout: Duration) -> String {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut body = Vec::new();
    let mut complete = true;
    while body.len() <= MAX_ERROR_BODY {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(Ok(chunk))) => body.extend_from_slice(&chunk),
            Ok(None | Some(Err(_))) => break,
            Err(_) => {
                complete = false;
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&body);
    if !complete {
        let waited = humantime::format_duration(timeout);
        return format!(
            "{} (the rest of the body did not arrive within {waited})",
            excerpt(text.trim())
        );
    }
    let message = serde_json::from_str::<Value>(&text)
        .ok()
        .and_then(|v| v.pointer("/error/message").and_then(Value::as_str).map(str::to_owned));
    excerpt(message.as_deref().unwrap_or(text.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const URL: &str = "http://127.0.0.1:1/v1/";

    fn config() -> LlmSettings {
        LlmSettings {
            base_urls: vec![URL.into()],
            model: "m".into(),
            api_key: Some("sk-secret".into()),
            headers: vec!["X-Tenant: a".parse().unwrap()],
            connect_timeout: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(1),
            max_retries: 0,
            retry_backoff: Duration::from_millis(1),
            max_line_bytes: 1024,
            max_event_bytes: 4096,
            max_idle_connections: 4,
            ..crate::Config::default().llm
        }
    }

    #[test]
    fn the_api_key_never_appears_in_debug_output() {
        let debug = format!("{:?}", config());
        assert!(!debug.contains("sk-secret"), "{debug}");
        assert!(debug.contains("<redacted>"));
        let client = HttpLlm::new(config(), URL, &[]).unwrap();
        assert_eq!(client.shown_url(), "http://127.0.0.1:1/v1/chat/completions");
        assert!(client.headers.get(AUTHORIZATION).is_some_and(HeaderValue::is_sensitive));
    }

    #[test]
    fn url_credentials_become_a_sensitive_header_and_are_scrubbed_from_errors() {
        let client = HttpLlm::new(
            LlmSettings {
                api_key: None,
                headers: vec!["X-Gateway-Key: gw-7890".parse().unwrap()],
                ..config()
            },
            "http://svc:pa55word@127.0.0.1:1/v1?key=qk-123456",
            &[],
        )
        .unwrap();
        assert_eq!(
            client.url.as_str(),
            "http://127.0.0.1:1/v1/chat/completions?key=qk-123456"
        );
        assert_eq!(client.shown_url(), "http://***@127.0.0.1:1/v1/chat/completions?key=***");
        let basic = client.headers.get(AUTHORIZATION).unwrap();
        assert!(basic.is_sensitive() && basic.to_str().unwrap().starts_with("Basic "));
        let echoed = format!(
            "denied: {} key=qk-123456 gw-7890 pa55word svc:pa55word",
            basic.to_str().unwrap()
        );
        let LlmError::Http(scrubbed) = client.http_error(echoed) else {
            unreachable!()
        };
        assert_eq!(scrubbed, "denied: *** key=*** *** *** ***");
    }

    #[test]
    fn bad_settings_are_refused() {
        assert!(HttpLlm::new(config(), "ftp://x/v1", &[]).is_err());
        assert!(
            HttpLlm::new(
                LlmSettings {
                    headers: vec!["bad name: v".parse().unwrap()],
                    ..config()
                },
                URL,
                &[]
            )
            .is_err()
        );
    }
}
