//! A2A 1.0 on `--a2a-listen`: other agents and agent frameworks reach runs through the
//! agent-to-agent protocol's JSON-RPC binding (`jsonrpc.rs`; streams as server-sent events), an
//! agent card for the server and one per named agent (`card.rs`). A task is a run, a context a
//! thread (`tasks.rs`), a push-notification config a webhook of the task (`push.rs`); refusals
//! carry A2A's codes (`error.rs`). Every call goes through the gRPC service in process as the caller's
//! principal, as the console's do, so A2A has no rules of its own: the same credentials (a
//! bearer token; a client certificate where those sign in), the same scopes (another principal's
//! task is not found), the same limits. The listener is the console's (TLS, head timeout). The
//! gRPC binding (`grpc.rs`) is served on the same port, at the cards' origin (agent frameworks
//! refuse a card whose interfaces are elsewhere); both call `calls.rs`.

mod calls;
mod card;
mod error;
mod grpc;
mod jsonrpc;
mod push;
mod tasks;

use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use proto::lf::a2a::v1::a2a_service_server::A2aServiceServer;
use shared::auth::{Authenticator, Principal};
use shared::runtime::AbortOnDrop;
use shared::serving::Security;

use super::console::listener::{self, Connections, Peer};
use crate::Error;
use crate::config::A2aSettings;
use crate::server::Core;
use crate::server::grpc::OrchestratorService;

/// What every A2A request shares.
#[derive(Clone)]
struct A2a {
    service: Arc<OrchestratorService>,
    core: Arc<Core>,
    auth: Option<Arc<Authenticator>>,
    /// Where callers reach this port (the cards name it).
    base_url: String,
}

/// Serves A2A (both bindings) on `--a2a-listen` (nothing when unset) until the handle is
/// dropped.
pub(crate) async fn start(
    settings: &A2aSettings,
    security: &Security,
    core: Arc<Core>,
) -> Result<Option<AbortOnDrop>, Error> {
    let Some(address) = settings.a2a_listen else {
        return Ok(None);
    };
    let flag = shared::config::flag::<A2aSettings>("a2a_listen");
    let (bound, local) = listener::bind(&flag, address).await?;
    let scheme = if security.tls() { "https" } else { "http" };
    let base_url = settings
        .a2a_public_url
        .clone()
        .unwrap_or_else(|| format!("{scheme}://{local}"))
        .trim_end_matches('/')
        .to_owned();
    let header_timeout = settings.a2a_header_timeout;
    let a2a = A2a {
        service: Arc::new(OrchestratorService::new(Arc::clone(&core))),
        core,
        auth: security.authenticator(),
        base_url,
    };
    let app = router(a2a, settings.a2a_max_body_bytes);
    let connections = Connections {
        incoming: security.incoming_http(bound),
        local,
    };
    tracing::info!(address = %local, tls = security.tls(), "a2a serving");
    Ok(Some(AbortOnDrop(shared::tasks::spawn(listener::serve(
        connections,
        app,
        header_timeout,
    )))))
}

/// The routes: the server's card and endpoint, each named agent's, and the gRPC binding (its
/// caller authenticated here, as the gRPC port's layer would).
fn router(a2a: A2a, max_body: usize) -> Router {
    let grpc = Router::new()
        .route_service(
            "/lf.a2a.v1.A2AService/{method}",
            A2aServiceServer::new(grpc::A2aGrpc::new(a2a.clone())),
        )
        .route_layer(axum::middleware::from_fn_with_state(a2a.clone(), grpc_caller));
    Router::new()
        .route("/.well-known/agent-card.json", get(server_card))
        .route("/", axum::routing::post(server_rpc))
        .route("/agents/{name}/.well-known/agent-card.json", get(agent_card))
        .route("/agents/{name}", axum::routing::post(agent_rpc))
        .layer(DefaultBodyLimit::max(max_body))
        .with_state(a2a)
        .merge(grpc)
}

/// A gRPC call's caller, put where the handlers read it (`shared::auth::caller`), or its
/// refusal (`UNAUTHENTICATED`): no call reaches the binding without one.
async fn grpc_caller(
    State(a2a): State<A2a>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    mut request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match principal(&a2a, request.headers(), &peer) {
        Ok(principal) => {
            request.extensions_mut().insert(principal);
            next.run(request).await
        }
        Err(why) => tonic::Status::unauthenticated(why).into_http::<axum::body::Body>(),
    }
}

/// Who is calling: the anonymous caller of a server without authentication, else the principal
/// its credentials name (why not, otherwise).
fn principal(a2a: &A2a, headers: &HeaderMap, peer: &Peer) -> Result<Arc<Principal>, String> {
    let Some(auth) = &a2a.auth else {
        return Ok(Arc::new(Principal::anonymous()));
    };
    auth.authenticate(headers, Some(&peer.0)).map_err(|e| e.to_string())
}

/// The HTTP 401 answer to a call without valid credentials.
fn unauthorized(why: String) -> Response {
    let body = error::error_body(serde_json::Value::Null, error::RpcError::unauthenticated(why));
    (
        StatusCode::UNAUTHORIZED,
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::WWW_AUTHENTICATE, "Bearer"),
        ],
        body,
    )
        .into_response()
}

/// The principal of a card request: its credentials when it sends any (a card of an agent open
/// to some principals only is shown to them), else no one in particular.
fn card_reader(a2a: &A2a, headers: &HeaderMap, peer: &Peer) -> Option<Arc<Principal>> {
    match (&a2a.auth, headers.contains_key(header::AUTHORIZATION)) {
        (None, _) => Some(Arc::new(Principal::anonymous())),
        (Some(_), true) => principal(a2a, headers, peer).ok(),
        (Some(_), false) => None,
    }
}

async fn server_card(State(a2a): State<A2a>) -> Response {
    json(StatusCode::OK, card::of_server(&a2a))
}

async fn agent_card(
    State(a2a): State<A2a>,
    Path(name): Path<String>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
) -> Response {
    let reader = card_reader(&a2a, &headers, &peer);
    match card::of_agent(&a2a, &name, reader.as_deref()) {
        Some(card) => json(StatusCode::OK, card),
        None => json(
            StatusCode::NOT_FOUND,
            serde_json::json!({ "error": format!("no agent {name:?} here that you may use") }),
        ),
    }
}

async fn server_rpc(
    State(a2a): State<A2a>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match principal(&a2a, &headers, &peer) {
        Ok(principal) => jsonrpc::answer(&a2a, None, principal, &body).await,
        Err(why) => unauthorized(why),
    }
}

async fn agent_rpc(
    State(a2a): State<A2a>,
    Path(name): Path<String>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match principal(&a2a, &headers, &peer) {
        Ok(principal) => jsonrpc::answer(&a2a, Some(name), principal, &body).await,
        Err(why) => unauthorized(why),
    }
}

/// `value` as a JSON answer with `status`.
fn json(status: StatusCode, value: serde_json::Value) -> Response {
    (status, [(header::CONTENT_TYPE, "application/json")], value.to_string()).into_response()
}
