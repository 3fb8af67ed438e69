//! `bench --peers`: the paced relay's peers, measured on the same stand-in model in the same run.
//! Each peer relays the same streamed text, as many at once; the figure is the CPU and wake-ups
//! per token of the peer's own process. So far: the LiteLLM proxy as a plain relay (installed by
//! `./scripts/model-servers` into the test cache). The OpenAI Agents SDK and agentic-api are
//! still to come.

use std::time::Duration;

use futures::StreamExt;
use serde::Serialize;
use testkit::model_servers::{LITELLM_MASTER_KEY, ModelServer};

use crate::paced::{MODEL, Paced};
use crate::procstat;

/// One peer, measured; or why it was not.
#[derive(Debug, Serialize)]
pub(crate) struct Peer {
    pub name: String,
    /// What the peer does with each token.
    pub role: String,
    pub cpu_us_per_token: Option<f64>,
    pub switches_per_token: Option<f64>,
    pub not_run: Option<String>,
}

/// Every peer against the stand-in model at `model_url`.
pub(crate) async fn measure(model_url: &str, paced: &Paced) -> Vec<Peer> {
    vec![litellm(model_url, paced).await]
}

/// The LiteLLM proxy relaying the paced stream (OpenAI chat completions in and out).
async fn litellm(model_url: &str, paced: &Paced) -> Peer {
    let role = "plain relay (LiteLLM proxy, chat completions)".to_owned();
    match litellm_figures(model_url, paced).await {
        Ok((cpu, switches)) => Peer {
            name: "litellm".into(),
            role,
            cpu_us_per_token: Some(cpu),
            switches_per_token: Some(switches),
            not_run: None,
        },
        Err(e) => Peer {
            name: "litellm".into(),
            role,
            cpu_us_per_token: None,
            switches_per_token: None,
            not_run: Some(format!("{e:#}")),
        },
    }
}

async fn litellm_figures(model_url: &str, paced: &Paced) -> anyhow::Result<(f64, f64)> {
    let folder = tempfile::tempdir()?;
    let config = folder.path().join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "model_list:\n  - model_name: {MODEL}\n    litellm_params:\n      model: openai/{MODEL}\n      api_base: {model_url}\n      api_key: not-checked\nlitellm_settings:\n  telemetry: false\ngeneral_settings:\n  master_key: {LITELLM_MASTER_KEY}\n"
        ),
    )?;
    let proxy = ModelServer::litellm(&config).await?;
    let pid = proxy.pid().ok_or_else(|| anyhow::anyhow!("the LiteLLM proxy exited"))?;
    let url = format!("{}/chat/completions", proxy.base_url());
    relay_round(&url, paced).await?;
    let (cpu, switches) = (procstat::scheduled_time(pid)?, procstat::switches(pid)?);
    let mut tokens = 0;
    for _ in 0..paced.rounds {
        tokens += relay_round(&url, paced).await?;
    }
    let cpu = procstat::scheduled_time(pid)?.saturating_sub(cpu);
    let switches = procstat::switches(pid)?.saturating_sub(switches);
    anyhow::ensure!(tokens > 0, "no text came through the LiteLLM proxy");
    Ok((cpu.as_secs_f64() * 1e6 / tokens as f64, switches as f64 / tokens as f64))
}

/// `concurrency` streamed completions through the relay at once, each read to its end; the
/// tokens relayed (chunks with text).
async fn relay_round(url: &str, paced: &Paced) -> anyhow::Result<usize> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?;
    let body = serde_json::json!({
        "model": MODEL,
        "stream": true,
        "messages": [{"role": "user", "content": "relay"}],
    });
    let calls = (0..paced.concurrency).map(|_| {
        let request = client.post(url).bearer_auth(LITELLM_MASTER_KEY).json(&body);
        async move {
            let response = request.send().await?.error_for_status()?;
            let mut bytes = response.bytes_stream();
            let mut text = Vec::new();
            while let Some(chunk) = bytes.next().await {
                text.extend_from_slice(&chunk?);
            }
            anyhow::Ok(crate::paced::text_chunks(&text))
        }
    });
    let mut tokens = 0;
    for relayed in futures::future::join_all(calls).await {
        tokens += relayed?;
    }
    Ok(tokens)
}
