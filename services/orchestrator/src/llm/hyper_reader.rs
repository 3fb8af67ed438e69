//! The `hyper` reader: completions read through `hyper::client::conn::http1`, its connection
//! driven inside the run's own task (polled by whoever reads the body, as the `run` reader's
//! socket is), over the same paced socket. Kept to measure it against the `run` reader.

use std::future::Future as _;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use http_body::Body as _;
use http_body_util::Full;
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use super::ReadPace;
use super::direct::{Idle, SendError, Socket};

/// hyper's read buffer, kept by the connection while the model thinks.
const READ_BUF: usize = 2048;

type Connection = http1::Connection<TokioIo<PacedIo>, Full<Bytes>>;

/// The paced socket, its pace set by the completion that uses the connection.
struct PacedIo {
    socket: Socket,
    pace: Arc<Mutex<ReadPace>>,
}

impl AsyncRead for PacedIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let pace = shared::sync::lock(&self.pace).clone();
        self.socket.poll_read(cx, buf, &pace)
    }
}

impl AsyncWrite for PacedIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(self.socket.tcp_mut()).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(self.socket.tcp_mut()).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        true
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(self.socket.tcp_mut()).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(self.socket.tcp_mut()).poll_shutdown(cx)
    }
}

/// One HTTP/1.1 connection: its request side, its connection future, and its pace.
struct Conn {
    sender: http1::SendRequest<Full<Bytes>>,
    connection: Connection,
    pace: Arc<Mutex<ReadPace>>,
}

/// Where the `hyper` reader connects, what it sends, and its idle connections.
pub(super) struct HyperReader {
    authority: String,
    target: http::Uri,
    headers: HeaderMap,
    connect_timeout: std::time::Duration,
    limits: Idle,
    idle: Mutex<Vec<(Conn, Instant)>>,
}

/// An answer's status and headers; its body is read by whoever reads `body`.
pub(super) struct Answered {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: HyperBody,
}

impl HyperReader {
    pub(super) fn new(
        authority: String,
        target: http::Uri,
        headers: HeaderMap,
        connect_timeout: std::time::Duration,
        limits: Idle,
    ) -> Arc<Self> {
        Arc::new(Self {
            authority,
            target,
            headers,
            connect_timeout,
            limits,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Sends the request on an idle connection, or a new one, driving the connection until the
    /// answer's head arrives.
    pub(super) async fn send_with(
        self: &Arc<Self>,
        body: &Bytes,
        header: Option<&(HeaderName, HeaderValue)>,
        pace: &ReadPace,
    ) -> Result<Answered, SendError> {
        let mut conn = match self.take_idle().await {
            Some(conn) => conn,
            None => self.connect().await?,
        };
        *shared::sync::lock(&conn.pace) = pace.clone();
        let mut request = http::Request::post(self.target.clone());
        if let Some(headers) = request.headers_mut() {
            headers.clone_from(&self.headers);
            if let Some((name, value)) = header {
                headers.insert(name.clone(), value.clone());
            }
        }
        let request = request
            .body(Full::new(body.clone()))
            .map_err(|e| SendError::Request(e.to_string()))?;
        let mut response = std::pin::pin!(conn.sender.send_request(request));
        let mut connection = Some(conn.connection);
        let answer = std::future::poll_fn(|cx| {
            drive(&mut connection, cx);
            response.as_mut().poll(cx)
        })
        .await
        .map_err(|e| SendError::Request(e.to_string()))?;
        let (parts, incoming) = answer.into_parts();
        Ok(Answered {
            status: parts.status,
            headers: parts.headers,
            body: HyperBody {
                sender: Some(conn.sender),
                connection,
                pace: conn.pace,
                incoming,
                pool: Arc::clone(self),
            },
        })
    }

    async fn connect(&self) -> Result<Conn, SendError> {
        let timeout = self.connect_timeout;
        let tcp = match tokio::time::timeout(timeout, TcpStream::connect(&self.authority)).await {
            Err(_) => return Err(SendError::Connect(format!("no connection within {timeout:?}"))),
            Ok(Err(e)) => return Err(SendError::Connect(e.to_string())),
            Ok(Ok(tcp)) => tcp,
        };
        let _ = tcp.set_nodelay(true);
        let pace = Arc::new(Mutex::new(ReadPace::default()));
        let io = PacedIo {
            socket: Socket::new(tcp),
            pace: Arc::clone(&pace),
        };
        let (sender, connection) = http1::Builder::new()
            .read_buf_exact_size(Some(READ_BUF))
            .handshake(TokioIo::new(io))
            .await
            .map_err(|e| SendError::Connect(e.to_string()))?;
        Ok(Conn {
            sender,
            connection,
            pace,
        })
    }

    /// The newest idle connection that can take a request.
    async fn take_idle(&self) -> Option<Conn> {
        let timeout = self.limits.timeout;
        loop {
            let (mut conn, since) = shared::sync::lock(&self.idle).pop()?;
            if since.elapsed() >= timeout {
                continue;
            }
            let mut connection = Some(conn.connection);
            let ready = std::future::poll_fn(|cx| {
                drive(&mut connection, cx);
                if connection.is_none() {
                    return Poll::Ready(false);
                }
                conn.sender.poll_ready(cx).map(|r| r.is_ok())
            })
            .await;
            if let (true, Some(connection)) = (ready, connection) {
                conn.connection = connection;
                return Some(conn);
            }
        }
    }

    fn keep(&self, conn: Conn) {
        let mut idle = shared::sync::lock(&self.idle);
        if idle.len() < self.limits.max {
            idle.push((conn, Instant::now()));
        }
    }
}

/// Polls the connection once, if it is still there; an ended or failed connection is dropped
/// (its request or body then reports the failure).
fn drive(connection: &mut Option<Connection>, cx: &mut Context<'_>) {
    if let Some(c) = connection.as_mut()
        && let Poll::Ready(_) = c.poll_without_shutdown(cx)
    {
        *connection = None;
    }
}

/// A completion's body: reading it drives its connection.
pub(super) struct HyperBody {
    sender: Option<http1::SendRequest<Full<Bytes>>>,
    connection: Option<Connection>,
    pace: Arc<Mutex<ReadPace>>,
    incoming: hyper::body::Incoming,
    pool: Arc<HyperReader>,
}

impl HyperBody {
    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, String>>> {
        loop {
            match Pin::new(&mut self.incoming).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => return Poll::Ready(Some(Ok(data))),
                    Err(_) => continue,
                },
                Poll::Ready(Some(Err(e))) => return Poll::Ready(Some(Err(e.to_string()))),
                Poll::Ready(None) => {
                    self.release();
                    return Poll::Ready(None);
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn release(&mut self) {
        if let (Some(sender), Some(connection)) = (self.sender.take(), self.connection.take()) {
            self.pool.keep(Conn {
                sender,
                connection,
                pace: Arc::clone(&self.pace),
            });
        }
    }
}

impl futures::Stream for HyperBody {
    type Item = Result<Bytes, String>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        // The body first (it asks the connection for more), then the connection (which reads
        // the socket into the body), then the body again.
        if let Poll::Ready(data) = this.poll_data(cx) {
            return Poll::Ready(data);
        }
        drive(&mut this.connection, cx);
        this.poll_data(cx)
    }
}
