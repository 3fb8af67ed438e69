//! The connection's TCP socket, read straight by whoever polls it, at its reader's pace.
//!
//! While the completion's reader reads only on its ticks, the socket's receive low-water mark is
//! raised, so that the kernel does not wake the runtime for every chunk; and since the runtime
//! then never hears that data is there, a read is tried on the socket itself before waiting for
//! readiness (and once more when the mark comes down). Otherwise it is read as any socket of the
//! runtime.

use std::task::{Context, Poll};

use tokio::io::{AsyncWriteExt as _, ReadBuf};
use tokio::net::TcpStream;

use crate::ReadPace;

/// Bytes that must be waiting before the socket wakes a reader that reads only on its ticks:
/// far more than a tick's worth of tokens, so arriving tokens wake nobody (and if a fast model
/// fills it, the reader is merely woken early).
const TICKING_LOW_WATER: i32 = 64 * 1024;

pub(crate) struct Socket {
    tcp: TcpStream,
    /// The low-water mark set on the socket.
    low_water: i32,
}

impl Socket {
    pub(crate) fn new(tcp: TcpStream) -> Self {
        Self { tcp, low_water: 1 }
    }

    /// Writes all of `head` and `body` (in one system call when the socket takes them).
    pub(crate) async fn send(&mut self, head: bytes::Bytes, body: bytes::Bytes) -> std::io::Result<()> {
        use bytes::Buf as _;
        self.tcp.write_all_buf(&mut head.chain(body)).await
    }

    /// Reads what the socket holds into `buf` at `pace`: nothing added to `buf` is its end.
    pub(crate) fn poll_read(
        &mut self,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
        pace: &ReadPace,
    ) -> Poll<std::io::Result<()>> {
        let was_raised = self.low_water > 1;
        self.follow_pace(pace.ticking());
        if !was_raised && self.low_water == 1 {
            // Not ticking: the runtime's readiness is exact.
            return self.poll_read_ready_then(cx, buf);
        }
        // Read once per tick: found drained on this tick, the socket waits for the next one
        // (or for more than the raised mark, which wakes the runtime).
        if !pace.drained_this_tick() {
            // Straight from the socket: under a raised low-water mark the runtime's readiness
            // says nothing about what is waiting.
            loop {
                let room = buf.remaining();
                match receive(&self.tcp, buf) {
                    Ok(n) => {
                        if n < room {
                            pace.drained();
                        }
                        return Poll::Ready(Ok(()));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break pace.drained(),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Poll::Ready(Err(e)),
                }
            }
        }
        self.poll_read_ready_then(cx, buf)
    }

    /// Waits for the runtime to hear the socket is readable, then reads through it, which clears
    /// that readiness if nothing is there any more.
    fn poll_read_ready_then(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        loop {
            std::task::ready!(self.tcp.poll_read_ready(cx))?;
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

    /// The low-water mark for the reader's pace, set on the socket when it changed.
    pub(crate) fn follow_pace(&mut self, ticking: bool) {
        let wanted = if ticking { TICKING_LOW_WATER } else { 1 };
        if wanted != self.low_water {
            match set_receive_low_water(&self.tcp, wanted) {
                Ok(()) => self.low_water = wanted,
                // Without it the socket wakes the runtime per chunk, as any socket does.
                Err(e) => tracing::debug!("SO_RCVLOWAT {wanted} on the LLM connection: {e}"),
            }
        }
    }

    /// Whether an idle connection can carry a request: the server neither closed it nor sent
    /// anything since its last answer (both make it unusable).
    pub(crate) fn idle_and_open(&self) -> bool {
        let mut probe = [std::mem::MaybeUninit::<u8>::uninit(); 1];
        matches!(
            socket2::SockRef::from(&self.tcp).peek(&mut probe),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
        )
    }
}

/// Reads what the socket holds into the unfilled part of `buf`, without zeroing it first.
#[allow(unsafe_code)]
fn receive(tcp: &TcpStream, buf: &mut ReadBuf<'_>) -> std::io::Result<usize> {
    // SAFETY: `recv` only writes bytes into the slice, never de-initializes any.
    let n = socket2::SockRef::from(tcp).recv(unsafe { buf.unfilled_mut() })?;
    // SAFETY: `recv` initialized the first `n` bytes of the unfilled part.
    unsafe { buf.assume_init(n) };
    buf.advance(n);
    Ok(n)
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
