//! The conformance checks the simulated JetStream answers (`sim::jetstream::conformance`), run
//! against a real `nats-server -js` through the production seam: what the simulation assumes of
//! NATS is what NATS does.

use testkit::nats::Nats;

#[tokio::test]
async fn a_real_nats_server_answers_the_checks_the_simulated_cluster_answers() -> anyhow::Result<()> {
    let nats = Nats::start().await?;
    let client = async_nats::connect(nats.url()).await?;
    let js = shared::jetstream::nats::context(client, None);
    sim::jetstream::conformance::check(shared::jetstream::JetStream::handle(&js), "real").await
}
