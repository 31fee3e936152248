//! Text from other users' messages (job names, ids, owners, drain reasons,
//! server names) shown to people: which characters must not reach a
//! terminal or a page raw.

/// Whether `c` must be shown escaped: a control character (C0, DEL, C1:
/// escape sequences, bells, carriage returns that rewrite a line), or a
/// bidirectional formatting character (U+061C, U+200E/U+200F, U+202A–U+202E,
/// U+2066–U+2069), which reorders what follows on the line so that one
/// user's text can disguise another's (CVE-2021-42574, "Trojan Source").
pub fn must_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{061c}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controls_and_bidi_overrides_are_escaped_letters_are_not() {
        for c in [
            '\u{1b}', '\u{7}', '\r', '\n', '\u{9b}', '\u{202e}', '\u{2066}', '\u{200f}',
        ] {
            assert!(must_escape(c), "{c:?}");
        }
        for c in ['a', 'ü', 'é', '-', ' ', '中', '\u{5d0}'] {
            assert!(!must_escape(c), "{c:?}");
        }
    }
}
