//! Chunks: the long strings and arrays of a durable run's checkpoints and transcript segments,
//! kept once in the journal (beside the segments) and named by what holds them, so a safe point
//! writes what is new since the last one, not what the run accumulated.
//!
//! A string of [`STRING_CHUNK`] bytes or more is cut into chunks of that many bytes (fewer, to end
//! on a character) from its start, its rest (shorter) held in place; an array of
//! [`ARRAY_CHUNK`] elements or more is cut the same way into chunks of that many elements. The
//! cuts depend only on what comes before them, so a string or array that grows keeps the chunks
//! it had: the run's text, its calls' records, a tool result that is both a call's outcome, its
//! `tool_call_finished` and its tool message are each kept once. A chunk is known by the SHA-256
//! of its bytes; what names it holds its journal position. Folded, a chunked string or array is
//! an object with a key no checkpoint has. A checkpoint holding one anyway (only a caller's own
//! schema could) is stored unfolded, and is misread when its run is taken over: only that
//! caller's run is affected, and the key is not escaped.
//!
//! Folding is bottom-up: an array chunk holding a chunked string names that string's chunks, so
//! it is written once they are kept (one round of writes per level).

use std::collections::HashMap;
use std::future::Future;

use serde_json::{Map, Value};
use sha2::{Digest as _, Sha256};

/// Bytes of a string chunk (at most: a chunk ends on a character).
pub const STRING_CHUNK: usize = 4096;
/// Elements of an array chunk.
pub const ARRAY_CHUNK: usize = 16;
/// Rounds of writes (levels of nesting) folding goes through; what is deeper stays in place.
const MAX_ROUNDS: usize = 8;
/// The key of a folded string: its chunks' positions (beside [`REST`]).
const STRING_KEY: &str = "\u{0}chunked string";
/// The key of a folded array: its chunks' positions (beside [`REST`]).
const ARRAY_KEY: &str = "\u{0}chunked array";
/// What of a folded string or array follows its chunks, held in place.
const REST: &str = "rest";

type Sha = [u8; 32];

/// The chunks of one run the journal keeps: their positions, by the digest of their bytes.
#[derive(Debug, Default)]
pub struct Kept {
    at: HashMap<Sha, u64>,
}

/// A chunk not kept yet: its bytes.
type Missing = Vec<Vec<u8>>;

impl Kept {
    /// Notes that the journal keeps `bytes` at `position`.
    pub fn note(&mut self, bytes: &[u8], position: u64) {
        self.at.insert(digest(bytes), position);
    }

    /// `value` with every chunk known folded to its position, the rest in place (a part folded
    /// in an earlier round stays as it is); the chunks that are not known yet and could be kept
    /// now (all they name is known) go to `missing`.
    fn fold(&self, value: Value, missing: &mut Missing) -> Value {
        match value {
            Value::String(s) if s.len() >= STRING_CHUNK => self.fold_string(s, missing),
            Value::Array(items) => {
                let items: Vec<Value> = items.into_iter().map(|v| self.fold(v, missing)).collect();
                if items.len() >= ARRAY_CHUNK {
                    self.fold_array(items, missing)
                } else {
                    Value::Array(items)
                }
            }
            Value::Object(map) if is_folded(&map) => Value::Object(map),
            Value::Object(map) => Value::Object(map.into_iter().map(|(k, v)| (k, self.fold(v, missing))).collect()),
            other => other,
        }
    }

    fn fold_string(&self, s: String, missing: &mut Missing) -> Value {
        let (chunks, rest) = string_chunks(&s);
        match self.positions(chunks.iter().map(|c| c.as_bytes()), missing) {
            Some(positions) => folded(STRING_KEY, positions, Value::String(rest.to_owned())),
            None => Value::String(s),
        }
    }

    fn fold_array(&self, mut items: Vec<Value>, missing: &mut Missing) -> Value {
        // A chunk naming a chunk not kept yet waits for the next round.
        if contains_unfolded(&items) {
            return Value::Array(items);
        }
        let sealed = items.len() / ARRAY_CHUNK * ARRAY_CHUNK;
        let chunks: Vec<Vec<u8>> = items[..sealed]
            .chunks(ARRAY_CHUNK)
            .map(|c| serde_json::to_vec(c).unwrap_or_default())
            .collect();
        match self.positions(chunks.iter().map(Vec::as_slice), missing) {
            Some(positions) => folded(ARRAY_KEY, positions, Value::Array(items.split_off(sealed))),
            None => Value::Array(items),
        }
    }

    /// The positions of `chunks` when all are known; otherwise `None`, the unknown ones noted
    /// in `missing` (each once).
    fn positions<'b>(&self, chunks: impl Iterator<Item = &'b [u8]>, missing: &mut Missing) -> Option<Vec<Value>> {
        let mut positions = Some(Vec::new());
        for chunk in chunks {
            match self.at.get(&digest(chunk)) {
                Some(&p) => {
                    if let Some(positions) = positions.as_mut() {
                        positions.push(Value::from(p));
                    }
                }
                None => {
                    positions = None;
                    if !missing.iter().any(|m| m == chunk) {
                        missing.push(chunk.to_vec());
                    }
                }
            }
        }
        positions
    }
}

/// `value` folded: its chunks kept with `keep` (a position, or `None` when the journal did not
/// take it, which leaves that part in place) and named by their positions. A value holding a
/// chunk key of its own is returned as it is.
pub async fn fold<F, Fut>(value: Value, kept: &std::sync::Mutex<Kept>, keep: F) -> Value
where
    F: Fn(Vec<u8>) -> Fut,
    Fut: Future<Output = Option<u64>>,
{
    if holds_keys(&value) {
        return value;
    }
    let mut value = value;
    for _ in 0..MAX_ROUNDS {
        let mut missing = Missing::new();
        value = shared::sync::lock(kept).fold(value, &mut missing);
        if missing.is_empty() {
            return value;
        }
        for chunk in missing {
            match keep(chunk.clone()).await {
                Some(position) => shared::sync::lock(kept).note(&chunk, position),
                // The journal does not take chunks now: what is not kept stays in place.
                None => return value,
            }
        }
    }
    value
}

/// `value` unfolded: every chunk it names read with `read` (their bytes, in the order asked)
/// and put back in place, the chunks read noted in `kept`. An error says what could not be read.
pub async fn unfold<F, Fut>(mut value: Value, kept: &mut Kept, read: F) -> Result<Value, String>
where
    F: Fn(Vec<u64>) -> Fut,
    Fut: Future<Output = Result<Vec<Vec<u8>>, String>>,
{
    for _ in 0..=MAX_ROUNDS {
        let mut positions = Vec::new();
        named(&value, &mut positions);
        if positions.is_empty() {
            return Ok(value);
        }
        positions.sort_unstable();
        positions.dedup();
        let bytes = read(positions.clone()).await?;
        if bytes.len() != positions.len() {
            return Err(format!(
                "{} chunks read of the {} asked for",
                bytes.len(),
                positions.len()
            ));
        }
        let chunks: HashMap<u64, Vec<u8>> = positions.into_iter().zip(bytes).collect();
        for (&position, bytes) in &chunks {
            kept.note(bytes, position);
        }
        value = put_back(value, &chunks)?;
    }
    Err("chunks nested deeper than a checkpoint's are".to_owned())
}

/// A string cut into its chunks (each at most [`STRING_CHUNK`] bytes, ending on a character)
/// and what follows them (shorter than a chunk).
fn string_chunks(s: &str) -> (Vec<&str>, &str) {
    let (mut chunks, mut rest) = (Vec::new(), s);
    while rest.len() >= STRING_CHUNK {
        let mut cut = STRING_CHUNK;
        while !rest.is_char_boundary(cut) {
            cut -= 1;
        }
        let (chunk, after) = rest.split_at(cut);
        chunks.push(chunk);
        rest = after;
    }
    (chunks, rest)
}

fn digest(bytes: &[u8]) -> Sha {
    Sha256::digest(bytes).into()
}

fn folded(key: &str, positions: Vec<Value>, rest: Value) -> Value {
    let mut map = Map::new();
    map.insert(key.to_owned(), Value::Array(positions));
    map.insert(REST.to_owned(), rest);
    Value::Object(map)
}

/// Whether a folded array's items still hold a chunkable part in place (a long string, or an
/// array long enough to chunk), which a later round folds first.
fn contains_unfolded(items: &[Value]) -> bool {
    items.iter().any(unfolded)
}

fn unfolded(value: &Value) -> bool {
    match value {
        Value::String(s) => s.len() >= STRING_CHUNK,
        Value::Array(a) => a.len() >= ARRAY_CHUNK || contains_unfolded(a),
        Value::Object(m) => !is_folded(m) && m.values().any(unfolded),
        _ => false,
    }
}

fn is_folded(map: &Map<String, Value>) -> bool {
    map.contains_key(STRING_KEY) || map.contains_key(ARRAY_KEY)
}

/// Whether `value` holds an object with a chunk key of its own.
fn holds_keys(value: &Value) -> bool {
    match value {
        Value::Array(items) => items.iter().any(holds_keys),
        Value::Object(map) => is_folded(map) || map.values().any(holds_keys),
        _ => false,
    }
}

/// The positions of the chunks `value` names (not those its chunks name in turn).
fn named(value: &Value, positions: &mut Vec<u64>) {
    match value {
        Value::Array(items) => items.iter().for_each(|v| named(v, positions)),
        Value::Object(map) if is_folded(map) => {
            let listed = map.get(STRING_KEY).or_else(|| map.get(ARRAY_KEY));
            positions.extend(
                listed
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .filter_map(Value::as_u64),
            );
            if let Some(rest) = map.get(REST) {
                named(rest, positions);
            }
        }
        Value::Object(map) => map.values().for_each(|v| named(v, positions)),
        _ => {}
    }
}

/// `value` with the folded parts whose chunks are in `chunks` put back in place.
fn put_back(value: Value, chunks: &HashMap<u64, Vec<u8>>) -> Result<Value, String> {
    match value {
        Value::Array(items) => Ok(Value::Array(
            items
                .into_iter()
                .map(|v| put_back(v, chunks))
                .collect::<Result<_, _>>()?,
        )),
        Value::Object(mut map) if is_folded(&map) => {
            let rest = put_back(map.remove(REST).unwrap_or(Value::Null), chunks)?;
            let listed = |key: &str| -> Result<Option<Vec<&Vec<u8>>>, String> {
                let Some(list) = map.get(key) else { return Ok(None) };
                let positions = list.as_array().ok_or("a chunk list that is not a list")?;
                let read = positions.iter().map(|p| {
                    let p = p.as_u64().ok_or("a chunk position that is not a number")?;
                    chunks.get(&p).ok_or_else(|| format!("chunk {p} was not read"))
                });
                read.collect::<Result<Vec<_>, String>>().map(Some)
            };
            if let Some(parts) = listed(STRING_KEY)? {
                let Value::String(rest) = rest else {
                    return Err("a chunked string whose rest is not a string".to_owned());
                };
                let mut whole = String::new();
                for part in parts {
                    whole.push_str(std::str::from_utf8(part).map_err(|e| format!("a string chunk: {e}"))?);
                }
                whole.push_str(&rest);
                return Ok(Value::String(whole));
            }
            let parts = listed(ARRAY_KEY)?.unwrap_or_default();
            let Value::Array(rest) = rest else {
                return Err("a chunked array whose rest is not an array".to_owned());
            };
            let mut whole = Vec::new();
            for part in parts {
                let items: Vec<Value> = serde_json::from_slice(part).map_err(|e| format!("an array chunk: {e}"))?;
                whole.extend(items);
            }
            whole.extend(rest);
            Ok(Value::Array(whole))
        }
        Value::Object(map) => Ok(Value::Object(
            map.into_iter()
                .map(|(k, v)| put_back(v, chunks).map(|v| (k, v)))
                .collect::<Result<_, _>>()?,
        )),
        other => Ok(other),
    }
}

#[cfg(test)]
pub(crate) mod tests;
