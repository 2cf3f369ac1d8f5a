//! A job's log line as safe HTML: SGR colours and styles become spans with classes (or a
//! colour we format ourselves from numbers), every other control sequence is dropped, and
//! the text is escaped. A job's output is hostile: nothing it prints may become markup, a
//! link, a script, or move the cursor over earlier lines.

use maud::{html, Markup, PreEscaped};

/// Style in effect while text is written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Style {
    fg: Option<Color>,
    bg: Option<Color>,
    bold: bool,
    dim: bool,
    italic: bool,
    underline: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Color {
    /// 0–15: the 16 named colours (classes, so a theme can pick them).
    Named(u8),
    Rgb(u8, u8, u8),
}

impl Style {
    fn is_plain(&self) -> bool {
        *self == Style::default()
    }

    fn classes(&self) -> String {
        let mut c = Vec::new();
        if let Some(Color::Named(n)) = self.fg {
            c.push(format!("f{n}"));
        }
        if let Some(Color::Named(n)) = self.bg {
            c.push(format!("b{n}"));
        }
        for (on, name) in [(self.bold, "bold"), (self.dim, "dim"), (self.italic, "it"), (self.underline, "ul")] {
            if on {
                c.push(name.to_string());
            }
        }
        c.join(" ")
    }

    fn inline(&self) -> String {
        let mut s = String::new();
        if let Some(Color::Rgb(r, g, b)) = self.fg {
            s.push_str(&format!("color:#{r:02x}{g:02x}{b:02x};"));
        }
        if let Some(Color::Rgb(r, g, b)) = self.bg {
            s.push_str(&format!("background:#{r:02x}{g:02x}{b:02x};"));
        }
        s
    }

    /// Applies the parameters of one SGR sequence (`ESC [ p ; p ... m`).
    fn apply(&mut self, params: &[u16]) {
        if params.is_empty() {
            *self = Style::default();
            return;
        }
        let mut i = 0;
        while i < params.len() {
            let p = params[i];
            match p {
                0 => *self = Style::default(),
                1 => self.bold = true,
                2 => self.dim = true,
                3 => self.italic = true,
                4 => self.underline = true,
                22 => {
                    self.bold = false;
                    self.dim = false;
                }
                23 => self.italic = false,
                24 => self.underline = false,
                30..=37 => self.fg = Some(Color::Named((p - 30) as u8)),
                90..=97 => self.fg = Some(Color::Named((p - 90 + 8) as u8)),
                39 => self.fg = None,
                40..=47 => self.bg = Some(Color::Named((p - 40) as u8)),
                100..=107 => self.bg = Some(Color::Named((p - 100 + 8) as u8)),
                49 => self.bg = None,
                38 | 48 => {
                    let (color, used) = extended(&params[i + 1..]);
                    if let Some(c) = color {
                        if p == 38 {
                            self.fg = Some(c);
                        } else {
                            self.bg = Some(c);
                        }
                    }
                    i += used;
                }
                _ => {}
            }
            i += 1;
        }
    }
}

/// `5;n` (256 colours) or `2;r;g;b`; returns the colour and how many parameters it used.
fn extended(rest: &[u16]) -> (Option<Color>, usize) {
    match rest {
        [5, n, ..] => (Some(color256(*n)), 2),
        [2, r, g, b, ..] => (Some(Color::Rgb(clamp(*r), clamp(*g), clamp(*b))), 4),
        [5] | [2, ..] => (None, rest.len()),
        _ => (None, 0),
    }
}

fn clamp(v: u16) -> u8 {
    v.min(255) as u8
}

fn color256(n: u16) -> Color {
    let n = n.min(255) as u8;
    match n {
        0..=15 => Color::Named(n),
        16..=231 => {
            let i = n - 16;
            let level = |v: u8| if v == 0 { 0 } else { 55 + v * 40 };
            Color::Rgb(level(i / 36), level((i / 6) % 6), level(i % 6))
        }
        _ => {
            let g = 8 + (n - 232) * 10;
            Color::Rgb(g, g, g)
        }
    }
}

/// What a line is once its control sequences are read: runs of text with their style.
fn runs(line: &str) -> Vec<(Style, String)> {
    // A carriage return redraws the line (progress bars): what was written after the last one
    // is what a terminal would show, as far as one line can say.
    let line = match line.trim_end_matches('\r').rfind('\r') {
        Some(i) => &line[i + 1..],
        None => line,
    };
    let mut out: Vec<(Style, String)> = Vec::new();
    let mut style = Style::default();
    // Past this many style changes the rest of the line keeps its style: a line of nothing but
    // escapes must not turn into a megabyte of spans.
    let mut changes = 0usize;
    let mut text = String::new();
    let mut chars = line.chars().peekable();
    let flush = |out: &mut Vec<(Style, String)>, text: &mut String, style: Style| {
        if !text.is_empty() {
            out.push((style, std::mem::take(text)));
        }
    };
    while let Some(c) = chars.next() {
        match c {
            '\u{1b}' => match chars.peek() {
                Some('[') => {
                    chars.next();
                    // CSI: parameters and intermediates, then one final byte in 0x40..=0x7e.
                    let mut body = String::new();
                    let mut fin = None;
                    for c in chars.by_ref() {
                        if ('\u{40}'..='\u{7e}').contains(&c) {
                            fin = Some(c);
                            break;
                        }
                        if body.len() < 64 {
                            body.push(c);
                        }
                    }
                    if fin == Some('m')
                        && body.chars().all(|c| c.is_ascii_digit() || c == ';' || c == ':')
                        && changes < MAX_STYLE_CHANGES
                    {
                        changes += 1;
                        flush(&mut out, &mut text, style);
                        let params: Vec<u16> = if body.is_empty() {
                            Vec::new()
                        } else {
                            body.split([';', ':']).map(|p| p.parse::<u16>().unwrap_or(0)).collect()
                        };
                        style.apply(&params);
                    }
                    // Every other CSI (cursor moves, erase, modes) is dropped.
                }
                Some(']') | Some('P') | Some('X') | Some('^') | Some('_') => {
                    // OSC (titles, hyperlinks), DCS, SOS, PM, APC: a string up to BEL or ST.
                    chars.next();
                    while let Some(c) = chars.next() {
                        if c == '\u{7}' {
                            break;
                        }
                        if c == '\u{1b}' && chars.peek() == Some(&'\\') {
                            chars.next();
                            break;
                        }
                    }
                }
                Some(_) => {
                    // A two-character escape (ESC 7, ESC M, charset selection ESC ( B).
                    if let Some(n) = chars.next() {
                        if matches!(n, '(' | ')' | '*' | '+' | '#' | '%') {
                            chars.next();
                        }
                    }
                }
                None => {}
            },
            '\t' => text.push(c),
            c if c.is_control() => {
                // C0/C1 controls and DEL: never rendered (a bell, a backspace over the text).
            }
            c if is_bidi_control(c) => text.push_str(&format!("<U+{:04X}>", c as u32)),
            c => text.push(c),
        }
    }
    flush(&mut out, &mut text, style);
    out
}

/// Style changes one line may make; the rest of the line keeps the last style.
const MAX_STYLE_CHANGES: usize = 128;

/// Bidirectional overrides, isolates and marks: they could make text read backwards (a log
/// line, or a step's name, that looks like another). Shown as their code point instead.
pub fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}' | '\u{061c}')
}

/// Text from a job (a step's name, a reason) with bidirectional controls made visible.
pub fn visible(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if is_bidi_control(c) {
            out.push_str(&format!("<U+{:04X}>", c as u32));
        } else if c.is_control() && c != '\n' && c != '\t' {
            out.push('\u{fffd}');
        } else {
            out.push(c);
        }
    }
    out
}

/// The line's text without any control sequence (what search matches).
pub fn plain(line: &str) -> String {
    runs(line).into_iter().map(|(_, t)| t).collect()
}

/// The line as HTML: escaped text in styled spans.
pub fn to_html(line: &str) -> Markup {
    html! {
        @for (style, text) in runs(line) {
            @if style.is_plain() {
                (text)
            } @else {
                @let inline = style.inline();
                @let classes = style.classes();
                span class=[(!classes.is_empty()).then_some(classes)] style=[(!inline.is_empty()).then_some(inline)] { (text) }
            }
        }
    }
}

/// As [`to_html`], as a string.
pub fn to_html_string(line: &str) -> String {
    let PreEscaped(s) = to_html(line);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colours_become_classes_and_text_is_escaped() {
        let h = to_html_string("\u{1b}[1;31mFAIL\u{1b}[0m <script>alert(1)</script> & done");
        assert_eq!(h, "<span class=\"f1 bold\">FAIL</span> &lt;script&gt;alert(1)&lt;/script&gt; &amp; done");
    }

    #[test]
    fn truecolor_and_256_colours_are_formatted_from_numbers() {
        let h = to_html_string("\u{1b}[38;2;255;0;16mx\u{1b}[48;5;196my");
        assert_eq!(
            h,
            "<span style=\"color:#ff0010;\">x</span><span style=\"color:#ff0010;background:#ff0000;\">y</span>"
        );
        // Values out of range are clamped, not wrapped or passed through.
        assert_eq!(to_html_string("\u{1b}[38;2;999;0;0mz"), "<span style=\"color:#ff0000;\">z</span>");
    }

    #[test]
    fn other_control_sequences_are_dropped() {
        // OSC 8 hyperlink, window title, cursor moves, erase, a bell and a backspace, a CSI
        // whose parameters try to smuggle text into the style.
        let l = "\u{1b}]8;;javascript:alert(1)\u{7}click\u{1b}]8;;\u{7} \u{1b}]0;title\u{1b}\\a\u{1b}[2J\u{1b}[10;1Hb\u{7}\u{8}c\u{1b}[31;\"m!";
        let h = to_html_string(l);
        assert_eq!(h, "click abc!");
        assert_eq!(plain("\u{1b}[32mok\u{1b}[0m"), "ok");
    }

    #[test]
    fn carriage_returns_keep_what_a_terminal_shows() {
        assert_eq!(plain("10%\r50%\r100% done"), "100% done");
        assert_eq!(plain("line\r"), "line");
    }

    #[test]
    fn bidi_overrides_are_shown_not_obeyed() {
        assert_eq!(plain("a\u{202e}cba"), "a<U+202E>cba");
    }

    #[test]
    fn a_line_of_escapes_stays_small() {
        let line = "\u{1b}[1;38;2;255;255;255m\"".repeat(5_000);
        let html = to_html_string(&line);
        assert!(html.len() < 8 * line.len() / 2, "{} bytes of HTML for {} bytes", html.len(), line.len());
        assert_eq!(html.matches("<span").count(), MAX_STYLE_CHANGES);
        assert_eq!(visible("a\u{200f}b\u{7}"), "a<U+200F>b\u{fffd}");
    }

    #[test]
    fn unterminated_sequences_do_not_panic() {
        for s in
            ["\u{1b}", "\u{1b}[", "\u{1b}[38;5", "\u{1b}[38;2;1", "\u{1b}]8;;x", "\u{1b}(", "x\u{1b}[999999999999m"]
        {
            let _ = to_html_string(s);
        }
    }
}
