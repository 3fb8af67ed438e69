//! A webhook receiver on loopback: it records every POST it gets (headers and body) and answers
//! the status a test sets (204 until told otherwise), so a test sees what an orchestrator
//! delivered, how often, and how it was signed.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};

/// One POST the receiver got.
#[derive(Debug, Clone)]
pub struct Received {
    /// `webhook-id`.
    pub id: String,
    /// `webhook-timestamp`.
    pub timestamp: String,
    /// `webhook-signature`.
    pub signature: String,
    /// The body.
    pub body: String,
    /// Every header, by its lowercase name.
    pub headers: std::collections::BTreeMap<String, String>,
}

impl Received {
    /// The body as JSON (null when it is not).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.body).unwrap_or_default()
    }
}

#[derive(Default)]
struct Shared {
    got: Mutex<Vec<Received>>,
    status: AtomicU16,
}

/// See the module docs.
pub struct Receiver {
    /// Where it listens.
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    server: tokio::task::JoinHandle<()>,
}

fn header(headers: &HeaderMap, name: &str) -> String {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

async fn take(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: String) -> StatusCode {
    let received = Received {
        id: header(&headers, "webhook-id"),
        timestamp: header(&headers, "webhook-timestamp"),
        signature: header(&headers, "webhook-signature"),
        body,
        headers: headers
            .iter()
            .map(|(name, value)| (name.as_str().to_owned(), value.to_str().unwrap_or_default().to_owned()))
            .collect(),
    };
    shared.got.lock().unwrap_or_else(|e| e.into_inner()).push(received);
    StatusCode::from_u16(shared.status.load(Ordering::SeqCst)).unwrap_or(StatusCode::NO_CONTENT)
}

impl Receiver {
    /// A receiver on 127.0.0.1, answering 204.
    pub async fn start() -> anyhow::Result<Self> {
        let shared = Arc::new(Shared {
            got: Mutex::default(),
            status: AtomicU16::new(204),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let app = axum::Router::new()
            .route("/hook", axum::routing::post(take))
            .with_state(Arc::clone(&shared));
        let server = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { addr, shared, server })
    }

    /// The URL it takes deliveries at.
    pub fn url(&self) -> String {
        format!("http://{}/hook", self.addr)
    }

    /// Answers `status` from now on.
    pub fn answer(&self, status: u16) {
        self.shared.status.store(status, Ordering::SeqCst);
    }

    /// Every POST so far, in order.
    pub fn received(&self) -> Vec<Received> {
        self.shared.got.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The POSTs so far, one per `webhook-id` (the first of each), as a receiver deduplicates.
    pub fn distinct(&self) -> Vec<Received> {
        let mut seen = std::collections::BTreeSet::new();
        self.received()
            .into_iter()
            .filter(|r| seen.insert(r.id.clone()))
            .collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.server.abort();
    }
}
