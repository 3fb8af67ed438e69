//! `http_get`: fetches a URL whose host is on the runner's allowlist (`--http-allow-host`).
//! Off when the allowlist is empty. Every hop (redirects included, at most five) must name an
//! allowlisted host and pass the address policy of [`shared::egress`]; the body is capped, and
//! only `http`/`https` URLs are accepted.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use serde_json::json;

use super::{Builtin, BuiltinConfig, spec};
use crate::tools::{Args, CallContext, ErrorCode, Tool, ToolError, ToolResult, str_arg};
use shared::egress::{CheckedResolver, EgressPolicy, Flags, Refused, system_lookup};

/// Most redirects followed for one request.
const MAX_REDIRECTS: usize = 5;

/// Hosts the tool may reach: exact names (`api.example.com`, `127.0.0.1`) or `*.example.com`
/// for any subdomain of `example.com`.
#[derive(Debug, Clone)]
struct Allowlist(Arc<Vec<String>>);

impl Allowlist {
    fn allows(&self, host: &str) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']').to_ascii_lowercase();
        self.0.iter().any(|entry| match entry.strip_prefix("*.") {
            Some(domain) => host.strip_suffix(domain).is_some_and(|rest| rest.ends_with('.')),
            None => *entry == host,
        })
    }

    fn check(&self, url: &reqwest::Url) -> Result<(), ToolError> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(ToolError::denied(format!(
                "only http and https URLs are allowed, not {}:",
                url.scheme()
            )));
        }
        let host = url
            .host_str()
            .ok_or_else(|| ToolError::invalid(format!("{url} has no host")))?;
        if !self.allows(host) {
            return Err(ToolError::denied(format!(
                "host {host:?} is not on this runner's allowlist (allowed: {})",
                self.0.join(", ")
            )));
        }
        Ok(())
    }
}

struct HttpGet {
    client: reqwest::Client,
    allowlist: Allowlist,
    egress: EgressPolicy,
    max_bytes: u64,
}

impl Tool for HttpGet {
    fn call(&self, args: Args, _ctx: &CallContext) -> BoxFuture<'static, ToolResult> {
        let client = self.client.clone();
        let allowlist = self.allowlist.clone();
        let egress = self.egress.clone();
        let max_bytes = self.max_bytes;
        let raw_url = str_arg(&args, "url").unwrap_or_default().to_owned();
        async move {
            let url = reqwest::Url::parse(&raw_url)
                .map_err(|e| ToolError::invalid(format!("{raw_url:?} is not a valid URL: {e}")))?;
            allowlist.check(&url)?;
            egress.check_url(&url).map_err(|e| ToolError::denied(e.0))?;
            let response = client.get(url).send().await.map_err(|e| request_error(&e))?;
            let status = response.status();
            let final_url = response.url().to_string();
            let content_type = response
                .headers()
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let mut body = Vec::new();
            let mut truncated = false;
            let mut stream = response.bytes_stream();
            while let Some(chunk) = stream.next().await {
                let chunk = chunk.map_err(|e| request_error(&e))?;
                let room = usize::try_from(max_bytes)
                    .unwrap_or(usize::MAX)
                    .saturating_sub(body.len());
                if chunk.len() > room {
                    body.extend_from_slice(&chunk[..room]);
                    truncated = true;
                    break;
                }
                body.extend_from_slice(&chunk);
            }
            Ok(json!({
                "url": final_url,
                "status": status.as_u16(),
                "content_type": content_type,
                "body": String::from_utf8_lossy(&body),
                "truncated": truncated,
            }))
        }
        .boxed()
    }
}

fn request_error(e: &reqwest::Error) -> ToolError {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(refused) = cause.downcast_ref::<Refused>() {
            return ToolError::denied(refused.0.clone());
        }
        source = cause.source();
    }
    if e.is_redirect() {
        // Our redirect policy refused the hop; its message names the host.
        let detail = std::error::Error::source(e).map_or_else(|| e.to_string(), ToString::to_string);
        return ToolError::denied(detail);
    }
    if e.is_timeout() {
        return ToolError::retryable(ErrorCode::Timeout, format!("the request timed out: {e}"));
    }
    ToolError::retryable(ErrorCode::Failed, format!("the request failed: {e}"))
}

pub(super) fn builtin(config: &BuiltinConfig) -> Result<Builtin, crate::Error> {
    if config.http_allow_hosts.is_empty() {
        return Ok(Builtin::Disabled {
            name: "http_get",
            reason: "the runner was started without --http-allow-host",
        });
    }
    for host in &config.http_allow_hosts {
        if host.is_empty() || host.contains('/') || host.contains(':') && !host.starts_with('[') {
            return Err(crate::Error::Config(format!(
                "--http-allow-host {host:?}: give a bare host name such as api.example.com or *.example.com (no scheme, path or port)"
            )));
        }
    }
    let allowlist = Allowlist(Arc::new(
        config.http_allow_hosts.iter().map(|h| h.to_ascii_lowercase()).collect(),
    ));
    let flags = Flags {
        cidr: "--http-allow-cidr",
        port: "--http-allow-port",
    };
    let egress = EgressPolicy::new(config.http_allow_cidrs.clone(), config.http_allow_ports.clone(), flags);
    let (policy_list, policy_egress) = (allowlist.clone(), egress.clone());
    let policy = reqwest::redirect::Policy::custom(move |attempt| {
        if attempt.previous().len() >= MAX_REDIRECTS {
            return attempt.error(format!("more than {MAX_REDIRECTS} redirects"));
        }
        if let Err(e) = policy_list.check(attempt.url()) {
            return attempt.error(format!("redirect refused: {}", e.message));
        }
        match policy_egress.check_url(attempt.url()) {
            Ok(()) => attempt.follow(),
            Err(e) => attempt.error(format!("redirect refused: {e}")),
        }
    });
    let resolver = CheckedResolver {
        policy: egress.clone(),
        lookup: system_lookup(),
    };
    let client = reqwest::Client::builder()
        .redirect(policy)
        .dns_resolver(Arc::new(resolver))
        .no_proxy()
        .timeout(config.io_timeout)
        .user_agent(concat!("tool-runner/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| crate::Error::Config(format!("cannot build the HTTP client for http_get: {e}")))?;
    let schema = json!({
        "type": "object",
        "properties": {
            "url": {"type": "string", "minLength": 1, "description": format!("http(s) URL on an allowed host ({}).", config.http_allow_hosts.join(", "))}
        },
        "required": ["url"],
        "additionalProperties": false
    });
    Ok(Builtin::Enabled(
        spec(
            "http_get",
            "Fetches a URL with HTTP GET and returns the status, content type and body (text).",
            schema,
            config.io_timeout,
        ),
        Arc::new(HttpGet {
            client,
            allowlist,
            egress,
            max_bytes: config.http_max_bytes,
        }),
    ))
}

#[cfg(test)]
mod tests {
    use super::Allowlist;
    use std::sync::Arc;

    #[test]
    fn allowlist_matches_exact_hosts_and_subdomain_patterns() {
        let list = Allowlist(Arc::new(vec![
            "example.com".into(),
            "*.api.test".into(),
            "127.0.0.1".into(),
        ]));
        assert!(list.allows("example.com"));
        assert!(list.allows("EXAMPLE.com"));
        assert!(!list.allows("evil-example.com"));
        assert!(!list.allows("example.com.evil"));
        assert!(list.allows("v1.api.test"));
        assert!(!list.allows("api.test"));
        assert!(!list.allows("xapi.test"));
        assert!(list.allows("127.0.0.1"));
        let url = |s: &str| reqwest::Url::parse(s).unwrap();
        assert!(list.check(&url("http://example.com/x")).is_ok());
        assert!(
            list.check(&url("file:///etc/passwd"))
                .unwrap_err()
                .message
                .contains("only http")
        );
        assert!(
            list.check(&url("http://169.254.169.254/"))
                .unwrap_err()
                .message
                .contains("not on this runner's allowlist")
        );
    }
}
