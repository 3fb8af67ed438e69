//! A stdio server's messages, one per line, held to `max_message_bytes` before the MCP client
//! sees them. A longer line is skipped as it arrives (never buffered whole); when it is the answer
//! to one of the runner's requests, that request gets an error answer in its place at once, so
//! the call fails saying why instead of waiting out its timeout.

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader};

/// How much of a skipped line's beginning and end is kept to find its `id`.
const ID_WINDOW: usize = 256;
/// The pipe between this copier and the MCP client.
pub(super) const PIPE_BYTES: usize = 64 * 1024;

/// Copies `from` to `to` line by line, as described above; returns when either side closes.
pub(super) async fn copy_lines(
    server: String,
    from: impl AsyncRead + Unpin,
    mut to: impl tokio::io::AsyncWrite + Unpin,
    max: usize,
) {
    let mut from = BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        let limit = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
        match (&mut from).take(limit).read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let forward = if line.len() > max {
            let ended = line.ends_with(b"\n");
            match skip_rest(&mut from, &line, ended).await {
                Some(id) => {
                    tracing::warn!(mcp.server = %server, "an answer of more than {max} bytes (max_message_bytes) was dropped");
                    too_large_answer(&id, max)
                }
                None => {
                    tracing::warn!(mcp.server = %server, "a message of more than {max} bytes (max_message_bytes) was dropped");
                    continue;
                }
            }
        } else {
            std::mem::take(&mut line)
        };
        if to.write_all(&forward).await.is_err() || to.flush().await.is_err() {
            return;
        }
        line = forward;
    }
}

/// Reads past the rest of an oversized line whose beginning is `head` (unless it `ended` there);
/// the `id` of the request it answers, when it is an answer and the id can be told.
async fn skip_rest(from: &mut (impl AsyncBufReadExt + Unpin), head: &[u8], ended: bool) -> Option<String> {
    let mut tail: Vec<u8> = head[head.len().saturating_sub(ID_WINDOW)..].to_vec();
    let mut at_end = ended;
    while !at_end {
        let chunk = match from.fill_buf().await {
            Ok([]) | Err(_) => break,
            Ok(chunk) => chunk,
        };
        let newline = chunk.iter().position(|&b| b == b'\n');
        let taken = newline.map_or(chunk.len(), |at| at + 1);
        tail.extend_from_slice(&chunk[..taken]);
        if tail.len() > ID_WINDOW {
            tail.drain(..tail.len() - ID_WINDOW);
        }
        from.consume(taken);
        at_end = newline.is_some();
    }
    leading_id(&head[..head.len().min(ID_WINDOW)]).or_else(|| trailing_id(&tail))
}

/// The `id` of a message that starts `{"jsonrpc":"2.0","id":…` (the key before any nested
/// value), as its JSON text.
fn leading_id(head: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(head).ok()?;
    let body = text.trim_start().strip_prefix('{')?;
    let flat = &body[..body.find(['{', '['])?];
    let (_, after) = flat.split_once("\"id\":")?;
    id_value(after)
}

/// The `id` of a message that ends `…,"id":…}` (the last key of the message, as the TypeScript
/// SDK writes answers), as its JSON text.
fn trailing_id(tail: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(tail);
    let body = text.trim_end().strip_suffix('}')?;
    let (_, after) = body.rsplit_once("\"id\":")?;
    (!after.contains(['{', '[', '}', ']']))
        .then(|| id_value(after))
        .flatten()
}

/// A JSON number or string at the start of `text` (up to `,` or the end).
fn id_value(text: &str) -> Option<String> {
    let value = text.split(',').next()?.trim();
    let is_number = !value.is_empty() && value.chars().all(|c| c.is_ascii_digit() || c == '-');
    let is_string = value.len() >= 2 && value.starts_with('"') && value.ends_with('"');
    (is_number || is_string).then(|| value.to_owned())
}

/// A JSON-RPC error answer to request `id` (JSON text), one line.
fn too_large_answer(id: &str, max: usize) -> Vec<u8> {
    let message = format!("the MCP server's answer is larger than max_message_bytes ({max} bytes) and was dropped");
    let mut line = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":{id},\"error\":{{\"code\":-32603,\"message\":{}}}}}",
        serde_json::Value::String(message)
    )
    .into_bytes();
    line.push(b'\n');
    line
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    async fn copied(input: &str, max: usize) -> String {
        let mut out = Vec::new();
        copy_lines("t".into(), input.as_bytes(), &mut out, max).await;
        String::from_utf8(out).unwrap_or_default()
    }

    #[tokio::test]
    async fn lines_up_to_the_bound_pass_and_longer_answers_become_errors() {
        let fits = "{\"a\":1}\n";
        assert_eq!(
            copied(fits, fits.len()).await,
            fits,
            "exactly max bytes, newline included"
        );
        let long = "x".repeat(100);
        let leading = format!("{{\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{{\"t\":\"{long}\"}}}}\n");
        let trailing = format!("{{\"result\":{{\"t\":\"{long}\"}},\"jsonrpc\":\"2.0\",\"id\":\"r-8\"}}\n");
        let unknown = format!("{{\"method\":\"notifications/message\",\"params\":{{\"t\":\"{long}\"}}}}\n");
        let out = copied(&format!("{leading}{fits}{trailing}{unknown}{fits}"), 40).await;
        let lines: Vec<serde_json::Value> = out.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        assert_eq!(lines.len(), 4, "{out}");
        assert_eq!(lines[0]["id"], 7);
        assert_eq!(lines[0]["error"]["code"], -32603);
        assert!(
            lines[0]["error"]["message"]
                .as_str()
                .unwrap_or_default()
                .contains("max_message_bytes (40 bytes)")
        );
        assert_eq!(lines[1]["a"], 1);
        assert_eq!(lines[2]["id"], "r-8");
        assert_eq!(lines[3]["a"], 1, "the notification is dropped");

        // One byte over, newline included: the next line is not taken for its rest.
        let just_over = "{\"jsonrpc\":\"2.0\",\"id\":9,\"result\":\"xyz\"}\n";
        let out = copied(&format!("{just_over}{fits}"), just_over.len() - 1).await;
        let lines: Vec<serde_json::Value> = out.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        assert_eq!(
            (lines.len(), &lines[0]["id"], &lines[1]["a"]),
            (2, &json!(9), &json!(1)),
            "{out}"
        );
    }

    #[test]
    fn ids_are_found_only_at_the_top_level() {
        assert_eq!(
            leading_id(b"{\"jsonrpc\":\"2.0\",\"id\":12,\"result\":{"),
            Some("12".into())
        );
        assert_eq!(leading_id(b"{\"result\":{\"id\":3"), None, "inside the result");
        assert_eq!(
            trailing_id(b"\"x\"}},\"jsonrpc\":\"2.0\",\"id\":4}\n"),
            Some("4".into())
        );
        assert_eq!(trailing_id(b",\"id\":4,\"more\":{}}\n"), None, "not the last key");
        assert_eq!(id_value("true}"), None);
    }
}
