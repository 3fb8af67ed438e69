//! Cutting text to a byte limit without splitting a character: the one text cutter of the
//! workspace (prefixes, suffixes, excerpts for error messages, cuts that say what was left out,
//! pieces for streaming); and a stable hash of text ([`fnv1a`]).

/// Characters an [`excerpt`] keeps: enough to recognise a value in an error message, short enough
/// that a huge or hostile value never floods a log line or a caller's status.
pub const EXCERPT_CHARS: usize = 300;

/// At most `max` bytes of `text`, cut on a character boundary.
pub fn truncate(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The last bytes of `text`, at most `max`, cut on a character boundary.
pub fn tail(text: &str, max: usize) -> &str {
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// `text` cut to at most `max` bytes in place; whether anything was cut.
pub fn truncate_owned(mut text: String, max: usize) -> (String, bool) {
    let keep = truncate(&text, max).len();
    let cut = keep < text.len();
    text.truncate(keep);
    (text, cut)
}

/// The first [`EXCERPT_CHARS`] characters of `text`, with `…` when there was more: how a value
/// from outside is quoted in an error message.
pub fn excerpt(text: &str) -> String {
    match text.char_indices().nth(EXCERPT_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// The last [`EXCERPT_CHARS`] characters of `text`, with `…` before them when there was more:
/// the end of what a model said, nearest to what it did next.
pub fn ending(text: &str) -> String {
    let count = text.chars().count();
    match count.checked_sub(EXCERPT_CHARS).filter(|skip| *skip > 0) {
        Some(skip) => {
            let cut = text.char_indices().nth(skip).map_or(0, |(at, _)| at);
            format!("…{}", &text[cut..])
        }
        None => text.to_owned(),
    }
}

/// `None` when `text` fits in `max` bytes; else its first `max` bytes followed by a line saying
/// how much of the `what` was left out, so a reader (a model, a person) knows it is incomplete.
pub fn cut_with_note(text: &str, max: usize, what: &str) -> Option<String> {
    if text.len() <= max {
        return None;
    }
    let kept = truncate(text, max);
    Some(format!(
        "{kept}\n[{what} cut: {} of {} bytes left out]",
        text.len() - kept.len(),
        text.len()
    ))
}

/// `text` in pieces of at most `max` bytes, cut on character boundaries (a character longer than
/// `max` is one piece).
pub fn pieces(text: &str, max: usize) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut cut = truncate(rest, max).len();
        if cut == 0 {
            cut = rest.chars().next().map_or(rest.len(), char::len_utf8);
        }
        let (piece, tail) = rest.split_at(cut);
        rest = tail;
        Some(piece)
    })
}

/// FNV-1a, 64 bits, of `bytes`: the same on every replica, machine and release (a std hasher is
/// neither), for choices every replica must make alike.
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `text` without terminal control: escape sequences (CSI, OSC and the other strings, and
/// two-character ones, by ESC or their C1 forms) and every other control character but newline
/// and tab, so text from outside (a model, a tool, a server's message) printed to a terminal
/// cannot move its cursor, rewrite what was printed, retitle it or plant a link.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    let kept = |c: char| !c.is_control() || c == '\n' || c == '\t';
    if text.chars().all(kept) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        let opener = match c {
            '\u{1b}' => chars.next(),
            '\u{9b}' => Some('['),
            '\u{9d}' => Some(']'),
            '\u{90}' | '\u{98}' | '\u{9e}' | '\u{9f}' => Some('P'),
            c if kept(c) => {
                out.push(c);
                continue;
            }
            _ => continue,
        };
        match opener {
            // A control sequence: parameters and intermediates up to its final character.
            Some('[') => while chars.next().is_some_and(|c| !('@'..='~').contains(&c)) {},
            // A string: up to BEL, ST (ESC \\) or its C1 form.
            Some(']' | 'P' | 'X' | '^' | '_') => {
                while let Some(c) = chars.next() {
                    if c == '\u{7}' || c == '\u{9c}' || (c == '\u{1b}' && chars.next_if_eq(&'\\').is_some()) {
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_on_a_character_boundary() {
        assert_eq!(truncate("héllo", 2), "h");
        assert_eq!(truncate("héllo", 3), "hé");
        assert_eq!(truncate("hi", 10), "hi");
        assert_eq!(truncate("é", 0), "");
    }

    #[test]
    fn tails_on_a_character_boundary() {
        assert_eq!(tail("héllo", 4), "llo");
        assert_eq!(tail("héllo", 5), "éllo");
        assert_eq!(tail("hi", 10), "hi");
        assert_eq!(tail("é", 1), "");
    }

    #[test]
    fn owned_cuts_say_whether_they_cut() {
        assert_eq!(truncate_owned("héllo".into(), 2), ("h".into(), true));
        assert_eq!(truncate_owned("hi".into(), 2), ("hi".into(), false));
    }

    #[test]
    fn printable_text_keeps_words_and_drops_terminal_control() {
        assert!(matches!(
            printable("plain ✔ text\n\tindented"),
            std::borrow::Cow::Borrowed(_)
        ));
        for (text, shown) in [
            ("\u{1b}[31mred\u{1b}[0m", "red"),
            ("a\u{1b}[2J\u{1b}[Hb", "ab"),
            ("title\u{1b}]0;pwned\u{7}!", "title!"),
            ("\u{1b}]8;;https://evil.example\u{1b}\\link\u{1b}]8;;\u{1b}\\", "link"),
            ("over\rwrite", "overwrite"),
            ("c1\u{9b}31mcsi", "c1csi"),
            ("bell\u{7} and \u{8}back", "bell and back"),
            ("cut at the end \u{1b}[", "cut at the end "),
            ("\u{1b}c reset", " reset"),
        ] {
            assert_eq!(printable(text), shown, "{text:?}");
        }
    }

    #[test]
    fn endings_keep_short_text_and_mark_where_long_text_was_cut() {
        assert_eq!(ending("short"), "short");
        let long = format!("{}é{}", "a".repeat(EXCERPT_CHARS), "b".repeat(9));
        let end = ending(&long);
        assert!(end.starts_with('…') && end.ends_with("ébbbbbbbbb"), "{end}");
        assert_eq!(end.chars().count(), EXCERPT_CHARS + 1);
    }

    #[test]
    fn excerpts_keep_short_text_and_mark_long_text() {
        assert_eq!(excerpt("short"), "short");
        let long = "é".repeat(EXCERPT_CHARS + 5);
        let quoted = excerpt(&long);
        assert!(quoted.ends_with('…'));
        assert_eq!(quoted.chars().count(), EXCERPT_CHARS + 1);
    }

    #[test]
    fn a_note_says_how_much_was_left_out() {
        assert_eq!(cut_with_note("abc", 3, "result"), None);
        assert_eq!(
            cut_with_note("abcdef", 4, "result").as_deref(),
            Some("abcd\n[result cut: 2 of 6 bytes left out]")
        );
    }

    #[test]
    fn pieces_cover_the_text_on_boundaries() {
        let text = "aé€😀b";
        let parts: Vec<&str> = pieces(text, 2).collect();
        assert_eq!(parts.concat(), text);
        assert!(parts.iter().all(|p| p.len() <= 2 || p.chars().count() == 1));
        assert_eq!(pieces("", 3).count(), 0);
    }
}
