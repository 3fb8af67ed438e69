//! What a streamed response is made of, before it is sent: bytes, scripted delays, stalls and
//! cuts; and how text and arguments are split into pieces. Both streaming APIs use them.

use std::time::Duration;

/// One piece of a streamed response.
pub(crate) enum Piece {
    Bytes(String),
    Delay(Duration),
    Stall,
    Cut,
}

/// Splits `text` into word-sized pieces (each keeps its trailing whitespace), or fixed-size ones.
pub(crate) fn split_text(text: &str, chunk_chars: Option<usize>) -> Vec<String> {
    match chunk_chars {
        Some(n) if n > 0 => {
            let chars: Vec<char> = text.chars().collect();
            chars.chunks(n).map(|c| c.iter().collect()).collect()
        }
        _ => {
            let mut pieces = Vec::new();
            let mut current = String::new();
            for c in text.chars() {
                if !c.is_whitespace() && current.ends_with(char::is_whitespace) {
                    pieces.push(std::mem::take(&mut current));
                }
                current.push(c);
            }
            if !current.is_empty() {
                pieces.push(current);
            }
            pieces
        }
    }
}

/// Splits `text` into `n` pieces of about equal length (at least one).
pub(crate) fn split_n(text: &str, n: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let size = chars.len().div_ceil(n.max(1)).max(1);
    chars.chunks(size).map(|c| c.iter().collect()).collect()
}
