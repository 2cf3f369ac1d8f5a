//! Secret masking for job output: every occurrence of a secret's value, and of its common
//! encodings, becomes `***`.
//!
//! Output reaches the masker as whole lines (the agent joins pipe reads up to a newline), so a
//! value written in several pieces is masked once its line is complete. A multi-line secret
//! (a private key) is masked line by line: each of its lines is a value of its own. Values
//! shorter than [`MIN_LEN`] are not masked: masking `1` or `true` would destroy the log
//! without protecting anything.
//!
//! **What is searched for.** Every value, and derived from it (and from the value with the
//! newline `echo` adds, and a multi-line secret also whole):
//! - *base64*, standard (`+/`) and URL-safe (`-_`) alphabets, with and without `=` padding,
//!   **at every offset**. A value inside a larger blob starts at byte offset 0, 1 or 2 modulo
//!   3, which gives three different encodings; of each, the characters that depend on the
//!   value's bits alone are searched for (a character straddling the value's first or last
//!   byte also carries a neighbour's bits, so it cannot be known in advance: GitHub does the
//!   same). A blob that *ends* with the value is also matched to its end, last partial
//!   character and padding included, so `echo -n $SECRET | base64` shows only `***`.
//! - *hex*, lower and upper case (`xxd -p` of a value up to 30 bytes, `.hex()`).
//! - *URL-encoding*: a line with a `%` in it is also searched after percent-decoding (either
//!   case of hex digit, any choice of which characters an encoder escaped, double-encoded
//!   derived values such as base64's `%3D` padding included), and a value with spaces is also
//!   searched for with `+` for each space (form encoding).
//!
//! Derived forms shorter than [`MIN_DERIVED_LEN`] characters are not searched for: they come
//! only from values of up to 6 bytes (the inner base64 of a 5-byte value at offset 1 is 5
//! characters), they are alphanumeric, and at that length they turn up in ordinary output
//! (hashes, identifiers, base64 of unrelated data) often enough to garble logs, while
//! protecting a value that short protects little. The value itself still follows [`MIN_LEN`].
//!
//! **How.** All of these strings are computed once, in [`Masker::new`], and searched for in one
//! pass with an Aho–Corasick automaton (the `aho-corasick` crate), not one substring scan per
//! string. Every match is reported, overlapping ones included, and the *union* of their spans
//! becomes `***`. That makes masking monotone: adding a value (a secret, or one a job registers
//! with `::add-mask::`) can only hide more, never uncover part of another value, as it could
//! when the leftmost match won and the search went on after it (registering `xxS` turned
//! `xxSECRET` into `***ECRET`).
//!
//! Two ways a job could slip a value past a plain search are closed here:
//! - *Escape sequences inside the value* (`printf 'AB\e[0mCD'`, colour codes between its
//!   characters, `\r`, invisible characters): the value is also searched for in what a
//!   terminal would show ([`crate::text::visible`]), and the whole span of the original it
//!   came from, sequences included, becomes `***`.
//! - *A line longer than the agent's cut* (64 KiB): [`Masker::cut`] masks the piece and keeps
//!   back its tail, long enough to hold the start of any searched string, for the next piece;
//!   no value can straddle a cut. Should that tail not fit the caller's bound, the longest
//!   tail that fits is kept, so shorter values are still caught.
//!
//! **Values a job registers** ([`add_mask_command`], [`Masker::register`]): a step prints
//! `::add-mask::VALUE` on its standard output (GitHub Actions' syntax, so scripts written for
//! it work unchanged; `%25`, `%0D` and `%0A` stand for `%`, CR and LF as there). From that line
//! on, VALUE and its encodings are masked like a secret, the command line itself included.
//! Refused (and said in the log, never with the value): values shorter than [`MIN_LEN`],
//! longer than [`MAX_REGISTERED_LEN`] bytes, more than [`MAX_REGISTERED`] per job or more
//! than [`MAX_REGISTERED_TOTAL`] bytes in all; the
//! bounds keep the automaton and the cut's tail small whatever a job prints. There is no
//! gpuci-specific second syntax: one name that existing scripts already print is easier to
//! audit than two.
//!
//! Not covered, by design: a value the job transforms otherwise (reversed, one character per
//! line, a combining accent or a Hangul jamo after each character, base64 or hex wrapped
//! over several lines — `base64` wraps at 76 columns, `xxd -p` at 60 — or with separators
//! between the bytes: those show), or redrawn out of order with cursor movement. A job that
//! holds a secret can always print it in a form no masker recognises; masking stops accidents
//! and the cheap tricks.

use crate::text::{has_hidden, visible};
use aho_corasick::AhoCorasick;

/// Shortest value that is masked.
pub const MIN_LEN: usize = 4;
/// Shortest derived form (an encoding of a value) that is searched for; see the module header.
pub const MIN_DERIVED_LEN: usize = 8;
/// Most values one job may register (`::add-mask::`).
pub const MAX_REGISTERED: usize = 64;
/// Longest value a job may register, in bytes: its percent-encoded form (the longest derived
/// form, three characters a byte) stays well under the agent's carry across a line cut (16 KiB).
pub const MAX_REGISTERED_LEN: usize = 1024;
/// Most bytes of registered values one job may hold in all. Each registration rebuilds the
/// masker from every value (its derived forms included), so this bounds what a job can make
/// the agent compute: 64 values of 4 KiB each took the debug build over a second per value at
/// the end and stalled an agent's heartbeats (outsider finding).
pub const MAX_REGISTERED_TOTAL: usize = 8 << 10;

/// Why a value a job registered is not masked. Never carries the value: these are shown in
/// the job's log.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    #[error("add-mask: a value of {len} characters is too short to be a secret (at least {MIN_LEN}); not masked")]
    TooShort { len: usize },
    #[error(
        "add-mask: a value of {len} bytes is longer than the {MAX_REGISTERED_LEN} bytes a job may register; not masked"
    )]
    TooLong { len: usize },
    #[error("add-mask: this job already registered {MAX_REGISTERED} values, the most one job may; not masked")]
    TooMany,
    #[error(
        "add-mask: this job's registered values would hold more than {MAX_REGISTERED_TOTAL} bytes in all; not masked"
    )]
    TooMuch,
}

#[derive(Clone, Debug, Default)]
pub struct Masker {
    /// What the masker was made from (secrets' values, then registered ones), to rebuild it.
    sources: Vec<String>,
    /// How many of `sources` the job registered.
    registered: usize,
    /// The strings searched for in the line as written (and percent-decoded).
    raw: Needles,
    /// What a terminal shows of each of them.
    shown: Needles,
    /// Characters in the longest string searched for.
    longest_chars: usize,
}

/// A set of strings and the automaton that finds them all in one pass. `None` with strings:
/// the automaton could not be built (it cannot, within the bounds above); every line is then
/// masked whole rather than shown unsearched.
#[derive(Clone, Debug, Default)]
struct Needles {
    strings: Vec<String>,
    search: Option<AhoCorasick>,
}

impl Needles {
    fn new(mut strings: Vec<String>) -> Needles {
        strings.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        strings.dedup();
        // The crate picks the automaton: for a job's few hundred strings a contiguous NFA
        // (~70 KiB, built in ~1.5 ms; a DFA scans ~2× faster but takes ~2.5 MiB and ~10 ms,
        // on the path to the job's start and again for each value the job registers).
        let search = if strings.is_empty() { None } else { AhoCorasick::new(&strings).ok() };
        Needles { strings, search }
    }

    /// Byte spans of every match in `text`, overlapping ones included, in order of their end.
    fn spans(&self, text: &[u8]) -> Vec<(usize, usize)> {
        match &self.search {
            Some(ac) => ac.find_overlapping_iter(text).map(|m| (m.start(), m.end())).collect(),
            None if self.strings.is_empty() => Vec::new(),
            None => vec![(0, text.len())],
        }
    }
}

impl Masker {
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a str>) -> Masker {
        Masker::build(secrets.into_iter().map(str::to_string).collect(), 0)
    }

    fn build(sources: Vec<String>, registered: usize) -> Masker {
        let mut raw = Vec::new();
        for s in &sources {
            let lines: Vec<&str> = s.lines().map(str::trim_end).filter(|l| l.len() >= MIN_LEN).collect();
            let mut encoded: Vec<Vec<u8>> = Vec::new();
            for l in &lines {
                raw.push(l.to_string());
                if l.contains(' ') {
                    raw.push(l.replace(' ', "+"));
                }
                // A value with a quote or a backslash, dumped by accident in a config's JSON
                // or a Python repr (outsider finding): its escaped forms.
                if l.contains(['"', '\\', '\'']) {
                    let backslashes = l.replace('\\', "\\\\");
                    raw.push(backslashes.replace('"', "\\\""));
                    raw.push(backslashes.replace('\'', "\\'"));
                    raw.push(backslashes);
                }
                encoded.push(l.as_bytes().to_vec());
                encoded.push(format!("{l}\n").into_bytes());
            }
            // A key file base64'd whole (a kubeconfig's certificate data).
            let whole = s.trim_end();
            if whole.contains('\n') && whole.len() >= MIN_LEN {
                encoded.extend([s.as_bytes().to_vec(), whole.as_bytes().to_vec(), format!("{whole}\n").into_bytes()]);
            }
            for bytes in &encoded {
                raw.extend(derived(bytes).into_iter().filter(|d| d.len() >= MIN_DERIVED_LEN));
            }
        }
        let shown: Vec<String> = raw.iter().map(|v| visible(v).text).filter(|v| v.len() >= MIN_LEN).collect();
        let longest_chars = shown.iter().chain(&raw).map(|v| v.chars().count()).max().unwrap_or(0);
        Masker { sources, registered, raw: Needles::new(raw), shown: Needles::new(shown), longest_chars }
    }

    pub fn is_empty(&self) -> bool {
        self.raw.strings.is_empty()
    }

    /// Mask `value` too from now on (a value the job registered with `::add-mask::`). The
    /// masker is unchanged when the value is refused.
    pub fn register(&mut self, value: &str) -> Result<(), RegisterError> {
        let value = self.admits(value)?;
        if !self.sources.iter().any(|s| s == value) {
            let mut sources = std::mem::take(&mut self.sources);
            sources.push(value.to_string());
            *self = Masker::build(sources, self.registered + 1);
        }
        Ok(())
    }

    /// Whether [`Masker::register`] would take `value` (trimmed, as it would keep it); cheap,
    /// so a job repeating a refused command costs no rebuild and no copy.
    pub fn admits<'v>(&self, value: &'v str) -> Result<&'v str, RegisterError> {
        let value = value.trim();
        if value.lines().all(|l| l.trim_end().len() < MIN_LEN) {
            return Err(RegisterError::TooShort { len: value.chars().count() });
        }
        if value.len() > MAX_REGISTERED_LEN {
            return Err(RegisterError::TooLong { len: value.len() });
        }
        if !self.sources.iter().any(|s| s == value) {
            if self.registered >= MAX_REGISTERED {
                return Err(RegisterError::TooMany);
            }
            let held: usize =
                self.sources[self.sources.len().saturating_sub(self.registered)..].iter().map(String::len).sum();
            if held + value.len() > MAX_REGISTERED_TOTAL {
                return Err(RegisterError::TooMuch);
            }
        }
        Ok(value)
    }

    /// The line with every secret value and derived form replaced by `***`: as written,
    /// percent-decoded, and as a terminal would show it.
    pub fn mask(&self, line: &str) -> String {
        if self.is_empty() {
            return line.to_string();
        }
        let mut spans = self.raw.spans(line.as_bytes());
        if let Some((decoded, escapes)) = percent_decoded(line) {
            // Decoded byte d lies 2 bytes further on in `line` for each `%XX` before it.
            let at = |d: usize| d + 2 * escapes.partition_point(|&e| e < d);
            let end = |d: usize| at(d) + if escapes.binary_search(&d).is_ok() { 3 } else { 1 };
            spans.extend(self.raw.spans(&decoded).into_iter().map(|(a, b)| (at(a), end(b - 1))));
        }
        let mut out = replace(line, spans);
        // Printable ASCII hides nothing: skip the (much slower) character-class test.
        if !out.bytes().all(|b| b == b'\t' || (b' '..=b'~').contains(&b)) && has_hidden(&out) {
            out = self.mask_shown(&out);
        }
        out
    }

    /// Values found in what a terminal shows of `line`; each is replaced with the whole
    /// stretch of `line` it was drawn from.
    fn mask_shown(&self, line: &str) -> String {
        let v = visible(line);
        let spans = self.shown.spans(v.text.as_bytes());
        if spans.is_empty() {
            return line.to_string();
        }
        replace(line, spans.into_iter().map(|(a, b)| (v.origin[a].0, v.origin[b - 1].1)).collect())
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
    /// caught. Should even that not fit (a derived form or a value longer than `max_carry`),
    /// the longest shown tail that fits beside an open sequence's introducer is carried:
    /// `max_carry` bounds memory and guarantees progress, and every value of up to
    /// `max_carry − 3` bytes is still caught.
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
                // Room for shown characters first: of an open sequence only its introducer
                // (at most 3 bytes). Carrying the whole sequence instead cost a 40-character
                // value its first characters when its base64 form (the longest searched)
                // did not fit: CI's proptest, `max_carry` 48.
                let open = if short.len() <= max_carry { short } else { String::new() };
                let room = max_carry.saturating_sub(open.len());
                let mut from = v.text.len().saturating_sub(room).max(from);
                while !v.text.is_char_boundary(from) {
                    from += 1;
                }
                let start = v.origin.get(from).map_or(end, |o| o.0);
                now.truncate(start);
                (now, format!("{}{open}", &v.text[from..]))
            }
        }
    }
}

/// `line` with each span (byte ranges, in any order, overlapping or not) replaced: spans
/// that overlap or touch become one `***`.
fn replace(line: &str, mut spans: Vec<(usize, usize)>) -> String {
    if spans.is_empty() {
        return line.to_string();
    }
    spans.sort_unstable();
    let mut out = String::with_capacity(line.len());
    let mut pos = 0;
    let mut it = spans.into_iter().peekable();
    while let Some((mut a, mut b)) = it.next() {
        while let Some(&(c, d)) = it.peek() {
            if c > b {
                break;
            }
            b = b.max(d);
            it.next();
        }
        // Matches of whole characters end on character boundaries; widen if one ever did not.
        a = a.max(pos);
        while !line.is_char_boundary(a) {
            a -= 1;
        }
        while !line.is_char_boundary(b) {
            b += 1;
        }
        if a < pos {
            a = pos;
        }
        out.push_str(&line[pos..a]);
        if b > a {
            out.push_str("***");
        }
        pos = pos.max(b);
    }
    out.push_str(&line[pos..]);
    out
}

/// `line` with each `%XX` (either case) decoded to its byte, and where in the result those
/// bytes are (in order); `None`: the line has no `%XX`, so nothing to decode. Every other
/// byte is copied as it is, so a match in the result maps back to `line` by counting the
/// escapes before it.
fn percent_decoded(line: &str) -> Option<(Vec<u8>, Vec<usize>)> {
    let bytes = line.as_bytes();
    let hex = |b: Option<&u8>| b.and_then(|&b| (b as char).to_digit(16));
    let (mut out, mut escapes) = (Vec::new(), Vec::new());
    let mut i = 0;
    while let Some(p) = bytes[i..].iter().position(|&b| b == b'%') {
        let p = i + p;
        if let (Some(h), Some(l)) = (hex(bytes.get(p + 1)), hex(bytes.get(p + 2))) {
            if escapes.is_empty() {
                out.reserve(line.len());
            }
            out.extend_from_slice(&bytes[i..p]);
            escapes.push(out.len());
            out.push((h * 16 + l) as u8);
            i = p + 3;
        } else {
            out.extend_from_slice(&bytes[i..=p]);
            i = p + 1;
        }
    }
    if escapes.is_empty() {
        return None;
    }
    out.extend_from_slice(&bytes[i..]);
    Some((out, escapes))
}

/// Every derived form of `value` that is searched for (before the length floor): base64 in
/// both alphabets at the three offsets, each in the middle of a blob and at its end (with and
/// without padding), and hex in both cases.
fn derived(value: &[u8]) -> Vec<String> {
    const STANDARD: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    const URL_SAFE: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = Vec::new();
    for alphabet in [STANDARD, URL_SAFE] {
        for offset in 0..3 {
            // The value after `offset` bytes of anything: character i of the encoding covers
            // bits [6i, 6i + 6), the value bits [8·offset, 8·(offset + len)).
            let mut bytes = vec![0u8; offset];
            bytes.extend_from_slice(value);
            let enc = base64(alphabet, &bytes);
            let first = (8 * offset).div_ceil(6);
            let stable = 8 * (offset + value.len()) / 6;
            if stable <= first {
                continue;
            }
            out.push(enc[first..stable].to_string());
            // The blob ends with the value: its last character's free bits are zero.
            out.push(enc[first..].to_string());
            let pad = (3 - bytes.len() % 3) % 3;
            out.push(format!("{}{}", &enc[first..], "=".repeat(pad)));
        }
    }
    let lower: String = value.iter().map(|b| format!("{b:02x}")).collect();
    out.push(lower.to_ascii_uppercase());
    out.push(lower);
    out
}

/// Base64 of `bytes` without padding (the last character's free bits zero).
fn base64(alphabet: &[u8; 64], bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for group in bytes.chunks(3) {
        let n = group.iter().enumerate().fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..=group.len() {
            out.push(alphabet[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
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

/// The value of an `::add-mask::VALUE` line (GitHub Actions' workflow command, at the start of
/// the line after any blanks), with `%25`, `%0D` and `%0A` decoded as GitHub does; `None`:
/// the line is no such command.
pub fn add_mask_command(line: &str) -> Option<String> {
    let value = line.trim_start().strip_prefix("::add-mask::")?;
    Some(value.replace("%0D", "\r").replace("%0A", "\n").replace("%0d", "\r").replace("%0a", "\n").replace("%25", "%"))
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

    /// Base64 of `bytes` with padding, in the standard or URL-safe alphabet (test-side,
    /// written out separately from the masker's).
    fn b64(bytes: &[u8], url: bool) -> String {
        let mut s = base64(
            if url {
                b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
            } else {
                b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
            },
            bytes,
        );
        while !s.len().is_multiple_of(4) {
            s.push('=');
        }
        s
    }

    #[test]
    fn base64_matches_known_encodings() {
        assert_eq!(b64(b"hf_Sup3rS3cretValue42", false), "aGZfU3VwM3JTM2NyZXRWYWx1ZTQy");
        assert_eq!(b64(b"any carnal pleas", false), "YW55IGNhcm5hbCBwbGVhcw==");
        assert_eq!(b64(&[0xfb, 0xff, 0xbf], false), "+/+/");
        assert_eq!(b64(&[0xfb, 0xff, 0xbf], true), "-_-_");
    }

    /// `echo -n $SECRET | base64` (and `echo $SECRET | base64`, with the newline): only `***`.
    #[test]
    fn base64_of_a_secret_is_masked_whole() {
        let secret = "hf_Sup3rS3cretValue42x";
        let m = Masker::new([secret]);
        for url in [false, true] {
            for tail in ["", "\n"] {
                let enc = b64(format!("{secret}{tail}").as_bytes(), url);
                assert_eq!(m.mask(&enc), "***", "{enc}");
                assert_eq!(m.mask(enc.trim_end_matches('=')), "***", "unpadded {enc}");
                assert_eq!(m.mask(&format!("token: {enc} end")), "token: *** end");
            }
        }
    }

    /// A secret inside a larger blob starts at offset 0, 1 or 2 modulo 3: three encodings,
    /// each masked, in both alphabets; at most the characters it shares with its neighbours
    /// show.
    #[test]
    fn base64_of_a_secret_inside_a_blob_is_masked_at_every_offset() {
        let secret = b"s3cr3t-T0ken/with+Bits?~~";
        let m = Masker::new([std::str::from_utf8(secret).unwrap()]);
        for before in 0..6 {
            for url in [false, true] {
                let mut blob = b"{\"user\":\"ci\",\"pass\":\"".to_vec()[..10 + before].to_vec();
                blob.extend_from_slice(secret);
                blob.extend_from_slice(b"\",\"x\":1}");
                let enc = b64(&blob, url);
                let out = m.mask(&enc);
                assert!(out.contains("***"), "offset {before} url {url}: {out}");
                // What shows is at most the blob around it: the secret's inner part is gone.
                let inner = &b64(secret, url)[4..28];
                assert!(!out.contains(inner), "{out}");
                assert!(out.len() <= enc.len() - 24, "offset {before}: {enc} -> {out}");
            }
        }
    }

    /// Outsider finding: a config dumped as JSON, or a Python repr, escapes a value's quotes
    /// and backslashes, and the value showed.
    #[test]
    fn a_value_with_quotes_or_backslashes_is_masked_in_json_and_repr() {
        let m = Masker::new(["Zq9/vK2\"pL7\\wX4+Q"]);
        assert_eq!(m.mask(r#"{"k": "Zq9/vK2\"pL7\\wX4+Q"}"#), r#"{"k": "***"}"#);
        assert_eq!(m.mask(r#"'Zq9/vK2"pL7\\wX4+Q'"#), "'***'");
    }

    /// Outsider finding: 64 registrations of 4 KiB each stalled an agent; the bytes a job may
    /// register are bounded in all.
    #[test]
    fn registered_values_are_bounded_in_total_bytes() {
        let mut m = Masker::new(std::iter::empty());
        let each = MAX_REGISTERED_LEN;
        for i in 0..MAX_REGISTERED_TOTAL / each {
            m.register(&format!("{i:04}{}", "v".repeat(each - 4))).unwrap();
        }
        assert_eq!(m.register(&format!("more{}", "w".repeat(8))), Err(RegisterError::TooMuch));
    }

    #[test]
    fn hex_of_a_secret_is_masked_in_either_case() {
        let m = Masker::new(["s3cr3t-token"]);
        assert_eq!(m.mask("digest 73336372337420746f6b656e"), "digest 73336372337420746f6b656e");
        assert_eq!(m.mask("hex 7333637233742d746f6b656e."), "hex ***.");
        assert_eq!(m.mask("HEX 7333637233742D746F6B656E"), "HEX ***");
    }

    #[test]
    fn url_encoded_secrets_are_masked() {
        let m = Masker::new(["p@ss/w0rd+k=y with space"]);
        for line in [
            "https://x/?q=p%40ss%2Fw0rd%2Bk%3Dy%20with%20space&z=1",
            "https://x/?q=p%40ss%2fw0rd%2bk%3dy%20with%20space&z=1",
            "q=p%40ss/w0rd%2Bk=y+with+space&z=1",
            "q=%70%40%73%73%2F%77%30%72%64%2B%6B%3D%79%20with%20space&z=1",
        ] {
            let out = m.mask(line);
            assert!(out.ends_with("***&z=1"), "{line} -> {out}");
            assert!(!out.contains("w0rd") && !out.contains("with"), "{out}");
        }
        // The base64 of a value, percent-encoded in a URL (`=` is `%3D`).
        let m = Masker::new(["s3cr3t-tokn"]);
        assert_eq!(m.mask("u=czNjcjN0LXRva24%3D&v=1"), "u=***&v=1");
    }

    #[test]
    fn short_derived_forms_are_not_masked() {
        // "abcd" at offset 1 in base64 is 4 characters (`YWJj` shifted): far too common.
        let m = Masker::new(["abcd"]);
        for (form, masked) in [("YWJjZA==", true), ("61626364", true), ("WJj", false)] {
            assert_eq!(m.mask(form) == "***", masked, "{form}");
        }
        assert!(derived(b"abcd").iter().any(|d| d.len() < MIN_DERIVED_LEN), "there are short forms to leave");
    }

    /// Regression (monotone masking): with the leftmost match winning, registering `xxS` (or
    /// any value overlapping a secret's start) uncovered the rest of the secret.
    #[test]
    fn adding_a_value_never_uncovers_another() {
        let mut m = Masker::new(["SECRETVALUE"]);
        m.register("xxSECR").unwrap();
        assert_eq!(m.mask("a xxSECRETVALUE b"), "a *** b");
        let m = Masker::new(["pass1234", "1234abcd"]);
        assert_eq!(m.mask("pass1234abcd"), "***");
    }

    #[test]
    fn a_registered_value_and_its_encodings_are_masked_from_then_on() {
        let mut m = Masker::new(["s3cr3t-token"]);
        let line = "::add-mask::derived-Value-42";
        let value = add_mask_command(line).unwrap();
        assert_eq!(m.mask(line), line, "not masked before it is registered");
        m.register(&value).unwrap();
        assert_eq!(m.mask(line), "::add-mask::***");
        assert_eq!(m.mask("x derived-Value-42 and s3cr3t-token"), "x *** and ***");
        assert_eq!(m.mask(&b64(b"derived-Value-42", false)), "***");
        assert_eq!(add_mask_command("  ::add-mask::a%0Ab%25c"), Some("a\nb%c".into()));
        assert_eq!(add_mask_command("echo ::add-mask::x"), None);
    }

    #[test]
    fn registering_refuses_short_long_and_too_many_values_without_echoing_them() {
        let mut m = Masker::new(std::iter::empty());
        let e = m.register("abc").unwrap_err();
        assert_eq!(e, RegisterError::TooShort { len: 3 });
        assert!(!e.to_string().contains("abc"));
        assert!(m.is_empty(), "a refused value changes nothing");
        let long = MAX_REGISTERED_LEN + 1;
        assert_eq!(m.register(&"x".repeat(long)), Err(RegisterError::TooLong { len: long }));
        for i in 0..MAX_REGISTERED {
            m.register(&format!("value-{i:04}")).unwrap();
        }
        assert_eq!(m.register("one-too-many"), Err(RegisterError::TooMany));
        assert_eq!(m.mask("value-0063 one-too-many"), "*** one-too-many");
    }

    /// A registered value held back across the agent's line cut, like a secret.
    #[test]
    fn a_registered_value_split_by_the_line_cut_is_masked() {
        let mut m = Masker::new(std::iter::empty());
        m.register("late-Registered-1").unwrap();
        let line = format!("{}late-Registered-1{}", "x".repeat(60), "y".repeat(10));
        for at in 55..80 {
            let out = through_cuts(&m, &line, &[at, 1000], 4096);
            assert!(!out.contains("late-Registered-1"), "cut at {at}: {out}");
        }
        let enc = b64(b"late-Registered-1", false);
        let line = format!("{}{enc}{}", "x".repeat(60), "y".repeat(10));
        for at in 55..90 {
            let out = through_cuts(&m, &line, &[at, 1000], 4096);
            assert!(!out.contains(&enc[..20]), "cut at {at}: {out}");
        }
    }

    /// Regression: a value longer than the carry made the cut carry nothing at all, so every
    /// other value across the cut showed (a job could register one to uncover a secret).
    #[test]
    fn a_value_longer_than_the_carry_does_not_uncover_shorter_ones_across_the_cut() {
        let long = "L".repeat(200);
        let m = Masker::new([long.as_str(), "s3cr3t-token"]);
        let line = format!("{}s3cr3t-token{}", "x".repeat(60), "y".repeat(10));
        for at in 55..75 {
            let out = through_cuts(&m, &line, &[at, 1000], 64);
            assert!(!out.contains("s3cr3t-token"), "cut at {at}: {out}");
        }
    }

    /// Regression (CI's proptest): a 40-character value whose base64 form (the longest
    /// searched, 56 characters) did not fit a 48-byte carry, cut inside an OSC sequence: the
    /// carry kept the whole open sequence and only 34 shown characters, and the value showed.
    #[test]
    fn a_value_that_fits_the_carry_is_masked_when_its_derived_forms_do_not() {
        let secret = "AaAAAaa0a0aAAAAAaAaAa00A0A0AaaaaaAA0AAAA";
        let m = Masker::new([secret]);
        let (r, b, o, n, z) = ("\r", "\u{1b}[1;31m", "\u{1b}]8;;http://e\u{1b}\\", "\u{1b}[0m", "\u{200b}");
        let seqs = [
            n, "", r, r, z, "", r, o, o, r, b, n, n, n, z, n, z, o, "", r, b, b, b, "", z, z, b, b, r, z, r, b, o, b,
            b, b, b, o, o, n,
        ];
        let hidden: String = secret.chars().zip(seqs).map(|(c, s)| format!("{c}{s}")).collect();
        let line = format!("{}{hidden}{}{secret}", "-".repeat(40), "=".repeat(20));
        let out = through_cuts(&m, &line, &[5, 12], 48);
        assert!(!visible(&out).text.contains(secret), "{out:?}");
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

        /// Base64 of any secret (7 bytes or longer: every offset's inner part is then at
        /// least `MIN_DERIVED_LEN` characters) at any offset inside random bytes: the
        /// characters that depend on the secret alone never show.
        #[test]
        fn base64_of_a_secret_anywhere_in_random_bytes_is_masked(
            secret in "[!-~][ -~]{5,40}[!-~]",
            before in proptest::collection::vec(any::<u8>(), 0..24),
            after in proptest::collection::vec(any::<u8>(), 0..24),
            url in any::<bool>(),
            padded in any::<bool>(),
        ) {
            let m = Masker::new([secret.as_str()]);
            let mut blob = before.clone();
            blob.extend_from_slice(secret.as_bytes());
            blob.extend_from_slice(&after);
            let mut enc = b64(&blob, url);
            if !padded {
                enc = enc.trim_end_matches('=').to_string();
            }
            let out = m.mask(&enc);
            let (from, to) = ((8 * before.len()).div_ceil(6), 8 * (before.len() + secret.len()) / 6);
            let inner = &enc[from..to];
            prop_assert!(out.contains("***") && !out.contains(inner), "{enc} -> {out}");
            prop_assert!(out.len() + inner.len() <= enc.len() + 3, "{enc} -> {out}");
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
