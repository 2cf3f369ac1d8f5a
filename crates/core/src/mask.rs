//! Secret masking for job output: every occurrence of a secret's value becomes `***`.
//!
//! Output reaches the masker as whole lines (the agent joins pipe reads up to a newline), so a
//! value written in several pieces is masked once its line is complete. A multi-line secret
//! (a private key) is masked line by line: each of its lines is a value of its own. Values
//! shorter than [`MIN_LEN`] are not masked: masking `1` or `true` would destroy the log
//! without protecting anything.

/// Shortest value that is masked.
pub const MIN_LEN: usize = 4;

#[derive(Clone, Debug, Default)]
pub struct Masker {
    /// Longest first, so a value that contains another is masked whole.
    values: Vec<String>,
}

impl Masker {
    pub fn new<'a>(secrets: impl IntoIterator<Item = &'a str>) -> Masker {
        let mut values: Vec<String> = secrets
            .into_iter()
            .flat_map(|s| {
                s.lines().map(str::trim_end).filter(|l| l.len() >= MIN_LEN).map(str::to_string).collect::<Vec<_>>()
            })
            .collect();
        values.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
        values.dedup();
        Masker { values }
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// The line with every secret value replaced by `***`.
    pub fn mask(&self, line: &str) -> String {
        if self.values.is_empty() {
            return line.to_string();
        }
        let mut out = String::with_capacity(line.len());
        let mut rest = line;
        'outer: while !rest.is_empty() {
            // Earliest match; among matches at the same place, the longest (values are sorted).
            let mut best: Option<(usize, usize)> = None;
            for v in &self.values {
                if let Some(at) = rest.find(v.as_str()) {
                    if best.is_none_or(|(b, _)| at < b) {
                        best = Some((at, v.len()));
                    }
                }
            }
            match best {
                Some((at, len)) => {
                    out.push_str(&rest[..at]);
                    out.push_str("***");
                    rest = &rest[at + len..];
                }
                None => {
                    out.push_str(rest);
                    break 'outer;
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    proptest! {
        #[test]
        fn a_masked_line_never_contains_a_secret(secret in "[a-zA-Z0-9]{4,12}", noise in "[a-z0-9 ]{0,40}", at in 0usize..40) {
            let m = Masker::new([secret.as_str()]);
            let cut = at.min(noise.len());
            let line = format!("{}{}{}{}", &noise[..cut], secret, &noise[cut..], secret);
            prop_assert!(!m.mask(&line).contains(&secret));
        }
    }
}
