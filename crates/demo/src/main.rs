//! `demo`: the whole loop in one command. Starts a tool-runner (built-in tools), the stand-in
//! model (unless `LLM_BASE_URL` points at a real server) and the orchestrator, all on loopback
//! ports in this process, then makes one `Orchestrate` call whose first turn asks for several
//! tools at once and whose second emits the `submit_report` exit signal, printing the event
//! stream as it arrives. Exit code 0 when the run completed, 1 when not, 2 on a bad setting.
//!
//! Against a real server (`LLM_BASE_URL`), the orchestrator's `LLM_*` environment variables and its
//! run limits (`ORCHESTRATOR_MAX_TURNS` …) apply as they do to the orchestrator itself,
//! `DEMO_PROMPT` replaces the prompt and `DEMO_TOOLS` the tools offered. `DEMO_CONSOLE=ADDRESS`
//! serves the orchestrator's console there too and keeps serving after the run, until Ctrl-C.
//!
//! A binary of its own, so the orchestrator's binary and image link neither the stand-in model
//! nor the tool-runner.

use std::process::ExitCode;
use std::time::Duration;

use orchestrator::cli::call::{CallOptions, call};
use orchestrator::config::{LimitSettings, LlmSettings};
use orchestrator::{Config, Error};

fn main() -> ExitCode {
    shared::runtime::block_on("demo", async {
        shared::telemetry::init_logging(shared::telemetry::LogFormat::Text, "warn");
        let options = match DemoOptions::from_env() {
            Ok(options) => options,
            Err(e) => return shared::runtime::exit_code("demo", Err::<bool, Error>(e)),
        };
        shared::runtime::exit_code("demo", run(options).await)
    })
}

/// What the demo runs against and asks.
#[derive(Debug, Clone)]
struct DemoOptions {
    /// `LLM_BASE_URL` is set: a real OpenAI-compatible server; else the embedded stand-in model.
    real_server: bool,
    /// The orchestrator's LLM settings from its own environment variables (`LLM_BASE_URL`,
    /// `LLM_MODEL`, `LLM_API_KEY`, `LLM_TOOL_CHOICE`, `LLM_TEMPERATURE`, `LLM_MAX_TOKENS` …).
    llm: LlmSettings,
    /// The orchestrator's run limits from its environment variables (`ORCHESTRATOR_MAX_TURNS` …).
    limits: LimitSettings,
    /// The user message (`DEMO_PROMPT`; default [`PROMPT`]).
    prompt: String,
    /// The tool-runner's tools offered (`DEMO_TOOLS`, comma-separated; default [`TOOLS`]).
    tools: Vec<String>,
    /// Whether the `submit_report` exit tool is offered (named in `DEMO_TOOLS`).
    submit_report: bool,
    /// Where the console is served (`DEMO_CONSOLE`; unset: no console).
    console: Option<std::net::SocketAddr>,
}

impl DemoOptions {
    fn from_env() -> Result<Self, Error> {
        let set = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let llm = shared::config::from_env::<LlmSettings>("demo")
            .map_err(|e| Error::Config(shared::secrets::without_userinfo(&e)))?;
        let limits = shared::config::from_env::<LimitSettings>("demo").map_err(Error::Config)?;
        let (tools, submit_report) = offered(&set("DEMO_TOOLS").unwrap_or_else(|| TOOLS.to_owned()))?;
        Ok(Self {
            real_server: set("LLM_BASE_URL").is_some(),
            llm,
            limits,
            prompt: set("DEMO_PROMPT").unwrap_or_else(|| PROMPT.to_owned()),
            tools,
            submit_report,
            console: set("DEMO_CONSOLE")
                .map(|a| {
                    a.parse()
                        .map_err(|e| Error::Config(format!("DEMO_CONSOLE {a:?}: {e} (write e.g. 127.0.0.1:8080)")))
                })
                .transpose()?,
        })
    }
}

/// The tools the demo offers unless `DEMO_TOOLS` names others.
const TOOLS: &str = "calculate,time_now,sleep,submit_report";
/// The demo's exit tool: never executed, its call becomes a signal.
const SUBMIT_REPORT: &str = "submit_report";

/// The tool-runner tools and whether `submit_report` is offered, from a comma-separated list. At
/// least one runner tool must be named: an empty allowlist would offer every tool.
fn offered(list: &str) -> Result<(Vec<String>, bool), Error> {
    let names: Vec<&str> = list.split(',').map(str::trim).filter(|n| !n.is_empty()).collect();
    let submit_report = names.contains(&SUBMIT_REPORT);
    let tools: Vec<String> = names
        .into_iter()
        .filter(|n| *n != SUBMIT_REPORT)
        .map(str::to_owned)
        .collect();
    if tools.is_empty() {
        return Err(Error::Config(format!(
            "DEMO_TOOLS={list:?} names no tool-runner tool (e.g. calculate,time_now,sleep)"
        )));
    }
    Ok((tools, submit_report))
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

    let mut llm = options.llm;
    let mock = if options.real_server {
        None
    } else {
        let mock = mock_llm::MockLlm::start(mock_llm::Scenario::demo())
            .await
            .map_err(|e| Error::Config(format!("cannot start the stand-in model: {e}")))?;
        llm.base_urls = vec![mock.base_url()];
        llm.model = "stand-in-model".to_owned();
        Some(mock)
    };
    println!(
        "demo: tool-runner on {runner_url}, model {:?} at {}{}",
        llm.model,
        shared::secrets::shown_url(&llm.base_urls.join(",")),
        if mock.is_some() {
            " (the embedded scripted stand-in; set LLM_BASE_URL to use a real server)"
        } else {
            ""
        }
    );

    let mut config = Config {
        llm,
        limits: options.limits,
        ..Config::default()
    };
    config.tool_runners.endpoints = vec![runner_url];
    config.console.console_listen = options.console;
    config.validate()?;
    let (listener, endpoint) = bind().await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let orchestrator = tokio::spawn(orchestrator::serve(listener, config, async move {
        let _ = stopped.await;
    }));
    println!("demo: orchestrator on {endpoint}\n");

    let outcome = call(&CallOptions {
        endpoint,
        prompt: options.prompt,
        tools: options.tools,
        exit_tools: options
            .submit_report
            .then(|| {
                (
                    SUBMIT_REPORT.into(),
                    "Files the final report (title and summary) for the people who asked.".into(),
                )
            })
            .into_iter()
            .collect(),
        timeout: Duration::from_secs(300),
        ..CallOptions::default()
    })
    .await;

    if let (Some(console), Ok(result)) = (options.console, &outcome) {
        println!(
            "\ndemo: the console is at http://{console}/#/runs/{} (no sign-in: the demo does not authenticate); Ctrl-C stops",
            result.run_id
        );
        let _ = tokio::signal::ctrl_c().await;
    }
    let _ = stop.send(());
    let _ = runner_stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), orchestrator).await;
    let _ = tokio::time::timeout(Duration::from_secs(10), runner).await;
    drop(mock);
    let result = outcome?;
    Ok(result.status == proto::orchestrator::v1::RunStatus::Completed as i32)
}
