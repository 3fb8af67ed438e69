//! HTTP/1.1 on the wire, as much as a completion needs: the request's head written once per
//! client, the answer's head parsed with `httparse`, and its body's framing (chunked, a
//! `Content-Length`, or up to the close) taken off as it is read. Nothing is buffered here:
//! payload goes straight to the caller's buffer, and a frame cut between two reads is carried
//! over as a few counters, so a connection waiting for the model's next token holds no buffer.

use bytes::{BufMut as _, Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

/// Headers an answer's head may carry; more is refused, as a head too long is.
const MAX_HEADERS: usize = 100;

/// Bytes a chunk's size line (with its extensions) or a trailer section may take.
const MAX_FRAMING_LINE: usize = 4096;

/// A request's head up to its `Content-Length`: the same for every completion of a client.
#[derive(Clone)]
pub(crate) struct RequestHead(Bytes);

impl RequestHead {
    /// `POST {target} HTTP/1.1` and `headers` (which a `HeaderMap` keeps free of line breaks).
    pub(crate) fn new(target: &str, headers: &HeaderMap) -> Self {
        let mut head = BytesMut::with_capacity(256);
        head.put_slice(b"POST ");
        head.put_slice(target.as_bytes());
        head.put_slice(b" HTTP/1.1\r\n");
        for (name, value) in headers {
            head.put_slice(name.as_str().as_bytes());
            head.put_slice(b": ");
            head.put_slice(value.as_bytes());
            head.put_slice(b"\r\n");
        }
        Self(head.freeze())
    }

    /// The whole head for a body of `length` bytes.
    #[cfg(test)]
    pub(crate) fn with_length(&self, length: usize) -> Bytes {
        self.with(None, length)
    }

    /// The whole head for a body of `length` bytes, with one more header of this request's.
    pub(crate) fn with(&self, header: Option<&(HeaderName, HeaderValue)>, length: usize) -> Bytes {
        let mut head = BytesMut::with_capacity(self.0.len() + 32);
        head.put_slice(&self.0);
        if let Some((name, value)) = header {
            head.put_slice(name.as_str().as_bytes());
            head.put_slice(b": ");
            head.put_slice(value.as_bytes());
            head.put_slice(b"\r\n");
        }
        head.put_slice(format!("content-length: {length}\r\n\r\n").as_bytes());
        head.freeze()
    }
}

/// What is wrong with an answer, as HTTP/1.1 framing goes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub(crate) enum WireError {
    #[error("the LLM server's response head is not valid HTTP/1.1: {0}")]
    Head(String),
    #[error("the LLM server's response head is longer than {0} bytes")]
    HeadTooLong(usize),
    #[error("the LLM server's chunked body is malformed: {0}")]
    Chunk(&'static str),
    #[error("the LLM server closed the connection before the end of the body")]
    Truncated,
}

impl From<WireError> for std::io::Error {
    fn from(e: WireError) -> Self {
        std::io::Error::new(std::io::ErrorKind::InvalidData, e)
    }
}

/// An answer's head, and how its body is framed.
#[derive(Debug)]
pub(crate) struct Head {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub framing: BodyDecoder,
    /// Whether the connection may carry another request once the body is read to its end.
    pub reusable: bool,
}

/// The head found at the start of `buf`, with its length; `None` while it is incomplete. An
/// informational answer (`1xx`) comes back as is: the caller skips it and parses again.
pub(crate) fn parse_head(buf: &[u8], max_bytes: usize) -> Result<Option<(Head, usize)>, WireError> {
    let mut slots = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut slots);
    let length = match response.parse(buf) {
        Ok(httparse::Status::Complete(length)) => length,
        Ok(httparse::Status::Partial) if buf.len() >= max_bytes => return Err(WireError::HeadTooLong(max_bytes)),
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(WireError::Head(e.to_string())),
    };
    if length > max_bytes {
        return Err(WireError::HeadTooLong(max_bytes));
    }
    let status = response
        .code
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or_else(|| WireError::Head("no valid status code".into()))?;
    let mut headers = HeaderMap::with_capacity(response.headers.len());
    for header in response.headers.iter() {
        let name = HeaderName::from_bytes(header.name.as_bytes()).map_err(|e| WireError::Head(e.to_string()))?;
        let value = HeaderValue::from_bytes(header.value).map_err(|e| WireError::Head(e.to_string()))?;
        headers.append(name, value);
    }
    let http11 = response.version == Some(1);
    let (framing, framed) = body_framing(status, &headers)?;
    let reusable = framed && http11 && !has_token(&headers, http::header::CONNECTION, "close");
    Ok(Some((
        Head {
            status,
            headers,
            framing,
            reusable,
        },
        length,
    )))
}

/// How the body of an answer to a POST ends, and whether that end is in its framing (rather
/// than the connection's close): a `1xx`, `204` or `304` has none; `Transfer-Encoding` wins
/// over `Content-Length` and, unless it ends in `chunked`, runs to the close.
fn body_framing(status: StatusCode, headers: &HeaderMap) -> Result<(BodyDecoder, bool), WireError> {
    if status.is_informational() || status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED {
        return Ok((BodyDecoder::length(0), true));
    }
    if headers.contains_key(http::header::TRANSFER_ENCODING) {
        let chunked = headers
            .get_all(http::header::TRANSFER_ENCODING)
            .iter()
            .next_back()
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.rsplit(',').next())
            .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
        // A length next to a transfer coding is ignored, and the connection not trusted after.
        let trusted = !headers.contains_key(http::header::CONTENT_LENGTH);
        return Ok(if chunked {
            (BodyDecoder::chunked(), trusted)
        } else {
            (BodyDecoder::until_close(), false)
        });
    }
    let mut lengths = headers.get_all(http::header::CONTENT_LENGTH).iter().map(|value| {
        value
            .to_str()
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .ok_or_else(|| WireError::Head("an invalid Content-Length".into()))
    });
    match lengths.next().transpose()? {
        None => Ok((BodyDecoder::until_close(), false)),
        Some(length) => {
            if lengths.any(|other| other != Ok(length)) {
                return Err(WireError::Head("Content-Length values that differ".into()));
            }
            Ok((BodyDecoder::length(length), true))
        }
    }
}

/// Whether a comma-separated header carries `token` (any case).
fn has_token(headers: &HeaderMap, name: HeaderName, token: &str) -> bool {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case(token))
}

/// Takes a body's framing off as its bytes arrive, in whatever pieces.
#[derive(Debug)]
pub(crate) struct BodyDecoder(State);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Bytes left of a `Content-Length` body.
    Length(u64),
    /// Everything up to the connection's close.
    UntilClose,
    /// A chunk's size line: the size so far and its digits.
    Size { size: u64, digits: u8 },
    /// A chunk's extensions, skipped; the size, and the line's bytes so far.
    Extension { size: u64, seen: usize },
    /// The size line's `\r` was read.
    SizeEnd { size: u64 },
    /// Bytes left of a chunk's data.
    Data(u64),
    /// The `\r\n` after a chunk's data.
    DataEnd { cr: bool },
    /// Trailer lines after the last chunk: bytes of the section so far, and where in a line
    /// (0: at its start, 1: after a `\r` there, more: inside one).
    Trailers { seen: usize, line: usize },
    /// The whole body was read.
    Done,
}

impl BodyDecoder {
    pub(crate) fn length(length: u64) -> Self {
        Self(if length == 0 {
            State::Done
        } else {
            State::Length(length)
        })
    }

    pub(crate) fn chunked() -> Self {
        Self(State::Size { size: 0, digits: 0 })
    }

    pub(crate) fn until_close() -> Self {
        Self(State::UntilClose)
    }

    /// Whether the body was read to its end.
    pub(crate) fn done(&self) -> bool {
        self.0 == State::Done
    }

    /// The connection closed: the end of a body that runs to it, or one cut short.
    pub(crate) fn closed(&mut self) -> Result<(), WireError> {
        match self.0 {
            State::UntilClose | State::Done => {
                self.0 = State::Done;
                Ok(())
            }
            _ => Err(WireError::Truncated),
        }
    }

    /// Takes the framing off `input`, putting the payload into `out`; returns the bytes used
    /// (fewer than given only once the body is done).
    pub(crate) fn decode(&mut self, input: &[u8], out: &mut BytesMut) -> Result<usize, WireError> {
        let mut used = 0;
        while used < input.len() && !self.done() {
            let rest = &input[used..];
            used += match self.0 {
                State::Length(left) | State::Data(left) => self.payload(left, rest, out),
                State::UntilClose => {
                    out.extend_from_slice(rest);
                    rest.len()
                }
                _ => {
                    self.framing_byte(rest[0])?;
                    1
                }
            };
        }
        Ok(used)
    }

    /// Up to `left` bytes of payload from `input`.
    fn payload(&mut self, left: u64, input: &[u8], out: &mut BytesMut) -> usize {
        let take = usize::try_from(left).map_or(input.len(), |left| left.min(input.len()));
        out.extend_from_slice(&input[..take]);
        let left = left - take as u64;
        self.0 = match (self.0, left) {
            (State::Length(_), 0) => State::Done,
            (State::Length(_), left) => State::Length(left),
            (_, 0) => State::DataEnd { cr: false },
            (_, left) => State::Data(left),
        };
        take
    }

    /// One byte of a chunked body's framing: size lines, the line ends after data, trailers.
    fn framing_byte(&mut self, byte: u8) -> Result<(), WireError> {
        self.0 = match (self.0, byte) {
            (State::Size { size, digits }, b) if b.is_ascii_hexdigit() => {
                if digits >= 15 {
                    return Err(WireError::Chunk("a chunk size too large"));
                }
                let digit = (b as char).to_digit(16).unwrap_or_default();
                State::Size {
                    size: size * 16 + u64::from(digit),
                    digits: digits + 1,
                }
            }
            (State::Size { digits: 0, .. }, _) => return Err(WireError::Chunk("a chunk size that is not hex")),
            (State::Size { size, .. }, b';' | b' ' | b'\t') => State::Extension { size, seen: 0 },
            (State::Size { size, .. } | State::Extension { size, .. }, b'\r') => State::SizeEnd { size },
            (State::Size { size, .. } | State::Extension { size, .. } | State::SizeEnd { size }, b'\n') => {
                Self::after_size(size)
            }
            (State::Size { .. } | State::SizeEnd { .. }, _) => return Err(WireError::Chunk("a bad chunk size line")),
            (State::Extension { size, seen }, _) if seen < MAX_FRAMING_LINE => {
                State::Extension { size, seen: seen + 1 }
            }
            (State::Extension { .. }, _) => return Err(WireError::Chunk("chunk extensions too long")),
            (State::DataEnd { cr: false }, b'\r') => State::DataEnd { cr: true },
            (State::DataEnd { .. }, b'\n') => State::Size { size: 0, digits: 0 },
            (State::DataEnd { .. }, _) => return Err(WireError::Chunk("no line end after a chunk's data")),
            (State::Trailers { seen, .. }, _) if seen >= MAX_FRAMING_LINE => {
                return Err(WireError::Chunk("trailers too long"));
            }
            (State::Trailers { line: 0 | 1, .. }, b'\n') => State::Done,
            (State::Trailers { seen, .. }, b'\n') => State::Trailers {
                seen: seen + 1,
                line: 0,
            },
            (State::Trailers { seen, line: 0 }, b'\r') => State::Trailers {
                seen: seen + 1,
                line: 1,
            },
            (State::Trailers { seen, line }, _) => State::Trailers {
                seen: seen + 1,
                line: line.max(1) + 1,
            },
            (state @ (State::Length(_) | State::Data(_) | State::UntilClose | State::Done), _) => state,
        };
        Ok(())
    }

    /// After a size line: the chunk's data, or the trailers after the last (empty) chunk.
    fn after_size(size: u64) -> State {
        if size == 0 {
            State::Trailers { seen: 0, line: 0 }
        } else {
            State::Data(size)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The payload of `body` fed in pieces of `piece` bytes, and whether it ended.
    fn decode_in_pieces(mut decoder: BodyDecoder, body: &[u8], piece: usize) -> Result<(String, bool), WireError> {
        let mut out = BytesMut::new();
        for part in body.chunks(piece) {
            let used = decoder.decode(part, &mut out)?;
            assert!(
                used == part.len() || decoder.done(),
                "bytes left over only after the end"
            );
        }
        Ok((String::from_utf8(out.to_vec()).unwrap(), decoder.done()))
    }

    #[test]
    fn a_chunked_body_decodes_the_same_in_any_pieces() {
        let body = b"5\r\nhello\r\n7;name=value\r\n, world\r\nA\r\n and more.\r\n0\r\nx-trailer: 1\r\n\r\n";
        for piece in 1..=body.len() {
            let decoded = decode_in_pieces(BodyDecoder::chunked(), body, piece).unwrap();
            assert_eq!(
                decoded,
                ("hello, world and more.".to_owned(), true),
                "pieces of {piece}"
            );
        }
    }

    #[test]
    fn the_end_of_a_body_leaves_what_follows_unread() {
        let mut decoder = BodyDecoder::chunked();
        let mut out = BytesMut::new();
        let input = b"2\r\nok\r\n0\r\n\r\nHTTP/1.1 200 OK\r\n";
        assert_eq!(decoder.decode(input, &mut out), Ok(12));
        assert!(decoder.done());
        let mut decoder = BodyDecoder::length(3);
        assert_eq!(decoder.decode(b"abcdef", &mut out), Ok(3));
        assert_eq!(&out[..], b"okabc");
    }

    #[test]
    fn bad_chunk_framing_is_an_error_not_a_guess() {
        for (body, why) in [
            (&b"zz\r\n"[..], "a chunk size that is not hex"),
            (b"5\r\nhelloXX", "no line end after a chunk's data"),
            (b"1234567890abcdef0\r\n", "a chunk size too large"),
            (b"5 x\r\r", "a bad chunk size line"),
        ] {
            assert_eq!(
                decode_in_pieces(BodyDecoder::chunked(), body, 3),
                Err(WireError::Chunk(why))
            );
        }
        let endless_extension = [b"5;".as_slice(), &[b'a'; MAX_FRAMING_LINE + 1]].concat();
        assert_eq!(
            decode_in_pieces(BodyDecoder::chunked(), &endless_extension, 64),
            Err(WireError::Chunk("chunk extensions too long"))
        );
        let endless_trailers = [b"0\r\n".as_slice(), &b"x: y\r\n".repeat(MAX_FRAMING_LINE)].concat();
        assert_eq!(
            decode_in_pieces(BodyDecoder::chunked(), &endless_trailers, 64),
            Err(WireError::Chunk("trailers too long"))
        );
    }

    #[test]
    fn a_close_ends_only_a_body_that_runs_to_it() {
        let mut decoder = BodyDecoder::until_close();
        let mut out = BytesMut::new();
        decoder.decode(b"all of it", &mut out).unwrap();
        assert_eq!(decoder.closed(), Ok(()));
        assert!(decoder.done());
        for mut cut in [BodyDecoder::chunked(), BodyDecoder::length(10)] {
            cut.decode(b"5\r\nab", &mut out).unwrap();
            assert_eq!(cut.closed(), Err(WireError::Truncated));
        }
    }

    /// `payload` sent as chunks of the given sizes (the rest in one), with an extension on some.
    fn chunked(payload: &[u8], sizes: &[usize]) -> Vec<u8> {
        let mut body = Vec::new();
        let mut rest = payload;
        for (i, size) in sizes.iter().chain(std::iter::once(&usize::MAX)).enumerate() {
            let (chunk, after) = rest.split_at((*size).min(rest.len()));
            if !chunk.is_empty() {
                let extension = if i % 2 == 1 { ";a=b" } else { "" };
                body.extend_from_slice(format!("{:X}{extension}\r\n", chunk.len()).as_bytes());
                body.extend_from_slice(chunk);
                body.extend_from_slice(b"\r\n");
            }
            rest = after;
        }
        body.extend_from_slice(b"0\r\n\r\n");
        body
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig {
            cases: std::env::var("FUZZ_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(128),
            ..proptest::prelude::ProptestConfig::default()
        })]

        /// However a body is cut into chunks, and the chunked bytes into reads, the payload comes
        /// out whole and the end is found.
        #[test]
        fn any_chunked_body_in_any_reads_decodes_to_its_payload(
            payload in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..600),
            sizes in proptest::collection::vec(1usize..80, 0..10),
            piece in 1usize..64,
        ) {
            let body = chunked(&payload, &sizes);
            let mut decoder = BodyDecoder::chunked();
            let mut out = BytesMut::new();
            for part in body.chunks(piece) {
                proptest::prop_assert_eq!(decoder.decode(part, &mut out), Ok(part.len()));
            }
            proptest::prop_assert!(decoder.done());
            proptest::prop_assert_eq!(&out[..], &payload[..]);
        }

        /// Whatever bytes come, decoding ends in payload, an error or a wait: never a panic, and
        /// never more payload than bytes given.
        #[test]
        fn any_bytes_decode_without_panic(input in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            let mut decoder = BodyDecoder::chunked();
            let mut out = BytesMut::new();
            if let Ok(used) = decoder.decode(&input, &mut out) {
                proptest::prop_assert!(used <= input.len() && out.len() <= used);
            }
            let _ = parse_head(&input, 1024);
        }
    }

    fn head(text: &str) -> Result<Option<(Head, usize)>, WireError> {
        parse_head(text.as_bytes(), 1024)
    }

    #[test]
    fn an_answers_head_says_its_status_headers_framing_and_reuse() {
        let text = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\ndata";
        let (parsed, length) = head(text).unwrap().unwrap();
        assert_eq!(length, text.len() - 4);
        assert_eq!(parsed.status, StatusCode::OK);
        assert_eq!(parsed.headers["content-type"], "text/event-stream");
        assert_eq!(parsed.framing.0, State::Size { size: 0, digits: 0 });
        assert!(parsed.reusable);

        let cases = [
            (
                "HTTP/1.1 429 Too Many\r\ncontent-length: 2\r\n\r\n",
                State::Length(2),
                true,
            ),
            (
                "HTTP/1.1 200 OK\r\nconnection: Keep-Alive, close\r\ncontent-length: 2\r\n\r\n",
                State::Length(2),
                false,
            ),
            ("HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\n", State::Length(2), false),
            ("HTTP/1.1 200 OK\r\n\r\n", State::UntilClose, false),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n",
                State::UntilClose,
                false,
            ),
            (
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n",
                State::Size { size: 0, digits: 0 },
                false,
            ),
            ("HTTP/1.1 204 No Content\r\n\r\n", State::Done, true),
            ("HTTP/1.1 100 Continue\r\n\r\n", State::Done, true),
        ];
        for (text, framing, reusable) in cases {
            let (parsed, _) = head(text).unwrap().unwrap();
            assert_eq!((parsed.framing.0, parsed.reusable), (framing, reusable), "{text:?}");
        }
    }

    #[test]
    fn a_bad_or_endless_head_is_an_error() {
        assert!(head("HTTP/1.1 200 OK\r\ncontent-le").unwrap().is_none(), "incomplete");
        assert!(matches!(head("SMTP ready\r\n\r\n"), Err(WireError::Head(_))));
        assert!(matches!(
            head("HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n"),
            Err(WireError::Head(_))
        ));
        assert!(matches!(
            head("HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n"),
            Err(WireError::Head(_))
        ));
        let long = format!("HTTP/1.1 200 OK\r\nx: {}", "a".repeat(1100));
        assert_eq!(head(&long).err(), Some(WireError::HeadTooLong(1024)));
        let at_the_limit = format!("HTTP/1.1 200 OK\r\nx: {}\r\n\r\n", "a".repeat(1024 - 24));
        assert_eq!(head(&at_the_limit).unwrap().unwrap().1, 1024);
        let over = format!("HTTP/1.1 200 OK\r\nx: {}\r\n\r\n", "a".repeat(1024 - 23));
        assert_eq!(head(&over).err(), Some(WireError::HeadTooLong(1024)));
        let many = format!("HTTP/1.1 200 OK\r\n{}\r\n", "a: b\r\n".repeat(MAX_HEADERS + 1));
        assert!(matches!(parse_head(many.as_bytes(), 1 << 20), Err(WireError::Head(_))));
    }

    #[test]
    fn a_request_head_carries_its_headers_and_length() {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::HOST, HeaderValue::from_static("model:8000"));
        headers.insert(http::header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        let head = RequestHead::new("/v1/chat/completions?x=1", &headers).with_length(42);
        assert_eq!(
            &head[..],
            b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: model:8000\r\nauthorization: Bearer k\r\ncontent-length: 42\r\n\r\n"
        );
    }
}
