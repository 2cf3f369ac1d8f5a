//! Condition text → [`Expr`], and its evaluation. See the module above for the language.

use super::{BuildEvent, BuildFacts, Truth, MAX_DEPTH, MAX_GLOBS, MAX_LEN, MAX_REGEX_SIZE, MAX_TERMS};
use regex::{Regex, RegexBuilder};
use std::collections::BTreeMap;

/// A problem in a condition, at `offset` characters from its start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("at character {}: {message}", .offset + 1)]
pub struct ConditionError {
    /// 0-based, in characters.
    pub offset: usize,
    pub message: String,
}

const FACTS: &[&str] = &["build.branch", "build.tag", "build.event", "build.commit", "env.NAME"];

#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Fact {
    Branch,
    Tag,
    Event,
    Commit,
    Env(String),
}

impl Fact {
    fn name(&self) -> String {
        match self {
            Fact::Branch => "build.branch".into(),
            Fact::Tag => "build.tag".into(),
            Fact::Event => "build.event".into(),
            Fact::Commit => "build.commit".into(),
            Fact::Env(n) => format!("env.{n}"),
        }
    }

    /// Its value; `None` when unknown.
    fn value<'f>(&self, facts: &'f BuildFacts, env: &'f BTreeMap<String, String>) -> Option<&'f str> {
        match self {
            Fact::Branch => facts.branch.as_deref(),
            Fact::Tag => facts.tag.as_deref(),
            Fact::Event => facts.event.map(BuildEvent::as_str),
            Fact::Commit => facts.commit.as_deref(),
            Fact::Env(n) => Some(env.get(n).map_or("", String::as_str)),
        }
    }
}

#[derive(Clone, Debug)]
pub(super) enum Operand {
    Fact(Fact),
    Lit(String),
}

impl Operand {
    fn value<'a>(
        &'a self,
        facts: &'a BuildFacts,
        env: &'a BTreeMap<String, String>,
        read: &mut Vec<String>,
    ) -> Option<&'a str> {
        match self {
            Operand::Lit(s) => Some(s),
            Operand::Fact(f) => {
                let v = f.value(facts, env);
                read.push(match v {
                    Some(v) => format!("{} = {v:?}", f.name()),
                    None => format!("{} is unknown", f.name()),
                });
                v
            }
        }
    }
}

#[derive(Clone, Debug)]
pub(super) enum Expr {
    Const(bool),
    Not(Box<Expr>),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
    Eq { left: Operand, right: Operand, negate: bool },
    Match { left: Operand, regex: Regex, negate: bool },
    Changed { globs: Vec<String>, matcher: Regex },
}

impl Expr {
    /// Every operand is evaluated (no short cut), so that `read` lists each fact the
    /// condition names; the work is still linear in the condition's size.
    pub(super) fn eval(&self, facts: &BuildFacts, env: &BTreeMap<String, String>, read: &mut Vec<String>) -> Truth {
        match self {
            Expr::Const(b) => Truth::of(*b),
            Expr::Not(e) => e.eval(facts, env, read).not(),
            Expr::And(a, b) => {
                let a = a.eval(facts, env, read);
                a.and(b.eval(facts, env, read))
            }
            Expr::Or(a, b) => {
                let a = a.eval(facts, env, read);
                a.or(b.eval(facts, env, read))
            }
            Expr::Eq { left, right, negate } => {
                let l = left.value(facts, env, read);
                let r = right.value(facts, env, read);
                match (l, r) {
                    (Some(l), Some(r)) => Truth::of((l == r) != *negate),
                    _ => Truth::Unknown,
                }
            }
            Expr::Match { left, regex, negate } => match left.value(facts, env, read) {
                Some(v) => Truth::of(regex.is_match(v) != *negate),
                None => Truth::Unknown,
            },
            Expr::Changed { globs, matcher } => {
                let call =
                    format!("changed({})", globs.iter().map(|g| format!("{g:?}")).collect::<Vec<_>>().join(", "));
                match &facts.changed {
                    None => {
                        read.push("the changed paths are unknown".into());
                        Truth::Unknown
                    }
                    Some(paths) => {
                        let hit = paths.iter().find(|p| matcher.is_match(p));
                        read.push(match hit {
                            Some(p) => format!("{call} matched {p:?}"),
                            None => format!("{call} matched none of {} changed paths", paths.len()),
                        });
                        Truth::of(hit.is_some())
                    }
                }
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Str(String),
    Regex(String),
    LParen,
    RParen,
    Comma,
    Not,
    And,
    Or,
    Eq,
    Ne,
    Match,
    NotMatch,
    End,
}

impl Tok {
    fn describe(&self) -> String {
        match self {
            Tok::Ident(s) => format!("`{s}`"),
            Tok::Str(s) => format!("the string {s:?}"),
            Tok::Regex(s) => format!("the regular expression /{s}/"),
            Tok::LParen => "`(`".into(),
            Tok::RParen => "`)`".into(),
            Tok::Comma => "`,`".into(),
            Tok::Not => "`!`".into(),
            Tok::And => "`&&`".into(),
            Tok::Or => "`||`".into(),
            Tok::Eq => "`==`".into(),
            Tok::Ne => "`!=`".into(),
            Tok::Match => "`=~`".into(),
            Tok::NotMatch => "`!~`".into(),
            Tok::End => "the end of the condition".into(),
        }
    }
}

fn err(offset: usize, message: impl Into<String>) -> ConditionError {
    ConditionError { offset, message: message.into() }
}

/// Tokens with their offsets in characters. A `/` starts a regex only right after `=~`/`!~`.
fn lex(text: &str) -> Result<Vec<(usize, Tok)>, ConditionError> {
    let chars: Vec<char> = text.chars().collect();
    let mut out: Vec<(usize, Tok)> = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let at = i;
        let next = chars.get(i + 1).copied();
        let tok = match c {
            ' ' | '\t' | '\n' | '\r' => {
                i += 1;
                continue;
            }
            '(' => Tok::LParen,
            ')' => Tok::RParen,
            ',' => Tok::Comma,
            '&' if next == Some('&') => Tok::And,
            '|' if next == Some('|') => Tok::Or,
            '=' if next == Some('=') => Tok::Eq,
            '=' if next == Some('~') => Tok::Match,
            '!' if next == Some('=') => Tok::Ne,
            '!' if next == Some('~') => Tok::NotMatch,
            '!' => Tok::Not,
            '&' => return Err(err(at, "`&` is not an operator; use `&&`")),
            '|' => return Err(err(at, "`|` is not an operator; use `||`")),
            '=' => return Err(err(at, "`=` is not an operator; use `==` to compare or `=~` to match")),
            '"' | '\'' => {
                let (s, end) = string(&chars, i)?;
                out.push((at, Tok::Str(s)));
                i = end;
                continue;
            }
            '/' if matches!(out.last(), Some((_, Tok::Match | Tok::NotMatch))) => {
                let (s, end) = regex_literal(&chars, i)?;
                out.push((at, Tok::Regex(s)));
                i = end;
                continue;
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                let mut end = i;
                while end < chars.len() && (chars[end].is_ascii_alphanumeric() || matches!(chars[end], '_' | '.')) {
                    end += 1;
                }
                out.push((at, Tok::Ident(chars[i..end].iter().collect())));
                i = end;
                continue;
            }
            '/' => return Err(err(at, "a regular expression (/…/) may only follow `=~` or `!~`")),
            c if c.is_control() => return Err(err(at, format!("unexpected control character {c:?}"))),
            c => return Err(err(at, format!("unexpected character `{c}`"))),
        };
        i += if matches!(tok, Tok::LParen | Tok::RParen | Tok::Comma | Tok::Not) { 1 } else { 2 };
        out.push((at, tok));
    }
    out.push((chars.len(), Tok::End));
    Ok(out)
}

fn string(chars: &[char], start: usize) -> Result<(String, usize), ConditionError> {
    let quote = chars[start];
    let mut s = String::new();
    let mut i = start + 1;
    loop {
        match chars.get(i) {
            None => return Err(err(start, format!("unterminated string: add the closing {quote}"))),
            Some(&c) if c == quote => return Ok((s, i + 1)),
            Some('\\') => {
                let e = match chars.get(i + 1) {
                    Some('\\') => '\\',
                    Some('"') => '"',
                    Some('\'') => '\'',
                    Some('n') => '\n',
                    Some('t') => '\t',
                    Some(c) => return Err(err(i, format!("unknown escape `\\{c}`; use \\\\, \\\", \\', \\n or \\t"))),
                    None => return Err(err(start, format!("unterminated string: add the closing {quote}"))),
                };
                s.push(e);
                i += 2;
            }
            Some(&c) if c.is_control() && c != '\t' => {
                return Err(err(i, format!("a string may not hold the control character {c:?}; write \\n or \\t")))
            }
            Some(&c) => {
                s.push(c);
                i += 1;
            }
        }
    }
}

fn regex_literal(chars: &[char], start: usize) -> Result<(String, usize), ConditionError> {
    let mut s = String::new();
    let mut i = start + 1;
    loop {
        match chars.get(i) {
            None | Some('\n') => return Err(err(start, "unterminated regular expression: add the closing /")),
            Some('/') => return Ok((s, i + 1)),
            Some('\\') if chars.get(i + 1) == Some(&'/') => {
                s.push('/');
                i += 2;
            }
            Some('\\') => {
                s.push('\\');
                if let Some(&c) = chars.get(i + 1) {
                    s.push(c);
                }
                i += 2;
            }
            Some(&c) => {
                s.push(c);
                i += 1;
            }
        }
    }
}

struct Parser {
    toks: Vec<(usize, Tok)>,
    at: usize,
    depth: usize,
    terms: usize,
}

pub(super) fn parse(text: &str) -> Result<Expr, ConditionError> {
    if text.len() > MAX_LEN {
        return Err(err(0, format!("the condition is {} bytes long, more than the {MAX_LEN} allowed", text.len())));
    }
    if text.trim().is_empty() {
        return Err(err(0, "the condition is empty; write one like build.branch == \"main\""));
    }
    let mut p = Parser { toks: lex(text)?, at: 0, depth: 0, terms: 0 };
    let e = p.or()?;
    match p.peek() {
        (_, Tok::End) => Ok(e),
        (at, t) => Err(err(at, format!("expected `&&`, `||` or the end of the condition, got {}", t.describe()))),
    }
}

impl Parser {
    fn peek(&self) -> (usize, Tok) {
        // `lex` always ends with `End`, and `next` never moves past it.
        self.toks.get(self.at).cloned().unwrap_or((0, Tok::End))
    }

    fn next(&mut self) -> (usize, Tok) {
        let t = self.peek();
        if t.1 != Tok::End {
            self.at += 1;
        }
        t
    }

    fn enter(&mut self, at: usize) -> Result<(), ConditionError> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(err(at, format!("nested more than {MAX_DEPTH} levels deep")));
        }
        Ok(())
    }

    fn term(&mut self, at: usize) -> Result<(), ConditionError> {
        self.terms += 1;
        if self.terms > MAX_TERMS {
            return Err(err(at, format!("more than {MAX_TERMS} comparisons and calls in one condition")));
        }
        Ok(())
    }

    fn or(&mut self) -> Result<Expr, ConditionError> {
        let mut e = self.and()?;
        while self.peek().1 == Tok::Or {
            self.next();
            e = Expr::Or(Box::new(e), Box::new(self.and()?));
        }
        Ok(e)
    }

    fn and(&mut self) -> Result<Expr, ConditionError> {
        let mut e = self.unary()?;
        while self.peek().1 == Tok::And {
            self.next();
            e = Expr::And(Box::new(e), Box::new(self.unary()?));
        }
        Ok(e)
    }

    fn unary(&mut self) -> Result<Expr, ConditionError> {
        let (at, t) = self.peek();
        if t == Tok::Not {
            self.next();
            self.enter(at)?;
            let e = self.unary()?;
            self.depth -= 1;
            return Ok(Expr::Not(Box::new(e)));
        }
        self.primary()
    }

    fn primary(&mut self) -> Result<Expr, ConditionError> {
        let (at, t) = self.next();
        match t {
            Tok::LParen => {
                self.enter(at)?;
                let e = self.or()?;
                self.depth -= 1;
                match self.next() {
                    (_, Tok::RParen) => Ok(e),
                    (a, t) => Err(err(
                        a,
                        format!("expected `)` to close the `(` at character {}, got {}", at + 1, t.describe()),
                    )),
                }
            }
            Tok::Ident(name) if name == "true" || name == "false" => {
                self.term(at)?;
                Ok(Expr::Const(name == "true"))
            }
            Tok::Ident(name) if self.peek().1 == Tok::LParen => self.call(at, &name),
            Tok::Ident(name) => {
                let left = Operand::Fact(fact(at, &name)?);
                self.comparison(at, left)
            }
            Tok::Str(s) => self.comparison(at, Operand::Lit(s)),
            t => Err(err(
                at,
                format!("expected a comparison, changed(…), `!`, `(`, true or false, got {}", t.describe()),
            )),
        }
    }

    fn comparison(&mut self, at: usize, left: Operand) -> Result<Expr, ConditionError> {
        self.term(at)?;
        let (op_at, op) = self.next();
        let e = match op {
            Tok::Eq | Tok::Ne => {
                let (r_at, r) = self.next();
                let right = match r {
                    Tok::Str(s) => Operand::Lit(s),
                    Tok::Ident(n) => Operand::Fact(fact(r_at, &n)?),
                    t => {
                        return Err(err(
                            r_at,
                            format!("expected a string or a fact after {}, got {}", op.describe(), t.describe()),
                        ))
                    }
                };
                check_event(&left, &right, r_at)?;
                check_event(&right, &left, at)?;
                Expr::Eq { left, right, negate: op == Tok::Ne }
            }
            Tok::Match | Tok::NotMatch => {
                let (r_at, r) = self.next();
                let Tok::Regex(src) = r else {
                    return Err(err(
                        r_at,
                        format!(
                            "expected a regular expression like /^release\\// after {}, got {}",
                            op.describe(),
                            r.describe()
                        ),
                    ));
                };
                let regex = RegexBuilder::new(&src)
                    .size_limit(MAX_REGEX_SIZE)
                    .dfa_size_limit(MAX_REGEX_SIZE)
                    .nest_limit(MAX_DEPTH as u32 * 2)
                    .build()
                    .map_err(|e| {
                        err(r_at, format!("invalid regular expression /{src}/: {}", one_line(&e.to_string())))
                    })?;
                Expr::Match { left, regex, negate: op == Tok::NotMatch }
            }
            t => {
                let what = match &left {
                    Operand::Fact(Fact::Tag) => {
                        "`build.tag` alone is not a condition; compare it, e.g. build.tag != \"\"".to_string()
                    }
                    Operand::Fact(f) => {
                        format!("`{}` alone is not a condition; compare it with ==, !=, =~ or !~", f.name())
                    }
                    Operand::Lit(_) => "a string alone is not a condition; compare it with ==, !=, =~ or !~".into(),
                };
                let at = if t == Tok::End { at } else { op_at };
                return Err(err(at, if t == Tok::End { what } else { format!("{what}; got {}", t.describe()) }));
            }
        };
        if let (c_at, t @ (Tok::Eq | Tok::Ne | Tok::Match | Tok::NotMatch)) = self.peek() {
            return Err(err(c_at, format!("comparisons do not chain: use parentheses and && around {}", t.describe())));
        }
        Ok(e)
    }

    fn call(&mut self, at: usize, name: &str) -> Result<Expr, ConditionError> {
        if name != "changed" {
            return Err(err(at, format!("unknown function `{name}`; the only function is changed(\"glob\", …)")));
        }
        self.term(at)?;
        self.next(); // `(`
        let mut globs = Vec::new();
        loop {
            let (g_at, t) = self.next();
            match t {
                Tok::Str(g) => {
                    check_glob(g_at, &g)?;
                    globs.push(g);
                    if globs.len() > MAX_GLOBS {
                        return Err(err(g_at, format!("more than {MAX_GLOBS} globs in one changed(…)")));
                    }
                }
                Tok::RParen if globs.is_empty() => {
                    return Err(err(g_at, "changed() needs at least one glob, like changed(\"src/**/*.cu\")"))
                }
                t => {
                    return Err(err(g_at, format!("expected a glob in quotes, like \"src/**\", got {}", t.describe())))
                }
            }
            match self.next() {
                (_, Tok::Comma) => {}
                (_, Tok::RParen) => break,
                (a, t) => return Err(err(a, format!("expected `,` or `)`, got {}", t.describe()))),
            }
        }
        let source = globs.iter().map(|g| glob_regex(g)).collect::<Vec<_>>().join("|");
        let matcher = RegexBuilder::new(&format!("^(?:{source})$"))
            .size_limit(MAX_REGEX_SIZE)
            .dfa_size_limit(MAX_REGEX_SIZE)
            .build()
            .map_err(|e| err(at, format!("these globs are too complex: {}", one_line(&e.to_string()))))?;
        Ok(Expr::Changed { globs, matcher })
    }
}

/// The closest candidate, if close enough to be what was meant.
fn suggest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    candidates
        .into_iter()
        .map(|c| (strsim::jaro_winkler(word, c), c))
        .filter(|(score, _)| *score >= 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, c)| c)
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn fact(at: usize, name: &str) -> Result<Fact, ConditionError> {
    Ok(match name {
        "build.branch" => Fact::Branch,
        "build.tag" => Fact::Tag,
        "build.event" => Fact::Event,
        "build.commit" => Fact::Commit,
        n if n.starts_with("env.") => {
            let var = &n[4..];
            if !crate::pipeline::is_env_name(var) {
                return Err(err(at, format!("`{n}`: expected env.NAME with NAME an environment variable name")));
            }
            Fact::Env(var.to_string())
        }
        n => {
            let hint = suggest(n, FACTS.iter().copied())
                .map(|s| format!(", did you mean `{s}`?"))
                .unwrap_or_else(|| format!("; expected one of {}", FACTS.join(", ")));
            let hint = if n == "true" || n == "false" { String::new() } else { hint };
            return Err(err(at, format!("unknown name `{n}`{hint}")));
        }
    })
}

/// `build.event == "pr"` is a typo, not a condition that is always false.
fn check_event(fact_side: &Operand, other: &Operand, at: usize) -> Result<(), ConditionError> {
    if let (Operand::Fact(Fact::Event), Operand::Lit(s)) = (fact_side, other) {
        if BuildEvent::parse(s).is_none() {
            let hint = suggest(s, BuildEvent::NAMES.iter().copied())
                .map(|h| format!(", did you mean \"{h}\"?"))
                .unwrap_or_default();
            return Err(err(at, format!("build.event is one of {}; got {s:?}{hint}", BuildEvent::NAMES.join(", "))));
        }
    }
    Ok(())
}

fn check_glob(at: usize, g: &str) -> Result<(), ConditionError> {
    if g.is_empty() {
        return Err(err(at, "a glob must not be empty"));
    }
    if g.starts_with('/') {
        return Err(err(at, "globs match paths from the repository root; drop the leading `/`"));
    }
    if g.contains('[') || g.contains('{') {
        return Err(err(
            at,
            "globs support `*`, `**` and `?` only (no `[…]` or `{…}`); list alternatives as more arguments",
        ));
    }
    Ok(())
}

/// `**/` any directories (or none), `**` anything, `*` within a segment, `?` one character.
fn glob_regex(g: &str) -> String {
    let mut out = String::new();
    let chars: Vec<char> = g.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        match chars[i] {
            '*' if chars.get(i + 1) == Some(&'*') => {
                if chars.get(i + 2) == Some(&'/') {
                    out.push_str("(?:.*/)?");
                    i += 3;
                } else {
                    out.push_str(".*");
                    i += 2;
                }
            }
            '*' => {
                out.push_str("[^/]*");
                i += 1;
            }
            '?' => {
                out.push_str("[^/]");
                i += 1;
            }
            c => {
                out.push_str(&regex::escape(&c.to_string()));
                i += 1;
            }
        }
    }
    out
}
