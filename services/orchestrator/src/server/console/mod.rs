//! The console: pages for the people who watch runs and decide (runs, one run live, what waits
//! for a person, a thread, usage), served by the orchestrator on `--console-listen` with the gRPC
//! port's TLS and tokens. Its pages and script are inside the binary (`assets.rs`). A person
//! signs in and gets a session cookie (`session.rs`); every call of a page goes through the gRPC
//! service in process as that person's principal (`gateway.rs`), so the console has no rules of
//! its own; `listener.rs` accepts its connections, `origin.rs` takes only requests sent to the
//! console's own names and origin, `limits.rs` bounds what one address or session may hold.
//!
//! Every state-changing request is a `POST` with a JSON body and the session's CSRF token in
//! `x-csrf-token`; every answer carries a Content-Security-Policy that allows no inline script,
//! and no token ever travels in a URL.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use shared::runtime::AbortOnDrop;
use shared::serving::Security;

use crate::Error;
use crate::config::ConsoleSettings;
use crate::server::Core;
use crate::server::grpc::OrchestratorService;

mod assets;
mod gateway;
mod limits;
pub(in crate::server) mod listener;
mod origin;
mod session;

use gateway::{Item, Refused};
use limits::{NoSlot, SignIns, Streams};
use listener::{Connections, Peer};
use origin::Origins;
use session::{Session, Sessions};

/// What every handler shares.
#[derive(Clone)]
struct Console {
    service: Arc<OrchestratorService>,
    sessions: Arc<Sessions>,
    /// Live run pages followed at once, in all and per session.
    streams: Arc<Streams>,
    /// Sign-ins per address.
    sign_ins: Arc<SignIns>,
    /// The names requests may be sent to.
    origins: Arc<Origins>,
    /// How often a quiet live page hears from the console, its session checked again
    /// (`--console-keep-alive`; proxies close silent connections too).
    keep_alive: Duration,
}

/// Serves the console on `--console-listen` until the handle is dropped; `None` when it is off.
pub(crate) async fn start(
    settings: &ConsoleSettings,
    security: &Security,
    core: Arc<Core>,
) -> Result<Option<AbortOnDrop>, Error> {
    let Some(address) = settings.console_listen else {
        return Ok(None);
    };
    let flag = shared::config::flag::<ConsoleSettings>("console_listen");
    let (listener, local) = listener::bind(&flag, address).await?;
    let origins = Origins::new(settings.console_public_url.as_deref(), security.tls())?;
    let store = (Arc::clone(&core.sign_outs), core.config.store.timeout);
    let console = Console {
        sessions: Arc::new(Sessions::new(
            settings,
            security.authenticator(),
            origins.secure(),
            store,
        )?),
        service: Arc::new(OrchestratorService::new(core)),
        streams: Arc::new(Streams::new(
            settings.console_max_streams,
            settings.console_max_streams_per_session,
        )),
        sign_ins: Arc::new(SignIns::new(settings.console_sign_ins_per_minute)),
        origins: Arc::new(origins),
        keep_alive: settings.console_keep_alive,
    };
    if security.authenticator().is_none() && !local.ip().is_loopback() {
        tracing::warn!(
            address = %local,
            "THE CONSOLE IS OPEN: it serves without authentication on an address other than loopback; anyone who reaches it reads every run and decides every call (--console-allow-unauthenticated)"
        );
    }
    let app = router(console, settings.console_max_body_bytes);
    let connections = Connections {
        incoming: security.incoming_http(listener),
        local,
    };
    tracing::info!(address = %local, tls = security.tls(), "console serving");
    Ok(Some(AbortOnDrop(shared::tasks::spawn(listener::serve(
        connections,
        app,
        settings.console_header_timeout,
    )))))
}

/// The console's routes, each answer with the security headers, each request sent to one of the
/// console's names.
fn router(console: Console, max_body: usize) -> Router {
    let secure = console.origins.secure();
    Router::new()
        .route("/", get(assets::page))
        .route("/assets/{name}", get(assets::asset))
        .route("/api/session", get(who).post(sign_in))
        .route("/api/session/end", post(sign_out))
        .route("/api/rpc/{method}", post(rpc))
        .route("/api/runs/{run_id}/events", get(events))
        .fallback(|| async { refusal(&Refused::new(StatusCode::NOT_FOUND, "NOT_FOUND", "no such page")) })
        .layer(DefaultBodyLimit::max(max_body))
        .layer(axum::middleware::from_fn_with_state(console.clone(), own_names_only))
        .layer(axum::middleware::map_response(assets::with_security_headers))
        .layer(axum::middleware::map_response(move |answer| {
            assets::with_hsts(answer, secure)
        }))
        .with_state(console)
}

/// Answers only requests sent to the console's own names (`origin.rs`).
async fn own_names_only(
    State(console): State<Console>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match console.origins.admit(request.method(), request.headers()) {
        Ok(()) => next.run(request).await,
        Err(refused) => refusal(&refused),
    }
}

/// A refusal as the page reads it.
fn refusal(refused: &Refused) -> Response {
    (
        refused.status,
        [(header::CONTENT_TYPE, "application/json")],
        refused.body(),
    )
        .into_response()
}

/// JSON `body` with status 200.
fn json(body: String) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// The session a request carries, or the refusal to answer.
async fn signed_in(console: &Console, headers: &HeaderMap) -> Result<Session, Refused> {
    console
        .sessions
        .session(headers)
        .await
        .map_err(|e| Refused::new(StatusCode::UNAUTHORIZED, "UNAUTHENTICATED", e.to_string()))
}

/// The session of a state-changing request: JSON, and the session's CSRF token in
/// `x-csrf-token` (a form of another site can send neither).
async fn signed_in_to_change(console: &Console, headers: &HeaderMap) -> Result<Session, Refused> {
    json_body(headers)?;
    let session = signed_in(console, headers).await?;
    let sent = headers
        .get("x-csrf-token")
        .map(HeaderValue::as_bytes)
        .unwrap_or_default();
    if aws_lc_rs::constant_time::verify_slices_are_equal(sent, session.csrf.as_bytes()).is_err() {
        return Err(Refused::new(
            StatusCode::FORBIDDEN,
            "PERMISSION_DENIED",
            "the request lacks the session's CSRF token (x-csrf-token): reload the page",
        ));
    }
    Ok(session)
}

/// Refuses a body that is not JSON.
fn json_body(headers: &HeaderMap) -> Result<(), Refused> {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    match content_type.is_some_and(|t| t.starts_with("application/json")) {
        true => Ok(()),
        false => Err(Refused::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "INVALID_ARGUMENT",
            "send JSON (content-type: application/json)",
        )),
    }
}

/// What a page knows of its session: who, their roles, the CSRF token, when it expires.
fn session_json(session: &Session, authenticates: bool) -> String {
    serde_json::json!({
        "principal": session.principal.name,
        "roles": session.principal.roles,
        "csrf": session.csrf,
        "expiresAt": session.expires_at,
        "authenticates": authenticates,
    })
    .to_string()
}

/// `GET /api/session`: who is signed in.
async fn who(State(console): State<Console>, headers: HeaderMap) -> Response {
    match signed_in(&console, &headers).await {
        Ok(session) => json(session_json(&session, console.sessions.authenticates())),
        Err(refused) => refusal(&refused),
    }
}

/// `POST /api/session` with `{"token": …}` (or `{}` with a client certificate, or on a server
/// without authentication): signs in.
async fn sign_in(
    State(console): State<Console>,
    ConnectInfo(Peer(peer)): ConnectInfo<Peer>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(refused) = json_body(&headers) {
        return refusal(&refused);
    }
    let address = peer.remote_addr.map(|a| a.ip());
    if address.is_some_and(|a| !console.sign_ins.admit(a)) {
        metrics::counter!(crate::telemetry::metric::CONSOLE_SIGN_INS, "outcome" => "limited").increment(1);
        let busy = "too many sign-ins from this address: wait a minute (--console-sign-ins-per-minute)";
        return refusal(&Refused::new(StatusCode::TOO_MANY_REQUESTS, "RESOURCE_EXHAUSTED", busy));
    }
    let token = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("token").and_then(|t| t.as_str()).map(str::to_owned));
    match console.sessions.sign_in(token.as_deref(), Some(&peer)) {
        Ok((session, cookie)) => {
            metrics::counter!(crate::telemetry::metric::CONSOLE_SIGN_INS, "outcome" => "ok").increment(1);
            tracing::info!(principal = %session.principal.name, remote = ?peer.remote_addr, "console sign-in");
            with_cookie(json(session_json(&session, console.sessions.authenticates())), &cookie)
        }
        Err(e) => {
            // Counted, and logged at debug only: failures are cheap to send, and a flood of them
            // must not flood the log.
            metrics::counter!(crate::telemetry::metric::CONSOLE_SIGN_INS, "outcome" => "refused").increment(1);
            tracing::debug!(remote = ?peer.remote_addr, "console sign-in refused: {e}");
            refusal(&Refused::new(
                StatusCode::UNAUTHORIZED,
                "UNAUTHENTICATED",
                e.to_string(),
            ))
        }
    }
}

/// `POST /api/session/end`: signs out, on every replica (the session is ended in the store of
/// sign-outs, and the cookie dropped).
async fn sign_out(State(console): State<Console>, headers: HeaderMap) -> Response {
    let session = match signed_in_to_change(&console, &headers).await {
        Ok(session) => session,
        Err(refused) => return refusal(&refused),
    };
    match console.sessions.sign_out(&session).await {
        Ok(cookie) => with_cookie(json("{}".into()), &cookie),
        Err(e) => refusal(&Refused::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "UNAVAILABLE",
            e.to_string(),
        )),
    }
}

/// `answer` setting the session cookie to `cookie` (a `Set-Cookie` value).
fn with_cookie(mut answer: Response, cookie: &str) -> Response {
    if let Ok(cookie) = HeaderValue::from_str(cookie) {
        answer.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    answer
}

/// `POST /api/rpc/{method}`: one call of the gRPC service as the signed-in person.
async fn rpc(State(console): State<Console>, Path(method): Path<String>, headers: HeaderMap, body: Bytes) -> Response {
    let session = match signed_in_to_change(&console, &headers).await {
        Ok(session) => session,
        Err(refused) => return refusal(&refused),
    };
    match gateway::call(&console.service, &method, session.principal, &body).await {
        Ok(answer) => json(answer),
        Err(refused) => refusal(&refused),
    }
}

/// `GET /api/runs/{run_id}/events`: the run's events as server-sent events, from after the
/// `Last-Event-ID` the browser sends when it reconnects (or `?after=SEQ`); an event `broke` when
/// the stream ends early, after which the browser reconnects.
async fn events(
    State(console): State<Console>,
    Path(run_id): Path<String>,
    headers: HeaderMap,
    uri: axum::http::Uri,
) -> Response {
    let session = match signed_in(&console, &headers).await {
        Ok(session) => session,
        Err(refused) => return refusal(&refused),
    };
    let slot = match console.streams.take(&session.id) {
        Ok(slot) => slot,
        Err(no_slot) => {
            let busy = match no_slot {
                NoSlot::Replica => "the console follows as many run pages as it may (--console-max-streams): close one",
                NoSlot::Session => {
                    "this session follows as many run pages as one may (--console-max-streams-per-session): close one"
                }
            };
            return refusal(&Refused::new(StatusCode::TOO_MANY_REQUESTS, "RESOURCE_EXHAUSTED", busy));
        }
    };
    let after = after_seq(&headers, &uri);
    let keep_alive = console.keep_alive;
    let items = match gateway::events(&console.service, run_id, after, session.principal).await {
        Ok(items) => items,
        Err(refused) => return refusal(&refused),
    };
    let stream = while_signed_in(items.boxed(), console, headers).map(move |item| {
        let _held = &slot;
        Ok::<_, Infallible>(match item {
            Item::Event(seq, json) => Event::default().id(seq.to_string()).event("run").data(json),
            Item::Broke(refused) => Event::default().event("broke").data(refused.body()),
        })
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(keep_alive))
        .into_response()
}

/// `items` while the session of `headers` holds: it is checked again every keep-alive, and a
/// session that ended, expired or lost its credentials ends the stream with a `broke`
/// (UNAUTHENTICATED) within one.
fn while_signed_in(
    items: futures::stream::BoxStream<'static, Item>,
    console: Console,
    headers: HeaderMap,
) -> impl futures::Stream<Item = Item> + Send {
    let every = console.keep_alive;
    let checks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    futures::stream::unfold(Some((items, checks, console, headers)), |state| async move {
        let (mut items, mut checks, console, headers) = state?;
        loop {
            // The check first: a page whose run streams without a pause is still checked.
            tokio::select! {
                biased;
                _ = checks.tick() => {
                    if let Err(refused) = signed_in(&console, &headers).await {
                        return Some((Item::Broke(refused), None));
                    }
                }
                item = items.next() => return item.map(|item| (item, Some((items, checks, console, headers)))),
            }
        }
    })
}

/// The last seq the page has: `Last-Event-ID` (a reconnect), else `?after=`, else 0.
fn after_seq(headers: &HeaderMap, uri: &axum::http::Uri) -> u64 {
    let last = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let query = uri.query().and_then(|q| {
        q.split('&')
            .filter_map(|pair| pair.split_once('='))
            .find(|(k, _)| *k == "after")
            .map(|(_, v)| v.to_owned())
    });
    last.or(query).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reconnect_goes_on_from_the_last_event_id() {
        let uri: axum::http::Uri = "/api/runs/r/events?after=4".parse().unwrap();
        assert_eq!(after_seq(&HeaderMap::new(), &uri), 4);
        let mut headers = HeaderMap::new();
        headers.insert("last-event-id", HeaderValue::from_static("9"));
        assert_eq!(after_seq(&headers, &uri), 9);
        let bare: axum::http::Uri = "/api/runs/r/events?after=x".parse().unwrap();
        assert_eq!(after_seq(&HeaderMap::new(), &bare), 0);
    }
}
