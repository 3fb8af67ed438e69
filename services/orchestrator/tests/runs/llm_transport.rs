//! The hosted path to the model, through the real binary: an `https://` model server whose
//! certificate a private CA signed (trusted with `--llm-ca-file`, refused without it), and the
//! proxy variables (`HTTP_PROXY` for a plain-http server, `HTTPS_PROXY` tunnelling to an https
//! one). Each run takes two model requests (a tool call, then the answer), so a kept-alive
//! connection or tunnel is used again.

use mock_llm::{MockLlm, Scenario, Step, Turn};
use proto::orchestrator::v1 as pb;
use testkit::fronts::{HttpProxy, TlsFront};
use testkit::pki::Pki;
use testkit::{Service, orchestrate, user};
use tokio::process::Command;

type TestResult = anyhow::Result<()>;

/// A tool call, then an answer.
fn two_turns() -> Scenario {
    Scenario::new(vec![
        Turn::default().then(Step::call("echo", serde_json::json!({"text": "hi"}))),
        Turn::text("done"),
    ])
}

/// A test CA and a server certificate for 127.0.0.1 signed by it.
async fn pki() -> anyhow::Result<Pki> {
    let pki = Pki::new()?;
    pki.ca("ca").await?;
    pki.leaf("ca", "model").await?;
    Ok(pki)
}

/// An orchestrator whose model is at `base_url`, with `env` set and no proxy variable inherited.
async fn orchestrator(base_url: &str, env: &[(&str, String)]) -> anyhow::Result<Service> {
    let runner = testkit::tool_runner_in_process().await?;
    let mut command = testkit::orchestrator_command(env!("CARGO_BIN_EXE_orchestrator"), base_url, &runner);
    command.env("LLM_MAX_RETRIES", "0");
    for proxy in [
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
        "NO_PROXY",
        "no_proxy",
    ] {
        command.env_remove(proxy);
    }
    for (name, value) in env {
        command.env(name, value);
    }
    Service::orchestrator(command).await
}

/// Runs one two-turn run to its end.
async fn run(service: &Service) -> anyhow::Result<pb::RunResult> {
    orchestrate(&format!("http://{}", service.grpc), user("say hi through echo")).await
}

#[tokio::test]
async fn an_https_model_server_behind_a_private_ca_is_trusted_with_llm_ca_file() -> TestResult {
    let pki = pki().await?;
    let mock = MockLlm::start(two_turns()).await?;
    let front = TlsFront::start(mock.addr(), &pki.path("model.pem"), &pki.path("model.key")).await?;
    let base_url = format!("https://{}/v1", front.addr());

    let trusting = orchestrator(&base_url, &[("LLM_CA_FILE", pki.arg("ca.pem"))]).await?;
    let result = run(&trusting).await?;
    assert_eq!(result.status(), pb::RunStatus::Completed, "{result:?}");
    assert_eq!(result.text, "done");
    assert_eq!(result.tool_calls.len(), 1, "{result:?}");
    assert_eq!(mock.requests().len(), 2, "both turns went over TLS");
    trusting.stop().await?;

    // Without the CA the server's certificate is not trusted: the run fails, the model is never
    // asked.
    let doubting = orchestrator(&base_url, &[]).await?;
    let result = run(&doubting).await?;
    assert_eq!(result.status(), pb::RunStatus::Failed, "{result:?}");
    assert_eq!(
        mock.requests().len(),
        2,
        "no request reached the model through an untrusted TLS"
    );
    doubting.stop().await
}

#[tokio::test]
async fn an_llm_ca_file_that_holds_no_certificate_stops_the_start() -> TestResult {
    let dir = tempfile::tempdir()?;
    let bad = dir.path().join("ca.pem");
    std::fs::write(&bad, "not a certificate\n")?;
    let mut command = Command::new(env!("CARGO_BIN_EXE_orchestrator"));
    command.env("ORCHESTRATOR_METRICS_LISTEN", "off");
    let bad = bad.display().to_string();
    let args = ["--listen", "127.0.0.1:0", "--llm-ca-file", &bad];
    let (code, _, stderr) = testkit::run_to_end(command, &args, &[]).await?;
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("--llm-ca-file") && stderr.contains("no certificate"),
        "{stderr}"
    );
    Ok(())
}

#[tokio::test]
async fn http_proxy_carries_the_requests_to_a_plain_http_model_server() -> TestResult {
    let mock = MockLlm::start(two_turns()).await?;
    let proxy = HttpProxy::start().await?;
    let service = orchestrator(&mock.base_url(), &[("HTTP_PROXY", proxy.url())]).await?;
    let result = run(&service).await?;
    assert_eq!(result.status(), pb::RunStatus::Completed, "{result:?}");
    assert_eq!(mock.requests().len(), 2);
    assert!(proxy.forwarded() >= 1, "the requests did not go through the proxy");
    service.stop().await
}

#[tokio::test]
async fn https_proxy_tunnels_to_an_https_model_server() -> TestResult {
    let pki = pki().await?;
    let mock = MockLlm::start(two_turns()).await?;
    let front = TlsFront::start(mock.addr(), &pki.path("model.pem"), &pki.path("model.key")).await?;
    let proxy = HttpProxy::start().await?;
    let env = [("HTTPS_PROXY", proxy.url()), ("LLM_CA_FILE", pki.arg("ca.pem"))];
    let service = orchestrator(&format!("https://{}/v1", front.addr()), &env).await?;
    let result = run(&service).await?;
    assert_eq!(result.status(), pb::RunStatus::Completed, "{result:?}");
    assert_eq!(mock.requests().len(), 2);
    assert!(proxy.tunnels() >= 1, "no CONNECT tunnel was opened");
    assert_eq!(
        proxy.forwarded(),
        0,
        "an https request is tunnelled, never passed on in the clear"
    );
    service.stop().await
}
