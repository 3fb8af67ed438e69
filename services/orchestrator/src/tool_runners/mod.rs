//! The client side of the tool-runners: one balanced gRPC channel over every runner endpoint,
//! the tool catalog (discovered with `ListTools` at start and refreshed periodically), and
//! [`ToolExecutor`] for the run loop.
//!
//! Endpoints are static (`http://host:port`, repeatable) or resolved from DNS
//! (`dns:///name:port`, e.g. a Kubernetes headless Service, which answers with every pod's
//! address). DNS names are re-resolved on an interval and the endpoint pool gains and loses endpoints
//! as the answer changes; each call goes to the less loaded of two random endpoints.
//!
//! Each `RunTool` carries the run id and call id as request metadata (`x-run-id`, `x-call-id`),
//! the run's metadata in the request body, the trace context, and a gRPC deadline. A call the
//! runner refused before running it (it says so with `x-tool-runner-refused`: over its
//! concurrency limit, draining, or unable to read the run's fence), or that never reached a
//! runner (connect error), is retried on another endpoint with backoff, a bounded number of
//! times; a call whose tool may have started is retried only when it is durable and the runners
//! record durable calls (`ListTools` says so): the runner answers it from the call's record, or
//! in doubt, and never runs it twice. Every attempt is sent only while
//! this replica holds the run, and a runner's refusal of a replaced owner's call
//! (`FAILED_PRECONDITION` with `x-run-epoch-current`) stops this replica acting for the run.
//! Dropping a call resets its HTTP/2 stream, which cancels the tool on the runner.
//!
//! Files: this one (the catalog, a call's gRPC attempts), `sender.rs` (the rules every attempt
//! follows: lease checks, stale refusals, retries of calls that did not run), `pool.rs` (the
//! endpoint pool: two random choices, ejections), `membership.rs` (DNS re-resolution, reload of
//! the TLS and token files), `transport.rs` (one endpoint's channel: TLS, token), `listings.rs`
//! (what each runner listed last: a warning when runners serve different tools). A call's
//! request body and a runner's answer are mapped by the wire (`crate::wire::runners`).

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use membership::Membership;
use proto::toolrunner::v1 as pb;
use shared::runtime::AbortOnDrop;
use transport::{SharedTransport, Transport};

use crate::Error;
use crate::config::{Target, ToolRunnerSettings};
use crate::domain::chat::ToolDefinition;
use crate::wire::runners::{outcome, run_tool_body};
use pool::Pool;

mod listings;
mod membership;
mod pool;
pub mod sender;
mod transport;
use crate::domain::ToolCallError;
use crate::domain::ports::{ProgressFn, ToolExecutor, ToolInvocation, ToolOutput, ToolProgress};
use sender::{Attempt, Retries};
#[cfg(test)]
use sender::{moved_away, stop_superseded};

/// Response metadata by which a runner says it refused a call before running it.
pub const REFUSED_HEADER: &str = "x-tool-runner-refused";

/// Response metadata of a runner's `FAILED_PRECONDITION` for a replaced owner's call: the run's
/// epoch as the runner read it from the run store's fence.
pub const CURRENT_EPOCH_HEADER: &str = "x-run-epoch-current";

/// A tool the runners offer.
#[derive(Debug, Clone)]
pub struct RemoteTool {
    /// Name, description and schema for the model.
    pub definition: ToolDefinition,
    /// The runner's own timeout for it.
    pub timeout: Duration,
    /// The runner requires a person's approval of each call.
    pub needs_approval: bool,
}

/// The tools the runners offer, and whether they answered the last fetch.
#[derive(Default)]
struct Catalog {
    /// The latest tools; replaced whole on refresh, so readers share a snapshot without copying.
    tools: Arc<BTreeMap<String, RemoteTool>>,
    /// Why the last fetch got no answer (`None`: a runner answered).
    unanswered: Option<String>,
    /// Fetches so far, so a request that waited for a fetch uses its answer.
    generation: u64,
}

pub use shared::dns::{Resolve, SystemResolver};

/// What a call needs of the settings (copied into each call, no allocation).
#[derive(Debug, Clone, Copy)]
struct CallSettings {
    retries: u32,
    backoff: Duration,
    max_response_bytes: usize,
    /// Most questions one call may ask.
    max_questions: usize,
}

/// How long an endpoint is skipped after refusing a call over its concurrency limit.
const BUSY_EJECTION: Duration = Duration::from_millis(200);
/// How long an endpoint is skipped after saying it drains, or when it cannot be reached.
const GONE_EJECTION: Duration = Duration::from_secs(2);

/// Connection to the tool-runners.
#[derive(Clone)]
pub struct ToolRunners {
    pool: Arc<Pool>,
    catalog: Arc<RwLock<Catalog>>,
    /// Held while the catalog is fetched: requests that find no answering runner share one fetch.
    fetching: Arc<tokio::sync::Mutex<()>>,
    targets: Arc<Vec<String>>,
    call: CallSettings,
    _membership: Option<Arc<AbortOnDrop>>,
    transport: SharedTransport,
    /// The runner that answered the last catalog fetch records durable calls: a durable call
    /// whose answer was lost may be sent again.
    records_calls: Arc<std::sync::atomic::AtomicBool>,
    listings: Arc<listings::Listings>,
}

impl ToolRunners {
    /// Connects to the targets of `settings` (static endpoints and DNS names); DNS names are
    /// resolved now and then every `settings.resolve_interval`, and the TLS and token files are
    /// checked for changes every `reload_interval` (see [`membership`]).
    pub async fn connect(
        settings: &ToolRunnerSettings,
        resolver: Arc<dyn Resolve>,
        reload_interval: Duration,
    ) -> Result<Self, Error> {
        if settings.endpoints.is_empty() {
            return Err(Error::Config("at least one --tool-runner endpoint is needed".into()));
        }
        let transport = SharedTransport::new(Transport::from_settings(settings)?);
        let pool = Arc::new(Pool::new());
        let membership = Membership::start(settings, resolver, Arc::clone(&pool), transport.clone()).await?;
        Ok(Self {
            pool,
            catalog: Arc::default(),
            fetching: Arc::default(),
            targets: Arc::new(settings.endpoints.clone()),
            call: CallSettings {
                retries: settings.call_retries,
                backoff: settings.call_retry_backoff,
                max_response_bytes: settings.max_response_bytes,
                max_questions: settings.max_questions,
            },
            _membership: membership.follow(settings.clone(), reload_interval).map(Arc::new),
            transport,
            records_calls: Arc::default(),
            listings: Arc::default(),
        })
    }

    /// The endpoints calls are balanced over now.
    pub fn endpoints(&self) -> Vec<String> {
        self.pool.uris()
    }

    /// Fetches the tool list from one endpoint (trying others if it fails); on failure the
    /// previous tools stay known, and the catalog says no runner answers.
    pub async fn refresh(&self, timeout: Duration) -> Result<usize, String> {
        let fetched = self.fetch(timeout).await;
        let mut catalog = shared::sync::write(&self.catalog);
        catalog.generation += 1;
        match fetched {
            Ok((uri, tools)) => {
                let count = tools.len();
                let names = tools.keys().cloned().collect();
                let disagreement = self.listings.record(&uri, names, &self.pool.uris());
                let changed = !catalog.tools.keys().eq(tools.keys());
                if let Some(warning) = disagreement.filter(|_| changed) {
                    tracing::warn!(runner = %uri, "{warning}");
                }
                catalog.tools = Arc::new(tools);
                catalog.unanswered = None;
                Ok(count)
            }
            Err(e) => {
                catalog.unanswered = Some(e.clone());
                Err(e)
            }
        }
    }

    /// The tools, when a runner answered the last fetch; otherwise fetches them now (requests that
    /// wait at the same time share one fetch), and without an answer within `wait` fails
    /// `UNAVAILABLE` rather than let a run go ahead without its tools.
    pub async fn answering_catalog(&self, wait: Duration) -> Result<Arc<BTreeMap<String, RemoteTool>>, Error> {
        let seen = {
            let catalog = self.read_catalog();
            if catalog.unanswered.is_none() && catalog.generation > 0 {
                return Ok(Arc::clone(&catalog.tools));
            }
            catalog.generation
        };
        let unanswered = |e: String| Error::NoToolRunner(e);
        let _fetching = tokio::time::timeout(wait, self.fetching.lock())
            .await
            .map_err(|_| unanswered(format!("no tool list within {}", humantime::format_duration(wait))))?;
        let shared = {
            let catalog = self.read_catalog();
            (catalog.generation != seen).then(|| (Arc::clone(&catalog.tools), catalog.unanswered.clone()))
        };
        match shared {
            Some((tools, None)) => Ok(tools),
            Some((_, Some(e))) => Err(unanswered(e)),
            None => {
                self.refresh(wait).await.map_err(unanswered)?;
                Ok(self.catalog())
            }
        }
    }

    fn read_catalog(&self) -> std::sync::RwLockReadGuard<'_, Catalog> {
        shared::sync::read(&self.catalog)
    }

    /// `ListTools` on one endpoint after another until one answers (another than the last
    /// answer's first, when there is one: see [`listings`]); which one, and its tools.
    async fn fetch(&self, timeout: Duration) -> Result<(String, BTreeMap<String, RemoteTool>), String> {
        let mut avoided = self.listings.last_answerer().filter(|_| self.pool.uris().len() > 1);
        let mut tried: Vec<String> = avoided.iter().cloned().collect();
        let mut last_error = format!("no tool-runner endpoint (targets: {})", self.targets.join(", "));
        let response = loop {
            let Some(checkout) = self.pool.pick(&tried).filter(|l| !tried.contains(&l.member.uri)) else {
                // The last answer's runner is asked last, not never.
                match avoided.take() {
                    Some(last) => {
                        tried.retain(|uri| *uri != last);
                        continue;
                    }
                    None => return Err(last_error),
                }
            };
            let uri = checkout.member.uri.clone();
            tried.push(checkout.member.uri.clone());
            let mut client = pb::tool_runner_client::ToolRunnerClient::new(checkout.member.channel.clone())
                .max_decoding_message_size(self.call.max_response_bytes);
            let mut request = tonic::Request::new(pb::ListToolsRequest {});
            request.set_timeout(timeout);
            self.transport.current().authorize(&mut request);
            match tokio::time::timeout(timeout, client.list_tools(request)).await {
                Ok(Ok(response)) => break (uri, response),
                Ok(Err(status)) => {
                    last_error = format!("ListTools on {} failed: {}", checkout.member.uri, status.message())
                }
                Err(_) => last_error = format!("ListTools on {} timed out", checkout.member.uri),
            }
        };
        let (uri, response) = (response.0, response.1.into_inner());
        self.records_calls
            .store(response.records_calls, std::sync::atomic::Ordering::Relaxed);
        let mut catalog = BTreeMap::new();
        for spec in response.tools {
            let parameters = serde_json::from_str(&spec.parameters_json_schema)
                .unwrap_or_else(|_| serde_json::json!({"type": "object"}));
            catalog.insert(
                spec.name.clone(),
                RemoteTool {
                    definition: ToolDefinition {
                        name: spec.name,
                        description: spec.description,
                        parameters: parameters.into(),
                    },
                    timeout: Duration::from_millis(u64::from(spec.timeout_ms)),
                    needs_approval: spec.needs_approval,
                },
            );
        }
        Ok((uri, catalog))
    }

    /// The tools known now, by name.
    pub fn catalog(&self) -> Arc<BTreeMap<String, RemoteTool>> {
        Arc::clone(&self.read_catalog().tools)
    }

    /// Refreshes the catalog every `interval` until the returned task is aborted.
    pub fn spawn_refresher(&self, interval: Duration, timeout: Duration) -> tokio::task::JoinHandle<()> {
        let this = self.clone();
        shared::tasks::spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticker.tick().await;
            loop {
                ticker.tick().await;
                match this.refresh(timeout).await {
                    Ok(count) => tracing::debug!(tools = count, "tool catalog refreshed"),
                    Err(e) => tracing::warn!("tool catalog refresh failed (keeping the previous one): {e}"),
                }
            }
        })
    }
}

fn ascii_header(value: &str) -> Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>> {
    value.parse().ok()
}

/// Whether the call certainly did not run, and why (as the retries metric counts it): the
/// runner refused it (its admission, draining, or its run store unread), or it never reached one.
pub fn refused_before_run(status: &tonic::Status) -> Option<&'static str> {
    if let Some(why) = status.metadata().get(REFUSED_HEADER) {
        return Some(match why.to_str().unwrap_or_default() {
            "run-store" => "run_store",
            _ if status.code() == tonic::Code::ResourceExhausted => "concurrency_limit",
            _ => "draining",
        });
    }
    if status.code() != tonic::Code::Unavailable {
        return None;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(status);
    while let Some(error) = source {
        let text = error.to_string().to_ascii_lowercase();
        if text.contains("connect error")
            || text.contains("error trying to connect")
            || text.contains("connection refused")
        {
            return Some("connect");
        }
        source = error.source();
    }
    None
}

impl ToolExecutor for ToolRunners {
    fn execute(&self, call: ToolInvocation) -> BoxFuture<'static, Result<ToolOutput, ToolCallError>> {
        let pool = Arc::clone(&self.pool);
        let settings = self.call;
        let transport = self.transport.current();
        let records = call.epoch > 0 && self.records_calls.load(std::sync::atomic::Ordering::Relaxed);
        async move {
            let retries = Retries {
                retries: settings.retries,
                backoff: settings.backoff,
            };
            let tried: Arc<std::sync::Mutex<Vec<String>>> = Arc::default();
            sender::send(&call, retries, || {
                let pinned = call.task.as_ref().and_then(|t| t.runner.clone());
                let checkout = match &pinned {
                    Some(uri) => pool.pick_only(uri),
                    None => pool.pick(&shared::sync::lock(&tried)),
                };
                // The streamed call, and the unary one for a runner that does not stream yet.
                let requests = (run_tool_request(&call, &transport), run_tool_request(&call, &transport));
                let progress = call.progress.clone();
                let (pool, tried, timeout) = (Arc::clone(&pool), Arc::clone(&tried), call.timeout);
                async move {
                    let Some(checkout) = checkout else {
                        return Attempt::Answered(Err(no_runner(pinned.as_deref())));
                    };
                    let mut client = pb::tool_runner_client::ToolRunnerClient::new(checkout.member.channel.clone())
                        .max_decoding_message_size(settings.max_response_bytes);
                    let started = tokio::time::Instant::now();
                    let status = match run_streamed(&mut client, requests, progress.as_ref()).await {
                        Ok(response) => {
                            let runner = &checkout.member.uri;
                            return Attempt::Answered(outcome(response, settings.max_questions, runner));
                        }
                        Err(status) => status,
                    };
                    let runner = checkout.member.uri.clone();
                    if let Some(current) = superseded(&status) {
                        return Attempt::Superseded { current, runner };
                    }
                    let error = call_error(&status, &runner, started.elapsed(), timeout);
                    let Some(reason) = refused_before_run(&status) else {
                        if records && lost_answer(&status) {
                            return Attempt::Lost { error };
                        }
                        return Attempt::Answered(Err(error));
                    };
                    let ejection = if reason == "concurrency_limit" {
                        BUSY_EJECTION
                    } else {
                        GONE_EJECTION
                    };
                    pool.eject(&checkout.member, ejection);
                    shared::sync::lock(&tried).push(runner);
                    Attempt::Unrun { reason, error }
                }
            })
            .await
        }
        .boxed()
    }
}

/// One attempt: `RunToolStream`, its progress updates handed to `progress`, its last update the
/// answer; a runner that does not stream (`UNIMPLEMENTED`: an older version) is asked with
/// `RunTool` instead (the second of `requests`).
async fn run_streamed(
    client: &mut pb::tool_runner_client::ToolRunnerClient<tonic::transport::Channel>,
    (streamed, unary): (tonic::Request<pb::RunToolRequest>, tonic::Request<pb::RunToolRequest>),
    progress: Option<&ProgressFn>,
) -> Result<pb::RunToolResponse, tonic::Status> {
    let streamed = streamed.map(|call| pb::RunToolStreamRequest { call: Some(call) });
    // Boxed: the call's opening (the request's encoding, the channel's response future) is the
    // larger state, and a call spends its time reading updates, which then hold only theirs.
    let mut updates = match Box::pin(client.run_tool_stream(streamed)).await {
        Ok(updates) => updates.into_inner(),
        Err(status) if status.code() == tonic::Code::Unimplemented => {
            return Box::pin(client.run_tool(unary)).await.map(tonic::Response::into_inner);
        }
        Err(status) => return Err(status),
    };
    loop {
        match updates.message().await?.and_then(|u| u.update) {
            Some(pb::run_tool_update::Update::Done(done)) => return Ok(done),
            Some(pb::run_tool_update::Update::Progress(p)) => {
                if let Some(report) = progress {
                    report.report(ToolProgress {
                        progress: p.progress,
                        total: p.total,
                        message: p.message,
                    });
                }
            }
            None => {
                return Err(tonic::Status::unknown(STREAM_ENDED));
            }
        }
    }
}

/// Why no runner could take a call: none is known, or the one that holds its task is gone.
fn no_runner(pinned: Option<&str>) -> ToolCallError {
    match pinned {
        Some(uri) => ToolCallError::new(
            "FAILED",
            format!(
                "the tool-runner {uri} that holds this call's task is gone; a task of a stdio MCP server lives in \
                 its runner's child process and does not survive that runner"
            ),
        ),
        None => ToolCallError::new("UNAVAILABLE", "no tool-runner endpoint is known (check --tool-runner)"),
    }
}

/// Whether `status` says the answer was lost on the way (the connection broke mid-call, or the
/// call's stream ended without its outcome), not that the runner answered with it.
fn lost_answer(status: &tonic::Status) -> bool {
    std::error::Error::source(status).is_some() || status.message() == STREAM_ENDED
}

/// What a call whose stream ended without its outcome fails with.
const STREAM_ENDED: &str = "the tool-runner ended the call's stream without its outcome";

/// The run's current epoch, when `status` is a runner's refusal of a replaced owner's call.
fn superseded(status: &tonic::Status) -> Option<u64> {
    if status.code() != tonic::Code::FailedPrecondition {
        return None;
    }
    status.metadata().get(CURRENT_EPOCH_HEADER)?.to_str().ok()?.parse().ok()
}

/// The `RunTool` request of a call: its deadline, the runner credentials, the trace context and
/// the run and call ids as headers (for the runner's access logs).
fn run_tool_request(call: &ToolInvocation, transport: &Transport) -> tonic::Request<pb::RunToolRequest> {
    let mut request = tonic::Request::new(run_tool_body(call));
    request.set_timeout(call.timeout);
    transport.authorize(&mut request);
    shared::telemetry::inject_current(request.metadata_mut());
    if let Some(v) = ascii_header(&call.run_id) {
        request.metadata_mut().insert("x-run-id", v);
    }
    if let Some(v) = ascii_header(&call.call_id) {
        request.metadata_mut().insert("x-call-id", v);
    }
    if let Some(v) = ascii_header(&call.epoch.to_string()) {
        request.metadata_mut().insert("x-run-epoch", v);
    }
    request
}

/// A failed `RunTool` as the tool error the model sees: a deadline is a `TIMEOUT`, a broken
/// connection or a busy runner `UNAVAILABLE`, refused arguments `INVALID_ARGUMENTS`, anything
/// else `FAILED`; the message names the runner and the gRPC status.
///
/// A deadline shows as `DEADLINE_EXCEEDED` or `CANCELLED` ("Timeout expired"), but so does a
/// connection the runner closed at once (a client certificate it refuses ends the connection
/// right after the handshake): only a call that lasted about its `timeout` timed out.
fn call_error(status: &tonic::Status, runner: &str, elapsed: Duration, timeout: Duration) -> ToolCallError {
    // A status with a source error came from the connection (the runner went away mid-call), not
    // from the runner itself.
    let from_transport = std::error::Error::source(status).is_some();
    let near_deadline = elapsed >= timeout.mul_f64(0.9);
    let code = match status.code() {
        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled if near_deadline => "TIMEOUT",
        tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => "UNAVAILABLE",
        _ if from_transport => "UNAVAILABLE",
        tonic::Code::ResourceExhausted | tonic::Code::Unavailable => "UNAVAILABLE",
        tonic::Code::InvalidArgument => "INVALID_ARGUMENTS",
        _ => "FAILED",
    };
    ToolCallError::new(
        code,
        format!("tool-runner {runner}: {:?}: {}", status.code(), status.message()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Call `call_3` of run `run-7` to `refund`, in epoch 1, sent by `owner`.
    fn refund(owner: Option<crate::domain::Ownership>) -> ToolInvocation {
        ToolInvocation {
            run_id: "run-7".into(),
            call_id: "call_3".into(),
            name: "refund".into(),
            arguments_json: "{}".into(),
            metadata: std::collections::BTreeMap::new(),
            principal: String::new(),
            epoch: 1,
            owner,
            timeout: Duration::from_secs(5),
            answers: None,
            task: None,
            cancel_task: false,
            rerun_in_doubt: false,
            progress: None,
        }
    }

    /// A call's run id, call id and epoch reach the runner in the request and as headers (its
    /// access logs, and a tool behind a gateway that reads headers only).
    #[test]
    fn a_call_carries_its_ids_and_epoch_in_the_request_and_its_headers() {
        let call = ToolInvocation {
            principal: "alice".into(),
            epoch: 4,
            ..refund(None)
        };
        let transport = Transport::from_settings(&crate::Config::default().tool_runners).unwrap();
        let request = run_tool_request(&call, &transport);
        let header = |name: &str| {
            request
                .metadata()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        assert_eq!(
            [header("x-run-id"), header("x-call-id"), header("x-run-epoch")],
            [Some("run-7".into()), Some("call_3".into()), Some("4".into())]
        );
        let body = request.get_ref();
        assert_eq!(
            (body.run_id.as_str(), body.call_id.as_str(), body.epoch),
            ("run-7", "call_3", 4)
        );
    }

    /// A runner's refusal of a replaced owner's call stops the sender's ownership of the run, and
    /// a call whose sender no longer holds its run is not sent (again): before every attempt.
    #[tokio::test]
    async fn a_stale_refusal_stops_the_owner_and_a_stopped_owner_sends_nothing() {
        let owner = crate::domain::Ownership::local();
        let call = refund(Some(owner.clone()));
        assert!(moved_away(&call).is_none());
        let mut refusal = tonic::Status::failed_precondition("stale");
        refusal.metadata_mut().insert(CURRENT_EPOCH_HEADER, 2.into());
        assert_eq!(superseded(&refusal), Some(2));
        assert_eq!(
            superseded(&tonic::Status::failed_precondition("a tool's own refusal")),
            None
        );
        let error = stop_superseded(&call, 2, "http://runner-b:50052");
        assert!(
            error.message.contains("epoch 1") && error.message.contains("epoch 2"),
            "{}",
            error.message
        );
        assert!(owner.stopped());
        assert!(moved_away(&call).is_some_and(|e| e.message.contains("runner-b")));
        // Not sent at all: the check answers before any runner is tried.
        let runners = ToolRunners::connect(
            &crate::Config::new("http://127.0.0.1:1/v1", "m", vec!["http://127.0.0.1:1".into()]).tool_runners,
            Arc::new(SystemResolver),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        let answer = runners.execute(call).await.unwrap_err();
        assert!(answer.message.starts_with("not sent"), "{}", answer.message);
    }

    #[test]
    fn only_a_call_that_lasted_its_timeout_timed_out() {
        let timeout = Duration::from_secs(60);
        let code = |status: tonic::Status, elapsed_ms| {
            call_error(
                &status,
                "https://runner:50052",
                Duration::from_millis(elapsed_ms),
                timeout,
            )
            .code
        };
        assert_eq!(code(tonic::Status::cancelled("Timeout expired"), 60_003), "TIMEOUT");
        assert_eq!(code(tonic::Status::deadline_exceeded("deadline"), 59_000), "TIMEOUT");
        // A connection closed right away (a refused client certificate) is no timeout.
        assert_eq!(
            code(tonic::Status::cancelled("operation was canceled"), 64),
            "UNAVAILABLE"
        );
        assert_eq!(code(tonic::Status::invalid_argument("schema"), 5), "INVALID_ARGUMENTS");
        assert_eq!(code(tonic::Status::internal("boom"), 5), "FAILED");
    }

    #[test]
    fn targets() {
        assert_eq!(
            "http://127.0.0.1:50052".parse(),
            Ok(Target::Static("http://127.0.0.1:50052".into()))
        );
        assert_eq!(
            "dns:///tool-runner.tools.svc:50052".parse(),
            Ok(Target::Dns {
                host: "tool-runner.tools.svc".into(),
                port: 50052
            })
        );
        for bad in [
            "dns:///name",
            "dns://8.8.8.8/name:1",
            "dns:///:1",
            "tcp://x:1",
            "dns:///name:port",
        ] {
            assert!(bad.parse::<Target>().is_err(), "{bad}");
        }
    }
}
