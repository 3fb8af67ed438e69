//! `mock-llm`: serve scenarios over HTTP. With no `--scenarios` file it plays the demo scenario.

use std::path::PathBuf;

use clap::Parser;
use mock_llm::{Scenario, Scenarios};

/// A stand-in OpenAI-compatible streaming chat-completions server (scripted, not a model).
#[derive(Parser)]
#[command(name = "mock-llm", version, about)]
struct Cli {
    /// Listen address.
    #[arg(long, env = "MOCK_LLM_LISTEN", default_value = "127.0.0.1:8000")]
    listen: std::net::SocketAddr,
    /// JSON file: a scenario, or {"default": scenario, "named": {"model": scenario}}.
    #[arg(long, env = "MOCK_LLM_SCENARIOS")]
    scenarios: Option<PathBuf>,
}

fn load(path: &PathBuf) -> anyhow::Result<Scenarios> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let scenarios = if value.get("default").is_some() {
        serde_json::from_value(value)
    } else {
        serde_json::from_value::<Scenario>(value).map(Scenarios::from)
    };
    scenarios.map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    shared::telemetry::init_logging(shared::telemetry::LogFormat::Text, "info");
    let scenarios = match &cli.scenarios {
        Some(path) => load(path)?,
        None => Scenario::demo().into(),
    };
    let listener = tokio::net::TcpListener::bind(cli.listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", cli.listen))?;
    let stop = shared::shutdown::stop_signal()?;
    tracing::info!(address = %cli.listen, "mock-llm serving (a scripted stand-in, not a model)");
    mock_llm::serve(listener, scenarios, async move {
        stop.await;
    })
    .await?;
    Ok(())
}
