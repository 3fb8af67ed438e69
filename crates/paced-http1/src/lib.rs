//! An HTTP/1.1 client for streamed answers (server-sent events from a model server), read by
//! whoever reads the answer's body, at its reader's pace.
//!
//! A general HTTP client reads every socket in a connection task of its own and hands each chunk
//! to the reader's task through a channel: two tasks woken per chunk, often on two threads, and
//! the connection's buffers kept while the server thinks. Here the connection is read by
//! whoever polls the body: one task per chunk, and nothing read between a paced reader's ticks
//! ([`ReadPace`]). The request is written and the answer parsed in place (`wire.rs`; the socket,
//! read at its reader's pace, in `socket.rs`), so a connection waiting for the next chunk holds
//! its socket and a few counters, no buffer. Connections are kept alive for the next request in
//! a bounded pool of idle ones; one that the server closed while idle is found closed when taken
//! (it is peeked first) and replaced, and a request refused by a reused connection before any
//! answer is sent again once on a new one.
//!
//! What it does not do: TLS, proxies, redirects, HTTP/2, compressed bodies, requests other than
//! `POST` with a body. The orchestrator reads a plain-http model server without a proxy with it,
//! and every other one through `reqwest` (docs/architecture.md, "Who reads the model's socket").
//!
//! ```no_run
//! # async fn example() -> Result<(), paced_http1::SendError> {
//! use futures::StreamExt as _;
//! let mut headers = http::HeaderMap::new();
//! headers.insert(http::header::HOST, http::HeaderValue::from_static("127.0.0.1:8000"));
//! let endpoint = paced_http1::Endpoint::new("127.0.0.1:8000", "/v1/chat/completions", &headers);
//! let client = paced_http1::Client::new(endpoint, paced_http1::Idle::default());
//! let pace = paced_http1::ReadPace::default();
//! let answer = client.send(&bytes::Bytes::from_static(b"{}"), None, &pace).await?;
//! let mut body = answer.body;
//! while let Some(chunk) = body.next().await {
//!     let _payload = chunk.map_err(|e| paced_http1::SendError::Request(e.to_string()))?;
//! }
//! # Ok(())
//! # }
//! ```

// Two unsafe places in the whole crate, allowed where they are (`socket.rs`): setting
// SO_RCVLOWAT on the socket, which no safe socket crate offers, and reading it into a buffer
// without zeroing the buffer first, as the runtime's own read does.
#![deny(unsafe_code)]

mod pace;
mod socket;
mod wire;

use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, StatusCode};
use tokio::io::ReadBuf;
use tokio::net::TcpStream;

pub use pace::ReadPace;
use socket::Socket;
use wire::{BodyDecoder, RequestHead};

/// Bytes read from the socket at a time, into a buffer on the reader's stack (so that none is
/// kept while the connection waits): a burst of more is read in several.
const READ_BYTES: usize = 16 * 1024;

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection could be made (worth retrying).
    #[error("{0}")]
    Connect(String),
    /// The connection failed before the answer's head, or the head was not HTTP/1.1.
    #[error("{0}")]
    Request(String),
    /// A kept-alive connection failed in a way that shows the server never read the request
    /// (the write failed, or the server reset the connection with the request unread): it is
    /// sent again on a new connection, and only reaches the caller if that one fails the same way.
    #[error("{0}")]
    Unread(String),
}

impl SendError {
    /// Whether the server cannot have processed the request: a failed write, or a reset before
    /// any byte of the answer (a server that closes a socket with unread bytes in it resets the
    /// connection; one that read the request and then closed it ends it cleanly, and may have
    /// acted on it).
    fn unread(error: &std::io::Error) -> bool {
        use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
        matches!(error.kind(), ConnectionReset | ConnectionAborted | BrokenPipe)
    }
}

/// How many idle connections are kept, and for how long.
#[derive(Debug, Clone, Copy)]
pub struct Idle {
    /// The most kept; a connection read to its end when there are this many is closed.
    pub max: usize,
    /// How long one is kept unused.
    pub timeout: Duration,
}

impl Default for Idle {
    fn default() -> Self {
        Self {
            max: 32,
            timeout: Duration::from_secs(90),
        }
    }
}

/// Where requests go and the head every one of them carries.
pub struct Endpoint {
    /// `host:port`, as connected to.
    authority: String,
    /// Every request's head but its length.
    head: RequestHead,
    connect_timeout: Duration,
    /// The longest answer head accepted.
    max_head_bytes: usize,
}

impl Endpoint {
    /// `POST {target}` to `authority` (`host:port`) with `headers` (which should hold `Host`); a
    /// connection is given 10 s to open and an answer's head 64 KiB, unless set otherwise.
    pub fn new(authority: &str, target: &str, headers: &HeaderMap) -> Self {
        Self {
            authority: authority.to_owned(),
            head: RequestHead::new(target, headers),
            connect_timeout: Duration::from_secs(10),
            max_head_bytes: 64 * 1024,
        }
    }

    /// How long a new connection may take to open.
    #[must_use]
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The longest answer head accepted (informational heads before it included).
    #[must_use]
    pub fn max_head_bytes(mut self, bytes: usize) -> Self {
        self.max_head_bytes = bytes;
        self
    }
}

/// A server's idle HTTP/1.1 connections, and how to make new ones.
pub struct Client {
    endpoint: Endpoint,
    limits: Idle,
    /// Idle connections, each with when it went idle; the newest last.
    idle: Mutex<Vec<(Socket, Instant)>>,
}

/// An answer's status and headers; its body is read by whoever reads `body`.
pub struct Answer {
    /// The final status (informational heads before it are skipped).
    pub status: StatusCode,
    /// The answer's headers.
    pub headers: HeaderMap,
    /// The payload, framing taken off; read to its end, the connection is kept for the next
    /// request, dropped before, it is closed.
    pub body: Body,
}

impl Client {
    /// The client of `endpoint`, keeping up to `limits` idle connections.
    pub fn new(endpoint: Endpoint, limits: Idle) -> Arc<Self> {
        Arc::new(Self {
            endpoint,
            limits,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Sends a request carrying `body` (and `header`, one more header of this request's, e.g. an
    /// affinity key) on an idle connection, or a new one, and reads until the answer's head
    /// arrives; the answer's body is read by whoever reads it, at `pace`.
    pub async fn send(
        self: &Arc<Self>,
        body: &Bytes,
        header: Option<&(http::HeaderName, http::HeaderValue)>,
        pace: &ReadPace,
    ) -> Result<Answer, SendError> {
        let head = self.endpoint.head.with(header, body.len());
        if let Some(socket) = self.take_idle() {
            // A connection the server is closing just as it is reused may refuse the request
            // unread: only then is it sent once more, on a fresh connection (a POST the server
            // may have acted on is never sent twice).
            match self.exchange(socket, &head, body, pace).await {
                Err(SendError::Unread(e)) => {
                    tracing::debug!(
                        "a kept-alive LLM connection refused the request unread, sending it on a new one: {e}"
                    );
                }
                answered => return answered,
            }
        }
        match self.exchange(self.connect().await?, &head, body, pace).await {
            Err(SendError::Unread(e)) => Err(SendError::Request(e)),
            answered => answered,
        }
    }

    async fn exchange(
        self: &Arc<Self>,
        mut socket: Socket,
        head: &Bytes,
        body: &Bytes,
        pace: &ReadPace,
    ) -> Result<Answer, SendError> {
        socket
            .send(head.clone(), body.clone())
            .await
            .map_err(|e| SendError::Unread(format!("sending the request: {e}")))?;
        let (head, rest) = self.read_head(&mut socket, pace).await?;
        let mut body = Body {
            socket: Some(socket),
            decoder: head.framing,
            ready: None,
            failed: None,
            reusable: head.reusable,
            pace: pace.clone(),
            pool: Arc::clone(self),
        };
        if let Err(e) = body.take_in(&rest) {
            if body.ready.is_none() {
                return Err(SendError::Request(e.to_string()));
            }
            // The payload before the error is the answer's too: it is read, then the error.
            body.fail(e);
        }
        Ok(Answer {
            status: head.status,
            headers: head.headers,
            body,
        })
    }

    /// Reads the answer's head (past any informational `1xx` one): the head, and the bytes read
    /// after it. The heads together, informational ones included, are bounded by the longest
    /// head accepted, so a server sending `1xx` heads without end is refused like an endless
    /// head.
    async fn read_head(&self, socket: &mut Socket, pace: &ReadPace) -> Result<(wire::Head, Vec<u8>), SendError> {
        let max = self.endpoint.max_head_bytes;
        let too_long = || SendError::Request(wire::WireError::HeadTooLong(max).to_string());
        let mut seen = Vec::new();
        let mut start = 0;
        loop {
            let read = std::future::poll_fn(|cx| {
                let mut room = [MaybeUninit::<u8>::uninit(); READ_BYTES];
                let mut buf = ReadBuf::uninit(&mut room);
                std::task::ready!(socket.poll_read(cx, &mut buf, pace))?;
                seen.extend_from_slice(buf.filled());
                Poll::Ready(Ok::<_, std::io::Error>(buf.filled().len()))
            })
            .await
            .map_err(|e| match seen.is_empty() && SendError::unread(&e) {
                true => SendError::Unread(format!("reading the answer: {e}")),
                false => SendError::Request(format!("reading the answer: {e}")),
            })?;
            if read == 0 {
                return Err(SendError::Request(
                    "the server closed the connection before answering (it may have read the request, so it is not sent again)".into(),
                ));
            }
            // A head ends at a line's end: parsed again only when one came, so a head sent a byte
            // at a time costs a parse per line, not per byte.
            if memchr::memchr(b'\n', &seen[seen.len() - read..]).is_none() {
                if seen.len() > max {
                    return Err(too_long());
                }
                continue;
            }
            while let Some((head, length)) = wire::parse_head(&seen[start..], max - start).map_err(|e| match e {
                wire::WireError::HeadTooLong(_) => too_long(),
                e => SendError::Request(e.to_string()),
            })? {
                start += length;
                if start > max {
                    return Err(too_long());
                }
                if head.status == StatusCode::SWITCHING_PROTOCOLS {
                    return Err(SendError::Request("the server switched protocols".into()));
                }
                if !head.status.is_informational() {
                    return Ok((head, seen.split_off(start)));
                }
            }
        }
    }

    async fn connect(&self) -> Result<Socket, SendError> {
        let timeout = self.endpoint.connect_timeout;
        let connect = TcpStream::connect(&self.endpoint.authority);
        let tcp = match tokio::time::timeout(timeout, connect).await {
            Err(_) => return Err(SendError::Connect(format!("no connection within {timeout:?}"))),
            Ok(Err(e)) => return Err(SendError::Connect(e.to_string())),
            Ok(Ok(tcp)) => tcp,
        };
        // Small SSE requests and answers: no Nagle delay.
        let _ = tcp.set_nodelay(true);
        Ok(Socket::new(tcp))
    }

    /// The newest idle connection still open and quiet; those idle too long are closed.
    fn take_idle(&self) -> Option<Socket> {
        let timeout = self.limits.timeout;
        self.idle_connections().retain(|(_, since)| since.elapsed() < timeout);
        loop {
            let (socket, _) = self.idle_connections().pop()?;
            if socket.idle_and_open() {
                return Some(socket);
            }
        }
    }

    /// The idle connections (a panic elsewhere while holding them leaves them usable).
    fn idle_connections(&self) -> std::sync::MutexGuard<'_, Vec<(Socket, Instant)>> {
        self.idle.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Keeps a connection whose answer was read to its end for the next request, if there is
    /// room.
    fn keep(&self, mut socket: Socket) {
        socket.follow_pace(false);
        let mut idle = self.idle_connections();
        if idle.len() < self.limits.max {
            idle.push((socket, Instant::now()));
        }
    }
}

/// A completion's body, read from its connection by the reader's own task. Read to its end, the
/// connection goes back to the pool (when its framing allows); dropped before, it is closed.
pub struct Body {
    /// `None` once the connection failed.
    socket: Option<Socket>,
    decoder: BodyDecoder,
    /// Payload that came with the head, not yet taken.
    ready: Option<Bytes>,
    /// An error found after `ready`'s payload in the same read: yielded once the payload is.
    failed: Option<std::io::Error>,
    reusable: bool,
    pace: ReadPace,
    pool: Arc<Client>,
}

impl futures::Stream for Body {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if let Some(ready) = this.ready.take() {
            return Poll::Ready(Some(Ok(ready)));
        }
        if let Some(failed) = this.failed.take() {
            return Poll::Ready(Some(Err(failed)));
        }
        loop {
            if this.decoder.done() {
                this.release();
                return Poll::Ready(None);
            }
            let Some(socket) = this.socket.as_mut() else {
                return Poll::Ready(None);
            };
            let mut room = [MaybeUninit::<u8>::uninit(); READ_BYTES];
            let mut buf = ReadBuf::uninit(&mut room);
            let read = match std::task::ready!(socket.poll_read(cx, &mut buf, &this.pace)) {
                Ok(()) if buf.filled().is_empty() => this.closed(),
                Ok(()) => this.take_in(buf.filled()),
                Err(e) => Err(e),
            };
            match read {
                Err(e) => {
                    // What was decoded before the error in this read comes first.
                    this.fail(e);
                    let first = this.ready.take().map(Ok).or_else(|| this.failed.take().map(Err));
                    return Poll::Ready(first);
                }
                Ok(()) => {
                    if let Some(payload) = this.ready.take() {
                        return Poll::Ready(Some(Ok(payload)));
                    }
                }
            }
        }
    }
}

impl Body {
    /// Takes the framing off bytes read, keeping their payload to be yielded.
    /// Bytes before a framing error in `read` are kept in `ready` too (the error is returned).
    fn take_in(&mut self, read: &[u8]) -> std::io::Result<()> {
        let mut payload = BytesMut::with_capacity(read.len());
        let used = self.decoder.decode(read, &mut payload);
        if !payload.is_empty() {
            self.ready = Some(payload.freeze());
        }
        // Bytes after the end of the answer: the server is not speaking HTTP/1.1 as it should.
        self.reusable &= used? == read.len();
        Ok(())
    }

    /// The connection failed after the payload in `ready`: the error comes once it is read.
    fn fail(&mut self, error: std::io::Error) {
        self.socket = None;
        self.failed = Some(error);
    }

    /// The server closed the connection: the end of a body that runs to it, or one cut short.
    fn closed(&mut self) -> std::io::Result<()> {
        self.reusable = false;
        Ok(self.decoder.closed()?)
    }

    /// The body is read to its end: its connection, if it may carry another request, goes back
    /// to the pool.
    fn release(&mut self) {
        if let Some(socket) = self.socket.take()
            && self.reusable
        {
            self.pool.keep(socket);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::WireError;
    use futures::{FutureExt as _, StreamExt as _};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server answering every request on a connection with a chunked SSE body; counts the
    /// connections it accepted. `close_after` answers per connection, then it closes it.
    async fn server(close_after: usize) -> (String, Arc<AtomicUsize>) {
        const ANSWER: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n\
            f\r\ndata: {\"a\":1}\n\n\r\nE\r\ndata: [DONE]\n\n\r\n0\r\n\r\n";
        scripted(ANSWER, close_after).await
    }

    /// A server answering every request on a connection with `answer`, `close_after` times, then
    /// closing it; counts the connections it accepted.
    async fn scripted(answer: &str, close_after: usize) -> (String, Arc<AtomicUsize>) {
        let answer: Arc<str> = answer.into();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                let answer = Arc::clone(&answer);
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 65536];
                    for _ in 0..close_after {
                        let mut seen = Vec::new();
                        while !request_complete(&seen) {
                            match socket.read(&mut buf).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => seen.extend_from_slice(&buf[..n]),
                            }
                        }
                        let _ = socket.write_all(answer.as_bytes()).await;
                    }
                });
            }
        });
        (address, accepted)
    }

    /// One request to a server answering it with `answer`, then closing.
    async fn send_to(answer: &str) -> Result<Answer, SendError> {
        let (address, _) = scripted(answer, 1).await;
        run_reader(&address, idle(4))
            .send(&request_body(), None, &ReadPace::default())
            .await
    }

    /// A whole request: the tests' requests all carry the body `{}`.
    fn request_complete(seen: &[u8]) -> bool {
        seen.ends_with(b"\r\n\r\n{}")
    }

    fn idle(max: usize) -> Idle {
        Idle {
            max,
            timeout: Duration::from_secs(90),
        }
    }

    /// The `run` reader of the server at `address`.
    fn run_reader(address: &str, limits: Idle) -> Arc<Client> {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::HOST, http::HeaderValue::try_from(address).unwrap());
        let endpoint = Endpoint::new(address, "/v1/chat/completions", &headers).connect_timeout(Duration::from_secs(5));
        Client::new(endpoint, limits)
    }

    fn request_body() -> Bytes {
        Bytes::from_static(b"{}")
    }

    async fn read_all(direct: &Arc<Client>) -> String {
        let answer = direct.send(&request_body(), None, &ReadPace::default()).await.unwrap();
        assert_eq!(answer.status, 200);
        let mut body = answer.body;
        let mut text = Vec::new();
        while let Some(chunk) = body.next().await {
            text.extend_from_slice(&chunk.unwrap());
        }
        String::from_utf8(text).unwrap()
    }

    #[tokio::test]
    async fn a_connection_read_to_its_end_serves_the_next_completion() {
        let (address, accepted) = server(usize::MAX).await;
        let direct = run_reader(&address, idle(4));
        for _ in 0..3 {
            assert_eq!(read_all(&direct).await, "data: {\"a\":1}\n\ndata: [DONE]\n\n");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_connection_the_server_closed_while_idle_is_replaced_and_none_are_kept_at_zero() {
        let (address, accepted) = server(1).await;
        let direct = run_reader(&address, idle(4));
        for _ in 0..3 {
            assert_eq!(read_all(&direct).await, "data: {\"a\":1}\n\ndata: [DONE]\n\n");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);

        let (address, accepted) = server(usize::MAX).await;
        let direct = run_reader(&address, idle(0));
        for _ in 0..2 {
            read_all(&direct).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "no idle connection kept at max 0");
    }

    #[tokio::test]
    async fn a_connection_idle_past_its_timeout_is_closed_not_reused() {
        let (address, accepted) = server(usize::MAX).await;
        let limits = Idle {
            max: 4,
            timeout: Duration::from_millis(100),
        };
        let direct = run_reader(&address, limits);
        read_all(&direct).await;
        read_all(&direct).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "reused within its timeout");
        tokio::time::sleep(Duration::from_millis(150)).await;
        read_all(&direct).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "a new one after it");
    }

    /// A server answering one request with the head, then each chunk it is given.
    async fn server_of_chunks() -> (String, tokio::sync::mpsc::UnboundedSender<&'static str>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (tx, mut chunks) = tokio::sync::mpsc::unbounded_channel::<&'static str>();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            assert!(read_request(&mut socket).await);
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
            socket.write_all(head.as_bytes()).await.unwrap();
            while let Some(piece) = chunks.recv().await {
                let chunk = format!("{:x}\r\n{piece}\r\n", piece.len());
                socket.write_all(chunk.as_bytes()).await.unwrap();
            }
            let _ = socket.write_all(b"0\r\n\r\n").await;
        });
        (address, tx)
    }

    /// While its reader reads on ticks, the socket is read once per tick: what arrives after a
    /// tick's read found it drained waits for the next tick; once the reader waits for chunks
    /// again, an arriving one wakes it.
    #[tokio::test]
    async fn a_reader_on_ticks_reads_the_socket_once_per_tick() {
        let settle = || tokio::time::sleep(Duration::from_millis(50));
        let (address, chunks) = server_of_chunks().await;
        let direct = run_reader(&address, idle(4));
        let pace = ReadPace::default();
        let mut body = direct.send(&request_body(), None, &pace).await.unwrap().body;
        chunks.send("data: 1\n\n").unwrap();
        assert_eq!(&body.next().await.unwrap().unwrap()[..], b"data: 1\n\n");

        // The mark is raised as the socket is next read (here: nothing there yet).
        pace.set_ticking(true);
        assert!(body.next().now_or_never().is_none());
        pace.ticked();
        chunks.send("data: 2\n\n").unwrap();
        settle().await;
        let on_tick = body.next().now_or_never().flatten().map(Result::unwrap);
        assert_eq!(on_tick.as_deref(), Some(&b"data: 2\n\n"[..]), "read on the tick");
        chunks.send("data: 3\n\n").unwrap();
        settle().await;
        assert!(
            body.next().now_or_never().is_none(),
            "drained on this tick: not read again"
        );
        pace.ticked();
        let next_tick = body.next().now_or_never().flatten().map(Result::unwrap);
        assert_eq!(next_tick.as_deref(), Some(&b"data: 3\n\n"[..]), "read on the next tick");

        pace.set_ticking(false);
        let waiting = tokio::spawn(async move { body.next().await.map(Result::unwrap) });
        settle().await;
        chunks.send("data: 4\n\n").unwrap();
        let woken = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(woken.as_deref(), Some(&b"data: 4\n\n"[..]), "woken by the chunk");
    }

    #[tokio::test]
    async fn an_answers_framing_says_whether_its_connection_serves_the_next() {
        let cases = [
            ("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello", 1),
            (
                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
                1,
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello",
                2,
            ),
            (
                "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello, and bytes after the end",
                2,
            ),
        ];
        for (answer, connections) in cases {
            let (address, accepted) = scripted(answer, usize::MAX).await;
            let direct = run_reader(&address, idle(4));
            for _ in 0..2 {
                assert_eq!(read_all(&direct).await, "hello", "{answer:?}");
            }
            assert_eq!(accepted.load(Ordering::SeqCst), connections, "{answer:?}");
        }
        // A body that runs to the close.
        let (address, accepted) = scripted("HTTP/1.1 200 OK\r\n\r\nhello", 1).await;
        let direct = run_reader(&address, idle(4));
        for _ in 0..2 {
            assert_eq!(read_all(&direct).await, "hello");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_body_cut_short_or_an_answer_not_http_is_an_error() {
        let cut = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n";
        let mut body = send_to(cut).await.unwrap().body;
        assert_eq!(&body.next().await.unwrap().unwrap()[..], b"hello");
        let error = body.next().await.unwrap().unwrap_err();
        assert_eq!(error.to_string(), WireError::Truncated.to_string());
        assert!(body.next().await.is_none(), "nothing after the error");

        for answer in ["SSH-2.0-OpenSSH\r\n\r\n", ""] {
            let sent = send_to(answer).await;
            assert!(matches!(sent, Err(SendError::Request(_))), "{answer:?}");
        }
    }

    /// A head longer than the limit is refused, with or without line ends in it (the reader's
    /// limit here: 64 KiB).
    #[tokio::test]
    async fn an_endless_head_is_refused_at_its_limit() {
        let no_line_end = format!("HTTP/1.1 200 OK{}", "a".repeat(200 * 1024));
        let long_lines = format!("HTTP/1.1 200 OK\r\nx: {}\r\n", "b".repeat(100 * 1024));
        for answer in [no_line_end, long_lines] {
            let sent = send_to(&answer).await;
            assert!(
                matches!(&sent, Err(SendError::Request(e)) if e.contains("longer than 65536 bytes")),
                "{:?}",
                sent.err()
            );
        }
        // Within the limit but never ended: the server's close ends the wait.
        let sent = send_to(&format!("HTTP/1.1 200 OK\r\n{}", "x: y\r\n".repeat(90))).await;
        assert!(
            matches!(&sent, Err(SendError::Request(e)) if e.contains("closed")),
            "{:?}",
            sent.err()
        );
    }

    /// `1xx` heads without end are bounded like one endless head: together they may not pass the
    /// limit.
    #[tokio::test]
    async fn a_flood_of_informational_heads_is_refused_at_the_head_limit() {
        let flood = format!(
            "{}HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
            "HTTP/1.1 100 Continue\r\n\r\n".repeat(5000)
        );
        let sent = send_to(&flood).await;
        assert!(
            matches!(&sent, Err(SendError::Request(e)) if e.contains("longer than 65536 bytes")),
            "{:?}",
            sent.err()
        );
        let few = format!(
            "{}HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
            "HTTP/1.1 102 Processing\r\n\r\n".repeat(100)
        );
        let (address, _) = scripted(&few, 1).await;
        assert_eq!(read_all(&run_reader(&address, idle(4))).await, "hello");
    }

    /// A server writing `first`, then after a pause `then`, to one request.
    async fn in_two_writes(first: &'static str, then: &'static str) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            assert!(read_request(&mut socket).await);
            socket.write_all(first.as_bytes()).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
            let _ = socket.write_all(then.as_bytes()).await;
        });
        address
    }

    /// Payload decoded before a framing error in the same read is yielded, then the error: with
    /// the head, or in a later read.
    #[tokio::test]
    async fn bytes_before_a_framing_error_in_the_same_read_are_kept() {
        let head = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
        let bad = "5\r\nhello\r\nZZ\r\n";
        let mut with_head = send_to(&format!("{head}{bad}")).await.unwrap().body;
        let address = in_two_writes(head, bad).await;
        let direct = run_reader(&address, idle(4));
        let mut later = direct
            .send(&request_body(), None, &ReadPace::default())
            .await
            .unwrap()
            .body;
        for body in [&mut with_head, &mut later] {
            assert_eq!(&body.next().await.unwrap().unwrap()[..], b"hello");
            let error = body.next().await.unwrap().unwrap_err();
            assert!(error.to_string().contains("chunk size"), "{error}");
            assert!(body.next().await.is_none(), "nothing after the error");
        }
    }

    /// A server that answers its first request on a connection, then treats the second as
    /// `second` says: reads it and closes cleanly, or closes with it unread (a reset).
    async fn closing_on_the_second(read_it: bool) -> (String, Arc<AtomicUsize>) {
        const ANSWER: &str = "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let requests = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&requests);
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let count = Arc::clone(&count);
                tokio::spawn(async move {
                    if !read_request(&mut socket).await {
                        return;
                    }
                    count.fetch_add(1, Ordering::SeqCst);
                    socket.write_all(ANSWER.as_bytes()).await.unwrap();
                    socket.readable().await.unwrap();
                    if read_it && read_request(&mut socket).await {
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                    // Dropped: a clean close, or a reset with the request unread.
                });
            }
        });
        (address, requests)
    }

    /// Reads one whole request from `socket`; false when it closed first.
    async fn read_request(socket: &mut tokio::net::TcpStream) -> bool {
        let mut buf = vec![0u8; 65536];
        let mut seen = Vec::new();
        while !request_complete(&seen) {
            let Ok(n @ 1..) = socket.read(&mut buf).await else {
                return false;
            };
            seen.extend_from_slice(&buf[..n]);
        }
        true
    }

    /// A kept-alive connection that fails is sent again on a new one only when the server
    /// cannot have read the request (it reset the connection with it unread); one the server
    /// read and then closed is an error, not a second POST.
    #[tokio::test]
    async fn a_request_is_sent_again_only_when_the_server_cannot_have_read_it() {
        let (address, requests) = closing_on_the_second(false).await;
        let direct = run_reader(&address, idle(4));
        assert_eq!(read_all(&direct).await, "hello");
        assert_eq!(read_all(&direct).await, "hello", "sent again on a new connection");
        assert_eq!(requests.load(Ordering::SeqCst), 2, "each request read once");

        let (address, requests) = closing_on_the_second(true).await;
        let direct = run_reader(&address, idle(4));
        assert_eq!(read_all(&direct).await, "hello");
        let sent = direct.send(&request_body(), None, &ReadPace::default()).await;
        assert!(
            matches!(&sent, Err(SendError::Request(e)) if e.contains("not sent again")),
            "{:?}",
            sent.err()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(
            requests.load(Ordering::SeqCst),
            2,
            "the read request was not sent again"
        );
    }

    #[tokio::test]
    async fn no_server_is_a_connect_error() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let address = format!("127.0.0.1:{port}");
        let direct = run_reader(&address, idle(4));
        assert!(matches!(
            direct.send(&request_body(), None, &ReadPace::default()).await,
            Err(SendError::Connect(_))
        ));
    }
}
