//! What the NATS adapters (the signal topic, the result store, the event log, the approval store)
//! share: their JetStream streams as this deployment sets them. A stream is created when missing
//! with `--nats-replicas` copies, and one that exists with another count (created before the
//! setting changed, or by hand) is brought to it, so that scaling a NATS cluster up to three nodes
//! and restarting the orchestrator with `--nats-replicas 3` makes every stream survive the loss
//! of a node.

use async_nats::jetstream::{self, stream};

/// The stream `config.name`, created as `config` says when missing, with its replicas brought to
/// `config.num_replicas` when it exists with another count.
pub(crate) async fn ensure_stream(js: &jetstream::Context, config: stream::Config) -> Result<stream::Stream, String> {
    let replicas = config.num_replicas;
    let stream = js.get_or_create_stream(config).await.map_err(|e| e.to_string())?;
    with_replicas(js, stream, replicas).await
}

/// The existing stream `name`, brought to `replicas` copies (see [`with_replicas`]).
pub(crate) async fn ensure_replicas(
    js: &jetstream::Context,
    name: &str,
    replicas: usize,
) -> Result<stream::Stream, String> {
    let stream = js.get_stream(name).await.map_err(|e| e.to_string())?;
    with_replicas(js, stream, replicas).await
}

/// `stream`, brought to `replicas` copies as its info read says (nothing when it has them). A
/// server that is not part of a JetStream cluster refuses more than one; its answer is the error.
async fn with_replicas(
    js: &jetstream::Context,
    stream: stream::Stream,
    replicas: usize,
) -> Result<stream::Stream, String> {
    let info = stream.cached_info();
    let had = info.config.num_replicas.max(1);
    if had == replicas.max(1) {
        return Ok(stream);
    }
    let mut config = info.config.clone();
    config.num_replicas = replicas;
    let name = config.name.clone();
    js.update_stream(config)
        .await
        .map_err(|e| format!("changing its replicas from {had} to {replicas}: {e}"))?;
    tracing::info!(stream = %name, from = had, to = replicas, "JetStream stream replicas changed");
    js.get_stream(&name).await.map_err(|e| e.to_string())
}
