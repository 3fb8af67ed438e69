//! Which requests the console takes, by the names they were sent to. A web page a person visits
//! could otherwise point its own domain at the console's address (DNS rebinding) and read runs or
//! decide calls through the person's browser: every request's `Host` must be an IP address,
//! `localhost` or the host of `--console-public-url` (a rebound domain is none of them), and every
//! `POST` carries an `Origin` that is the console's own (the public URL's, or the scheme and host
//! the request was sent to). Behind `--console-public-url https://…` (a TLS-terminating Ingress)
//! the session cookie is `Secure` and `__Host-` prefixed and answers carry HSTS, as when the
//! console serves TLS itself.

use std::net::IpAddr;

use axum::http::{HeaderMap, Method, StatusCode, header};

use super::gateway::Refused;
use crate::Error;

/// The console's own names.
#[derive(Debug, Clone)]
pub(super) struct Origins {
    /// `--console-public-url`: its lowercased `host[:port]` and its origin.
    public: Option<(String, String)>,
    /// The console serves TLS itself.
    tls: bool,
    /// Cookies `Secure`, HSTS: TLS here or at the public URL.
    secure: bool,
}

impl Origins {
    /// The names of a console served over TLS (`tls`) or not, reached at `public_url` if given.
    pub(super) fn new(public_url: Option<&str>, tls: bool) -> Result<Self, Error> {
        let public = public_url.map(public_origin).transpose()?;
        let https = public_url.is_some_and(|u| u.to_ascii_lowercase().starts_with("https://"));
        Ok(Self {
            public,
            tls,
            secure: tls || https,
        })
    }

    /// Whether cookies are `Secure` and answers carry HSTS.
    pub(super) fn secure(&self) -> bool {
        self.secure
    }

    /// Takes a request with `headers` and `method`, or says why not.
    pub(super) fn admit(&self, method: &Method, headers: &HeaderMap) -> Result<(), Refused> {
        let host = headers
            .get(header::HOST)
            .and_then(|v| v.to_str().ok())
            .map(str::to_ascii_lowercase)
            .ok_or_else(|| misdirected("the request names no Host"))?;
        if !self.is_own_host(&host) {
            return Err(misdirected(format!(
                "the console does not answer to the name {:?}: open it by its address, localhost, or its --console-public-url",
                shared::text::excerpt(&host)
            )));
        }
        if method == Method::GET || method == Method::HEAD {
            return Ok(());
        }
        let origin = headers
            .get(header::ORIGIN)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        match origin.eq_ignore_ascii_case(&self.expected_origin(&host)) {
            true => Ok(()),
            false => Err(Refused::new(
                StatusCode::FORBIDDEN,
                "PERMISSION_DENIED",
                "the console takes changes from its own pages only (the request's Origin is not the console's)",
            )),
        }
    }

    /// An IP address (no domain can be rebound to it), `localhost`, or the public URL's host.
    fn is_own_host(&self, host: &str) -> bool {
        if self.public.as_ref().is_some_and(|(authority, _)| authority == host) {
            return true;
        }
        let name = host_name(host);
        name == "localhost" || name.parse::<IpAddr>().is_ok()
    }

    /// The origin a page of the console sent to `host` has.
    fn expected_origin(&self, host: &str) -> String {
        match &self.public {
            Some((authority, origin)) if authority == host => origin.clone(),
            _ => format!("{}://{host}", if self.tls { "https" } else { "http" }),
        }
    }
}

fn misdirected(message: impl Into<String>) -> Refused {
    Refused::new(StatusCode::MISDIRECTED_REQUEST, "PERMISSION_DENIED", message)
}

/// `host` of `host[:port]` or `[v6]:port`, brackets left out.
fn host_name(authority: &str) -> &str {
    if let Some(rest) = authority.strip_prefix('[') {
        return rest.split(']').next().unwrap_or_default();
    }
    authority.rsplit_once(':').map_or(authority, |(name, _)| name)
}

/// The lowercased `host[:port]` and origin of `--console-public-url`.
fn public_origin(url: &str) -> Result<(String, String), Error> {
    let flag = shared::config::flag::<crate::config::ConsoleSettings>("console_public_url");
    let bad = |why: &str| Error::Config(format!("{flag} {url:?}: {why}"));
    let parsed = reqwest::Url::parse(url).map_err(|e| bad(&e.to_string()))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(bad("must be an http:// or https:// URL"));
    }
    if parsed.path() != "/" || parsed.query().is_some() || parsed.fragment().is_some() || !parsed.username().is_empty()
    {
        return Err(bad(
            "must be a scheme and a host (and port), the console being served at its root",
        ));
    }
    let host = parsed.host_str().ok_or_else(|| bad("names no host"))?;
    let authority = match parsed.port() {
        Some(port) => format!("{host}:{port}"),
        None => host.to_owned(),
    }
    .to_ascii_lowercase();
    let origin = format!("{}://{authority}", parsed.scheme());
    Ok((authority, origin))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(host: &str, origin: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::HOST, host.parse().unwrap());
        if let Some(origin) = origin {
            headers.insert(header::ORIGIN, origin.parse().unwrap());
        }
        headers
    }

    #[test]
    fn a_rebound_name_is_refused_and_addresses_and_localhost_are_taken() {
        let origins = Origins::new(None, false).unwrap();
        for host in [
            "127.0.0.1:8080",
            "localhost:8080",
            "[::1]:8080",
            "10.1.2.3:8080",
            "LOCALHOST",
        ] {
            assert!(origins.admit(&Method::GET, &headers(host, None)).is_ok(), "{host}");
        }
        for host in [
            "attacker.example:8080",
            "localhost.attacker.example:8080",
            "127.0.0.1.nip.io",
        ] {
            let refused = origins.admit(&Method::GET, &headers(host, None)).unwrap_err();
            assert_eq!(refused.status, StatusCode::MISDIRECTED_REQUEST, "{host}");
        }
        assert!(origins.admit(&Method::GET, &HeaderMap::new()).is_err(), "no Host");
    }

    #[test]
    fn a_post_needs_the_consoles_own_origin() {
        let origins = Origins::new(None, false).unwrap();
        let post = |origin| origins.admit(&Method::POST, &headers("127.0.0.1:8080", origin));
        assert!(post(Some("http://127.0.0.1:8080")).is_ok());
        for origin in [
            None,
            Some("http://attacker.example"),
            Some("https://127.0.0.1:8080"),
            Some("null"),
        ] {
            let refused = post(origin).unwrap_err();
            assert_eq!(refused.status, StatusCode::FORBIDDEN, "{origin:?}");
        }
    }

    #[test]
    fn a_public_https_url_is_a_name_of_its_own_and_makes_cookies_secure() {
        let origins = Origins::new(Some("https://Console.Example.com"), false).unwrap();
        assert!(origins.secure());
        let post = |host, origin| origins.admit(&Method::POST, &headers(host, Some(origin)));
        assert!(post("console.example.com", "https://console.example.com").is_ok());
        assert!(post("console.example.com", "http://console.example.com").is_err());
        assert!(
            post("localhost:8080", "http://localhost:8080").is_ok(),
            "a port-forward"
        );
        assert!(
            !Origins::new(Some("http://console.internal:8080"), false)
                .unwrap()
                .secure()
        );
        for bad in [
            "ftp://x",
            "https://x/console",
            "https://x/?a=1",
            "not a url",
            "https://u:p@x",
        ] {
            assert!(Origins::new(Some(bad), false).is_err(), "{bad}");
        }
    }
}
