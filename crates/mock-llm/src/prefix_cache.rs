//! A simulated prefix cache, as vLLM, SGLang and llama.cpp keep one: a prompt whose beginning
//! equals the beginning of a prompt served before is prefilled only from where they differ.
//!
//! The prompt is what a server renders its chat template from: the request's tools and messages,
//! as their bytes came in (so a client that rewrites any of them, even a byte, loses the rest).
//! Four bytes count as a token. The cache keeps the last [`PrefixCache::CAPACITY`] prompts, in
//! at most [`PrefixCache::MAX_BYTES`]; a prompt that extends one it holds takes that one's
//! place, as a server's slot does.

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::Deserialize;
use serde_json::value::RawValue;

/// Bytes that count as one prompt token.
pub const BYTES_PER_TOKEN: usize = 4;

/// How much of a prompt was cached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Lookup {
    /// Tokens in the prompt.
    pub prompt_tokens: u64,
    /// Of them, taken from the cache.
    pub cached_tokens: u64,
}

impl Lookup {
    /// Tokens that had to be prefilled.
    pub fn uncached_tokens(self) -> u64 {
        self.prompt_tokens - self.cached_tokens
    }
}

/// The prompts served lately.
#[derive(Default)]
pub struct PrefixCache {
    prompts: Mutex<VecDeque<Vec<u8>>>,
}

/// The parts of a chat-completions body that a chat template renders.
#[derive(Deserialize)]
struct Rendered<'a> {
    #[serde(borrow, default)]
    tools: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Vec<&'a RawValue>,
}

/// The prompt of a chat-completions request body: its tools, then its messages, as sent (empty
/// for a body that is not such a request).
pub fn prompt_of(body: &[u8]) -> Vec<u8> {
    let Ok(rendered) = serde_json::from_slice::<Rendered<'_>>(body) else {
        return Vec::new();
    };
    let mut prompt = Vec::with_capacity(body.len());
    if let Some(tools) = rendered.tools {
        prompt.extend_from_slice(tools.get().as_bytes());
    }
    for message in rendered.messages {
        prompt.push(b'\n');
        prompt.extend_from_slice(message.get().as_bytes());
    }
    prompt
}

impl PrefixCache {
    /// Prompts kept.
    pub const CAPACITY: usize = 256;
    /// Bytes of prompts kept.
    pub const MAX_BYTES: usize = 64 * 1024 * 1024;

    /// How much of `prompt` the cache holds; the prompt is cached from now on.
    pub fn serve(&self, prompt: Vec<u8>) -> Lookup {
        let mut prompts = shared::sync::lock(&self.prompts);
        let best = prompts
            .iter()
            .enumerate()
            .map(|(i, cached)| (i, common_prefix(cached, &prompt)))
            .max_by_key(|&(_, common)| common);
        let common = best.map_or(0, |(_, common)| common);
        // A prompt that extends a cached one replaces it; the newest is last.
        if let Some((i, common)) = best
            && common == prompts[i].len()
        {
            prompts.remove(i);
        }
        let lookup = Lookup {
            prompt_tokens: tokens(prompt.len()),
            cached_tokens: tokens(common),
        };
        prompts.push_back(prompt);
        let mut bytes: usize = prompts.iter().map(Vec::len).sum();
        while prompts.len() > Self::CAPACITY || (bytes > Self::MAX_BYTES && prompts.len() > 1) {
            bytes -= prompts.pop_front().map_or(0, |p| p.len());
        }
        lookup
    }
}

fn tokens(bytes: usize) -> u64 {
    (bytes / BYTES_PER_TOKEN) as u64
}

/// The length of the common prefix of `a` and `b`: compared a block at a time (`memcmp`), then
/// byte by byte within the first block that differs, so a long shared prefix costs little.
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const BLOCK: usize = 1024;
    let len = a.len().min(b.len());
    let mut at = 0;
    while at + BLOCK <= len && a[at..at + BLOCK] == b[at..at + BLOCK] {
        at += BLOCK;
    }
    at + a[at..len].iter().zip(&b[at..len]).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(messages: &[&str]) -> Vec<u8> {
        let messages: Vec<String> = messages
            .iter()
            .map(|m| format!(r#"{{"role":"user","content":"{m}"}}"#))
            .collect();
        format!(
            r#"{{"model":"m","tools":[{{"type":"function"}}],"messages":[{}],"stream":true}}"#,
            messages.join(",")
        )
        .into_bytes()
    }

    #[test]
    fn a_prompt_that_extends_the_last_is_cached_up_to_where_it_differs() {
        let cache = PrefixCache::default();
        let first = cache.serve(prompt_of(&body(&["a long first message, forty bytes or so"])));
        assert_eq!(first.cached_tokens, 0);
        assert!(first.prompt_tokens > 10);
        let second = cache.serve(prompt_of(&body(&["a long first message, forty bytes or so", "next"])));
        assert_eq!(second.cached_tokens, first.prompt_tokens, "{second:?}");
        // One changed byte at the start: nothing after it is cached.
        let rewritten = cache.serve(prompt_of(&body(&["A long first message, forty bytes or so", "next"])));
        assert!(rewritten.cached_tokens < 20, "{rewritten:?}");
    }

    #[test]
    fn fields_after_the_messages_do_not_count() {
        let a = prompt_of(br#"{"messages":[{"role":"user","content":"x"}],"tool_choice":"required"}"#);
        let b = prompt_of(br#"{"messages":[{"role":"user","content":"x"}],"tool_choice":"auto"}"#);
        assert_eq!(a, b);
        assert!(prompt_of(b"not json").is_empty());
    }

    #[test]
    fn the_common_prefix_is_found_across_blocks() {
        let a = vec![7u8; 5000];
        for differs_at in [0, 1, 1023, 1024, 1025, 4999] {
            let mut b = a.clone();
            b[differs_at] = 8;
            assert_eq!(common_prefix(&a, &b), differs_at);
        }
        assert_eq!(common_prefix(&a, &a[..3000]), 3000);
        assert_eq!(common_prefix(&a, &[]), 0);
    }

    #[test]
    fn the_cache_keeps_its_capacity() {
        let cache = PrefixCache::default();
        for i in 0..PrefixCache::CAPACITY + 10 {
            cache.serve(format!("prompt {i:>8} of many").into_bytes());
        }
        assert_eq!(shared::sync::lock(&cache.prompts).len(), PrefixCache::CAPACITY);
    }
}
