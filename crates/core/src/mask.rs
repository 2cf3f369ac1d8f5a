//! Secret masking for job output: every occurrence of a secret's value becomes `***`.
//!
//! Output reaches the masker as whole lines (the agent joins pipe reads up to a newline), so a
//! value written in several pieces is masked once its line is complete. A multi-line secret
//! (a private key) is masked line by line: each of its lines is a value of its own. Values
//! shorter than [`MIN_LEN`] are not masked: masking `1` or `true` would destroy the log
//! without protecting anything.
//!
//! Two ways a job could slip a value past a plain search are closed here:
//! - *Escape sequences inside the value* (`printf 'AB\e[0mCD'`, colour codes between its
//!   characters, `\r`, invisible characters): the value is also searched for in what a
//!   terminal would show ([`crate::text::visible`]), and the whole span of the original it
//!   came from, sequences included, becomes `***`.
//! - *A line longer than the agent's cut* (64 KiB): [`Masker::cut`] masks the piece and keeps
//!   back its tail, long enough to hold the start of any value, for the next piece; no value
//!   can straddle a cut.
//!
//! Not covered, by design: a value the job transforms (base64, reversed, one character per
//! line, a combining accent or a Hangul jamo after each character: those show), or redrawn out
//! of order with cursor movement. A job that holds a secret can always
//! print it in a form no masker recognises; masking stops accidents and the cheap tricks.

use crate::text::{has_hidden, visible};

/// Shortest value that is masked.
pub const MIN_LEN: usize = 4;

#[derive(Clone, Debug, Default)]
pub struct Masker {
    /// Longest first, so a value that contains another is masked whole.
    values: Vec<String>,
    /// What a terminal shows of each value (usually the value itself), longest first.
    shown: Vec<String>,
    /// Characters in the longest shown value.
    longest_chars: usize,
}

impl Masker {
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a str>) -> Masker {
        let mut values: Vec<String> = secrets
            .into_iter()
            .flat_map(|s| {
                s.lines().map(str::trim_end).filter(|l| l.len() >= MIN_LEN).map(str::to_string).collect::<Vec<_>>()
            })
            .collect();
        longest_first(&mut values);
        let mut shown: Vec<String> = values.iter().map(|v| visible(v).text).filter(|v| v.len() >= MIN_LEN).collect();
        longest_first(&mut shown);
        let longest_chars = shown.iter().chain(&values).map(|v| v.chars().count()).max().unwrap_or(0);
        Masker { values, shown, longest_chars }
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The line with every secret value replaced by `***`: as written, and as a terminal
    /// would show it.
    pub fn mask(&self, line: &str) -> String {
        if self.values.is_empty() {
            return line.to_string();
        }
        let mut out = String::with_capacity(line.len());
        let mut rest = line;
        while let Some((at, len)) = earliest(&self.values, rest) {
            out.push_str(&rest[..at]);
            out.push_str("***");
            rest = &rest[at + len..];
        }
        out.push_str(rest);
        if has_hidden(&out) {
            out = self.mask_shown(&out);
        }
        out
    }

    /// Values found in what a terminal shows of `line`; each is replaced with the whole
    /// stretch of `line` it was drawn from.
    fn mask_shown(&self, line: &str) -> String {
        let v = visible(line);
        let mut spans = Vec::new();
        let mut from = 0;
        while let Some((at, len)) = earliest(&self.shown, &v.text[from..]) {
            let (a, b) = (from + at, from + at + len);
            spans.push((v.origin[a].0, v.origin[b - 1].1));
            from = b;
        }
        if spans.is_empty() {
            return line.to_string();
        }
        let mut out = String::with_capacity(line.len());
        let mut pos = 0;
        for (a, b) in spans {
            out.push_str(&line[pos..a]);
            out.push_str("***");
            pos = b;
        }
        out.push_str(&line[pos..]);
        out
    }

    /// A piece of a line that is being cut because it is too long: what to write now (masked)
    /// and what to carry to the front of the next piece.
    ///
    /// The carry is the tail that could be the start of a value continuing in the next piece:
    /// the last (longest value − 1) characters a terminal would show, with whatever sequences
    /// lie between them, and an escape sequence the piece ends inside of (so the next piece
    /// continues it, not shows it). Should that be longer than `max_carry` bytes (a job padding
    /// a value with escape sequences), only the shown characters are carried, and of a long
    /// open sequence only its introducer: what is dropped is invisible, the value is still
    /// caught. A value longer than `max_carry` is not held back: `max_carry` bounds memory and
    /// guarantees progress.
    pub fn cut(&self, piece: &str, max_carry: usize) -> (String, String) {
        let masked = self.mask(piece);
        if self.longest_chars < 2 {
            return (masked, String::new());
        }
        let v = visible(&masked);
        let end = v.open.unwrap_or(masked.len());
        let (open, short) = match v.open {
            Some(o) => (masked[o..].to_string(), shortened(&masked[o..])),
            None => (String::new(), String::new()),
        };
        let from = v.text.char_indices().rev().nth(self.longest_chars - 2).map_or(0, |(at, _)| at);
        let start = v.origin.get(from).map_or(end, |o| o.0);
        let (raw, shown) = (&masked[start..end], &v.text[from..]);
        let carry = [(raw, &open), (shown, &open), (shown, &short)]
            .into_iter()
            .find(|(tail, open)| tail.len() + open.len() <= max_carry)
            .map(|(tail, open)| format!("{tail}{open}"));
        let mut now = masked;
        match carry {
            Some(carry) => {
                now.truncate(start);
                (now, carry)
            }
            None => {
                now.truncate(end);
                (now, if open.len() <= max_carry { open } else { short })
            }
        }
    }
}

/// An open escape sequence without its payload: what opens it (`ESC ]`, `ESC [`, a C1
/// control), and a final ESC that may be the start of its terminator.
fn shortened(seq: &str) -> String {
    let mut ends = seq.char_indices().map(|(i, c)| i + c.len_utf8());
    let intro = match (seq.starts_with('\u{1b}'), ends.next(), ends.next()) {
        (true, _, Some(two)) => &seq[..two],
        (_, Some(one), _) => &seq[..one],
        _ => seq,
    };
    if seq.len() > intro.len() && seq.ends_with('\u{1b}') {
        format!("{intro}\u{1b}")
    } else {
        intro.to_string()
    }
}

fn longest_first(values: &mut Vec<String>) {
    values.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
    values.dedup();
}

/// Earliest match of any value in `text`; among matches at the same place the longest
/// (values are sorted longest first).
fn earliest(values: &[String], text: &str) -> Option<(usize, usize)> {
    let mut best: Option<(usize, usize)> = None;
    for v in values {
        if let Some(at) = text.find(v.as_str()) {
            if best.is_none_or(|(b, _)| at < b) {
                best = Some((at, v.len()));
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::text::visible;
    use proptest::prelude::*;

    #[test]
    fn masks_every_occurrence() {
        let m = Masker::new(["s3cr3t-token"]);
        assert_eq!(m.mask("a s3cr3t-token b s3cr3t-token"), "a *** b ***");
        assert_eq!(m.mask("nothing here"), "nothing here");
    }

    #[test]
    fn longer_values_win_and_short_values_are_left() {
        let m = Masker::new(["abcd", "abcdefgh", "xy"]);
        assert_eq!(m.mask("abcdefgh abcd xy"), "*** *** xy");
    }

    #[test]
    fn multi_line_secrets_are_masked_per_line() {
        let key = "-----BEGIN KEY-----\nAAAABBBBCCCC\n-----END KEY-----\n";
        let m = Masker::new([key]);
        assert_eq!(m.mask("AAAABBBBCCCC"), "***");
        assert_eq!(m.mask("-----END KEY-----"), "***");
    }

    /// Regression (outsider attack): these zero-width characters were neither skipped nor
    /// escaped, so `S\u{1d173}ECRET` was stored unmasked and a terminal showed `SECRET`.
    #[test]
    fn a_secret_with_any_default_ignorable_or_format_character_inside_is_masked() {
        let m = Masker::new(["SECRETVALUE"]);
        for c in ['\u{1d173}', '\u{1bca0}', '\u{fff9}', '\u{2065}', '\u{e0100}', '\u{13430}', '\u{fff0}', '\u{16fe4}'] {
            assert_eq!(m.mask(&format!("x SECR{c}ETVALUE y")), "x *** y", "U+{:04X}", c as u32);
        }
    }

    #[test]
    fn a_secret_with_escape_sequences_inside_is_masked() {
        let m = Masker::new(["ABCD"]);
        // printf 'AB\e[0mCD': the terminal shows ABCD.
        assert_eq!(m.mask("x AB\u{1b}[0mCD y"), "x *** y");
        assert_eq!(m.mask("\u{1b}[1mA\u{1b}[31mB\u{1b}[32mC\u{1b}[33mD\u{1b}[0m!"), "\u{1b}[1m***\u{1b}[0m!");
        assert_eq!(m.mask("AB\u{1b}]0;title\u{7}CD"), "***");
        assert_eq!(m.mask("A\rB\u{200b}C\u{8}\u{8}BCD"), "***");
        assert_eq!(m.mask("AB\u{1b}[0mCE"), "AB\u{1b}[0mCE");
    }

    /// Feed `line` through [`Masker::cut`] in pieces of the given sizes, as the agent does
    /// with a line longer than its cut, and return everything written.
    fn through_cuts(m: &Masker, line: &str, sizes: &[usize], max_carry: usize) -> String {
        let (mut out, mut carry, mut rest) = (String::new(), String::new(), line);
        for &n in sizes.iter().cycle() {
            if rest.is_empty() {
                break;
            }
            let mut n = n.min(rest.len());
            while !rest.is_char_boundary(n) {
                n += 1;
            }
            let piece = format!("{carry}{}", &rest[..n]);
            rest = &rest[n..];
            let (now, next) = m.cut(&piece, max_carry);
            out.push_str(&now);
            carry = next;
        }
        out.push_str(&m.mask(&carry));
        out
    }

    #[test]
    fn a_secret_split_by_the_line_cut_is_masked() {
        let m = Masker::new(["s3cr3t-token"]);
        let line = format!("{}s3cr3t-token{}", "x".repeat(60), "y".repeat(10));
        for at in 55..75 {
            let out = through_cuts(&m, &line, &[at, 1000], 4096);
            assert!(!out.contains("s3cr3t-token"), "cut at {at}: {out}");
        }
    }

    fn sequence() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("\u{1b}[0m".to_string()),
            Just("\u{1b}[1;31m".to_string()),
            Just("\u{1b}]0;x\u{7}".to_string()),
            Just("\u{1b}]8;;http://e\u{1b}\\".to_string()),
            Just("\r".to_string()),
            Just("\u{200b}".to_string()),
            Just("\u{202e}".to_string()),
            Just(String::new()),
        ]
    }

    proptest! {
        #[test]
        fn a_secret_interleaved_with_sequences_is_never_shown(
            secret in "[a-zA-Z0-9]{4,12}",
            seqs in proptest::collection::vec(sequence(), 12),
            noise in "[a-z0-9 ]{0,40}",
        ) {
            let m = Masker::new([secret.as_str()]);
            let mut hidden = String::new();
            for (c, s) in secret.chars().zip(&seqs) {
                hidden.push(c);
                hidden.push_str(s);
            }
            let line = format!("{noise}{hidden}{noise}");
            let out = m.mask(&line);
            prop_assert!(!out.contains(&secret), "{out:?}");
            prop_assert!(!visible(&out).text.contains(&secret), "{out:?}");
        }

        #[test]
        fn a_secret_is_masked_wherever_the_line_is_cut(
            secret in "[a-zA-Z0-9]{4,40}",
            seqs in proptest::collection::vec(sequence(), 40),
            before in 0usize..200,
            sizes in proptest::collection::vec(1usize..64, 1..4),
            max_carry in 48usize..200,
        ) {
            let m = Masker::new([secret.as_str()]);
            let mut hidden = String::new();
            for (c, s) in secret.chars().zip(&seqs) {
                hidden.push(c);
                hidden.push_str(s);
            }
            let line = format!("{}{hidden}{}{secret}", "-".repeat(before), "=".repeat(before / 2));
            let out = through_cuts(&m, &line, &sizes, max_carry);
            prop_assert!(!visible(&out).text.contains(&secret), "{out:?}");
        }

        #[test]
        fn a_masked_line_never_contains_a_secret(secret in "[a-zA-Z0-9]{4,12}", noise in "[a-z0-9 ]{0,40}", at in 0usize..40) {
            let m = Masker::new([secret.as_str()]);
            let cut = at.min(noise.len());
            let line = format!("{}{}{}{}", &noise[..cut], secret, &noise[cut..], secret);
            prop_assert!(!m.mask(&line).contains(&secret));
        }
    }
}
