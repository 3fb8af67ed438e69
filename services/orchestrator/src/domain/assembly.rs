//! Assembles streamed tool-call fragments into whole calls.
//!
//! Fragments are keyed by `index`; without an index by `id`; without either they continue the
//! last call. A fragment whose index matches a call but whose id differs starts a new call (some
//! servers send every call at index 0). Repeated ids and names are ignored. At the end, a call
//! whose joined arguments are not valid JSON but whose last fragment is a complete JSON value
//! repeating what was streamed before it (vLLM + GLM re-send the whole arguments in the finish
//! chunk) takes that last fragment alone.
//!
//! Bounded: at most `max_calls` calls are kept (the assembler then says there were more), and
//! at most `max_argument_bytes` of one call's arguments (the call then says how many bytes the
//! model sent); a name is kept up to the longest valid tool name and one byte more.

/// A call being assembled.
#[derive(Debug, Default)]
struct Partial {
    index: Option<u32>,
    id: Option<String>,
    name: String,
    arguments: String,
    last_fragment_len: usize,
    argument_bytes: usize,
}

/// A call as assembled from the stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssembledCall {
    /// The server's id, if it sent one.
    pub id: Option<String>,
    /// Tool name.
    pub name: String,
    /// Arguments text (`{}` when the server sent none), cut at the limit when longer.
    pub arguments: String,
    /// Bytes of arguments the model sent (more than `arguments` holds when it was cut).
    pub argument_bytes: usize,
}

/// Collects the fragments of one completion.
#[derive(Debug)]
pub struct Assembler {
    calls: Vec<Partial>,
    max_calls: usize,
    max_argument_bytes: usize,
    /// The model started a call past `max_calls`.
    too_many: bool,
    /// Fragments continuing the last call go nowhere: it was one too many.
    dropping: bool,
}

impl Default for Assembler {
    fn default() -> Self {
        Self::new(usize::MAX, usize::MAX)
    }
}

/// Longest name kept: one byte over the longest valid tool name, so it still reads as invalid.
const MAX_NAME_BYTES: usize = shared::tools::MAX_TOOL_NAME_LEN + 1;

impl Assembler {
    /// An assembler keeping at most `max_calls` calls and `max_argument_bytes` of each one's
    /// arguments.
    pub fn new(max_calls: usize, max_argument_bytes: usize) -> Self {
        Self {
            calls: Vec::new(),
            max_calls,
            max_argument_bytes,
            too_many: false,
            dropping: false,
        }
    }

    /// The model started more calls than this assembler keeps.
    pub fn too_many(&self) -> bool {
        self.too_many
    }

    /// True when no fragment has been seen.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Adds one fragment.
    pub fn push(&mut self, index: Option<u32>, id: Option<String>, name: Option<String>, arguments: Option<String>) {
        let position = match (index, &id) {
            (Some(i), id) => {
                self.calls
                    .iter()
                    .rposition(|c| c.index == Some(i))
                    .filter(|&p| match (id, &self.calls[p].id) {
                        (Some(new), Some(old)) => new == old,
                        _ => true,
                    })
            }
            (None, Some(id)) => self.calls.iter().rposition(|c| c.id.as_ref() == Some(id)),
            (None, None) => self.calls.len().checked_sub(1),
        };
        let continues_dropped = index.is_none() && id.is_none() && self.dropping;
        let call = match position {
            Some(_) if continues_dropped => return,
            Some(p) => &mut self.calls[p],
            None if self.calls.len() >= self.max_calls => {
                self.too_many = true;
                self.dropping = true;
                return;
            }
            None => {
                self.calls.push(Partial {
                    index,
                    ..Partial::default()
                });
                let last = self.calls.len() - 1;
                &mut self.calls[last]
            }
        };
        self.dropping = false;
        if call.id.is_none() {
            call.id = id;
        }
        if let Some(name) = name {
            if call.name.is_empty() {
                call.name = name;
            } else if call.name != name {
                call.name.push_str(&name);
            }
            let kept = shared::text::truncate(&call.name, MAX_NAME_BYTES).len();
            call.name.truncate(kept);
        }
        if let Some(arguments) = arguments {
            call.argument_bytes += arguments.len();
            let room = self.max_argument_bytes.saturating_sub(call.arguments.len());
            let kept = shared::text::truncate(&arguments, room);
            call.arguments.push_str(kept);
            call.last_fragment_len = kept.len();
        }
    }

    /// How many of the calls started so far are complete: every one but the last (a later
    /// call began after it).
    pub fn complete(&self) -> usize {
        self.calls.len().saturating_sub(1)
    }

    /// Call `position` as assembled so far.
    pub fn snapshot(&self, position: usize) -> Option<AssembledCall> {
        self.calls.get(position).map(|c| AssembledCall {
            arguments: resolve_arguments(c.arguments.clone(), c.last_fragment_len),
            argument_bytes: c.argument_bytes,
            id: c.id.clone(),
            name: c.name.clone(),
        })
    }

    /// The assembled calls, in the order they started.
    pub fn finish(self) -> Vec<AssembledCall> {
        self.calls
            .into_iter()
            .map(|c| AssembledCall {
                arguments: resolve_arguments(c.arguments, c.last_fragment_len),
                argument_bytes: c.argument_bytes,
                id: c.id,
                name: c.name,
            })
            .collect()
    }
}

fn resolve_arguments(joined: String, last_len: usize) -> String {
    if joined.trim().is_empty() {
        return "{}".to_owned();
    }
    if serde_json::from_str::<serde::de::IgnoredAny>(&joined).is_ok() {
        return joined;
    }
    let split = joined.len() - last_len;
    let (before, last) = joined.split_at(split);
    let last_is_whole = serde_json::from_str::<serde_json::Value>(last).is_ok_and(|v| v.is_object());
    let squeeze = |s: &str| s.chars().filter(|c| !c.is_whitespace()).collect::<String>();
    if !before.is_empty() && last_is_whole && squeeze(last).starts_with(&squeeze(before)) {
        return last.to_owned();
    }
    joined
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &str) -> Option<String> {
        Some(v.to_owned())
    }

    #[test]
    fn fragments_by_index_with_repeated_id_and_name() {
        let mut a = Assembler::default();
        a.push(Some(0), s("0"), s("get"), s("{\"a\""));
        a.push(Some(0), s("0"), s("get"), s(": 1}"));
        a.push(Some(1), s("c2"), s("put"), None);
        a.push(Some(1), None, None, s("{}"));
        let calls = a.finish();
        assert_eq!(
            calls[0],
            AssembledCall {
                id: s("0"),
                name: "get".into(),
                arguments: "{\"a\": 1}".into(),
                argument_bytes: 8,
            }
        );
        assert_eq!(
            calls[1],
            AssembledCall {
                id: s("c2"),
                name: "put".into(),
                arguments: "{}".into(),
                argument_bytes: 2,
            }
        );
    }

    #[test]
    fn no_index_no_id_continue_the_last_call_and_same_index_new_id_starts_one() {
        let mut a = Assembler::default();
        a.push(None, s("x"), s("f"), s("{\"k\":"));
        a.push(None, None, None, s("2}"));
        a.push(Some(0), s("y1"), s("g"), s("{}"));
        a.push(Some(0), s("y2"), s("g"), None);
        let calls = a.finish();
        assert_eq!(calls.len(), 3);
        assert_eq!(calls[0].arguments, "{\"k\":2}");
        assert_eq!(
            calls[2].arguments, "{}",
            "a call without arguments gets an empty object"
        );
    }

    #[test]
    fn a_resent_complete_argument_object_replaces_the_streamed_prefix() {
        let mut a = Assembler::default();
        a.push(Some(1), s("r"), s("read"), s("{\"filePath\":\"/a/"));
        a.push(Some(1), None, None, s("b\""));
        a.push(Some(1), None, None, s("{\"filePath\": \"/a/b\"}"));
        assert_eq!(a.finish()[0].arguments, "{\"filePath\": \"/a/b\"}");
        // Invalid arguments that are not a re-send stay as they are (the loop reports them).
        let mut b = Assembler::default();
        b.push(Some(0), s("r"), s("read"), s("{\"x\": 1"));
        b.push(Some(0), None, None, s("{\"y\": 2}"));
        assert_eq!(b.finish()[0].arguments, "{\"x\": 1{\"y\": 2}");
    }

    #[test]
    fn calls_and_argument_bytes_are_bounded() {
        let mut a = Assembler::new(2, 8);
        a.push(Some(0), s("a"), s("f"), s("{\"k\": \"0123456789\"}"));
        a.push(Some(1), s("b"), s("g"), s("{}"));
        assert!(!a.too_many());
        // A third call, and fragments continuing it, go nowhere.
        a.push(Some(2), s("c"), s("h"), s("{"));
        a.push(None, None, None, s("}"));
        a.push(Some(1), None, Some("x".repeat(1000)), None);
        assert!(a.too_many());
        let calls = a.finish();
        assert_eq!(calls.len(), 2);
        assert_eq!(
            (calls[0].arguments.as_str(), calls[0].argument_bytes),
            ("{\"k\": \"0", 19)
        );
        assert_eq!((calls[1].arguments.as_str(), calls[1].argument_bytes), ("{}", 2));
        assert_eq!(
            calls[1].name.len(),
            shared::tools::MAX_TOOL_NAME_LEN + 1,
            "a growing name is cut"
        );
    }
}
