//! Job output as text: what a printer may show of it, and what a terminal would show of it.
//!
//! A job's output is hostile. Printed raw it can set the terminal's title, write the clipboard
//! (OSC 52), move the cursor, overwrite a line with `\r`, reorder text with bidi overrides, or
//! hide text in invisible characters. Two pure functions answer that, here and nowhere else:
//!
//! - [`escape`] is for every printer (the CLI today, a web UI later): it makes each character
//!   that could act on a terminal or hide text *visible*, so the reader sees exactly what the
//!   job wrote and the terminal receives only printable text. `--json` output needs none of
//!   this: JSON string escaping already carries the exact text safely.
//! - [`visible`] is for secret masking: the characters a terminal would *show* of a line, each
//!   with where it came from, so a secret with colour codes or other control characters
//!   inserted between its characters is still found (see `mask`).
//!
//! The escapes (chosen to be unambiguous and copy-pasteable, as in Rust string literals):
//! - C0 controls (except tab) and DEL become `\xNN`: ESC is `\x1b`, `\r` is `\x0d`;
//! - C1 controls (U+0080–U+009F), bidi controls, invisible formatting characters (zero-width
//!   space, word joiner, BOM, line/paragraph separators) and Unicode tag characters become
//!   `\u{NNNN}`: a right-to-left override is `\u{202e}`.
//!
//! Tab is printable here: it only moves the cursor forward and is common in real output.
//! A backslash is left as it is, so a job *can* print the text `\x1b`; it can never print an
//! ESC. Zero-width joiner and non-joiner are left as they are (emoji and several scripts need
//! them); [`visible`] still skips them.

use std::borrow::Cow;
use std::fmt::Write as _;

/// Whether `c` is escaped by [`escape`]: it could control a terminal or hide text.
pub fn needs_escape(c: char) -> bool {
    (c.is_control() && c != '\t') || is_invisible_format(c)
}

/// Characters that change how nearby text shows without showing themselves: Unicode's
/// Default_Ignorable_Code_Point set (what a renderer shows nothing for, including code points
/// reserved for more of the same, such as U+2065 and U+FFF0–U+FFF8) and every format (Cf)
/// character, bidi controls included; all escaped by [`escape`], all skipped by [`visible`].
/// Whole sets, not a list of favourites: a secret with U+1D173 or U+1BCA0 inserted showed
/// unmasked and looked untouched in a terminal (outsider attack). ZWJ and ZWNJ are handled by
/// the callers (see the module header).
fn is_invisible_format(c: char) -> bool {
    matches!(c,
        '\u{00AD}'                  // soft hyphen
        | '\u{034F}'                // combining grapheme joiner
        | '\u{0600}'..='\u{0605}'   // Arabic number signs (Cf)
        | '\u{061C}'                // Arabic letter mark
        | '\u{06DD}'                // Arabic end of ayah (Cf)
        | '\u{070F}'                // Syriac abbreviation mark (Cf)
        | '\u{0890}'..='\u{0891}'   // Arabic pound/piastre marks above (Cf)
        | '\u{08E2}'                // Arabic disputed end of ayah (Cf)
        | '\u{115F}'..='\u{1160}'   // Hangul fillers
        | '\u{17B4}'..='\u{17B5}'   // Khmer inherent vowels
        | '\u{180B}'..='\u{180F}'   // Mongolian variation selectors, vowel separator
        | '\u{200B}'                // zero-width space
        | '\u{200E}'..='\u{200F}'   // LRM, RLM
        | '\u{2028}'..='\u{2029}'   // line and paragraph separator
        | '\u{202A}'..='\u{202E}'   // LRE, RLE, PDF, LRO, RLO
        | '\u{2060}'..='\u{206F}'   // word joiner, invisible operators, U+2065, isolates, deprecated
        | '\u{3164}'                // Hangul filler
        | '\u{FE00}'..='\u{FE0F}'   // variation selectors
        | '\u{FEFF}'                // zero-width no-break space (BOM)
        | '\u{FFA0}'                // halfwidth Hangul filler
        | '\u{FFF0}'..='\u{FFFB}'   // reserved ignorables, interlinear annotation (Cf)
        | '\u{110BD}' | '\u{110CD}' // Kaithi number signs (Cf)
        | '\u{13430}'..='\u{1345F}' // Egyptian hieroglyph format controls (Cf)
        | '\u{16FE4}'               // Khitan small script filler
        | '\u{1BCA0}'..='\u{1BCA3}' // shorthand format controls
        | '\u{1D173}'..='\u{1D17A}' // musical symbol format controls
        | '\u{E0000}'..='\u{E0FFF}' // tags, variation selectors supplement, reserved ignorables
    )
}

/// `text` with every character that could act on a terminal or hide text replaced by a
/// visible escape (see the module header). Text without such characters comes back as it is.
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if !needs_escape(c) {
            out.push(c);
        } else if (c as u32) < 0x80 {
            let _ = write!(out, "\\x{:02x}", c as u32);
        } else {
            let _ = write!(out, "\\u{{{:x}}}", c as u32);
        }
    }
    Cow::Owned(out)
}

/// What a terminal would show of a line: its characters without escape sequences, control
/// characters and invisible formatting, with backspace taking back the character before it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Visible {
    pub text: String,
    /// For each byte of `text`: the byte range in the original line of the character it is
    /// part of.
    pub origin: Vec<(usize, usize)>,
    /// Where an escape sequence that the line ends inside of starts: the line was cut in the
    /// middle of it, and the next piece continues it.
    pub open: Option<usize>,
}

/// Whether [`visible`] of `text` differs from `text` (there is something to skip).
pub fn has_hidden(text: &str) -> bool {
    text.chars().any(|c| (c.is_control() && c != '\t') || is_invisible_format(c) || c == '\u{200C}' || c == '\u{200D}')
}

/// The characters of `line` a terminal would show (an approximation on the safe side for
/// masking: what it skips can only join text, never split it):
/// - escape sequences: CSI (`ESC [` … final byte), OSC/DCS/SOS/PM/APC strings (up to BEL, ST
///   or the next ESC), two-character escapes (`ESC 7`, `ESC ( B`), and their C1 forms;
/// - every other control character except tab, and invisible formatting characters;
/// - backspace removes the character shown before it (the next one overwrites it).
///
/// Cursor movement is not replayed: text drawn out of order by `ESC [ nD` is not reassembled.
pub fn visible(line: &str) -> Visible {
    let mut v = Visible { text: String::with_capacity(line.len()), origin: Vec::with_capacity(line.len()), open: None };
    let mut it = line.char_indices().peekable();
    while let Some((at, c)) = it.next() {
        let ended = match c {
            '\u{1b}' => match it.peek().map(|&(_, n)| n) {
                Some('[') => {
                    it.next();
                    skip_csi(&mut it, &mut v)
                }
                Some(']' | 'P' | 'X' | '^' | '_') => {
                    it.next();
                    skip_string(&mut it)
                }
                Some(' '..='/') => {
                    while it.next_if(|&(_, n)| matches!(n, ' '..='/')).is_some() {}
                    it.next_if(|&(_, n)| matches!(n, '0'..='~')).is_some() || it.peek().is_some()
                }
                Some('0'..='~') => {
                    it.next();
                    true
                }
                Some(_) => true,
                None => false,
            },
            '\u{9b}' => skip_csi(&mut it, &mut v),
            '\u{90}' | '\u{98}' | '\u{9d}' | '\u{9e}' | '\u{9f}' => skip_string(&mut it),
            '\u{8}' => {
                if let Some(last) = v.text.pop() {
                    v.origin.truncate(v.origin.len() - last.len_utf8());
                }
                true
            }
            c if c == '\t' || !(c.is_control() || is_invisible_format(c) || c == '\u{200C}' || c == '\u{200D}') => {
                let end = at + c.len_utf8();
                v.text.push(c);
                v.origin.extend(std::iter::repeat_n((at, end), c.len_utf8()));
                true
            }
            _ => true,
        };
        if !ended {
            v.open = Some(at);
        }
    }
    v
}

type Chars<'a> = std::iter::Peekable<std::str::CharIndices<'a>>;

/// Parameters and intermediates up to the final byte; another control character ends it too.
/// False: the line ended first.
fn skip_csi(it: &mut Chars<'_>, v: &mut Visible) -> bool {
    while let Some(&(_, c)) = it.peek() {
        match c {
            ' '..='?' => {
                it.next();
            }
            '@'..='~' => {
                it.next();
                return true;
            }
            // A terminal executes a C0 control met inside a sequence and carries on with the
            // sequence (ECMA-48 / xterm); ESC, CAN and SUB end it. A backspace there still
            // takes back the character before: `AB\e[\bmBC` shows `ABC`.
            '\u{1b}' | '\u{18}' | '\u{1a}' => return true,
            '\u{8}' => {
                it.next();
                if let Some(last) = v.text.pop() {
                    v.origin.truncate(v.origin.len() - last.len_utf8());
                }
            }
            '\u{0}'..='\u{1f}' | '\u{7f}' => {
                it.next();
            }
            _ => return true,
        }
    }
    false
}

/// A control string's payload (an OSC title, a clipboard write) up to BEL, ST (`ESC \` or
/// U+009C) or the next ESC, which starts a new sequence. False: the line ended first (or
/// right after an ESC that may be the start of ST).
fn skip_string(it: &mut Chars<'_>) -> bool {
    while let Some(&(_, c)) = it.peek() {
        match c {
            '\u{7}' | '\u{9c}' => {
                it.next();
                return true;
            }
            '\u{1b}' => {
                it.next();
                return it.next_if(|&(_, n)| n == '\\').is_some() || it.peek().is_some();
            }
            _ => {
                it.next();
            }
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn terminal_controls_become_visible() {
        assert_eq!(escape("\u{1b}[31mred\u{1b}[0m"), "\\x1b[31mred\\x1b[0m");
        assert_eq!(escape("\u{1b}]52;c;aGk=\u{7}"), "\\x1b]52;c;aGk=\\x07");
        assert_eq!(escape("fake\rreal"), "fake\\x0dreal");
        assert_eq!(escape("a\u{7f}b\u{9b}c"), "a\\x7fb\\u{9b}c");
        assert_eq!(escape("abc\u{202e}fed"), "abc\\u{202e}fed");
        assert_eq!(escape("tab\tstays, ü and 😀 too"), "tab\tstays, ü and 😀 too");
    }

    #[test]
    fn visible_skips_sequences_and_maps_back() {
        let line = "AB\u{1b}[0mCD";
        let v = visible(line);
        assert_eq!(v.text, "ABCD");
        assert_eq!(v.origin[2], (6, 7));
        assert_eq!(visible("x\u{1b}]0;title\u{7}y\u{1b}]8;;http://a\u{1b}\\z").text, "xyz");
        assert_eq!(visible("AB\u{9b}1;31mC\u{200b}D\r").text, "ABCD");
        assert_eq!(visible("ABX\u{8}CD").text, "ABCD");
        assert_eq!(visible("\u{1b}(Bok\u{1b}7").text, "ok");
        assert_eq!(visible("ok\u{1b}[1;3").open, Some(2));
        assert_eq!(visible("ok\u{1b}]0;ti").open, Some(2));
        assert_eq!(visible("ok\u{1b}").open, Some(2));
        assert_eq!(visible("ok\u{1b}[1m").open, None);
    }

    #[test]
    fn controls_inside_a_sequence_do_not_end_it() {
        // Found by an outside attack: each of these shows "topsecret" on a terminal.
        assert_eq!(visible("tops\u{1b}[\u{7}mecret").text, "topsecret");
        assert_eq!(visible("tops\u{1b}[\u{0}mecret").text, "topsecret");
        assert_eq!(visible("tops\u{1b}[\u{8}msecret").text, "topsecret");
        for c in ['\u{34f}', '\u{fe0f}', '\u{ad}', '\u{206a}', '\u{180e}'] {
            assert_eq!(visible(&format!("tops{c}ecret")).text, "topsecret", "{:x}", c as u32);
        }
    }

    fn hostile() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![
                any::<char>().prop_map(String::from),
                Just("\u{1b}[31m".to_string()),
                Just("\u{1b}]0;t\u{7}".to_string()),
                Just("\r".to_string()),
                Just("\u{202e}".to_string()),
                "[a-z ]{0,5}",
            ],
            0..20,
        )
        .prop_map(|v| v.concat())
    }

    proptest! {
        #[test]
        fn escaped_text_holds_no_control_character(s in hostile()) {
            let e = escape(&s);
            prop_assert!(!e.chars().any(needs_escape), "{e:?}");
            prop_assert!(!e.bytes().any(|b| b == 0x1b || b == b'\r' || b == 0x7f));
        }

        #[test]
        fn printable_text_is_unchanged(s in any::<String>()) {
            let printable: String = s.chars().filter(|&c| !needs_escape(c)).collect();
            prop_assert_eq!(escape(&printable), printable.as_str());
        }

        #[test]
        fn visible_origins_point_at_the_same_characters(s in hostile()) {
            let v = visible(&s);
            prop_assert_eq!(v.origin.len(), v.text.len());
            for (i, c) in v.text.char_indices() {
                let (a, b) = v.origin[i];
                prop_assert_eq!(&s[a..b], c.to_string());
            }
        }
    }
}
