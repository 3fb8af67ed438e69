//! `demo`: the whole loop in one command. Starts a tool-runner (built-in tools), the stand-in
//! model (unless `LLM_BASE_URL` points at a real server) and the orchestrator, all on loopback
//! ports in this process, then makes one `Orchestrate` call whose first turn asks for several
//! tools at once and whose second emits the `submit_report` exit signal, printing the event
//! stream as it arrives. Exit code 0 when the run completed, 1 when not, 2 on a bad setting.
//!
//! A binary of its own, so the orchestrator's binary and image link neither the stand-in model
//! nor the tool-runner.

use std::process::ExitCode;
use std::time::Duration;

use orchestrator::client::{CallOptions, call};
use orchestrator::config::Secret;
use orchestrator::{Config, Error};

fn main() -> ExitCode {
    shared::runtime::block_on("demo", async {
        shared::telemetry::init_logging(shared::telemetry::LogFormat::Text, "warn");
        let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let options = DemoOptions {
            llm_base_url: env("LLM_BASE_URL"),
            llm_model: env("LLM_MODEL"),
            llm_api_key: env("LLM_API_KEY"),
        };
        shared::runtime::exit_code("demo", run(options).await)
    })
}

/// Where the demo's model comes from.
#[derive(Debug, Clone, Default)]
struct DemoOptions {
    /// A real OpenAI-compatible server (`LLM_BASE_URL`); `None` = the embedded stand-in model.
    llm_base_url: Option<String>,
    /// Its model (`LLM_MODEL`).
    llm_model: Option<String>,
    /// Its API key (`LLM_API_KEY`).
    llm_api_key: Option<String>,
}

const PROMPT: &str = "Use the tools, calling them in parallel in one turn: compute (1234 * 5678) / 2 with \
calculate, get the current UTC time with time_now, and sleep 300 ms with sleep. Then tell me the results in two \
sentences and file them with submit_report.";

async fn bind() -> Result<(tokio::net::TcpListener, String), Error> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| Error::Config(format!("cannot bind a loopback port: {e}")))?;
    let address = listener.local_addr().map_err(|e| Error::Config(e.to_string()))?;
    Ok((listener, format!("http://{address}")))
}

/// Runs the demo; returns whether the run completed.
async fn run(options: DemoOptions) -> Result<bool, Error> {
    let (runner_listener, runner_url) = bind().await?;
    let (runner_stop, runner_stopped) = tokio::sync::oneshot::channel::<()>();
    let runner = tokio::spawn(tool_runner::serve(
        runner_listener,
        tool_runner::Config::default(),
        async move {
            let _ = runner_stopped.await;
        },
    ));

    let (mock, base_url, model) = match &options.llm_base_url {
        Some(url) => (
            None,
            url.clone(),
            options.llm_model.clone().unwrap_or_else(|| "llama3.1".to_owned()),
        ),
        None => {
            let mock = mock_llm::MockLlm::start(mock_llm::Scenario::demo())
                .await
                .map_err(|e| Error::Config(format!("cannot start the stand-in model: {e}")))?;
            let url = mock.base_url();
            (Some(mock), url, "stand-in-model".to_owned())
        }
    };
    println!(
        "demo: tool-runner on {runner_url}, model {model:?} at {}{}",
        orchestrator::secrets::shown_url(&base_url),
        if mock.is_some() {
            " (the embedded scripted stand-in; set LLM_BASE_URL to use a real server)"
        } else {
            ""
        }
    );

    let mut config = Config::new(&base_url, &model, vec![runner_url]);
    config.llm.api_key = options.llm_api_key.as_deref().map(Secret::from);
    let (listener, endpoint) = bind().await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let orchestrator = tokio::spawn(orchestrator::serve(listener, config, async move {
        let _ = stopped.await;
    }));
    println!("demo: orchestrator on {endpoint}\n");

    let outcome = call(&CallOptions {
        endpoint,
        prompt: PROMPT.to_owned(),
        tools: vec!["calculate".into(), "time_now".into(), "sleep".into()],
        exit_tools: vec![(
            "submit_report".into(),
            "Files the final report (title and summary) for the people who asked.".into(),
        )],
        timeout: Duration::from_secs(300),
        ..CallOptions::default()
    })
    .await;

    let _ = stop.send(());
    let _ = runner_stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), orchestrator).await;
    let _ = tokio::time::timeout(Duration::from_secs(10), runner).await;
    drop(mock);
    let result = outcome?;
    Ok(result.status == proto::orchestrator::v1::RunStatus::Completed as i32)
}
