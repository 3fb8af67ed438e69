//! The `run` reader: completions from a plain-http LLM server read by the run itself.
//!
//! A shared HTTP client reads every socket in a connection task of its own and hands each chunk
//! to the run's task through a channel: two tasks woken per token, often on two threads. Here a
//! completion's HTTP/1.1 connection is driven by whoever reads its body (the run's task): one
//! task per token, and nothing read between a stream interval's ticks. Connections are kept
//! alive for the next turn in a bounded pool of idle ones; one that the server closed while idle
//! is found closed when taken (it is polled first) and replaced, and a request refused by a
//! reused connection before any answer is sent again once on a new one.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use std::future::Future as _;

use futures::FutureExt;
use http_body_util::Full;
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::ReadPace;

/// One HTTP/1.1 connection: the request side and the connection's I/O, driven by its reader.
struct Conn {
    sender: http1::SendRequest<Full<Bytes>>,
    io: http1::Connection<TokioIo<Socket>, Full<Bytes>>,
    /// The pace of the completion the connection now carries (its socket reads it).
    pace: Arc<Mutex<ReadPace>>,
}

/// Bytes that must be waiting before the socket wakes a reader that reads only on its ticks:
/// far more than a tick's worth of tokens, so arriving tokens wake nobody (and if a fast model
/// fills it, the reader is merely woken early).
const TICKING_LOW_WATER: i32 = 64 * 1024;

/// The connection's TCP socket, read straight by whoever polls it. While the completion's reader
/// reads only on its ticks, the socket's receive low-water mark is raised, so that the kernel
/// does not wake the runtime for every chunk; and since the runtime then never hears that data
/// is there, a read is tried on the socket itself before waiting for readiness (and once more
/// when the mark comes down). Otherwise it is read as any socket of the runtime.
struct Socket {
    tcp: TcpStream,
    pace: Arc<Mutex<ReadPace>>,
    /// The low-water mark set on the socket.
    low_water: i32,
}

impl Socket {
    /// The low-water mark for the reader's pace, set on the socket when it changed.
    fn follow_pace(&mut self, ticking: bool) {
        let wanted = if ticking { TICKING_LOW_WATER } else { 1 };
        if wanted != self.low_water {
            match set_receive_low_water(&self.tcp, wanted) {
                Ok(()) => self.low_water = wanted,
                // Without it the socket wakes the runtime per chunk, as any socket does.
                Err(e) => tracing::debug!("SO_RCVLOWAT {wanted} on the LLM connection: {e}"),
            }
        }
    }
}

impl tokio::io::AsyncRead for Socket {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let pace = shared::sync::lock(&self.pace).clone();
        let was_raised = self.low_water > 1;
        self.follow_pace(pace.ticking());
        if !was_raised && self.low_water == 1 {
            // Not ticking: the runtime's readiness is exact, and its read fills the buffer
            // without zeroing it first.
            return Pin::new(&mut self.tcp).poll_read(cx, buf);
        }
        // Read once per tick: found drained on this tick, the socket waits for the next one
        // (or for more than the raised mark, which wakes the runtime).
        let mut tried = pace.drained_this_tick();
        loop {
            if !tried {
                // Straight from the socket: under a raised low-water mark the runtime's
                // readiness says nothing about what is waiting.
                let room = buf.remaining();
                match receive(&self.tcp, buf) {
                    Ok(n) => {
                        if n < room {
                            pace.drained();
                        }
                        return Poll::Ready(Ok(()));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => pace.drained(),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Poll::Ready(Err(e)),
                }
                tried = true;
            }
            std::task::ready!(self.tcp.poll_read_ready(cx))?;
            // The runtime heard the socket was readable: read through it, which clears that
            // readiness if nothing is there any more.
            match self
                .tcp
                .try_io(tokio::io::Interest::READABLE, || receive(&self.tcp, buf))
            {
                Ok(_) => return Poll::Ready(Ok(())),
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

/// Reads what the socket holds into the unfilled part of `buf`, without zeroing it first.
#[allow(unsafe_code)]
fn receive(tcp: &TcpStream, buf: &mut tokio::io::ReadBuf<'_>) -> std::io::Result<usize> {
    // SAFETY: `recv` only writes bytes into the slice, never de-initializes any.
    let n = socket2::SockRef::from(tcp).recv(unsafe { buf.unfilled_mut() })?;
    // SAFETY: `recv` initialized the first `n` bytes of the unfilled part.
    unsafe { buf.assume_init(n) };
    buf.advance(n);
    Ok(n)
}

impl tokio::io::AsyncWrite for Socket {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.tcp.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// Sets `SO_RCVLOWAT`: the bytes that must be queued before the socket reports itself readable.
#[allow(unsafe_code)]
fn set_receive_low_water(socket: &impl std::os::fd::AsFd, bytes: i32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd as _;
    let value: libc::c_int = bytes;
    let length = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()).unwrap_or(4);
    // SAFETY: the descriptor is open for as long as `socket` is borrowed, and the option value
    // points to a `c_int` that lives across the call, with its size passed as its length.
    let result = unsafe {
        libc::setsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&raw const value).cast(),
            length,
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl Conn {
    /// Drives the connection's I/O once; `false` once it is closed (cleanly or not).
    fn drive(&mut self, cx: &mut Context<'_>) -> Result<bool, hyper::Error> {
        match self.io.poll_unpin(cx) {
            Poll::Pending => Ok(true),
            Poll::Ready(Ok(())) => Ok(false),
            Poll::Ready(Err(e)) => Err(e),
        }
    }
}

/// Why a request got no answer.
#[derive(Debug)]
pub(super) enum SendError {
    /// No connection could be made (worth retrying).
    Connect(String),
    /// The connection failed before the answer's head.
    Request(String),
}

/// How many idle connections are kept, and for how long.
#[derive(Debug, Clone, Copy)]
pub(super) struct Idle {
    pub max: usize,
    pub timeout: Duration,
}

/// The LLM server's idle HTTP/1.1 connections, and how to make new ones.
pub(super) struct Direct {
    /// `host:port`, as connected to.
    authority: String,
    connect_timeout: Duration,
    limits: Idle,
    /// Idle connections, each with when it went idle; the newest last.
    idle: Mutex<Vec<(Conn, Instant)>>,
}

impl Direct {
    pub(super) fn new(authority: String, connect_timeout: Duration, limits: Idle) -> Arc<Self> {
        Arc::new(Self {
            authority,
            connect_timeout,
            limits,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Sends `request` on an idle connection, or a new one, and drives the connection until the
    /// answer's head arrives; the body is read by whoever reads the returned stream.
    pub(super) async fn send(
        self: &Arc<Self>,
        request: impl Fn() -> http::Request<Full<Bytes>>,
        pace: &ReadPace,
    ) -> Result<http::Response<DirectBody>, SendError> {
        if let Some(conn) = self.take_idle().await {
            // A connection the server is closing just as it is reused refuses the request
            // before any answer: send it once more, on a fresh connection.
            match self.exchange(conn, request(), pace).await {
                Ok(response) => return Ok(response),
                Err(e) => tracing::debug!("a kept-alive LLM connection failed, sending again on a new one: {e:?}"),
            }
        }
        self.exchange(self.connect().await?, request(), pace).await
    }

    async fn exchange(
        self: &Arc<Self>,
        mut conn: Conn,
        request: http::Request<Full<Bytes>>,
        pace: &ReadPace,
    ) -> Result<http::Response<DirectBody>, SendError> {
        *shared::sync::lock(&conn.pace) = pace.clone();
        let mut answer = std::pin::pin!(conn.sender.send_request(request));
        let mut open = true;
        let head = std::future::poll_fn(|cx| {
            if open {
                match conn.drive(cx) {
                    Ok(still_open) => open = still_open,
                    Err(e) => return Poll::Ready(Err(e)),
                }
            }
            answer.as_mut().poll(cx)
        })
        .await
        .map_err(|e| SendError::Request(e.to_string()))?;
        let (parts, incoming) = head.into_parts();
        let body = DirectBody {
            conn: open.then_some(conn),
            incoming,
            pool: Arc::clone(self),
        };
        Ok(http::Response::from_parts(parts, body))
    }

    async fn connect(&self) -> Result<Conn, SendError> {
        let connect = TcpStream::connect(&self.authority);
        let tcp = match tokio::time::timeout(self.connect_timeout, connect).await {
            Err(_) => {
                return Err(SendError::Connect(format!(
                    "no connection within {:?}",
                    self.connect_timeout
                )));
            }
            Ok(Err(e)) => return Err(SendError::Connect(e.to_string())),
            Ok(Ok(tcp)) => tcp,
        };
        // Small SSE requests and answers: no Nagle delay.
        let _ = tcp.set_nodelay(true);
        let pace = Arc::new(Mutex::new(ReadPace::default()));
        let socket = Socket {
            tcp,
            pace: Arc::clone(&pace),
            low_water: 1,
        };
        let (sender, io) = http1::handshake(TokioIo::new(socket))
            .await
            .map_err(|e| SendError::Connect(e.to_string()))?;
        Ok(Conn { sender, io, pace })
    }

    /// The newest idle connection still open and ready for a request; those idle too long are
    /// closed.
    async fn take_idle(&self) -> Option<Conn> {
        let timeout = self.limits.timeout;
        shared::sync::lock(&self.idle).retain(|(_, since)| since.elapsed() < timeout);
        loop {
            let (mut conn, _) = shared::sync::lock(&self.idle).pop()?;
            // One poll reads an EOF or error the server sent while the connection was idle.
            let usable = std::future::poll_fn(|cx| {
                let open = matches!(conn.drive(cx), Ok(true));
                Poll::Ready(open && matches!(conn.sender.poll_ready(cx), Poll::Ready(Ok(()))))
            })
            .await;
            if usable {
                return Some(conn);
            }
        }
    }

    /// Keeps a connection whose answer was read to its end for the next request, if there is
    /// room.
    fn keep(&self, conn: Conn) {
        let mut idle = shared::sync::lock(&self.idle);
        if idle.len() < self.limits.max {
            idle.push((conn, Instant::now()));
        }
    }
}

/// A completion's body, read from its connection by the reader's own task. Read to its end,
/// the connection goes back to the pool; dropped before, the connection is closed.
pub(super) struct DirectBody {
    conn: Option<Conn>,
    incoming: Incoming,
    pool: Arc<Direct>,
}

impl futures::Stream for DirectBody {
    type Item = Result<Bytes, hyper::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if let Some(conn) = &mut this.conn {
                match conn.drive(cx) {
                    Ok(true) => {}
                    Ok(false) => this.conn = None,
                    Err(e) => {
                        this.conn = None;
                        return Poll::Ready(Some(Err(e)));
                    }
                }
            }
            match Pin::new(&mut this.incoming).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    this.release(cx);
                    return Poll::Ready(None);
                }
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(Some(Ok(frame))) => {
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        return Poll::Ready(Some(Ok(data)));
                    }
                }
            }
        }
    }
}

impl DirectBody {
    /// The body is read to its end: its connection, once it has taken the end in and is ready
    /// for another request, goes back to the pool.
    fn release(&mut self, cx: &mut Context<'_>) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        *shared::sync::lock(&conn.pace) = ReadPace::default();
        let open = matches!(conn.drive(cx), Ok(true));
        if open && conn.sender.is_ready() {
            self.pool.keep(conn);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A server answering every request on a connection with a chunked SSE body; counts the
    /// connections it accepted. `close_after` answers per connection, then it closes it.
    async fn server(close_after: usize) -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
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
                        let head =
                            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n";
                        let _ = socket.write_all(head.as_bytes()).await;
                        for piece in ["data: {\"a\":1}\n\n", "data: [DONE]\n\n"] {
                            let chunk = format!("{:x}\r\n{piece}\r\n", piece.len());
                            let _ = socket.write_all(chunk.as_bytes()).await;
                        }
                        let _ = socket.write_all(b"0\r\n\r\n").await;
                    }
                });
            }
        });
        (address, accepted)
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

    fn request(address: &str) -> http::Request<Full<Bytes>> {
        http::Request::post(format!("http://{address}/v1/chat/completions"))
            .header(http::header::HOST, address)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    }

    async fn read_all(direct: &Arc<Direct>, address: &str) -> String {
        let response = direct.send(|| request(address), &ReadPace::default()).await.unwrap();
        assert_eq!(response.status(), 200);
        let mut body = response.into_body();
        let mut text = Vec::new();
        while let Some(chunk) = body.next().await {
            text.extend_from_slice(&chunk.unwrap());
        }
        String::from_utf8(text).unwrap()
    }

    #[tokio::test]
    async fn a_connection_read_to_its_end_serves_the_next_completion() {
        let (address, accepted) = server(usize::MAX).await;
        let direct = Direct::new(address.clone(), Duration::from_secs(5), idle(4));
        for _ in 0..3 {
            assert_eq!(read_all(&direct, &address).await, "data: {\"a\":1}\n\ndata: [DONE]\n\n");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_connection_the_server_closed_while_idle_is_replaced_and_none_are_kept_at_zero() {
        let (address, accepted) = server(1).await;
        let direct = Direct::new(address.clone(), Duration::from_secs(5), idle(4));
        for _ in 0..3 {
            assert_eq!(read_all(&direct, &address).await, "data: {\"a\":1}\n\ndata: [DONE]\n\n");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3);

        let (address, accepted) = server(usize::MAX).await;
        let direct = Direct::new(address.clone(), Duration::from_secs(5), idle(0));
        for _ in 0..2 {
            read_all(&direct, &address).await;
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
        let direct = Direct::new(address.clone(), Duration::from_secs(5), limits);
        read_all(&direct, &address).await;
        read_all(&direct, &address).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "reused within its timeout");
        tokio::time::sleep(Duration::from_millis(150)).await;
        read_all(&direct, &address).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 2, "a new one after it");
    }

    /// A server answering one request with the head, then each chunk it is given.
    async fn server_of_chunks() -> (String, tokio::sync::mpsc::UnboundedSender<&'static str>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (tx, mut chunks) = tokio::sync::mpsc::unbounded_channel::<&'static str>();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 65536];
            let mut seen = Vec::new();
            while !request_complete(&seen) {
                let n = socket.read(&mut buf).await.unwrap();
                seen.extend_from_slice(&buf[..n]);
            }
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
        let direct = Direct::new(address.clone(), Duration::from_secs(5), idle(4));
        let pace = ReadPace::default();
        let mut body = direct.send(|| request(&address), &pace).await.unwrap().into_body();
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
    async fn no_server_is_a_connect_error() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let address = format!("127.0.0.1:{port}");
        let direct = Direct::new(address.clone(), Duration::from_secs(5), idle(4));
        assert!(matches!(
            direct.send(|| request(&address), &ReadPace::default()).await,
            Err(SendError::Connect(_))
        ));
    }
}
