#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use super::*;

fn facts() -> BuildFacts {
    BuildFacts {
        branch: Some("release/1.2".into()),
        tag: Some(String::new()),
        event: Some(BuildEvent::Push),
        commit: Some("abc123".into()),
        changed: Some(vec!["src/kernels/gemm.cu".into(), "README.md".into()]),
        subject: None,
        author: None,
    }
}

fn env() -> BTreeMap<String, String> {
    BTreeMap::from([("RUN_GPU".to_string(), "1".to_string())])
}

fn truth(text: &str, f: &BuildFacts) -> Truth {
    Condition::parse(text).unwrap_or_else(|e| panic!("{text}: {e}")).evaluate(f, &env()).truth
}

fn holds(text: &str) -> bool {
    match truth(text, &facts()) {
        Truth::True => true,
        Truth::False => false,
        Truth::Unknown => panic!("{text} is unknown"),
    }
}

/// The error's offset (0-based characters) and message.
fn error(text: &str) -> (usize, String) {
    let e = Condition::parse(text).err().unwrap_or_else(|| panic!("{text} parsed"));
    (e.offset, e.message)
}

#[test]
fn every_operator() {
    assert!(holds(r#"build.branch == "release/1.2""#));
    assert!(!holds(r#"build.branch == "main""#));
    assert!(holds(r#"build.branch != "main""#));
    assert!(holds(r#"build.branch =~ /^release\//"#));
    assert!(!holds(r#"build.branch !~ /^release\//"#));
    assert!(holds(r#"build.event != "pull_request""#));
    assert!(holds(r#"build.event == "push""#));
    assert!(!holds(r#"build.tag != """#));
    assert!(holds(r#"env.RUN_GPU == "1""#));
    assert!(holds(r#"env.UNSET == """#), "an unset variable is empty, never unknown");
    assert!(holds(r#""abc123" == build.commit"#), "a literal on the left");
    assert!(holds(r#"changed("src/**/*.cu")"#));
    assert!(holds(r#"changed("docs/**", "*.md")"#));
    assert!(!holds(r#"changed("docs/**")"#));
    assert!(!holds(r#"changed("*.cu")"#), "a glob matches the whole path: `*` stays in its segment");
    assert!(holds(r#"changed("src/kernels/gemm.c?")"#));
    assert!(holds(r#"changed("**")"#));
    assert!(holds("true") && !holds("false"));
    assert!(holds("!false") && !holds("!!false"));
    assert!(holds("true && true") && !holds("true && false"));
    assert!(holds("false || true") && !holds("false || false"));
    assert!(holds(r#"build.branch == 'release/1.2'"#), "single quotes");
}

#[test]
fn precedence_not_then_comparison_then_and_then_or() {
    assert!(holds("true || false && false"), "&& binds tighter than ||");
    assert!(!holds("(true || false) && false"));
    assert!(holds("!false && true"), "! binds tighter than &&");
    assert!(!holds("!(false || true)"));
    assert!(holds(r#"!build.branch == "main""#), "`!` applies to the whole comparison after it");
    assert!(holds(r#"build.event == "push" && build.branch =~ /^release/ || env.RUN_GPU == "0""#));
}

#[test]
fn string_escapes() {
    let f = BuildFacts { branch: Some("a\"b\\c\n\t'".into()), ..facts() };
    assert_eq!(truth(r#"build.branch == "a\"b\\c\n\t'""#, &f), Truth::True);
    assert_eq!(truth(r#"build.branch == 'a"b\\c\n\t\''"#, &f), Truth::True);
}

#[test]
fn missing_facts_are_unknown_and_kleene_decides() {
    let none = BuildFacts::default();
    assert_eq!(truth(r#"build.branch == "main""#, &none), Truth::Unknown);
    assert_eq!(truth(r#"!(build.branch == "main")"#, &none), Truth::Unknown);
    assert_eq!(truth(r#"build.branch == "main" && false"#, &none), Truth::False);
    assert_eq!(truth(r#"build.branch == "main" || true"#, &none), Truth::True);
    assert_eq!(truth(r#"changed("docs/**")"#, &none), Truth::Unknown);
    assert_eq!(truth(r#"!changed("docs/**")"#, &none), Truth::Unknown);
    assert_eq!(truth(r#"build.tag =~ /^v/"#, &none), Truth::Unknown);
    let nothing_changed = BuildFacts { changed: Some(Vec::new()), ..none };
    assert_eq!(truth(r#"changed("**")"#, &nothing_changed), Truth::False);
}

#[test]
fn the_verdict_lists_the_facts_read() {
    let c = Condition::parse(r#"build.branch == "main" && changed("docs/**") || build.branch == "dev""#).unwrap();
    let v = c.evaluate(&facts(), &env());
    assert_eq!(v.truth, Truth::False);
    assert_eq!(
        v.read,
        vec![
            r#"build.branch = "release/1.2""#.to_string(),
            r#"changed("docs/**") matched none of 2 changed paths"#.into()
        ]
    );
    let v = c.evaluate(&BuildFacts::default(), &env());
    assert_eq!(v.read, vec!["build.branch is unknown".to_string(), "the changed paths are unknown".into()]);
}

#[test]
fn every_error_names_its_character() {
    let cases: &[(&str, usize, &str)] = &[
        ("", 0, "empty"),
        ("   ", 0, "empty"),
        (r#"build.brnch == "x""#, 0, "did you mean `build.branch`"),
        (r#"build.branch = "x""#, 13, "use `==`"),
        (r#"true & false"#, 5, "use `&&`"),
        (r#"true | false"#, 5, "use `||`"),
        (r#"build.branch == "x"#, 16, "unterminated string"),
        (r#"build.branch == "\q""#, 17, "unknown escape"),
        (r#"build.tag"#, 0, "build.tag != \"\""),
        (r#"build.branch"#, 0, "alone is not a condition"),
        (r#"build.branch && true"#, 13, "alone is not a condition"),
        (r#"build.branch =~ "main""#, 16, "regular expression"),
        (r#"build.branch =~ /(/"#, 16, "invalid regular expression"),
        (r#"build.branch =~ /abc"#, 16, "unterminated regular expression"),
        (r#"build.branch == /x/"#, 16, "may only follow"),
        (r#"build.event == "pr""#, 15, "one of push, pull_request, schedule, manual"),
        (r#""pul_request" == build.event"#, 0, "did you mean \"pull_request\""),
        (r#"(true"#, 5, "expected `)`"),
        (r#"true)"#, 4, "expected `&&`, `||` or the end"),
        (r#"true true"#, 5, "expected `&&`"),
        (r#"a == b == c"#, 0, "unknown name `a`"),
        (r#"env.A == "1" == "1""#, 13, "do not chain"),
        (r#"changed()"#, 8, "at least one glob"),
        (r#"changed(build.branch)"#, 8, "a glob in quotes"),
        (r#"changed("a" "b")"#, 12, "expected `,` or `)`"),
        (r#"changed("/src/**")"#, 8, "repository root"),
        (r#"changed("src/[ab]")"#, 8, "`*`, `**` and `?` only"),
        (r#"changed("")"#, 8, "must not be empty"),
        (r#"exists("x")"#, 0, "unknown function `exists`"),
        (r#"env.1X == "" "#, 0, "env.NAME"),
        (r#"&&"#, 0, "expected a comparison"),
        (r#"true && # x"#, 8, "unexpected character `#`"),
        ("true && \u{7}", 8, "control character"),
        (r#"!"#, 1, "expected a comparison"),
        (r#"é == "x""#, 0, "unexpected character `é`"),
        (r#""é" == build.brnch"#, 7, "did you mean"),
    ];
    for (text, offset, needle) in cases {
        let (at, message) = error(text);
        assert!(message.contains(needle), "{text:?}: {message:?} does not say {needle:?}");
        assert_eq!(at, *offset, "{text:?}: {message}");
    }
}

#[test]
fn size_and_depth_limits() {
    let long = format!(r#"env.A == "{}""#, "x".repeat(MAX_LEN));
    assert!(error(&long).1.contains("bytes long"));
    let deep = format!("{}true{}", "(".repeat(MAX_DEPTH), ")".repeat(MAX_DEPTH));
    assert!(Condition::parse(&deep).is_ok());
    let deeper = format!("{}true{}", "(".repeat(MAX_DEPTH + 1), ")".repeat(MAX_DEPTH + 1));
    assert_eq!(error(&deeper), (MAX_DEPTH, format!("nested more than {MAX_DEPTH} levels deep")));
    let nots = format!("{}true", "!".repeat(MAX_DEPTH + 1));
    assert!(error(&nots).1.contains("levels deep"));
    let many = vec!["true"; MAX_TERMS].join(" && ");
    assert!(Condition::parse(&many).is_ok());
    let more = vec!["true"; MAX_TERMS + 1].join(" && ");
    assert!(error(&more).1.contains("more than 32 comparisons"));
    let globs = (0..=MAX_GLOBS).map(|i| format!("\"g{i}\"")).collect::<Vec<_>>().join(",");
    assert!(error(&format!("changed({globs})")).1.contains("globs in one"));
    // A regex that compiles to more than the size limit.
    assert!(error(r#"build.branch =~ /\w{1000}\w{1000}/"#).1.contains("invalid regular expression"));
}

#[test]
fn hostile_input_never_panics() {
    // Every prefix and every single-character deletion of conditions that use every feature.
    let seeds = [
        r#"!(build.branch =~ /^release\/\d+/ && env.RUN_GPU != "0") || changed("src/**/*.cu", 'a?b') && build.tag == "v\"1\"""#,
        r#"build.event == "pull_request" || "é" != build.commit && !!true"#,
    ];
    for seed in seeds {
        let chars: Vec<char> = seed.chars().collect();
        for n in 0..=chars.len() {
            let prefix: String = chars[..n].iter().collect();
            let _ = Condition::parse(&prefix).map(|c| c.evaluate(&facts(), &env()));
            let mut cut = chars.clone();
            if n < cut.len() {
                cut.remove(n);
            }
            let cut: String = cut.into_iter().collect();
            if let Err(e) = Condition::parse(&cut) {
                assert!(e.offset <= cut.chars().count(), "{cut:?}: offset {} past the end", e.offset);
            }
        }
    }
    for junk in ["((((", "))))", "!!!!", "\"\\", "/", "=~ /", "changed(", "changed(\"a\",", "\0", "env.", "build."] {
        assert!(Condition::parse(junk).is_err(), "{junk:?}");
    }
    // Evaluation stays linear: a wide condition over many paths.
    let wide = vec![r#"changed("x/**/y*.z")"#; MAX_TERMS].join(" || ");
    let many = BuildFacts { changed: Some((0..MAX_CHANGED_PATHS).map(|i| format!("a/b/{i}.c")).collect()), ..facts() };
    assert_eq!(truth(&wide, &many), Truth::False);
}

fn step(key: &str, condition: Option<&str>, deps: &[&str]) -> Step {
    let mut s = Step::new(key, "true");
    s.condition = condition.map(str::to_string);
    s.depends_on = deps.iter().map(|d| d.to_string()).collect();
    s
}

#[test]
fn plan_skips_false_conditions_and_their_dependents() {
    let mut cleanup = step("cleanup", None, &["deploy"]);
    cleanup.allow_dependency_failure = true;
    let steps = vec![
        step("test", Some(r#"build.branch =~ /^release/"#), &[]),
        step("deploy", Some(r#"build.branch == "main""#), &["test"]),
        step("notify", None, &["deploy"]),
        step("after-notify", None, &["notify"]),
        cleanup,
        step("docs", Some(r#"changed("docs/**")"#), &[]),
    ];
    let d = plan(&steps, &facts(), &env());
    assert_eq!(d[0], Decision::Run { note: None });
    assert_eq!(
        d[1],
        Decision::Skip(r#"skipped: `if: build.branch == "main"` is false (build.branch = "release/1.2")"#.into())
    );
    assert_eq!(
        d[2],
        Decision::Skip("skipped: dependency `deploy` was skipped by a condition; this step never ran".into())
    );
    assert!(matches!(&d[3], Decision::Skip(why) if why.contains("`notify`")), "transitively");
    assert_eq!(d[4], Decision::Run { note: None }, "allow_dependency_failure runs after a skip");
    assert!(matches!(&d[5], Decision::Skip(why) if why.contains("matched none of 2 changed paths")));

    let unknown = plan(&steps, &BuildFacts::default(), &env());
    assert!(
        matches!(&unknown[1], Decision::Run { note: Some(n) } if n.contains("build.branch is unknown") && n.contains("the step runs")),
        "a missing fact never skips a step: {:?}",
        unknown[1]
    );
    assert!(matches!(&unknown[5], Decision::Run { note: Some(n) } if n.contains("changed paths are unknown")));
}
