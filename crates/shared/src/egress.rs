//! Where a service's outgoing HTTP may connect, by address (the tool-runner's `http_get`, the
//! orchestrator's webhooks): a host name is resolved once, every address it
//! resolves to is checked, and the connection goes to the checked addresses only (the resolver
//! below is the HTTP client's, so there is no second lookup a rebinding DNS server could answer
//! differently). Loopback, link-local (169.254.0.0/16 with the cloud metadata address,
//! fe80::/10), private, CGNAT, multicast, broadcast and unspecified addresses are refused unless
//! an allowed CIDR (`--http-allow-cidr`, `--webhook-allow-cidr`) admits them; IPv4-mapped IPv6
//! addresses are judged as the IPv4 address they carry. Only the allowed ports are reached (80
//! and 443 by default).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use ipnet::IpNet;

/// A refusal of the address policy, found in the HTTP client's error chain.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// See the module docs.
#[derive(Debug, Clone)]
pub struct EgressPolicy {
    allowed_cidrs: Arc<Vec<IpNet>>,
    ports: Arc<Vec<u16>>,
    /// The flags that widen the policy, named in refusals so the reader knows what to change.
    flags: Flags,
}

/// The flags a service widens its policy with (`--http-allow-cidr`, `--http-allow-port`).
#[derive(Debug, Clone, Copy)]
pub struct Flags {
    /// The flag admitting address ranges.
    pub cidr: &'static str,
    /// The flag admitting ports.
    pub port: &'static str,
}

/// The kind of address refused by default, if `ip` is one.
fn special_range(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => special_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => special_v4(v4),
            None => special_v6(v6),
        },
    }
}

fn special_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, ..] = ip.octets();
    Some(match () {
        () if ip.is_loopback() => "loopback",
        () if ip.is_link_local() => "link-local (cloud metadata lives here)",
        () if ip.is_private() => "private",
        () if a == 100 && (64..128).contains(&b) => "shared address space (CGNAT)",
        () if ip.is_multicast() => "multicast",
        () if ip.is_broadcast() => "broadcast",
        () if ip.is_unspecified() || a == 0 => "unspecified",
        () => return None,
    })
}

fn special_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let first = ip.segments()[0];
    Some(match () {
        () if ip.is_loopback() => "loopback",
        () if ip.is_unspecified() => "unspecified",
        () if first & 0xffc0 == 0xfe80 => "link-local",
        () if first & 0xfe00 == 0xfc00 => "private (unique local)",
        () if ip.is_multicast() => "multicast",
        () => return None,
    })
}

impl EgressPolicy {
    /// A policy admitting `allowed_cidrs` besides public addresses, on `ports`, widened by
    /// `flags`.
    pub fn new(allowed_cidrs: Vec<IpNet>, ports: Vec<u16>, flags: Flags) -> Self {
        Self {
            allowed_cidrs: Arc::new(allowed_cidrs),
            ports: Arc::new(ports),
            flags,
        }
    }

    /// Why `ip` may not be reached, if it may not.
    pub fn refusal(&self, ip: IpAddr) -> Option<String> {
        let kind = special_range(ip)?;
        let mapped = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4),
            IpAddr::V4(_) => None,
        };
        let admitted = self
            .allowed_cidrs
            .iter()
            .any(|net| net.contains(&ip) || mapped.is_some_and(|m| net.contains(&m)));
        (!admitted).then(|| format!("{ip} is a {kind} address, which {} does not admit", self.flags.cidr))
    }

    /// Checks a URL's port, and its host when it is an address.
    pub fn check_url(&self, url: &reqwest::Url) -> Result<(), Refused> {
        let port = url.port_or_known_default().unwrap_or(0);
        if !self.ports.contains(&port) {
            let ports: Vec<String> = self.ports.iter().map(u16::to_string).collect();
            return Err(Refused(format!(
                "port {port} is not allowed (allowed: {}; see {})",
                ports.join(", "),
                self.flags.port
            )));
        }
        let literal = url
            .host_str()
            .and_then(|h| h.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().ok());
        match literal.and_then(|ip| self.refusal(ip)) {
            Some(why) => Err(Refused(why)),
            None => Ok(()),
        }
    }

    /// The addresses `host` resolved to that may be reached; an error naming the refused ones
    /// when none may.
    pub fn admit(&self, host: &str, resolved: Vec<SocketAddr>) -> Result<Vec<SocketAddr>, Refused> {
        let (mut admitted, mut reasons) = (Vec::new(), Vec::new());
        for address in resolved {
            match self.refusal(address.ip()) {
                None => admitted.push(address),
                Some(why) => reasons.push(why),
            }
        }
        if admitted.is_empty() {
            return Err(Refused(if reasons.is_empty() {
                format!("{host:?} resolves to no address")
            } else {
                format!("{host:?} resolves only to refused addresses: {}", reasons.join("; "))
            }));
        }
        Ok(admitted)
    }
}

/// Looks names up (the system resolver; a scripted one in tests).
pub type Lookup = Arc<dyn Fn(String) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> + Send + Sync>;

/// The system resolver.
pub fn system_lookup() -> Lookup {
    Arc::new(|host: String| async move { Ok(tokio::net::lookup_host((host.as_str(), 0)).await?.collect()) }.boxed())
}

/// The HTTP client's resolver: resolves once and hands the client the admitted addresses only.
pub struct CheckedResolver {
    /// What it admits.
    pub policy: EgressPolicy,
    /// How it looks names up.
    pub lookup: Lookup,
}

impl reqwest::dns::Resolve for CheckedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let (policy, lookup, host) = (self.policy.clone(), Arc::clone(&self.lookup), name.as_str().to_owned());
        async move {
            let resolved = lookup(host.clone()).await?;
            let admitted = policy.admit(&host, resolved)?;
            Ok(Box::new(admitted.into_iter()) as reqwest::dns::Addrs)
        }
        .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(cidrs: &[&str]) -> EgressPolicy {
        let flags = Flags {
            cidr: "--http-allow-cidr",
            port: "--http-allow-port",
        };
        EgressPolicy::new(cidrs.iter().map(|c| c.parse().unwrap()).collect(), vec![80, 443], flags)
    }

    #[test]
    fn special_addresses_are_refused_unless_admitted() {
        let closed = policy(&[]);
        for refused in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "224.0.0.1",
            "255.255.255.255",
            "0.0.0.0",
            "::1",
            "::",
            "fe80::1",
            "fd00::1",
            "ff02::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
        ] {
            assert!(
                closed.refusal(refused.parse().unwrap()).is_some(),
                "{refused} was admitted"
            );
        }
        for public in ["93.184.216.34", "100.128.0.1", "2606:2800:220:1::1", "8.8.8.8"] {
            assert_eq!(closed.refusal(public.parse().unwrap()), None, "{public} was refused");
        }
        let open = policy(&["127.0.0.0/8", "::1/128", "fd00::/8"]);
        assert_eq!(open.refusal("127.0.0.2".parse().unwrap()), None);
        // IPv6 entries match IPv6 addresses, and an IPv4 entry matches the mapped form.
        assert_eq!(open.refusal("::1".parse().unwrap()), None);
        assert_eq!(open.refusal("fd00::5".parse().unwrap()), None);
        assert_eq!(open.refusal("::ffff:127.0.0.1".parse().unwrap()), None);
        assert!(open.refusal("169.254.169.254".parse().unwrap()).is_some());
    }

    #[test]
    fn urls_are_checked_for_port_and_literal_address() {
        let p = policy(&[]);
        let url = |s: &str| reqwest::Url::parse(s).unwrap();
        assert!(p.check_url(&url("https://example.com/")).is_ok());
        assert!(
            p.check_url(&url("http://example.com:8080/"))
                .unwrap_err()
                .0
                .contains("port 8080")
        );
        assert!(
            p.check_url(&url("http://169.254.169.254/latest/meta-data/"))
                .unwrap_err()
                .0
                .contains("link-local")
        );
        assert!(p.check_url(&url("http://[::1]/")).unwrap_err().0.contains("loopback"));
    }

    #[tokio::test]
    async fn names_are_resolved_once_and_only_admitted_addresses_are_used() {
        use reqwest::dns::Resolve;
        let lookup: Lookup = Arc::new(|host: String| {
            let answer: Vec<SocketAddr> = match host.as_str() {
                "metadata.test" => vec!["169.254.169.254:0".parse().unwrap()],
                "loopback.test" => vec!["127.0.0.1:0".parse().unwrap(), "[::1]:0".parse().unwrap()],
                "mixed.test" => vec!["10.0.0.1:0".parse().unwrap(), "93.184.216.34:0".parse().unwrap()],
                _ => vec![],
            };
            async move { Ok(answer) }.boxed()
        });
        let resolver = CheckedResolver {
            policy: policy(&[]),
            lookup,
        };
        let resolve = |name: &str| resolver.resolve(name.parse().unwrap());
        let error = |r: Result<reqwest::dns::Addrs, Box<dyn std::error::Error + Send + Sync>>| {
            r.err().map(|e| e.to_string()).unwrap_or_default()
        };
        assert!(error(resolve("metadata.test").await).contains("169.254.169.254 is a link-local"));
        assert!(error(resolve("loopback.test").await).contains("::1 is a loopback"));
        let mixed: Vec<SocketAddr> = resolve("mixed.test").await.unwrap().collect();
        assert_eq!(mixed, vec!["93.184.216.34:0".parse::<SocketAddr>().unwrap()]);
    }
}
