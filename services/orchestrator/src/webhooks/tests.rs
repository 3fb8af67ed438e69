use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;
use crate::domain::webhook::Attempt;
use crate::domain::{Event, RunStatus};

fn settings(allow_loopback: bool) -> WebhookSettings {
    let mut settings = crate::config::Config::default().webhooks;
    if allow_loopback {
        settings.webhook_allow_cidrs = vec!["127.0.0.0/8".parse().unwrap()];
        settings.webhook_allow_ports = vec![1];
    }
    settings.webhook_max_backoff = Duration::from_secs(1);
    settings.webhook_timeout = Duration::from_secs(1);
    settings
}

fn webhooks(buckets: Buckets, settings: WebhookSettings) -> Arc<Webhooks> {
    Arc::new(Webhooks::new(buckets, settings, Duration::from_secs(5)))
}

fn shared_buckets(settings: &WebhookSettings) -> (Buckets, Buckets) {
    let one = Buckets::in_memory(settings);
    let two = Buckets {
        registrations: Arc::clone(&one.registrations),
        outbox: Arc::clone(&one.outbox),
    };
    (one, two)
}

fn registration(url: &str) -> Registration {
    Registration {
        url: url.into(),
        scope: Scope::Principal,
        topics: vec![],
        secret: None,
        format: Format::Standard,
        headers: BTreeMap::new(),
    }
}

fn run(run_id: &str) -> Mutex<RunResult> {
    Mutex::new(RunResult {
        principal: "billing".into(),
        status: RunStatus::Completed,
        labels: BTreeMap::from([("team".to_owned(), "a".to_owned())]),
        ..RunResult::running(run_id)
    })
}

fn finished(run: &Mutex<RunResult>, seq: u64) -> Vec<NumberedEvent> {
    let result = shared::sync::lock(run).clone();
    vec![NumberedEvent {
        seq,
        event: Event::RunFinished(Box::new(result)),
    }]
}

async fn all(hooks: &Webhooks) -> Vec<WebhookDelivery> {
    hooks.deliveries("billing", &Narrowing::default(), 500).await.unwrap()
}

#[tokio::test]
async fn private_and_metadata_addresses_are_refused_unless_allowed() {
    let closed = webhooks(Buckets::in_memory(&settings(false)), settings(false));
    for url in [
        "http://127.0.0.1/hook",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/hook",
        "http://10.0.0.1/hook",
    ] {
        let refused = closed.register("billing", registration(url)).await.unwrap_err();
        assert!(matches!(refused, Error::PermissionDenied(_)), "{url}: {refused}");
        assert!(refused.to_string().contains("--webhook-allow-cidr"), "{refused}");
    }
    let port = closed
        .register("billing", registration("https://example.com:8443/"))
        .await
        .unwrap_err();
    assert!(port.to_string().contains("--webhook-allow-port"), "{port}");
    for url in ["ftp://example.com/", "not a url", "https://user:pw@example.com/"] {
        assert!(closed.register("billing", registration(url)).await.is_err(), "{url}");
    }
    let open = webhooks(Buckets::in_memory(&settings(true)), settings(true));
    let hook = open
        .register("billing", registration("http://127.0.0.1:1/hook"))
        .await
        .unwrap();
    assert!(hook.secret.starts_with("whsec_") && hook.id.starts_with("wh_"));
    // Still refused: the metadata address is not in the allowed range.
    assert!(
        open.register("billing", registration("http://169.254.169.254:1/"))
            .await
            .is_err()
    );
    let mut bad_secret = registration("http://127.0.0.1:1/hook");
    bad_secret.secret = Some("hunter2".into());
    assert!(matches!(
        open.register("billing", bad_secret).await,
        Err(Error::InvalidArgument(_))
    ));
}

#[tokio::test]
async fn registrations_are_bounded_per_principal_and_deleted_by_their_owner_only() {
    let mut bounded = settings(true);
    bounded.max_webhooks = 2;
    let hooks = webhooks(Buckets::in_memory(&bounded), bounded);
    let first = hooks
        .register("billing", registration("http://127.0.0.1:1/a"))
        .await
        .unwrap();
    hooks
        .register("billing", registration("http://127.0.0.1:1/b"))
        .await
        .unwrap();
    let third = hooks.register("billing", registration("http://127.0.0.1:1/c")).await;
    assert!(matches!(third, Err(Error::TooManyWebhooks { max: 2, .. })));
    hooks
        .register("support", registration("http://127.0.0.1:1/c"))
        .await
        .unwrap();
    assert!(matches!(
        hooks.remove("support", &first.id).await,
        Err(Error::NotFound(_))
    ));
    hooks.remove("billing", &first.id).await.unwrap();
    assert_eq!(hooks.list("billing").await.unwrap().len(), 1);
}

#[tokio::test]
async fn a_happening_noticed_twice_is_written_once_and_a_failed_attempt_is_kept_pending() {
    let hooks = webhooks(Buckets::in_memory(&settings(true)), settings(true));
    // Port 1 on loopback: nobody listens, every attempt fails.
    hooks
        .register("billing", registration("http://127.0.0.1:1/hook"))
        .await
        .unwrap();
    let state = run("r1");
    let notices: Arc<dyn Notices> = Arc::new(Arc::clone(&hooks));
    notices.notice(&state, &finished(&state, 9)).await;
    notices.notice(&state, &finished(&state, 9)).await;
    let tried = testkit_like_until(|| async {
        let found = all(&hooks).await;
        (found.len() == 1 && found[0].attempts == 1).then_some(found)
    })
    .await;
    let delivery = &tried[0];
    assert_eq!(
        (delivery.state, delivery.topic),
        (DeliveryState::Pending, Topic::Finished)
    );
    assert!(delivery.last_error.is_some(), "{delivery:?}");
    let body: serde_json::Value = serde_json::from_str(&delivery.body).unwrap();
    assert_eq!(
        (body["type"].as_str(), body["data"]["status"].as_str()),
        (Some("run.finished"), Some("COMPLETED"))
    );
    assert_eq!(body["data"]["labels"]["team"], "a");
    // A batch without anything webhooks hear of writes nothing.
    let text = vec![NumberedEvent {
        seq: 10,
        event: Event::TextDelta {
            text: "hi".into(),
            turn: 1,
        },
    }];
    notices.notice(&state, &text).await;
    assert_eq!(all(&hooks).await.len(), 1);
}

#[tokio::test]
async fn a_webhook_with_its_queue_full_has_new_deliveries_dropped_and_a_deleted_one_cancels() {
    let mut bounded = settings(true);
    bounded.webhook_max_pending = 1;
    let hooks = webhooks(Buckets::in_memory(&bounded), bounded);
    let hook = hooks
        .register("billing", registration("http://127.0.0.1:1/hook"))
        .await
        .unwrap();
    let state = run("r2");
    hooks
        .deliver(happenings::happenings(&state, &finished(&state, 1)))
        .await;
    hooks
        .deliver(happenings::happenings(&state, &finished(&state, 2)))
        .await;
    let states = testkit_like_until(|| async {
        let mut states: Vec<_> = all(&hooks).await.iter().map(|d| (d.state, d.attempts)).collect();
        states.sort_by_key(|(state, _)| state.name());
        (states == [(DeliveryState::Dropped, 0), (DeliveryState::Pending, 1)]).then_some(states)
    })
    .await;
    assert_eq!(states.len(), 2);
    hooks.remove("billing", &hook.id).await.unwrap();
    // The next attempt (after the backoff) finds the webhook gone.
    testkit_like_until(|| async {
        let _ = hooks.sweep_once().await;
        all(&hooks)
            .await
            .iter()
            .any(|d| d.state == DeliveryState::Canceled)
            .then_some(())
    })
    .await;
}

#[tokio::test]
async fn of_two_replicas_one_holds_a_delivery_and_the_other_takes_it_when_the_hold_passes() {
    let (one, two) = shared_buckets(&settings(true));
    let (first, second) = (webhooks(one, settings(true)), webhooks(two, settings(true)));
    first
        .register("billing", registration("http://127.0.0.1:1/hook"))
        .await
        .unwrap();
    let state = run("r3");
    first
        .deliver(happenings::happenings(&state, &finished(&state, 1)))
        .await;
    let keys = first.outbox.pending_keys().await.unwrap();
    assert_eq!(keys.len(), 1);
    let now = shared::sync::unix_ms() + 60_000;
    // Due (long past the backoff): the first replica holds it; the second cannot, until the hold passes.
    let held = testkit_like_until(|| async { first.outbox.hold(&keys[0], now, now + 1_000).await.unwrap() }).await;
    assert_eq!(
        second.outbox.hold(&keys[0], now + 500, now + 2_000).await.unwrap(),
        None
    );
    let taken = second.outbox.hold(&keys[0], now + 1_000, now + 2_000).await.unwrap();
    assert!(taken.is_some());
    // The first replica's record of its attempt is refused: the second holds it now.
    let mut late = held.0;
    late.record(
        Attempt::NoAnswer("late".into()),
        now + 1_500,
        10,
        Duration::from_secs(1),
    );
    assert!(!first.outbox.settle(&late, held.1).await.unwrap());
}

/// Polls `probe` for up to ten seconds.
async fn testkit_like_until<T, F: Future<Output = Option<T>>>(mut probe: impl FnMut() -> F) -> T {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(tokio::time::Instant::now() < deadline, "gave up waiting");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
