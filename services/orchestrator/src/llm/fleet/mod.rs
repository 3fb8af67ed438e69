//! The model fleet: every endpoint that serves the model (`--llm-base-url`, repeatable, and
//! `dns:///name:port/path` for every address of a name, re-resolved), and where each completion
//! goes (docs/architecture.md, "The model fleet").
//!
//! * **Affinity.** A run's turns go to one endpoint, the first in its rendezvous order of the
//!   run's affinity key ([`rendezvous`]), because a later turn resends the whole transcript and
//!   the endpoint that served the previous turn holds it in its prefix cache. An endpoint that is
//!   ejected or has `--llm-max-inflight-per-endpoint` completions in flight is passed over for the
//!   next in the order; a run that moved stays where it went while that endpoint serves it well.
//! * **Failover.** No connection, a 5xx or 429, or no response and no event within the idle
//!   timeout: the completion goes to the next endpoint at once (each endpoint once, then
//!   `--llm-max-retries` more tries with backoff, though never again to a server that stalled);
//!   the error names every endpoint's answer.
//! * **Passive health** ([`member`]): failures in a row eject an endpoint for a while (never more
//!   than `--llm-max-ejected-percent` of the fleet at once); let back in, one more failure ejects
//!   it again for twice as long, and a success clears it.
//!
//! Which endpoints the fleet holds (the static URLs and what each DNS name resolves to, again on
//! an interval) is `membership.rs`.
//!
//! Once a completion's first event has arrived it is never retried here: its events went on to
//! the run.

mod member;
mod membership;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use futures::{FutureExt, Stream, StreamExt};
use shared::runtime::AbortOnDrop;
use shared::sync::lock;
use tokio::time::Instant;

use crate::domain::rendezvous;

use self::member::{HealthRules, InFlight, Member};
use super::body::request_body_with;
use super::client::Attempt;
use crate::config::LlmSettings;
use crate::domain::model::{ChatModel, ChatRequest, LlmError, LlmEvent};
use crate::telemetry::metric;
use shared::dns::Resolve;

/// Runs whose turns moved off their first endpoint that are remembered.
const MAX_MOVED: usize = 65_536;

/// Endpoints tried at once, without backoff, before the retries.
const MAX_FAILOVER: usize = 8;

/// The model fleet (see the module docs); cheap to clone.
#[derive(Clone)]
pub struct Fleet {
    inner: Arc<Inner>,
    _membership: Option<Arc<AbortOnDrop>>,
}

struct Inner {
    members: RwLock<Arc<[Arc<Member>]>>,
    settings: LlmSettings,
    rules: HealthRules,
    /// Affinity key → the endpoint its turns moved to (when not their first).
    moved: Mutex<HashMap<String, String>>,
    /// The header that carries a request's affinity key (`--llm-affinity-header`).
    affinity_header: Option<reqwest::header::HeaderName>,
}

impl Fleet {
    /// The fleet of `settings.base_urls`: DNS names are resolved now and followed in the
    /// background. Fails on an unusable URL or header (errors never show a credential).
    pub async fn start(settings: LlmSettings, resolver: Arc<dyn Resolve>) -> Result<Self, String> {
        let targets = settings.targets()?;
        let affinity_header = settings.affinity_header()?;
        let membership = membership::Membership::start(&settings, targets, resolver).await?;
        let inner = Arc::new(Inner {
            members: RwLock::new(membership.members()),
            rules: HealthRules {
                eject_after: settings.eject_after,
                eject_for: settings.eject_for,
            },
            settings,
            moved: Mutex::default(),
            affinity_header,
        });
        inner.set_members(inner.members());
        let follow = membership.follow(Arc::downgrade(&inner));
        Ok(Self {
            inner,
            _membership: follow.map(Arc::new),
        })
    }

    /// The endpoints as logs show them.
    pub fn shown(&self) -> Vec<String> {
        self.inner.members().iter().map(|m| m.name.clone()).collect()
    }
}

impl ChatModel for Fleet {
    fn stream(
        &self,
        request: ChatRequest,
    ) -> BoxFuture<'static, Result<BoxStream<'static, Result<LlmEvent, LlmError>>, LlmError>> {
        Arc::clone(&self.inner).open(request).boxed()
    }
}

impl Inner {
    fn members(&self) -> Arc<[Arc<Member>]> {
        self.members
            .read()
            .map_or_else(|e| Arc::clone(e.get_ref()), |m| Arc::clone(&m))
    }

    fn set_members(&self, members: Arc<[Arc<Member>]>) {
        metrics::gauge!(metric::LLM_ENDPOINTS).set(members.len() as f64);
        match self.members.write() {
            Ok(mut current) => *current = members,
            Err(poisoned) => *poisoned.into_inner() = members,
        }
    }

    /// Posts the completion to the endpoints of its plan in turn until one streams it: each
    /// once at once, then `--llm-max-retries` more tries with backoff, never again to one that
    /// stalled.
    async fn open(
        self: Arc<Self>,
        request: ChatRequest,
    ) -> Result<BoxStream<'static, Result<LlmEvent, LlmError>>, LlmError> {
        let post = self.post(&request);
        let plan = self.plan_avoiding(&request.affinity, request.avoid.as_deref());
        let tried = &plan.tries;
        if tried.is_empty() {
            return Err(LlmError::Http(
                "no model endpoint: every dns:/// name of --llm-base-url resolved to no address".to_owned(),
            ));
        }
        let first_round = tried.len().min(MAX_FAILOVER);
        let tries = first_round + self.settings.max_retries as usize;
        let (mut failures, mut retry_after) = (Vec::new(), None);
        for attempt in 0..tries {
            let member = &tried[attempt % tried.len()];
            if attempt >= first_round {
                self.back_off(attempt - first_round, retry_after.take(), member).await;
            }
            let (outcome, failure) = match self.try_member(member, &post, &request.pace).await {
                Ok(stream) => {
                    self.remember(&request.affinity, &member.name, &plan);
                    return Ok(stream);
                }
                Err(Tried::Final(failure)) => return Err(failure),
                Err(Tried::Failed {
                    outcome,
                    failure,
                    retry_after: after,
                }) => {
                    retry_after = after;
                    (outcome, failure)
                }
            };
            self.failed(member, outcome);
            failures.push((member.name.clone(), failure));
            let stalled = matches!(outcome, "no_response" | "no_event");
            if (stalled && attempt + 1 >= first_round) || attempt + 1 == tries {
                break;
            }
            metrics::counter!(metric::LLM_RETRIES, "reason" => outcome).increment(1);
        }
        Err(combined(failures, tried.len()))
    }

    /// What every try of `request` sends: its body, and its affinity header when one is set.
    fn post(&self, request: &ChatRequest) -> Post {
        let body = bytes::Bytes::from(request_body_with(request, self.settings.affinity_field.as_deref()));
        let header = self.affinity_header.clone().and_then(|name| {
            let value = reqwest::header::HeaderValue::from_str(&request.affinity).ok()?;
            Some((name, value))
        });
        Post { body, header }
    }

    /// Waits before a retry: the server's `Retry-After` when it gave one, else the backoff,
    /// doubling with each retry.
    async fn back_off(&self, retry: usize, retry_after: Option<std::time::Duration>, member: &Member) {
        let backoff = self.settings.retry_backoff.saturating_mul(1 << retry.min(16));
        let delay = retry_after.unwrap_or(backoff);
        tracing::warn!(
            retry,
            endpoint = %member.name,
            delay_ms = delay.as_millis() as u64,
            "retrying the LLM request"
        );
        tokio::time::sleep(delay).await;
    }

    /// One try on `member`: its stream once the first event is in, or how it failed.
    async fn try_member(
        self: &Arc<Self>,
        member: &Arc<Member>,
        post: &Post,
        pace: &crate::domain::model::ReadPace,
    ) -> Result<BoxStream<'static, Result<LlmEvent, LlmError>>, Tried> {
        let in_flight = member.enter();
        let failed = |outcome, failure, retry_after| Tried::Failed {
            outcome,
            failure,
            retry_after,
        };
        match member
            .client
            .attempt(post.body.clone(), post.header.as_ref(), pace)
            .await
        {
            Attempt::Streaming(events) => self
                .first_event(events, in_flight)
                .await
                .map_err(|failure| failed("no_event", failure, None)),
            Attempt::Retryable { retry_after, failure } => Err(failed(retry_reason(&failure), failure, retry_after)),
            Attempt::Final(failure @ LlmError::Stalled(_)) => Err(failed("no_response", failure, None)),
            Attempt::Final(failure) => Err(Tried::Final(failure)),
        }
    }

    /// Waits for the stream's first event: a stall before it fails over; anything else is the
    /// completion's, returned with the stream watched from here on.
    async fn first_event(
        self: &Arc<Self>,
        mut events: BoxStream<'static, Result<LlmEvent, LlmError>>,
        in_flight: InFlight,
    ) -> Result<BoxStream<'static, Result<LlmEvent, LlmError>>, LlmError> {
        let first = match events.next().await {
            Some(Err(stalled @ LlmError::Stalled(_))) => return Err(stalled),
            Some(first) => first,
            None => {
                in_flight.member().succeeded();
                return Ok(futures::stream::empty().boxed());
            }
        };
        Ok(Watched {
            first: Some(first),
            events,
            in_flight: Some(in_flight),
            fleet: Arc::clone(self),
        }
        .boxed())
    }

    /// The order in which endpoints are tried for `key`: the healthy ones in the key's
    /// rendezvous order, the one its turns moved to first while it is not saturated, else the
    /// first that is not; ejected ones last, as a last resort.
    fn plan(&self, key: &str) -> Plan {
        let members = self.members();
        let now = Instant::now();
        let ranked = rendezvous::order(key, members.iter().map(|m| m.name.as_str()));
        let first_choice = ranked.first().map(|&i| members[i].name.clone());
        let (mut plan, ejected): (Vec<Arc<Member>>, Vec<Arc<Member>>) = ranked
            .into_iter()
            .map(|i| Arc::clone(&members[i]))
            .partition(|m| !m.ejected(now));
        let limit = self.settings.max_inflight_per_endpoint;
        let moved = lock(&self.moved).get(key).cloned();
        let lead = moved
            .and_then(|name| plan.iter().position(|m| m.name == name && !m.saturated(limit)))
            .or_else(|| plan.iter().position(|m| !m.saturated(limit)));
        if let Some(lead) = lead {
            let member = plan.remove(lead);
            plan.insert(0, member);
        }
        plan.extend(ejected);
        Plan {
            tries: plan,
            first_choice,
        }
    }

    /// [`Inner::plan`], with `avoid` (an endpoint that just cut the turn's stream) last.
    fn plan_avoiding(&self, key: &str, avoid: Option<&str>) -> Plan {
        let mut plan = self.plan(key);
        let tries = &mut plan.tries;
        if let Some(at) = avoid.and_then(|name| tries.iter().position(|m| m.name == name)) {
            let member = tries.remove(at);
            tries.push(member);
        }
        plan
    }

    /// A completion of `key` streams from `endpoint`: remembered when that is not the key's
    /// first choice, forgotten when it is.
    fn remember(&self, key: &str, endpoint: &str, plan: &Plan) {
        let mut moved = lock(&self.moved);
        if plan.first_choice.as_deref() == Some(endpoint) || plan.tries.len() < 2 {
            moved.remove(key);
            return;
        }
        if moved.len() >= MAX_MOVED && !moved.contains_key(key) {
            moved.clear();
        }
        moved.insert(key.to_owned(), endpoint.to_owned());
    }

    /// Counts a failure against `member`, ejecting it when the rules say so and the fleet has
    /// room for one more ejected endpoint.
    fn failed(&self, member: &Member, outcome: &'static str) {
        let members = self.members();
        let now = Instant::now();
        let ejected = members.iter().filter(|m| m.ejected(now)).count();
        let may_eject = (ejected + 1) * 100 <= self.settings.max_ejected_percent as usize * members.len();
        member.failed(outcome, self.rules, may_eject);
    }
}

/// Where a completion is tried, in order, and the endpoint its key ranks first.
struct Plan {
    tries: Vec<Arc<Member>>,
    first_choice: Option<String>,
}

/// What a completion's tries send.
struct Post {
    body: bytes::Bytes,
    header: Option<(reqwest::header::HeaderName, reqwest::header::HeaderValue)>,
}

/// How one try on an endpoint failed.
enum Tried {
    /// Worth trying elsewhere or again: `outcome` names how (for the metrics and health).
    Failed {
        outcome: &'static str,
        failure: LlmError,
        retry_after: Option<std::time::Duration>,
    },
    /// Not worth another try anywhere (the server understood and refused the request).
    Final(LlmError),
}

/// The reason a refusal is retried, for the metrics.
fn retry_reason(failure: &LlmError) -> &'static str {
    match failure {
        LlmError::Http(m) if m.contains("429") => "rate_limited",
        LlmError::Http(m) if m.contains("cannot reach") => "connect",
        _ => "server_error",
    }
}

/// The error when every try failed: with one endpoint its last answer, else every endpoint's.
fn combined(mut failures: Vec<(String, LlmError)>, endpoints: usize) -> LlmError {
    if endpoints == 1
        && let Some((_, last)) = failures.pop()
    {
        return last;
    }
    let tries = failures.len();
    let answers: Vec<String> = failures
        .iter()
        .map(|(endpoint, failure)| format!("{endpoint}: {failure}"))
        .collect();
    LlmError::Http(format!(
        "{tries} tries on {endpoints} model endpoints failed: {}",
        answers.join("; ")
    ))
}

/// A completion streaming from a member: counts its prompt tokens, and its end or its failure
/// against the member's health; holds its place in flight until dropped.
struct Watched {
    first: Option<Result<LlmEvent, LlmError>>,
    events: BoxStream<'static, Result<LlmEvent, LlmError>>,
    in_flight: Option<InFlight>,
    fleet: Arc<Inner>,
}

impl Watched {
    /// Counts `item` against the member; a stream cut (broken off, or quiet for the idle
    /// timeout) names the member when the fleet has another to restart the turn on.
    fn saw(&mut self, item: Option<Result<LlmEvent, LlmError>>) -> Option<Result<LlmEvent, LlmError>> {
        let Some(in_flight) = &self.in_flight else {
            return item;
        };
        let member = Arc::clone(in_flight.member());
        match item {
            Some(Ok(LlmEvent::Usage(usage))) => member.count_prompt(usage),
            Some(Ok(LlmEvent::Done)) | None => {
                member.succeeded();
                self.in_flight = None;
            }
            Some(Err(error)) => {
                self.fleet.failed(&member, "cut");
                self.in_flight = None;
                let cut = matches!(error, LlmError::Protocol(_) | LlmError::Stalled(_));
                if cut && self.fleet.members().len() > 1 {
                    return Some(Err(LlmError::Cut {
                        endpoint: member.name.clone(),
                        error: Box::new(error),
                    }));
                }
                return Some(Err(error));
            }
            Some(Ok(_)) => {}
        }
        item
    }
}

impl Stream for Watched {
    type Item = Result<LlmEvent, LlmError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let item = match self.first.take() {
            Some(first) => Some(first),
            None => match self.events.poll_next_unpin(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(item) => item,
            },
        };
        Poll::Ready(self.saw(item))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Reader;
    use crate::domain::model::ReadPace;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server that answers one short completion per connection and keeps what it was sent.
    async fn capturing() -> (String, Arc<Mutex<Vec<String>>>) {
        const ANSWER: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n\
            data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\ndata: [DONE]\n\n";
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1", listener.local_addr().unwrap());
        let seen = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&seen);
        shared::tasks::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let kept = Arc::clone(&kept);
                shared::tasks::spawn(async move {
                    let (mut buf, mut request) = (vec![0u8; 65536], Vec::new());
                    while !String::from_utf8_lossy(&request).contains("\"stream\":true") {
                        match socket.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    lock(&kept).push(String::from_utf8_lossy(&request).into_owned());
                    let _ = socket.write_all(ANSWER.as_bytes()).await;
                });
            }
        });
        (url, seen)
    }

    fn request(affinity: &str) -> ChatRequest {
        ChatRequest {
            model: "m".into(),
            messages: vec![crate::domain::chat::Message::User {
                content: "hi".into(),
                name: None,
            }],
            tools: Arc::from(Vec::new()),
            params: Default::default(),
            pace: ReadPace::default(),
            affinity: affinity.into(),
            avoid: None,
            prefix: Default::default(),
        }
    }

    #[tokio::test]
    async fn the_affinity_key_goes_in_the_configured_field_and_header_on_both_readers() {
        for reader in [Reader::Run, Reader::Pooled] {
            let (url, seen) = capturing().await;
            let settings = LlmSettings {
                base_urls: vec![url],
                affinity_field: Some("prompt_cache_key".into()),
                affinity_header: Some("x-grok-conv-id".into()),
                reader,
                ..crate::Config::default().llm
            };
            let fleet = Fleet::start(settings, Arc::new(shared::dns::SystemResolver))
                .await
                .unwrap();
            let events: Vec<_> = fleet.stream(request("conversation-9")).await.unwrap().collect().await;
            assert!(events.iter().all(Result::is_ok), "{events:?}");
            let sent = lock(&seen).concat();
            assert!(
                sent.to_lowercase().contains("x-grok-conv-id: conversation-9"),
                "{reader:?}: {sent}"
            );
            assert!(
                sent.contains(r#""prompt_cache_key":"conversation-9""#),
                "{reader:?}: {sent}"
            );
        }
    }

    #[tokio::test]
    async fn without_the_settings_the_key_is_not_sent() {
        let (url, seen) = capturing().await;
        let settings = LlmSettings {
            base_urls: vec![url],
            ..crate::Config::default().llm
        };
        let fleet = Fleet::start(settings, Arc::new(shared::dns::SystemResolver))
            .await
            .unwrap();
        let _: Vec<_> = fleet.stream(request("conversation-9")).await.unwrap().collect().await;
        assert!(!lock(&seen).concat().contains("conversation-9"));
    }
}
