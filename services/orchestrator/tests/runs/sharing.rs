//! A service many callers share, through the real `orchestrator` binaries: `ListRuns` finds a
//! caller's runs by status, thread, label and time, newest first, paged by a cursor, hiding every
//! other principal's runs unless the caller is an operator; with the in-memory store on one
//! replica, and with three replicas on a real `nats-server -js`, where any replica lists the
//! runs of all (live ones too) and pages stay free of gaps and repeats while runs start and end.
//! `orchestrator runs` does the same from a shell.

use std::collections::HashSet;
use std::time::Duration;

use mock_llm::{MockLlm, Scenario, Step, Turn};
use proto::orchestrator::v1 as pb;
use serde_json::json;
use testkit::Service;
use testkit::wait::until;
use tonic::transport::Channel;

type TestResult = anyhow::Result<()>;
type Client = pb::orchestrator_client::OrchestratorClient<Channel>;

const BIN: &str = env!("CARGO_BIN_EXE_orchestrator");

/// Turn 1 calls `sleep` (which waits for approval in the runs that ask so) and `echo`; turn 2
/// answers.
fn scenario() -> Scenario {
    Scenario::new(vec![
        Turn::text("Refunding.")
            .then(Step::call("sleep", json!({"ms": 5})))
            .then(Step::call("echo", json!({"note": "refund"}))),
        Turn::text("Done."),
    ])
}

/// Replicas of the orchestrator (alice and bob own runs, olga is an operator), a tool-runner in
/// this process, the stand-in model, and NATS when there are several replicas.
struct World {
    replicas: Vec<Service>,
    _nats: Option<testkit::nats::Nats>,
    llm: MockLlm,
    _dir: tempfile::TempDir,
}

async fn world(replicas: usize, flags: &[&str]) -> anyhow::Result<World> {
    world_with(replicas, flags, scenario(), &[]).await
}

/// [`world`] with another scenario, and `more` principals: `(name, token, tokens file lines)`.
async fn world_with(
    replicas: usize,
    flags: &[&str],
    scenario: impl Into<mock_llm::Scenarios>,
    more: &[(&str, &str, &str)],
) -> anyhow::Result<World> {
    let dir = tempfile::tempdir()?;
    let tokens = dir.path().join("tokens.toml");
    let mut principals = vec![
        ("alice", "alice-token", ""),
        ("bob", "bob-token", ""),
        ("olga", "olga-token", "roles = [\"operator\"]"),
    ];
    principals.extend_from_slice(more);
    std::fs::write(&tokens, testkit::pki::tokens_toml(&principals))?;
    let llm = MockLlm::start(scenario).await?;
    let runner = testkit::helpers::tool_runner_in_process_with(tool_runner::Config::default()).await?;
    let nats = match replicas {
        1 => None,
        _ => Some(testkit::nats::Nats::start().await?),
    };
    let mut started = Vec::new();
    for _ in 0..replicas {
        let mut command = testkit::orchestrator_command(BIN, &llm.base_url(), &runner);
        if let Some(nats) = &nats {
            command = testkit::on_nats(command, &nats.url());
        }
        command
            .args(["--auth-tokens", &tokens.display().to_string()])
            .args(flags);
        started.push(Service::orchestrator(command).await?);
    }
    Ok(World {
        replicas: started,
        _nats: nats,
        llm,
        _dir: dir,
    })
}

impl World {
    async fn client(&self, replica: usize) -> anyhow::Result<Client> {
        Ok(Client::connect(self.endpoint(replica)).await?)
    }

    fn endpoint(&self, replica: usize) -> String {
        format!("http://{}", self.replicas[replica].grpc)
    }
}

/// `message` sent as `token`'s principal.
fn as_<T>(token: &str, message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Ok(value) = format!("Bearer {token}").parse() {
        request.metadata_mut().insert("authorization", value);
    }
    request
}

/// A detached run `run_id` with `labels`, on `thread` (empty: none); its `sleep` calls wait for
/// approval when `parks`.
fn run(run_id: &str, labels: &[(&str, &str)], thread: &str, parks: bool) -> pb::OrchestrateRequest {
    let approval = parks.then(|| pb::ApprovalPolicy {
        tools: vec!["sleep".into()],
        ..Default::default()
    });
    pb::OrchestrateRequest {
        run_id: run_id.into(),
        detached: true,
        thread_id: thread.into(),
        labels: labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        tools: Some(pb::ToolSelection {
            approval,
            ..Default::default()
        }),
        ..testkit::user("refund order 7")
    }
}

/// Starts `request` as `token` and waits until it has ended (or parked, when it `parks`).
async fn start(client: &mut Client, token: &str, request: pb::OrchestrateRequest) -> TestResult {
    let run_id = request.run_id.clone();
    drop(client.orchestrate(as_(token, request)).await?);
    until(&format!("run {run_id} ends or parks"), Duration::from_secs(30), || {
        let (mut client, run_id) = (client.clone(), run_id.clone());
        async move {
            let run = client.get_run(as_(token, pb::GetRunRequest { run_id })).await.ok()?;
            (run.into_inner().status != pb::RunStatus::Running as i32).then_some(())
        }
    })
    .await
}

/// Every page of `request` as `token`, `page_size` rows at a time, calling `between` after each
/// page; the run ids in order.
async fn all_pages(
    client: &mut Client,
    token: &str,
    mut request: pb::ListRunsRequest,
    mut between: impl AsyncFnMut(),
) -> anyhow::Result<Vec<pb::RunSummary>> {
    let mut rows = Vec::new();
    for _ in 0..1000 {
        let page = client.list_runs(as_(token, request.clone())).await?.into_inner();
        rows.extend(page.runs);
        if page.next_page_token.is_empty() {
            return Ok(rows);
        }
        request.page_token = page.next_page_token;
        between().await;
    }
    anyhow::bail!("the listing did not end in 1000 pages")
}

fn ids(rows: &[pb::RunSummary]) -> Vec<String> {
    rows.iter().map(|r| r.run_id.clone()).collect()
}

fn sorted(mut ids: Vec<String>) -> Vec<String> {
    ids.sort();
    ids
}

fn list(statuses: &[pb::RunStatus]) -> pb::ListRunsRequest {
    pb::ListRunsRequest {
        statuses: statuses.iter().map(|s| *s as i32).collect(),
        ..Default::default()
    }
}

/// Rows newest first: by admission time, then run id.
fn assert_newest_first(rows: &[pb::RunSummary]) {
    for pair in rows.windows(2) {
        assert!(
            (pair[0].created_at_ms, &pair[0].run_id) > (pair[1].created_at_ms, &pair[1].run_id),
            "{:?} before {:?}",
            pair[0],
            pair[1]
        );
    }
}

#[tokio::test]
async fn a_caller_finds_its_runs_by_every_filter_and_no_one_elses() -> TestResult {
    let w = world(1, &["--list-page-max", "3"]).await?;
    let mut client = w.client(0).await?;
    let refunds = [("team", "refunds")];
    start(&mut client, "alice-token", run("a1", &refunds, "", false)).await?;
    let before_a2 = shared::sync::unix_ms();
    start(&mut client, "alice-token", run("a2", &refunds, "t-1", false)).await?;
    start(&mut client, "alice-token", run("a3", &[("team", "sales")], "", true)).await?;
    start(&mut client, "bob-token", run("b1", &refunds, "", false)).await?;
    start(&mut client, "bob-token", run("b2", &[], "", false)).await?;

    // Her own runs only, newest first, three a page (--list-page-max), the waiting one marked.
    let mine = all_pages(&mut client, "alice-token", pb::ListRunsRequest::default(), async || {}).await?;
    assert_eq!(sorted(ids(&mine)), ["a1", "a2", "a3"]);
    assert_newest_first(&mine);
    let a3 = mine
        .iter()
        .find(|r| r.run_id == "a3")
        .ok_or_else(|| anyhow::anyhow!("a3 is not listed"))?;
    assert_eq!(a3.status, pb::RunStatus::AwaitingApproval as i32);
    assert_eq!(a3.waiting_for, pb::WaitingFor::Approval as i32);
    assert_eq!(a3.principal, "alice");
    assert_eq!(a3.labels.get("team").map(String::as_str), Some("sales"));
    let a2 = mine
        .iter()
        .find(|r| r.run_id == "a2")
        .ok_or_else(|| anyhow::anyhow!("a2 is not listed"))?;
    assert_eq!(
        (a2.status, a2.thread_id.as_str(), a2.turns),
        (pb::RunStatus::Completed as i32, "t-1", 2)
    );
    assert!(a2.usage.is_some_and(|u| u.completion_tokens > 0), "{a2:?}");
    assert!(
        a2.created_at_ms >= i64::try_from(before_a2)? && a2.updated_at_ms >= a2.created_at_ms,
        "{a2:?}"
    );

    // Each filter.
    let by = async |client: &mut Client, request: pb::ListRunsRequest| -> anyhow::Result<Vec<String>> {
        Ok(sorted(ids(
            &all_pages(client, "alice-token", request, async || {}).await?
        )))
    };
    let waiting = list(&[pb::RunStatus::AwaitingApproval]);
    assert_eq!(by(&mut client, waiting).await?, ["a3"]);
    let ended = list(&[pb::RunStatus::Completed, pb::RunStatus::Failed]);
    assert_eq!(by(&mut client, ended).await?, ["a1", "a2"]);
    let thread = pb::ListRunsRequest {
        thread_id: "t-1".into(),
        ..Default::default()
    };
    assert_eq!(by(&mut client, thread).await?, ["a2"]);
    let labeled = pb::ListRunsRequest {
        labels: [("team".to_owned(), "refunds".to_owned())].into(),
        ..Default::default()
    };
    assert_eq!(by(&mut client, labeled).await?, ["a1", "a2"]);
    let since = pb::ListRunsRequest {
        created_after_ms: i64::try_from(before_a2)?,
        ..Default::default()
    };
    assert_eq!(by(&mut client, since).await?, ["a2", "a3"]);
    let until_a2 = pb::ListRunsRequest {
        created_before_ms: i64::try_from(before_a2)?,
        ..Default::default()
    };
    assert_eq!(by(&mut client, until_a2).await?, ["a1"]);

    // Another principal's runs: refused by name, and never in her listing; an operator sees all.
    let bobs = pb::ListRunsRequest {
        principal: "bob".into(),
        ..Default::default()
    };
    let refused = client.list_runs(as_("alice-token", bobs.clone())).await.err();
    assert_eq!(refused.map(|s| s.code()), Some(tonic::Code::PermissionDenied));
    let everyone = all_pages(&mut client, "olga-token", pb::ListRunsRequest::default(), async || {}).await?;
    assert_eq!(sorted(ids(&everyone)), ["a1", "a2", "a3", "b1", "b2"]);
    assert_newest_first(&everyone);
    let of_bob = all_pages(&mut client, "olga-token", bobs, async || {}).await?;
    assert_eq!(sorted(ids(&of_bob)), ["b1", "b2"]);

    // The page size on both sides of its cap, and tokens of other listings.
    let two = client
        .list_runs(as_(
            "olga-token",
            pb::ListRunsRequest {
                page_size: 2,
                ..Default::default()
            },
        ))
        .await?
        .into_inner();
    assert_eq!(two.runs.len(), 2);
    let capped = client
        .list_runs(as_(
            "olga-token",
            pb::ListRunsRequest {
                page_size: 4,
                ..Default::default()
            },
        ))
        .await?
        .into_inner();
    assert_eq!(capped.runs.len(), 3, "--list-page-max 3 caps page_size 4");
    let other_filters = pb::ListRunsRequest {
        statuses: vec![pb::RunStatus::Completed as i32],
        page_token: two.next_page_token.clone(),
        ..Default::default()
    };
    let status = client.list_runs(as_("olga-token", other_filters)).await.err();
    assert_eq!(
        status.as_ref().map(tonic::Status::code),
        Some(tonic::Code::InvalidArgument),
        "{status:?}"
    );
    let forged = pb::ListRunsRequest {
        page_token: "bm90IG1pbmU".into(),
        ..Default::default()
    };
    let status = client.list_runs(as_("olga-token", forged)).await.err();
    assert_eq!(status.map(|s| s.code()), Some(tonic::Code::InvalidArgument));
    let bad_label = pb::ListRunsRequest {
        labels: [("no spaces".to_owned(), "x".to_owned())].into(),
        ..Default::default()
    };
    let status = client.list_runs(as_("olga-token", bad_label)).await.err();
    assert_eq!(status.map(|s| s.code()), Some(tonic::Code::InvalidArgument));

    // A run's labels are checked when it starts.
    let too_many: Vec<(String, String)> = (0..17).map(|i| (format!("k{i}"), "v".to_owned())).collect();
    let mut request = run("a4", &[], "", false);
    request.labels = too_many.into_iter().collect();
    let status = client.orchestrate(as_("alice-token", request)).await.err();
    assert!(
        status
            .as_ref()
            .is_some_and(|s| s.code() == tonic::Code::InvalidArgument && s.message().contains("--max-labels")),
        "{status:?}"
    );

    // From a shell.
    let output = tokio::process::Command::new(BIN)
        .args([
            "runs",
            "--endpoint",
            &w.endpoint(0),
            "--status",
            "awaiting-approval",
            "--label",
            "team=sales",
        ])
        .env("ORCHESTRATOR_TOKEN", "alice-token")
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{stdout}");
    assert!(
        lines[1].starts_with("a3 ") && lines[1].contains("AWAITING_APPROVAL") && lines[1].contains("team=sales"),
        "{stdout}"
    );
    Ok(())
}

#[tokio::test]
async fn any_replica_lists_the_fleets_runs_and_pages_without_gaps_while_runs_come_and_go() -> TestResult {
    fleet_listing(1).await
}

/// The same over a store in four shards: the index is read from every shard's stream and merged
/// newest first, and a page's cursor holds a position per shard.
#[tokio::test]
async fn a_store_in_four_shards_lists_newest_first_and_pages_without_gaps_while_runs_come_and_go() -> TestResult {
    fleet_listing(4).await
}

/// Three replicas over a store of `shards` shards list the fleet's runs.
async fn fleet_listing(shards: usize) -> TestResult {
    let w = world(3, &["--run-store-shards", &shards.to_string()]).await?;
    let mut clients = Vec::new();
    for replica in 0..3 {
        clients.push(w.client(replica).await?);
    }
    // Alice's runs on every replica, one parked on replica 0; bob's on replica 2.
    let mut alices = Vec::new();
    for i in 0..9 {
        let id = format!("a{i}");
        let labels: &[(&str, &str)] = if i % 3 == 0 { &[("team", "refunds")] } else { &[] };
        start(&mut clients[i % 3], "alice-token", run(&id, labels, "", false)).await?;
        alices.push(id);
    }
    start(
        &mut clients[0],
        "alice-token",
        run("parked", &[("team", "refunds")], "", true),
    )
    .await?;
    alices.push("parked".to_owned());
    start(&mut clients[2], "bob-token", run("b0", &[], "", false)).await?;
    start(&mut clients[2], "bob-token", run("b1", &[], "", false)).await?;

    for client in &mut clients {
        let request = pb::ListRunsRequest {
            page_size: 4,
            ..Default::default()
        };
        let rows = all_pages(client, "alice-token", request, async || {}).await?;
        // Newest first: each run was admitted after the one before it ended.
        assert_eq!(ids(&rows), alices.iter().rev().cloned().collect::<Vec<_>>());
        // The live run parked on replica 0, found from every replica.
        let waiting = all_pages(
            client,
            "alice-token",
            list(&[pb::RunStatus::AwaitingApproval]),
            async || {},
        )
        .await?;
        assert_eq!(ids(&waiting), ["parked"]);
        assert_eq!(waiting[0].waiting_for, pb::WaitingFor::Approval as i32);
        let labeled = pb::ListRunsRequest {
            labels: [("team".to_owned(), "refunds".to_owned())].into(),
            ..Default::default()
        };
        let rows = all_pages(client, "alice-token", labeled, async || {}).await?;
        assert_eq!(sorted(ids(&rows)), ["a0", "a3", "a6", "parked"]);
    }
    let of_bob = pb::ListRunsRequest {
        principal: "bob".into(),
        ..Default::default()
    };
    let rows = all_pages(&mut clients[1], "olga-token", of_bob, async || {}).await?;
    assert_eq!(sorted(ids(&rows)), ["b0", "b1"]);
    index_spread(&w, shards, 12).await?;

    // Paging on replica 1 while runs start on the others and the parked one is decided and ends:
    // every run there at the start is listed once, none twice.
    let (mut starter, mut decider) = (clients[0].clone(), clients[2].clone());
    let mut started = 0;
    let request = pb::ListRunsRequest {
        page_size: 2,
        ..Default::default()
    };
    let rows = all_pages(&mut clients[1], "alice-token", request, async || {
        started += 1;
        let _ = start(
            &mut starter,
            "alice-token",
            run(&format!("new{started}"), &[], "", false),
        )
        .await;
        if started == 2 {
            let pending = decider
                .list_pending_approvals(as_("alice-token", pb::ListPendingApprovalsRequest::default()))
                .await
                .map(|r| r.into_inner().approvals)
                .unwrap_or_default();
            let decisions = pending
                .iter()
                .map(|p| pb::ToolCallDecision {
                    call_id: p.call_id.clone(),
                    kind: pb::DecisionKind::Approve as i32,
                    ..Default::default()
                })
                .collect();
            let decide = pb::DecideToolCallsRequest {
                run_id: "parked".into(),
                decisions,
            };
            let _ = decider.decide_tool_calls(as_("alice-token", decide)).await;
        }
    })
    .await?;
    let listed = ids(&rows);
    let unique: HashSet<&String> = listed.iter().collect();
    assert_eq!(unique.len(), listed.len(), "a run listed twice: {listed:?}");
    for id in &alices {
        assert!(unique.contains(id), "{id} missing from {listed:?}");
    }
    assert!(started >= 4, "the listing took {started} pages");
    Ok(())
}

/// Each of the `shards` index streams holds the entries of its runs, `runs` in all.
async fn index_spread(w: &World, shards: usize, runs: u64) -> TestResult {
    let nats = w
        ._nats
        .as_ref()
        .ok_or_else(|| anyhow::anyhow!("a fleet runs on NATS"))?;
    let js = async_nats::jetstream::new(async_nats::connect(nats.url()).await?);
    let mut held = Vec::new();
    for shard in 0..shards {
        let bucket = shared::jetstream::shards::name("orchestrator-runs", shard);
        let mut stream = js.get_stream(format!("INDEX_{bucket}")).await?;
        held.push(stream.info().await?.state.messages);
    }
    assert_eq!(held.iter().sum::<u64>(), runs, "entries per shard: {held:?}");
    assert!(held.iter().all(|n| *n > 0), "a shard holds no entry: {held:?}");
    Ok(())
}

/// Turn 1 naps `ms` in a tool call, turn 2 answers.
fn napping(ms: u64) -> Scenario {
    Scenario::new(vec![
        Turn::text("Working.").then(Step::call("sleep", json!({"ms": ms}))),
        Turn::text("Done."),
    ])
}

/// Runs the orchestrate call of `request` as `token` to its last event in a task: the call
/// returns once the run was let in (it may wait for a slot first); the run's `run_started`
/// `queued_ms`, or the refusal's code.
fn spawn_run(
    client: &Client,
    token: &'static str,
    request: pb::OrchestrateRequest,
) -> tokio::task::JoinHandle<Result<u64, tonic::Code>> {
    let mut client = client.clone();
    tokio::spawn(async move {
        let mut stream = client
            .orchestrate(as_(token, request))
            .await
            .map_err(|s| s.code())?
            .into_inner();
        let mut queued = 0;
        while let Some(event) = stream.message().await.map_err(|s| s.code())? {
            if let Some(pb::orchestrate_event::Event::RunStarted(started)) = event.event {
                queued = started.queued_ms;
            }
        }
        Ok(queued)
    })
}

/// How many runs wait for a slot on the replica (its metrics).
async fn queued(service: &Service) -> f64 {
    testkit::helpers::scrape(&service.metrics)
        .await
        .ok()
        .and_then(|m| m.get("orchestrator_runs_queued{}").copied())
        .unwrap_or(-1.0)
}

/// Waits until `runs` wait for a slot on `replica`.
async fn waiting(replica: &Service, runs: f64) -> TestResult {
    until(&format!("{runs} runs to wait"), Duration::from_secs(30), || async {
        (queued(replica).await == runs).then_some(())
    })
    .await
}

#[tokio::test]
async fn runs_wait_for_a_slot_and_a_flood_does_not_starve_a_quiet_caller() -> TestResult {
    let flood = "max_queued = 30";
    let w = world_with(
        1,
        &["--max-runs", "2", "--max-queued-runs", "100"],
        mock_llm::Scenarios {
            default: napping(100),
            named: [("slow".to_owned(), napping(4000))].into(),
        },
        &[("flood", "flood-token", flood), ("quiet", "quiet-token", "")],
    )
    .await?;
    let client = w.client(0).await?;
    let plain = |id: String| pb::OrchestrateRequest {
        run_id: id,
        ..testkit::user("work")
    };
    // Two slow flood runs hold both slots, and 29 more wait.
    let mut floods = Vec::new();
    for i in 0..2 {
        let slow = pb::OrchestrateRequest {
            model: "slow".into(),
            ..plain(format!("flood-{i}"))
        };
        floods.push(spawn_run(&client, "flood-token", slow));
    }
    until("both slots to be taken", Duration::from_secs(30), || async {
        let live = testkit::helpers::scrape(&w.replicas[0].metrics).await.ok()?;
        (live.get("orchestrator_runs_in_flight{}") == Some(&2.0)).then_some(())
    })
    .await?;
    for i in 2..31 {
        floods.push(spawn_run(&client, "flood-token", plain(format!("flood-{i}"))));
    }
    waiting(&w.replicas[0], 29.0).await?;
    // A run whose deadline passes while it waits, as the 30th: DEADLINE_EXCEEDED.
    let mut hurried = plain("flood-hurried".into());
    hurried.limits = Some(pb::RunLimits {
        run_timeout_ms: Some(300),
        ..Default::default()
    });
    let hurried = spawn_run(&client, "flood-token", hurried).await?;
    assert_eq!(hurried, Err(tonic::Code::DeadlineExceeded));
    // The flood's queue holds 30 (its max_queued): the 31st waiting is refused at once.
    floods.push(spawn_run(&client, "flood-token", plain("flood-31".into())));
    waiting(&w.replicas[0], 30.0).await?;
    let refused = spawn_run(&client, "flood-token", plain("flood-32".into())).await?;
    assert_eq!(refused, Err(tonic::Code::ResourceExhausted));
    // The quiet caller's runs go ahead of the flood's queue as slots free.
    let quiets: Vec<_> = (0..3)
        .map(|i| spawn_run(&client, "quiet-token", plain(format!("quiet-{i}"))))
        .collect();
    let mut waited = Vec::new();
    for quiet in quiets {
        waited.push(
            quiet
                .await?
                .map_err(|code| anyhow::anyhow!("a quiet run was refused: {code:?}"))?,
        );
    }
    for flood in floods {
        flood
            .await?
            .map_err(|code| anyhow::anyhow!("a flood run was refused: {code:?}"))?;
    }
    let mut admin = w.client(0).await?;
    let request = pb::ListRunsRequest {
        page_size: 100,
        ..Default::default()
    };
    let rows = all_pages(&mut admin, "olga-token", request, async || {}).await?;
    let mut order: Vec<(i64, String)> = rows.iter().map(|r| (r.created_at_ms, r.run_id.clone())).collect();
    order.sort();
    let last_quiet = order
        .iter()
        .rposition(|(_, id)| id.starts_with("quiet"))
        .unwrap_or(usize::MAX);
    let floods_after = order[last_quiet..]
        .iter()
        .filter(|(_, id)| id.starts_with("flood"))
        .count();
    assert!(floods_after >= 15, "the quiet runs waited behind the flood: {order:?}");
    // Each run says how long it waited, in its stream and in GetRun.
    let quiet = admin
        .get_run(as_(
            "quiet-token",
            pb::GetRunRequest {
                run_id: "quiet-2".into(),
            },
        ))
        .await?
        .into_inner();
    assert!(waited.contains(&quiet.queued_ms), "{waited:?} vs {}", quiet.queued_ms);
    let last_flood = admin
        .get_run(as_(
            "flood-token",
            pb::GetRunRequest {
                run_id: "flood-31".into(),
            },
        ))
        .await?
        .into_inner();
    assert!(last_flood.queued_ms >= 1000, "{}", last_flood.queued_ms);
    assert_eq!(queued(&w.replicas[0]).await, 0.0);
    Ok(())
}

/// The most of `spans` (`[from, to]`, ms) that overlap at one instant.
fn most_at_once(spans: &[(i64, i64)]) -> usize {
    let mut edges: Vec<(i64, i32)> = spans.iter().flat_map(|(from, to)| [(*from, 1), (*to, -1)]).collect();
    // An end and a start at the same ms: the end first (a slot given back, then taken).
    edges.sort();
    let (mut now, mut most) = (0i32, 0i32);
    for (_, step) in edges {
        now += step;
        most = most.max(now);
    }
    usize::try_from(most).unwrap_or(0)
}

#[tokio::test]
async fn max_runs_holds_across_replicas_also_when_one_is_killed_with_slots_held() -> TestResult {
    let mut w = world_with(
        3,
        &[
            "--max-runs",
            "4",
            "--run-store-lease",
            "2s",
            "--run-fence-grace",
            "200ms",
        ],
        napping(600),
        &[("capped", "capped-token", "max_runs = 3\nmax_queued = 50")],
    )
    .await?;
    let mut clients = Vec::new();
    for replica in 0..3 {
        clients.push(w.client(replica).await?);
    }
    // Twelve runs of a caller allowed three in flight, four on each replica; each call returns
    // once its run is let in (a killed replica's waiting ones never are).
    let mut calls = Vec::new();
    for i in 0..12 {
        let mut client = clients[i % 3].clone();
        let request = pb::OrchestrateRequest {
            run_id: format!("capped-{i}"),
            detached: true,
            ..testkit::user("work")
        };
        calls.push(tokio::spawn(async move {
            client
                .orchestrate(as_("capped-token", request))
                .await
                .map(drop)
                .map_err(|s| s.code())
        }));
    }
    until(
        "a run of the caller live on replica 0",
        Duration::from_secs(30),
        || async {
            let metrics = testkit::helpers::scrape(&w.replicas[0].metrics).await.ok()?;
            (metrics.get("orchestrator_runs_in_flight{}").copied().unwrap_or(0.0) >= 1.0).then_some(())
        },
    )
    .await?;
    w.replicas[0].child.start_kill()?;
    let mut let_in = 0;
    for call in calls {
        if call.await?.is_ok() {
            let_in += 1;
        }
    }
    // Every run let in ends, those of the killed replica taken over by the others.
    let mut operator = w.client(1).await?;
    let rows = until("every run let in to end", Duration::from_secs(90), || {
        let mut operator = operator.clone();
        async move {
            let request = pb::ListRunsRequest {
                page_size: 100,
                ..Default::default()
            };
            let rows = operator
                .list_runs(as_("olga-token", request))
                .await
                .ok()?
                .into_inner()
                .runs;
            rows.iter()
                .all(|r| r.status == pb::RunStatus::Completed as i32)
                .then_some(rows)
        }
    })
    .await?;
    assert!(
        rows.len() >= let_in && let_in >= 6,
        "{let_in} let in, {} listed",
        rows.len()
    );
    // From each run's admission to its end as its record holds them: never more than three.
    let spans: Vec<(i64, i64)> = rows.iter().map(|r| (r.created_at_ms, r.updated_at_ms)).collect();
    let most = most_at_once(&spans);
    assert!((2..=3).contains(&most), "{most} runs of the caller at once: {spans:?}");
    let _ = &mut operator;
    Ok(())
}

/// Three turns of 50 tokens each (30 prompt, 20 completion): two call `echo`, the third answers.
fn fifty_a_turn() -> Scenario {
    let turn = |text: &str| Turn {
        usage: Some([30, 20]),
        ..Turn::text(text)
    };
    Scenario::new(vec![
        turn("One.").then(Step::call("echo", json!({"n": 1}))),
        turn("Two.").then(Step::call("echo", json!({"n": 2}))),
        turn("Done."),
    ])
}

/// Runs `request` as `token` to its end on `client`: its result.
async fn run_to_end(
    client: &mut Client,
    token: &str,
    request: pb::OrchestrateRequest,
) -> anyhow::Result<pb::RunResult> {
    let mut stream = client.orchestrate(as_(token, request)).await?.into_inner();
    while let Some(event) = stream.message().await? {
        if let Some(pb::orchestrate_event::Event::RunFinished(finished)) = event.event {
            return finished
                .result
                .ok_or_else(|| anyhow::anyhow!("run_finished without a result"));
        }
    }
    anyhow::bail!("the stream ended without run_finished")
}

#[tokio::test]
async fn token_budgets_end_runs_and_a_callers_hour_is_held_across_replicas() -> TestResult {
    // Not across an hour's turn: the caller's budget is per hour.
    let hour = 3_600_000;
    until(
        "a moment not just before the hour turns",
        Duration::from_secs(30),
        || async { (shared::sync::unix_ms() % hour < hour - 20_000).then_some(()) },
    )
    .await?;
    let w = world_with(
        2,
        &[],
        fifty_a_turn(),
        &[("thrifty", "thrifty-token", "tokens_per_hour = 80")],
    )
    .await?;
    let (mut first, mut second) = (w.client(0).await?, w.client(1).await?);

    // A run's own budget: its second turn's prompt (at least the first turn's 50 tokens) would
    // pass the 10 left, so it is never asked; the first turn's output is kept.
    let mut capped = testkit::user("go");
    capped.limits = Some(pb::RunLimits {
        max_total_tokens: Some(60),
        ..Default::default()
    });
    let result = run_to_end(&mut first, "alice-token", capped.clone()).await?;
    assert_eq!(
        (
            result.status,
            result.failure_reason,
            result.turns,
            result.tool_calls.len()
        ),
        (
            pb::RunStatus::Failed as i32,
            pb::FailureReason::TokenBudget as i32,
            1,
            1
        ),
        "{result:?}"
    );
    assert!(
        result.failure_detail.contains("max_total_tokens"),
        "{}",
        result.failure_detail
    );
    // Both sides of the ceiling.
    capped.limits = Some(pb::RunLimits {
        max_total_tokens: Some(10_000_001),
        ..Default::default()
    });
    let refused = first.orchestrate(as_("alice-token", capped)).await.err();
    assert_eq!(refused.map(|s| s.code()), Some(tonic::Code::InvalidArgument));

    // Whatever it sends, what a request may spend is the orchestrator's: extra_body may not set
    // max_tokens, n or best_of; a max_tokens far past its budget is lowered to what is left.
    for field in ["max_tokens", "max_completion_tokens", "n", "best_of"] {
        let mut greedy = testkit::user("go");
        greedy.params = Some(pb::ModelParams {
            extra_body_json: format!("{{\"{field}\": 100000}}"),
            ..Default::default()
        });
        let refused = first.orchestrate(as_("thrifty-token", greedy)).await.err();
        assert_eq!(refused.map(|s| s.code()), Some(tonic::Code::InvalidArgument), "{field}");
    }
    let mut greedy = testkit::user("go");
    greedy.params = Some(pb::ModelParams {
        max_tokens: Some(100_000),
        ..Default::default()
    });

    // The caller's hour: 80 tokens. Its first run spends 50 in its first turn, on replica 0;
    // its second turn's prompt (at least those 50) would pass the 30 left: never asked.
    let result = run_to_end(&mut first, "thrifty-token", greedy.clone()).await?;
    assert_eq!(
        (result.status, result.failure_reason, result.turns),
        (pb::RunStatus::Failed as i32, pb::FailureReason::TokenBudget as i32, 1),
        "{result:?}"
    );
    assert!(
        result.failure_detail.contains("tokens_per_hour"),
        "{}",
        result.failure_detail
    );
    // Its next run, on replica 1, may ask for the 30 left and no more: it overshoots the hour by
    // at most that turn's max_tokens, and ends.
    let result = run_to_end(&mut second, "thrifty-token", greedy).await?;
    assert_eq!(
        (result.status, result.failure_reason, result.turns),
        (pb::RunStatus::Failed as i32, pb::FailureReason::TokenBudget as i32, 1),
        "{result:?}"
    );
    let requests = w.llm.requests();
    let asked: Vec<Option<u64>> = requests
        .iter()
        .rev()
        .take(2)
        .map(|r| r["max_tokens"].as_u64())
        .collect();
    assert_eq!(
        asked,
        [Some(30), Some(80)],
        "the last two turns' max_tokens, newest first"
    );
    // … and the one after it is refused, with the time the budget resets.
    let refused = second
        .orchestrate(as_("thrifty-token", testkit::user("again")))
        .await
        .err();
    let refused = refused.ok_or_else(|| anyhow::anyhow!("a run past the caller's hour was let in"))?;
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("resets at"), "{}", refused.message());

    // What it spent, from either replica: its own, or an operator's view; not another caller's.
    let spent = second
        .get_usage(as_("thrifty-token", pb::GetUsageRequest::default()))
        .await?
        .into_inner();
    let total = spent.total.unwrap_or_default();
    assert_eq!(
        (
            total.prompt_tokens,
            total.completion_tokens,
            total.runs,
            total.tool_calls
        ),
        (60, 40, 2, 2),
        "{spent:?}"
    );
    assert_eq!(spent.tokens_per_hour, Some(80));
    let of_thrifty = pb::GetUsageRequest {
        principal: "thrifty".into(),
        ..Default::default()
    };
    let seen = first
        .get_usage(as_("olga-token", of_thrifty.clone()))
        .await?
        .into_inner();
    assert_eq!(seen.total, spent.total);
    let denied = first.get_usage(as_("alice-token", of_thrifty)).await.err();
    assert_eq!(denied.map(|s| s.code()), Some(tonic::Code::PermissionDenied));
    // From a shell.
    let output = tokio::process::Command::new(BIN)
        .args(["usage", "--endpoint", &w.endpoint(1), "--since", "2h"])
        .env("ORCHESTRATOR_TOKEN", "thrifty-token")
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let total = stdout
        .lines()
        .find(|l| l.starts_with("total (thrifty)"))
        .unwrap_or_default();
    let numbers: Vec<&str> = total.split_whitespace().skip(2).take(5).collect();
    // Prompt, cached (what the stand-in model's prefix cache served), completion, runs, calls.
    assert_eq!(
        [numbers[0], numbers[2], numbers[3], numbers[4]],
        ["60", "40", "2", "2"],
        "{stdout}"
    );
    assert!(stdout.contains("tokens_per_hour: 80"), "{stdout}");
    // Each replica counts the tokens of the runs it ran by principal: replica 0 ran the first.
    let metrics = testkit::helpers::scrape(&w.replicas[0].metrics).await?;
    let prompt = metrics
        .iter()
        .find(|(k, _)| {
            k.starts_with("orchestrator_principal_tokens_total")
                && k.contains("principal=\"thrifty\"")
                && k.contains("kind=\"prompt\"")
        })
        .map(|(_, v)| *v);
    assert_eq!(prompt, Some(30.0), "{metrics:?}");
    let too_long = pb::GetUsageRequest {
        from_ms: 1,
        ..Default::default()
    };
    let refused = first.get_usage(as_("alice-token", too_long)).await.err();
    assert_eq!(refused.map(|s| s.code()), Some(tonic::Code::InvalidArgument));
    Ok(())
}

/// How many runs wait for a slot on all `replicas` together.
async fn queued_on(replicas: &[Service]) -> f64 {
    let mut total = 0.0;
    for replica in replicas {
        total += queued(replica).await.max(0.0);
    }
    total
}

#[tokio::test]
async fn a_flood_of_200_across_three_replicas_does_not_keep_a_quiet_caller_waiting() -> TestResult {
    let w = world_with(
        3,
        &["--max-runs", "4", "--max-queued-runs", "300"],
        napping(100),
        &[
            ("flood", "flood-token", "max_queued = 200"),
            ("quiet", "quiet-token", ""),
        ],
    )
    .await?;
    let mut clients = Vec::new();
    for replica in 0..3 {
        clients.push(w.client(replica).await?);
    }
    let plain = |id: String| pb::OrchestrateRequest {
        run_id: id,
        ..testkit::user("work")
    };
    let floods: Vec<_> = (0..200)
        .map(|i| spawn_run(&clients[i % 3], "flood-token", plain(format!("flood-{i}"))))
        .collect();
    until("a hundred flood runs to wait", Duration::from_secs(60), || async {
        (queued_on(&w.replicas).await >= 100.0).then_some(())
    })
    .await?;
    let quiets: Vec<_> = (0..20)
        .map(|i| spawn_run(&clients[i % 3], "quiet-token", plain(format!("quiet-{i}"))))
        .collect();
    let mut quiet_waits = Vec::new();
    for quiet in quiets {
        quiet_waits.push(
            quiet
                .await?
                .map_err(|code| anyhow::anyhow!("a quiet run was refused: {code:?}"))?,
        );
    }
    let mut flood_waits = Vec::new();
    for flood in floods {
        flood_waits.push(
            flood
                .await?
                .map_err(|code| anyhow::anyhow!("a flood run was refused: {code:?}"))?,
        );
    }
    flood_waits.sort_unstable();
    let median = flood_waits[flood_waits.len() / 2];
    let worst = quiet_waits.iter().copied().max().unwrap_or(0);
    // First come first served would put every quiet run behind the hundred flood runs waiting.
    assert!(
        worst < median,
        "the quiet caller waited up to {worst} ms, the flood's median {median} ms: {quiet_waits:?}"
    );
    Ok(())
}

/// Listings filter before they bound, and operators open what they list: with
/// `--list-read-max 10` and a dozen of bob's runs live in the fleet, alice's one live run is
/// still in her listing of live runs (the fleet's live runs are kept to hers before at most ten
/// are read); olga, an operator, lists bob's runs and opens one (GetRun), but cancels none; ada,
/// an approver, opens the run whose pending approval she is asked to decide.
#[tokio::test]
async fn listings_filter_before_they_bound_and_operators_open_what_they_list() -> TestResult {
    let ada = [("ada", "ada-token", "roles = [\"approver\"]")];
    let w = world_with(2, &["--list-read-max", "10"], scenario(), &ada).await?;
    let mut client = w.client(0).await?;
    for i in 0..12 {
        start(&mut client, "bob-token", run(&format!("a-bob-{i:02}"), &[], "", true)).await?;
    }
    start(&mut client, "alice-token", run("z-alice", &[], "", true)).await?;
    let waiting = pb::ListRunsRequest {
        statuses: vec![pb::RunStatus::AwaitingApproval as i32],
        ..Default::default()
    };
    let mut other = w.client(1).await?;
    let mine = other.list_runs(as_("alice-token", waiting.clone())).await?.into_inner();
    let ids: Vec<&str> = mine.runs.iter().map(|r| r.run_id.as_str()).collect();
    assert_eq!(ids, ["z-alice"], "alice's live runs");

    let listed = other.list_runs(as_("olga-token", waiting)).await?.into_inner();
    assert!(listed.runs.iter().any(|r| r.run_id.starts_with("a-bob-")), "{listed:?}");
    let opened = other
        .get_run(as_(
            "olga-token",
            pb::GetRunRequest {
                run_id: "a-bob-00".into(),
            },
        ))
        .await?
        .into_inner();
    assert_eq!(opened.principal, "bob");
    let cancel = pb::CancelRunRequest {
        run_id: "a-bob-00".into(),
        ..Default::default()
    };
    let refused = other
        .cancel_run(as_("olga-token", cancel))
        .await
        .err()
        .map(|s| s.code());
    assert_eq!(refused, Some(tonic::Code::NotFound), "an operator reads, never acts");
    let asked = pb::ListPendingApprovalsRequest {
        run_id: "a-bob-01".into(),
        limit: 0,
    };
    let waiting = other
        .list_pending_approvals(as_("ada-token", asked))
        .await?
        .into_inner();
    let run_id = waiting.approvals.first().map(|a| a.run_id.clone()).unwrap_or_default();
    assert_eq!(run_id, "a-bob-01", "{waiting:?}");
    let opened = other
        .get_run(as_("ada-token", pb::GetRunRequest { run_id }))
        .await?
        .into_inner();
    assert_eq!(opened.status(), pb::RunStatus::AwaitingApproval);
    Ok(())
}
