use std::sync::Mutex;

use serde_json::{Value, json};

use super::*;

/// A journal of chunks in memory: what it keeps, in order (position = index + 1).
#[derive(Default)]
struct Journal {
    kept: Mutex<Vec<Vec<u8>>>,
    /// Refuses every chunk (a journal that does not answer).
    refusing: bool,
}

impl Journal {
    async fn keep(&self, bytes: Vec<u8>) -> Option<u64> {
        if self.refusing {
            return None;
        }
        let mut kept = self.kept.lock().unwrap();
        kept.push(bytes);
        Some(kept.len() as u64)
    }

    async fn read(&self, positions: Vec<u64>) -> Result<Vec<Vec<u8>>, String> {
        let kept = self.kept.lock().unwrap();
        positions
            .iter()
            .map(|p| kept.get(*p as usize - 1).cloned().ok_or(format!("no chunk at {p}")))
            .collect()
    }

    fn count(&self) -> usize {
        self.kept.lock().unwrap().len()
    }

    async fn fold(&self, kept: &Mutex<Kept>, value: &Value) -> Value {
        fold(value.clone(), kept, |b| self.keep(b)).await
    }

    async fn unfold(&self, value: Value) -> Value {
        unfold(value, &mut Kept::default(), |p| self.read(p)).await.unwrap()
    }
}

/// Numbers drawn from `seed` (xorshift64): a sequence that does not repeat within a text.
fn draws(seed: u64) -> impl Iterator<Item = u64> {
    let mut x = seed ^ 0x9e37_79b9_7f4a_7c15;
    std::iter::repeat_with(move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    })
}

/// A text of about `n` bytes (`n` at most), its characters of one to four bytes in an order
/// that does not repeat (so its chunks differ), some across every chunk boundary; `seed` makes
/// texts differ.
fn text(n: usize, seed: u64) -> String {
    let chars = ['a', 'é', '€', '😀'];
    let mut s = String::new();
    for x in draws(seed) {
        let c = chars[(x % 4) as usize];
        if s.len() + c.len_utf8() > n {
            break;
        }
        s.push(c);
    }
    s
}

/// `n` lowercase letters in an order that does not repeat, drawn from `seed`.
pub(crate) fn letters(n: usize, seed: u64) -> String {
    draws(seed).take(n).map(|x| char::from(b'a' + (x % 26) as u8)).collect()
}

fn checkpoint(calls: usize, result_bytes: usize) -> Value {
    let records: Vec<Value> = (0..calls)
        .map(|i| json!({"call_id": format!("call_{i}"), "name": "read_file", "ok": true, "turn": i + 1}))
        .collect();
    let result = text(result_bytes, 1);
    json!({
        "result": {"text": text(STRING_CHUNK * 2 + 17, 2), "tool_calls": records},
        "conversation": [{"role": "tool", "content": result.clone()}],
        "outbox": [{"seq": 9, "event": {"tool_call_finished": {"content_json": result}}}],
        "short": "a",
        "numbers": (0..ARRAY_CHUNK * 3).collect::<Vec<_>>(),
    })
}

#[tokio::test]
async fn folded_and_unfolded_a_checkpoint_is_the_same() {
    let journal = Journal::default();
    let kept = Mutex::new(Kept::default());
    for (calls, result_bytes) in [(0, 0), (ARRAY_CHUNK - 1, STRING_CHUNK - 1), (40, 16 * 1024 + 5)] {
        let whole = checkpoint(calls, result_bytes);
        let stored = journal.fold(&kept, &whole).await;
        assert_eq!(journal.unfold(stored.clone()).await, whole);
        assert!(
            serde_json::to_vec(&stored).unwrap().len() < 4 * STRING_CHUNK,
            "folded, what is kept apart is named: {stored}"
        );
    }
}

/// An array of objects each holding a long string: the strings are kept first, then the
/// array's chunks naming them; all unfold back.
#[tokio::test]
async fn chunks_that_name_chunks_unfold_too() {
    let journal = Journal::default();
    let kept = Mutex::new(Kept::default());
    let messages: Vec<Value> = (0..ARRAY_CHUNK + 3)
        .map(|i| json!({"role": "tool", "content": format!("{i}{}", text(STRING_CHUNK + 100, i as u64))}))
        .collect();
    let whole = Value::Array(messages);
    let stored = journal.fold(&kept, &whole).await;
    assert!(stored.is_object(), "the array is folded: {stored}");
    assert_eq!(journal.unfold(stored).await, whole);
}

/// What grows keeps the chunks it had: a safe point after the run's text and calls grew writes
/// only the chunks that filled since; a tool result held in three places is kept once.
#[tokio::test]
async fn a_value_that_grows_keeps_only_its_new_chunks_and_a_result_is_kept_once() {
    let journal = Journal::default();
    let kept = Mutex::new(Kept::default());
    journal.fold(&kept, &checkpoint(20, 16 * 1024)).await;
    let first = journal.count();
    // 4 chunks of the result (once, though it is in two places), 2 of the text, 1 of 16
    // records, 3 of the numbers.
    assert_eq!(first, 4 + 2 + 1 + 3);
    journal.fold(&kept, &checkpoint(20, 16 * 1024)).await;
    assert_eq!(journal.count(), first, "nothing new: nothing written");
    journal.fold(&kept, &checkpoint(32, 16 * 1024)).await;
    assert_eq!(journal.count(), first + 1, "16 records more: one chunk");
}

/// A journal that does not take chunks leaves the value in place (and it reads back as it is).
#[tokio::test]
async fn without_the_journal_the_value_stays_whole() {
    let journal = Journal {
        refusing: true,
        ..Journal::default()
    };
    let kept = Mutex::new(Kept::default());
    let whole = checkpoint(40, 9000);
    let stored = journal.fold(&kept, &whole).await;
    assert_eq!(stored, whole);
    assert_eq!(journal.unfold(stored).await, whole);
}

/// A value holding a chunk key of its own is kept as it is, never folded around it.
#[tokio::test]
async fn a_value_with_a_chunk_key_of_its_own_is_not_folded() {
    let journal = Journal::default();
    let kept = Mutex::new(Kept::default());
    let mut whole = checkpoint(40, 9000);
    whole["schema"] = json!({ STRING_KEY: [1], "rest": "" });
    assert_eq!(journal.fold(&kept, &whole).await, whole);
    assert_eq!(journal.count(), 0);
}

/// A chunk the journal lost is an error naming it, not a value with a hole.
#[tokio::test]
async fn a_lost_chunk_is_an_error() {
    let journal = Journal::default();
    let kept = Mutex::new(Kept::default());
    let stored = journal.fold(&kept, &checkpoint(0, 9000)).await;
    journal.kept.lock().unwrap().clear();
    let read = unfold(stored, &mut Kept::default(), |p| journal.read(p)).await;
    assert!(read.unwrap_err().contains("no chunk at"));
}

#[test]
fn strings_are_cut_on_characters_and_cuts_depend_only_on_what_comes_before() {
    let long = text(3 * STRING_CHUNK + 10, 3);
    let (chunks, rest) = string_chunks(&long);
    assert_eq!(chunks.len(), 3);
    assert!(
        chunks
            .iter()
            .all(|c| c.len() <= STRING_CHUNK && c.len() > STRING_CHUNK - 4)
    );
    assert_eq!(chunks.concat() + rest, long);
    let longer = format!("{long}{}", text(STRING_CHUNK, 4));
    let (grown, _) = string_chunks(&longer);
    assert_eq!(&grown[..3], &chunks[..]);
}
