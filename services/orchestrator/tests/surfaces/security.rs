//! Security through the real binaries, driven by a grpcio client (gRPC's C core, as a service in
//! another language would call us): TLS on the orchestrator with bearer tokens, principals that
//! own their runs and may use only some tools; a tool-runner that serves only callers with a
//! certificate from its CA (mTLS), reached by the orchestrator over `https://` with its client
//! certificate; plaintext health on its own address for probes.
//!
//! Certificates are made with `openssl` for each run; the Python client lives in
//! `tests/python/grpc_probe.py` and runs from the virtualenv `./scripts/test` installs.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use mock_llm::{MockLlm, Scenario, Step, Turn};
use serde_json::{Value, json};
use testkit::Service;
use testkit::pki::Pki;
use testkit::python::python;
use tokio::io::AsyncWriteExt;
use tokio::process::Command;

type TestResult = anyhow::Result<()>;

/// The tool-runner command serving `cert`/`key` and admitting only callers with a certificate
/// signed by `client_ca` (files of `pki`), plus `extra` flags.
fn mtls_runner(pki: &Pki, [cert, key, client_ca]: [&str; 3], extra: &[&str]) -> anyhow::Result<Command> {
    let mut command = Command::new(testkit::tool_runner_bin!()?);
    command
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .args(["--tls-cert", &pki.arg(cert), "--tls-key", &pki.arg(key)])
        .args(["--tls-client-ca", &pki.arg(client_ca)])
        .args(extra);
    Ok(command)
}

/// Runs the grpcio client over `steps`; each outcome by step name.
async fn grpcio(steps: Vec<Value>) -> anyhow::Result<std::collections::HashMap<String, Value>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/grpc_probe.py");
    let plan = json!({ "proto_root": testkit::repo_root().join("proto"), "steps": steps });
    let mut child = Command::new(python()?)
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdin = child.stdin.take().ok_or_else(|| anyhow::anyhow!("no stdin"))?;
    stdin.write_all(plan.to_string().as_bytes()).await?;
    drop(stdin);
    let output = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output()).await??;
    anyhow::ensure!(
        output.status.success(),
        "grpc_probe.py failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let mut outcomes = std::collections::HashMap::new();
    for line in String::from_utf8(output.stdout)?.lines() {
        let outcome: Value = serde_json::from_str(line)?;
        outcomes.insert(outcome["name"].as_str().unwrap_or_default().to_owned(), outcome);
    }
    Ok(outcomes)
}

/// The address a service logged with `message`.
fn logged_address(service: &Service, message: &str) -> anyhow::Result<String> {
    service
        .logs()
        .iter()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .find(|entry| entry["message"] == message)
        .and_then(|entry| entry["address"].as_str().map(str::to_owned))
        .ok_or_else(|| anyhow::anyhow!("no {message:?} in the logs"))
}

async fn health_status(address: &str, service: &str) -> anyhow::Result<i32> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}"))?
        .connect()
        .await?;
    let mut client = tonic_health::pb::health_client::HealthClient::new(channel);
    let request = tonic_health::pb::HealthCheckRequest {
        service: service.into(),
    };
    Ok(client.check(request).await?.into_inner().status)
}

fn tokens_file(dir: &Path) -> anyhow::Result<PathBuf> {
    let path = dir.join("tokens.toml");
    let sha = shared::auth::token_sha256;
    std::fs::write(
        &path,
        format!(
            "[[token]]\nprincipal = \"alice\"\nsha256 = \"{}\"\ntools = [\"calc*\"]\n\n[[token]]\nprincipal = \"bob\"\nsha256 = \"{}\"\n",
            sha("alice-token"),
            sha("bob-token")
        ),
    )?;
    Ok(path)
}

fn step(
    name: &str,
    target: &str,
    service: &str,
    method: &str,
    request: Value,
    tls: Value,
    token: Option<&str>,
) -> Value {
    json!({ "name": name, "target": target, "service": service, "method": method,
            "request": request, "tls": tls, "token": token })
}

fn run_request(run_id: &str, tools: &[&str]) -> Value {
    json!({ "run_id": run_id, "messages": [{"role": "user", "content": "what is 6*7?"}],
            "tools": {"normal": tools} })
}

fn code(outcomes: &std::collections::HashMap<String, Value>, name: &str) -> String {
    outcomes.get(name).map_or_else(
        || format!("step {name} missing"),
        |o| o["code"].as_str().unwrap_or("?").to_owned(),
    )
}

/// The orchestrator (TLS, tokens, an mTLS tool-runner) and its tool-runner (mTLS only, and
/// plaintext health), on a model that calls `calculate` then answers.
async fn secured_pair(pki: &Pki) -> anyhow::Result<(Service, Service, MockLlm)> {
    let runner_command = mtls_runner(
        pki,
        ["server.pem", "server.key", "ca.pem"],
        &["--health-listen", "127.0.0.1:0"],
    )?;
    let runner = Service::spawn(runner_command, "127.0.0.1", "tool-runner serving").await?;

    let llm = MockLlm::start(Scenario::new(vec![
        Turn::default().then(Step::call("calculate", json!({"expression": "6*7"}))),
        Turn::text("It is 42."),
    ]))
    .await?;
    let tokens = tokens_file(pki.dir.path())?;
    let mut orchestrator_command = Command::new(env!("CARGO_BIN_EXE_orchestrator"));
    orchestrator_command
        .env("LLM_BASE_URL", llm.base_url())
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .args(["--tool-runner", &format!("https://{}", runner.grpc)])
        .args(["--tool-runner-ca", &pki.arg("ca.pem")])
        .args([
            "--tool-runner-cert",
            &pki.arg("orchestrator.pem"),
            "--tool-runner-key",
            &pki.arg("orchestrator.key"),
        ])
        .args([
            "--tls-cert",
            &pki.arg("server.pem"),
            "--tls-key",
            &pki.arg("server.key"),
        ])
        .args([
            "--auth-tokens",
            &tokens.display().to_string(),
            "--health-listen",
            "127.0.0.1:0",
        ]);
    let orchestrator = Service::orchestrator(orchestrator_command).await?;
    for service in [&runner, &orchestrator] {
        assert!(
            !service.logs().iter().any(|l| l.contains("is unauthenticated")),
            "a secured service warned that it is unauthenticated"
        );
    }

    Ok((runner, orchestrator, llm))
}

/// Every call the grpcio callers make: to the orchestrator with and without TLS and tokens, on
/// Alice's run as Bob and as Alice; to the runner with and without a client certificate.
fn grpcio_steps(pki: &Pki, orchestrator: &Service, runner: &Service) -> Vec<Value> {
    let (orch, run) = (orchestrator.grpc.as_str(), runner.grpc.as_str());
    let tls = json!({"ca": pki.arg("ca.pem")});
    let o = |name: &str, method: &str, request: Value, tls: &Value, token: Option<&str>| {
        step(name, orch, "orchestrator", method, request, tls.clone(), token)
    };
    let r = |name: &str, tls: Value| step(name, run, "runner", "ListTools", json!({}), tls, None);
    let get = |id: &str| json!({"run_id": id});
    vec![
        o(
            "plaintext",
            "Orchestrate",
            run_request("p", &["calculate"]),
            &Value::Null,
            Some("alice-token"),
        ),
        o("no_token", "Orchestrate", run_request("n", &["calculate"]), &tls, None),
        o(
            "wrong_token",
            "Orchestrate",
            run_request("w", &["calculate"]),
            &tls,
            Some("guess"),
        ),
        o("no_token_get", "GetRun", get("x"), &tls, None),
        o(
            "forbidden_tool",
            "Orchestrate",
            run_request("f", &["time_now"]),
            &tls,
            Some("alice-token"),
        ),
        o(
            "alice_run",
            "Orchestrate",
            run_request("alice-run", &["calculate"]),
            &tls,
            Some("alice-token"),
        ),
        o("bob_get", "GetRun", get("alice-run"), &tls, Some("bob-token")),
        o("bob_cancel", "CancelRun", get("alice-run"), &tls, Some("bob-token")),
        o("bob_attach", "AttachRun", get("alice-run"), &tls, Some("bob-token")),
        o("no_token_attach", "AttachRun", get("alice-run"), &tls, None),
        o("alice_attach", "AttachRun", get("alice-run"), &tls, Some("alice-token")),
        o(
            "bob_replay",
            "Orchestrate",
            run_request("alice-run", &["calculate"]),
            &tls,
            Some("bob-token"),
        ),
        o("alice_get", "GetRun", get("alice-run"), &tls, Some("alice-token")),
        o(
            "alice_replay",
            "Orchestrate",
            run_request("alice-run", &["calculate"]),
            &tls,
            Some("alice-token"),
        ),
        r("runner_plaintext", Value::Null),
        r("runner_no_client_cert", json!({"ca": pki.arg("ca.pem")})),
        r(
            "runner_other_ca",
            json!({"ca": pki.arg("ca.pem"), "cert": pki.arg("impostor.pem"), "key": pki.arg("impostor.key")}),
        ),
        r(
            "runner_with_cert",
            json!({"ca": pki.arg("ca.pem"), "cert": pki.arg("orchestrator.pem"), "key": pki.arg("orchestrator.key")}),
        ),
    ]
}

/// The code each step must get.
const EXPECTED_CODES: [(&str, &str); 18] = [
    ("plaintext", "UNAVAILABLE"),
    ("no_token", "UNAUTHENTICATED"),
    ("wrong_token", "UNAUTHENTICATED"),
    ("no_token_get", "UNAUTHENTICATED"),
    ("forbidden_tool", "PERMISSION_DENIED"),
    ("alice_run", "OK"),
    ("bob_get", "NOT_FOUND"),
    ("bob_cancel", "NOT_FOUND"),
    ("bob_attach", "NOT_FOUND"),
    ("no_token_attach", "UNAUTHENTICATED"),
    ("alice_attach", "OK"),
    ("bob_replay", "NOT_FOUND"),
    ("alice_get", "OK"),
    ("alice_replay", "OK"),
    ("runner_plaintext", "UNAVAILABLE"),
    ("runner_no_client_cert", "UNAVAILABLE"),
    ("runner_other_ca", "UNAVAILABLE"),
    ("runner_with_cert", "OK"),
];

#[tokio::test]
async fn grpcio_callers_meet_tls_tokens_ownership_and_an_mtls_tool_runner() -> TestResult {
    python()?;
    let pki = Pki::new()?;
    pki.ca("ca").await?;
    pki.ca("other-ca").await?;
    pki.leaf("ca", "server").await?;
    pki.leaf("ca", "orchestrator").await?;
    pki.leaf("other-ca", "impostor").await?;
    let (runner, orchestrator, _llm) = secured_pair(&pki).await?;
    let outcomes = grpcio(grpcio_steps(&pki, &orchestrator, &runner)).await?;
    for (name, expected) in EXPECTED_CODES {
        assert_eq!(code(&outcomes, name), expected, "{name}: {}", outcomes[name]);
    }
    refusals_say_what_to_do_and_alices_run_went_through_the_mtls_runner(&outcomes);
    probes_are_plaintext_and_serving(&orchestrator, &runner).await?;
    orchestrator.stop().await?;
    runner.stop().await?;
    Ok(())
}

fn refusals_say_what_to_do_and_alices_run_went_through_the_mtls_runner(
    outcomes: &std::collections::HashMap<String, Value>,
) {
    // The refusals say what to do, and never echo the token.
    assert!(
        outcomes["no_token"]["details"]
            .as_str()
            .unwrap_or_default()
            .contains("Bearer")
    );
    assert!(!outcomes["wrong_token"].to_string().contains("guess"));
    // Alice's run went through the mTLS runner: the tool ran and the run completed.
    let events = outcomes["alice_run"]["response"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let finished = events
        .iter()
        .find_map(|e| e.get("run_finished"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(finished["result"]["status"], "RUN_STATUS_COMPLETED", "{events:?}");
    assert_eq!(finished["result"]["principal"], "alice");
    assert_eq!(finished["result"]["tool_calls"][0]["ok"], true, "{finished}");
    assert_eq!(outcomes["alice_get"]["response"]["principal"], "alice");
    // Alice re-attaches to her finished run: the same events, from any client (grpcio here).
    assert_eq!(outcomes["alice_attach"]["response"], outcomes["alice_run"]["response"]);
    let tools = outcomes["runner_with_cert"]["response"]["tools"]
        .as_array()
        .map_or(0, Vec::len);
    assert!(tools > 0, "ListTools over mTLS listed no tool");
}

/// Plaintext health on its own address, SERVING, with no credentials.
async fn probes_are_plaintext_and_serving(orchestrator: &Service, runner: &Service) -> TestResult {
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    let orchestrator_health = logged_address(orchestrator, "health serving (plaintext)")?;
    assert_eq!(
        health_status(&orchestrator_health, "orchestrator.v1.Orchestrator").await?,
        serving
    );
    let runner_health = logged_address(runner, "health serving (plaintext)")?;
    assert_eq!(
        health_status(&runner_health, "toolrunner.v1.ToolRunner").await?,
        serving
    );

    Ok(())
}

/// A TLS channel to `address` trusting `ca`, presenting `identity` (`name`.pem/.key).
async fn tls_channel(pki: &Pki, address: &str, ca: &str, identity: &str) -> anyhow::Result<tonic::transport::Channel> {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let read = |name: String| std::fs::read(pki.path(&name));
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read(format!("{ca}.pem"))?))
        .identity(Identity::from_pem(
            read(format!("{identity}.pem"))?,
            read(format!("{identity}.key"))?,
        ))
        .domain_name("localhost");
    Ok(tonic::transport::Endpoint::from_shared(format!("https://{address}"))?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?)
}

async fn list_tools(channel: tonic::transport::Channel) -> anyhow::Result<usize> {
    let mut client = proto::toolrunner::v1::tool_runner_client::ToolRunnerClient::new(channel);
    let request = proto::toolrunner::v1::ListToolsRequest {};
    Ok(client.list_tools(request).await?.into_inner().tools.len())
}

/// cert-manager rotates a Secret's files in place: new handshakes must use the new certificate,
/// connections made before must go on working.
#[tokio::test]
async fn tls_files_are_reloaded_without_dropping_connections() -> TestResult {
    let pki = Pki::new()?;
    for (ca, leaf) in [("ca", "server"), ("other-ca", "rotated")] {
        pki.ca(ca).await?;
        pki.leaf(ca, leaf).await?;
    }
    pki.leaf("ca", "orchestrator").await?;
    // The runner trusts client certificates of both CAs, and serves `live.pem` (now from "ca").
    let both = [
        std::fs::read(pki.path("ca.pem"))?,
        std::fs::read(pki.path("other-ca.pem"))?,
    ]
    .concat();
    std::fs::write(pki.path("clients.pem"), both)?;
    std::fs::copy(pki.path("server.pem"), pki.path("live.pem"))?;
    std::fs::copy(pki.path("server.key"), pki.path("live.key"))?;
    let command = mtls_runner(
        &pki,
        ["live.pem", "live.key", "clients.pem"],
        &["--tls-reload-interval", "1s"],
    )?;
    let runner = Service::spawn(command, "127.0.0.1", "tool-runner serving").await?;
    let before = tls_channel(&pki, &runner.grpc, "ca", "orchestrator").await?;
    assert!(list_tools(before.clone()).await? > 0);

    // Rotate to a certificate of the other CA: key first, as a half-done rotation would.
    std::fs::copy(pki.path("rotated.key"), pki.path("live.key"))?;
    std::fs::copy(pki.path("rotated.pem"), pki.path("live.pem"))?;
    anyhow::ensure!(
        runner
            .logged("TLS files changed; new connections use them", Duration::from_secs(15))
            .await,
        "the runner never reloaded its TLS files"
    );
    assert!(
        tls_channel(&pki, &runner.grpc, "ca", "orchestrator").await.is_err(),
        "a new connection still got the old certificate"
    );
    let after = tls_channel(&pki, &runner.grpc, "other-ca", "orchestrator").await?;
    assert!(list_tools(after).await? > 0);
    // The connection made before the rotation was not dropped.
    assert!(list_tools(before).await? > 0);

    // Files that cannot be used (a key that does not fit) keep the last good certificate.
    std::fs::copy(pki.path("server.key"), pki.path("live.key"))?;
    assert!(
        runner
            .logged("keeping the previous ones", Duration::from_secs(10))
            .await
    );
    assert!(list_tools(tls_channel(&pki, &runner.grpc, "other-ca", "orchestrator").await?).await? > 0);
    runner.stop().await?;
    Ok(())
}

/// A half-done rotation of the orchestrator's runner certificate (the new key with the old
/// certificate) is refused and nothing changes; once the certificate follows, it is taken for new
/// connections.
async fn rotate_the_orchestrators_certificate(pki: &Pki, orchestrator: &Service) -> TestResult {
    std::fs::copy(pki.path("rotated.key"), pki.path("live.key"))?;
    assert!(
        orchestrator
            .logged("keeping the previous ones", Duration::from_secs(10))
            .await,
        "the unusable pair was not refused"
    );
    // The rotation completes.
    std::fs::copy(pki.path("rotated.pem"), pki.path("live.pem"))?;
    assert!(
        orchestrator
            .logged("new connections to the runners use them", Duration::from_secs(10))
            .await,
        "the rotated certificate was not picked up"
    );
    Ok(())
}

/// The orchestrator's client certificate for the runners (`--tool-runner-cert`) is rotated in
/// place, as cert-manager does: the orchestrator notices, and its next connections present the
/// new one. The runner is replaced by one that trusts only the new CA, so a call can only succeed
/// over a new connection with the new certificate. A half-rotated pair (key of another
/// certificate) is refused and the previous files stay in use.
#[tokio::test]
async fn the_orchestrators_runner_certificate_is_reloaded_when_rotated() -> TestResult {
    use proto::orchestrator::v1 as pb;
    let pki = Pki::new()?;
    for ca in ["ca", "new-ca"] {
        pki.ca(ca).await?;
    }
    pki.leaf("ca", "server").await?;
    pki.leaf("ca", "orchestrator").await?;
    pki.leaf("new-ca", "rotated").await?;
    std::fs::copy(pki.path("orchestrator.pem"), pki.path("live.pem"))?;
    std::fs::copy(pki.path("orchestrator.key"), pki.path("live.key"))?;
    let runner_trusting = |client_ca| mtls_runner(&pki, ["server.pem", "server.key", client_ca], &[]);
    let runner = Service::spawn(runner_trusting("ca.pem")?, "127.0.0.1", "tool-runner serving").await?;
    let runner_address = runner.grpc.clone();
    let llm = MockLlm::start(Scenario::new(vec![
        Turn::default().then(Step::call("calculate", json!({"expression": "6*7"}))),
        Turn::text("It is 42."),
    ]))
    .await?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_orchestrator"));
    command
        .env("LLM_BASE_URL", llm.base_url())
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .args([
            "--tool-runner",
            &format!("https://localhost:{}", port_of(&runner_address)),
        ])
        .args(["--tool-runner-ca", &pki.arg("ca.pem")])
        .args(["--tool-runner-cert", &pki.arg("live.pem")])
        .args(["--tool-runner-key", &pki.arg("live.key")])
        .args(["--tls-reload-interval", "1s"]);
    let orchestrator = Service::orchestrator(command).await?;
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", orchestrator.grpc))?
        .connect()
        .await?;
    let mut client = pb::orchestrator_client::OrchestratorClient::new(channel);
    let ask = || pb::OrchestrateRequest {
        tools: Some(pb::ToolSelection {
            normal: vec!["calculate".into()],
            ..Default::default()
        }),
        ..testkit::user("what is 6*7?")
    };
    let calls_ok = |result: &pb::RunResult| result.tool_calls.iter().map(|c| c.ok).collect::<Vec<_>>();
    let before = run_to_result(&mut client, ask()).await?;
    assert_eq!(calls_ok(&before), [true], "{before:?}");

    rotate_the_orchestrators_certificate(&pki, &orchestrator).await?;
    // The runner is replaced by one trusting only the new CA.
    runner.stop().await?;
    let listen = runner_address.clone();
    let runner = Service::spawn_on(
        runner_trusting("new-ca.pem")?,
        &listen,
        "127.0.0.1",
        "tool-runner serving",
    )
    .await?;
    let after = run_to_result(&mut client, ask()).await?;
    assert_eq!(
        calls_ok(&after),
        [true],
        "the call reached the new runner with the rotated certificate: {after:?}"
    );
    orchestrator.stop().await?;
    runner.stop().await?;
    Ok(())
}

fn port_of(address: &str) -> &str {
    address.rsplit(':').next().unwrap_or_default()
}

/// Whether the server closes `conn` within `wait` (EOF or reset); a silent client never sends
/// a byte, so the server is all that can end it.
async fn closed_within(conn: &mut tokio::net::TcpStream, wait: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut byte = [0u8; 1];
    match tokio::time::timeout(wait, conn.read(&mut byte)).await {
        Ok(Ok(0) | Err(_)) => true,
        Ok(Ok(_)) => false,
        Err(_) => false,
    }
}

/// Slow TLS handshakes are bounded in number and time (`--tls-max-pending-handshakes`,
/// `--tls-handshake-timeout`), on both sides of each bound: with 2 allowed, two silent clients
/// are kept and a third is closed at once; they are closed when the timeout passes, not before;
/// then a real client gets in.
#[tokio::test]
async fn slow_handshakes_are_bounded_in_number_and_time() -> TestResult {
    let pki = Pki::new()?;
    pki.ca("ca").await?;
    pki.leaf("ca", "server").await?;
    pki.leaf("ca", "orchestrator").await?;
    let command = mtls_runner(
        &pki,
        ["server.pem", "server.key", "ca.pem"],
        &["--tls-handshake-timeout", "8s", "--tls-max-pending-handshakes", "2"],
    )?;
    let runner = Service::spawn(command, "127.0.0.1", "tool-runner serving").await?;
    let address = runner.grpc.trim_start_matches("https://").trim_start_matches("http://");
    let started = tokio::time::Instant::now();
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(tokio::net::TcpStream::connect(address).await?);
    }
    // Let the runner take both before the third arrives. Stays: the runner shows nothing of a
    // handshake it waits for; a third connection taken first fails the test loudly.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut third = tokio::net::TcpStream::connect(address).await?;
    assert!(
        closed_within(&mut third, Duration::from_secs(2)).await,
        "the third pending handshake was refused at once"
    );
    for conn in &mut silent {
        assert!(
            !closed_within(conn, Duration::from_millis(500)).await,
            "a pending handshake under the bound is kept until its timeout"
        );
    }
    // Generous margins: the checks above take about 1.5 s of the 8 s.
    assert!(started.elapsed() < Duration::from_secs(8), "checked before the timeout");
    assert!(
        runner
            .logged("--tls-max-pending-handshakes", Duration::from_secs(5))
            .await,
        "the refusal names the flag"
    );
    for conn in &mut silent {
        assert!(
            closed_within(conn, Duration::from_secs(15)).await,
            "closed once --tls-handshake-timeout passed"
        );
    }
    assert!(started.elapsed() >= Duration::from_secs(8), "not before the timeout");
    let channel = tls_channel(&pki, &runner.grpc, "ca", "orchestrator").await?;
    assert!(list_tools(channel).await? > 0, "the slots are free again");
    runner.stop().await?;
    Ok(())
}

/// Carol's `max_runs` in the tokens file, alone.
const CAROL_ONLY: &str = "[[token]]\nprincipal = \"carol\"\nmax_runs = 1\nmax_queued = 0\n";

/// A tool-runner over mTLS found by `dns:///localhost`, and the orchestrator taking principals
/// from client certificates with a tokens file listing Carol only (re-read every second); the
/// model calls `calculate` then answers, or (`slow`) answers after 1.5 s.
async fn certificate_world(pki: &Pki) -> anyhow::Result<(Service, Service, MockLlm, std::path::PathBuf)> {
    let runner_command = mtls_runner(pki, ["server.pem", "server.key", "ca.pem"], &[])?;
    let runner = Service::spawn(runner_command, "127.0.0.1", "tool-runner serving").await?;
    let runner_port = runner.grpc.rsplit(':').next().unwrap_or_default().to_owned();

    let calculate = Scenario::new(vec![
        Turn::default().then(Step::call("calculate", json!({"expression": "6*7"}))),
        Turn::text("It is 42."),
    ]);
    let slow = Scenario {
        ttft_ms: 1500,
        ..Scenario::new(vec![Turn::text("Slowly.")])
    };
    let llm = MockLlm::start(mock_llm::Scenarios {
        default: calculate,
        named: [("slow".to_owned(), slow)].into_iter().collect(),
    })
    .await?;
    let tokens = pki.path("tokens.toml");
    std::fs::write(&tokens, CAROL_ONLY)?;
    let mut orchestrator_command = Command::new(env!("CARGO_BIN_EXE_orchestrator"));
    orchestrator_command
        .env("LLM_BASE_URL", llm.base_url())
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .args(["--tool-runner", &format!("dns:///localhost:{runner_port}")])
        .args(["--tool-runner-ca", &pki.arg("ca.pem")])
        .args(["--tool-runner-cert", &pki.arg("orchestrator.pem")])
        .args(["--tool-runner-key", &pki.arg("orchestrator.key")])
        .args([
            "--tls-cert",
            &pki.arg("server.pem"),
            "--tls-key",
            &pki.arg("server.key"),
        ])
        .args(["--tls-client-ca", &pki.arg("ca.pem"), "--auth-principal-from-cert"])
        .args([
            "--auth-tokens",
            &tokens.display().to_string(),
            "--tls-reload-interval",
            "1s",
        ]);
    let orchestrator = Service::orchestrator(orchestrator_command).await?;
    Ok((runner, orchestrator, llm, tokens))
}

/// Principals from client certificates (mTLS on the orchestrator, `--auth-principal-from-cert`),
/// through a tool-runner found by `dns:///localhost` over mTLS (the certificate checked against
/// the name, as in Kubernetes with a headless Service): the principal is the certificate's common
/// name; a subject the tokens file does not list is PERMISSION_DENIED, reflection included, until
/// the file (re-read while serving) lists it; a principal's `max_runs` holds through the API.
/// (Callers without a certificate meet the handshake refusal of the grpcio test above.)
#[tokio::test]
async fn certificate_principals_dns_runners_and_per_principal_runs() -> TestResult {
    use proto::orchestrator::v1 as pb;
    let pki = Pki::new()?;
    pki.ca("ca").await?;
    for leaf in ["server", "orchestrator", "carol", "mallory"] {
        pki.leaf("ca", leaf).await?;
    }
    let (runner, orchestrator, llm, tokens) = certificate_world(&pki).await?;
    let address = orchestrator.grpc.clone();
    let client = |identity: &'static str| {
        let (pki, address) = (&pki, address.clone());
        async move {
            let channel = tls_channel(pki, &address, "ca", identity).await?;
            anyhow::Ok(pb::orchestrator_client::OrchestratorClient::new(channel))
        }
    };
    let ask = |model: &str| pb::OrchestrateRequest {
        model: model.into(),
        tools: Some(pb::ToolSelection {
            normal: vec!["calculate".into()],
            ..Default::default()
        }),
        ..testkit::user("what is 6*7?")
    };

    // Carol's certificate is her principal; the tool ran on the runner found by DNS, over mTLS.
    let mut carol = client("carol").await?;
    let finished = run_to_result(&mut carol, ask("")).await?;
    assert_eq!(finished.status(), pb::RunStatus::Completed, "{finished:?}");
    assert_eq!(finished.principal, "carol");
    assert!(finished.tool_calls.first().is_some_and(|c| c.ok), "{finished:?}");

    // Mallory's certificate is valid but she is not a principal here: refused, reflection too.
    let mut mallory = client("mallory").await?;
    let channel = tls_channel(&pki, &address, "ca", "mallory").await?;
    a_certificate_the_tokens_file_does_not_list_is_refused_reflection_too(&mut mallory, &channel).await?;
    let reflection = tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(channel);

    // The tokens file is re-read while serving: once it lists mallory, she is served.
    std::fs::write(&tokens, format!("{CAROL_ONLY}\n[[token]]\nprincipal = \"mallory\"\n"))?;
    testkit::wait::until("the new tokens file to be read", Duration::from_secs(10), || {
        let mut reflection = reflection.clone();
        async move { list_services(&mut reflection, &list_request()).await.ok() }
    })
    .await?;

    // Carol may have one run in flight and none waiting: a second, while a slow one runs, is
    // RESOURCE_EXHAUSTED.
    let mut first = client("carol").await?;
    let slow_run = tokio::spawn(async move { run_to_result(&mut first, ask("slow")).await });
    testkit::wait::until_sync("the slow run to ask the model", Duration::from_secs(10), || {
        llm.requests().iter().any(|r| r["model"] == "slow").then_some(())
    })
    .await?;
    let second = carol.orchestrate(ask("")).await.err().map(|s| s.code());
    assert_eq!(second, Some(tonic::Code::ResourceExhausted));
    assert_eq!(slow_run.await??.status(), pb::RunStatus::Completed);
    // Mallory, another principal, was never limited by Carol's runs.
    assert_eq!(run_to_result(&mut mallory, ask("")).await?.principal, "mallory");

    orchestrator.stop().await?;
    runner.stop().await?;
    Ok(())
}

/// A certificate with an empty subject (SAN-only, as SPIFFE issuers make them) names no one: on
/// a server taking principals from certificates without a tokens file it is UNAUTHENTICATED, for
/// reading, listing and canceling another principal's run alike, while a certificate with a
/// common name is that principal and sees only its own runs.
#[tokio::test]
async fn a_certificate_without_a_subject_is_no_one_not_everyone() -> TestResult {
    use proto::orchestrator::v1 as pb;
    let pki = Pki::new()?;
    pki.ca("ca").await?;
    for leaf in ["server", "carol", "dave"] {
        pki.leaf("ca", leaf).await?;
    }
    pki.leaf_without_subject("ca", "nobody").await?;
    let llm = MockLlm::start(Scenario::new(vec![Turn::text("Done.")])).await?;
    let runner = testkit::helpers::tool_runner_in_process().await?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_orchestrator"));
    command
        .env("LLM_BASE_URL", llm.base_url())
        .args(["--tool-runner", &runner])
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .args([
            "--tls-cert",
            &pki.arg("server.pem"),
            "--tls-key",
            &pki.arg("server.key"),
        ])
        .args(["--tls-client-ca", &pki.arg("ca.pem"), "--auth-principal-from-cert"]);
    let orchestrator = Service::orchestrator(command).await?;
    let client = |identity: &'static str| {
        let (pki, address) = (&pki, orchestrator.grpc.clone());
        async move {
            let channel = tls_channel(pki, &address, "ca", identity).await?;
            anyhow::Ok(pb::orchestrator_client::OrchestratorClient::new(channel))
        }
    };
    let mut carol = client("carol").await?;
    let finished = run_to_result(&mut carol, testkit::user("hello")).await?;
    assert_eq!(finished.principal, "carol", "{finished:?}");
    let run_id = finished.run_id.clone();

    let mut nobody = client("nobody").await?;
    let read = nobody.get_run(pb::GetRunRequest { run_id: run_id.clone() }).await;
    let refused = read
        .err()
        .ok_or_else(|| anyhow::anyhow!("a certificate without a subject read carol's run"))?;
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    assert!(refused.message().contains("names no principal"), "{refused:?}");
    let listed = nobody
        .list_runs(pb::ListRunsRequest::default())
        .await
        .err()
        .map(|s| s.code());
    assert_eq!(listed, Some(tonic::Code::Unauthenticated));
    let cancel = pb::CancelRunRequest {
        run_id: run_id.clone(),
        ..Default::default()
    };
    assert_eq!(
        nobody.cancel_run(cancel).await.err().map(|s| s.code()),
        Some(tonic::Code::Unauthenticated)
    );

    // Another named principal does not see carol's run either.
    let mut dave = client("dave").await?;
    let other = dave.get_run(pb::GetRunRequest { run_id }).await.err().map(|s| s.code());
    assert_eq!(other, Some(tonic::Code::NotFound));
    orchestrator.stop().await?;
    Ok(())
}

/// A `ListServices` reflection request.
fn list_request() -> tonic_reflection::pb::v1::ServerReflectionRequest {
    tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(String::new()),
        ),
    }
}

/// A caller whose certificate is valid but names no principal of the tokens file is
/// PERMISSION_DENIED: its runs, and reflection (v1 and v1alpha) too.
async fn a_certificate_the_tokens_file_does_not_list_is_refused_reflection_too(
    stranger: &mut proto::orchestrator::v1::orchestrator_client::OrchestratorClient<tonic::transport::Channel>,
    channel: &tonic::transport::Channel,
) -> TestResult {
    let refused = stranger
        .orchestrate(testkit::user("what is 6*7?"))
        .await
        .err()
        .map(|s| s.code());
    assert_eq!(refused, Some(tonic::Code::PermissionDenied));
    let mut reflection =
        tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(channel.clone());
    assert_eq!(
        list_services(&mut reflection, &list_request()).await.err(),
        Some(tonic::Code::PermissionDenied),
        "reflection without a principal"
    );
    let v1alpha = async {
        use tonic_reflection::pb::v1alpha;
        let request = v1alpha::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(v1alpha::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            )),
        };
        let mut client = v1alpha::server_reflection_client::ServerReflectionClient::new(channel.clone());
        let mut stream = client
            .server_reflection_info(futures::stream::iter([request]))
            .await?
            .into_inner();
        stream.message().await.map(|_| ())
    };
    assert_eq!(
        v1alpha.await.err().map(|s| s.code()),
        Some(tonic::Code::PermissionDenied),
        "reflection v1alpha without a principal"
    );
    Ok(())
}

/// One reflection `list_services` exchange: Ok, or the refusal's code.
async fn list_services(
    client: &mut tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient<tonic::transport::Channel>,
    request: &tonic_reflection::pb::v1::ServerReflectionRequest,
) -> Result<(), tonic::Code> {
    let mut stream = client
        .server_reflection_info(futures::stream::iter([request.clone()]))
        .await
        .map_err(|s| s.code())?
        .into_inner();
    stream.message().await.map(|_| ()).map_err(|s| s.code())
}

/// Runs `request` on `client` to its `run_finished` result.
async fn run_to_result(
    client: &mut proto::orchestrator::v1::orchestrator_client::OrchestratorClient<tonic::transport::Channel>,
    request: proto::orchestrator::v1::OrchestrateRequest,
) -> anyhow::Result<proto::orchestrator::v1::RunResult> {
    use proto::orchestrator::v1 as pb;
    let mut stream = client.orchestrate(request).await?.into_inner();
    while let Some(event) = tokio::time::timeout(Duration::from_secs(30), stream.message()).await?? {
        if let Some(pb::orchestrate_event::Event::RunFinished(f)) = event.event {
            return f.result.ok_or_else(|| anyhow::anyhow!("run_finished without a result"));
        }
    }
    anyhow::bail!("the stream ended without run_finished")
}
