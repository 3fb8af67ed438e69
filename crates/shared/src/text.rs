//! Cutting text to a byte limit without splitting a character.

/// At most `max` bytes of `text`, cut on a character boundary.
pub fn truncate(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

#[cfg(test)]
mod tests {
    #[test]
    fn cuts_on_a_character_boundary() {
        assert_eq!(super::truncate("héllo", 2), "h");
        assert_eq!(super::truncate("héllo", 3), "hé");
        assert_eq!(super::truncate("hi", 10), "hi");
        assert_eq!(super::truncate("é", 0), "");
    }
}
