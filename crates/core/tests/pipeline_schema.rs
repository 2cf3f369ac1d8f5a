//! The published JSON Schema: up to date on disk, accepts the examples, rejects what the
//! parser rejects for shape, and names every key the parser accepts.
#![allow(clippy::unwrap_used)] // tests: a panic is the failure report

use gpuci_core::pipeline::{parse, schema::json_schema};
use serde_json::{json, Value};
use std::path::PathBuf;
use yaml_rust2::{Yaml, YamlLoader};

fn repo_file(path: &str) -> PathBuf {
    PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR")).join("../..").join(path)
}

const SCHEMA_FILE: &str = "docs/gpuci-pipeline.schema.json";

#[test]
fn committed_schema_is_up_to_date() {
    let path = repo_file(SCHEMA_FILE);
    let fresh = json_schema();
    let text = serde_json::to_string_pretty(&fresh).unwrap_or_default() + "\n";
    if std::env::var_os("GPUCI_BLESS").is_some() {
        if let Err(e) = std::fs::write(&path, &text) {
            panic!("cannot write {}: {e}", path.display());
        }
        return;
    }
    let committed: Option<Value> = std::fs::read_to_string(&path).ok().and_then(|t| serde_json::from_str(&t).ok());
    assert!(
        committed.as_ref() == Some(&fresh),
        "{SCHEMA_FILE} is missing or out of date with pipeline::schema::json_schema().\n\
         Regenerate it with: GPUCI_BLESS=1 cargo test -p gpuci-core --test pipeline_schema"
    );
}

/// YAML (as yaml-rust2 reads it) → JSON, the way an editor's YAML language server sees it.
fn to_json(y: &Yaml) -> Value {
    match y {
        Yaml::Real(s) => s.parse::<f64>().map(Value::from).unwrap_or(Value::Null),
        Yaml::Integer(i) => json!(i),
        Yaml::String(s) => json!(s),
        Yaml::Boolean(b) => json!(b),
        Yaml::Array(items) => Value::Array(items.iter().map(to_json).collect()),
        Yaml::Hash(h) => Value::Object(
            h.iter()
                .map(|(k, v)| {
                    let key = match k {
                        Yaml::String(s) => s.clone(),
                        Yaml::Integer(i) => i.to_string(),
                        other => format!("{other:?}"),
                    };
                    (key, to_json(v))
                })
                .collect(),
        ),
        _ => Value::Null,
    }
}

fn yaml_json(text: &str) -> Value {
    let docs = YamlLoader::load_from_str(text).unwrap_or_else(|e| panic!("bad YAML: {e}"));
    docs.first().map(to_json).unwrap_or(Value::Null)
}

/// A validator for the part of JSON Schema draft-07 that schemars emits here: `$ref` into
/// `definitions`, `allOf`/`anyOf`/`oneOf`, `type`, `enum`, `properties`, `required`,
/// `additionalProperties`, `items`, `minItems`, `minimum`/`maximum`, `minLength`, `pattern`
/// (anchored character-class patterns only). Returns the problems found.
fn validate(root: &Value, schema: &Value, v: &Value, path: &str, problems: &mut Vec<String>) {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let name = r.trim_start_matches("#/definitions/");
        validate(root, &root["definitions"][name], v, path, problems);
    }
    for sub in schema.get("allOf").and_then(Value::as_array).into_iter().flatten() {
        validate(root, sub, v, path, problems);
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(subs) = schema.get(key).and_then(Value::as_array) {
            let passing = subs
                .iter()
                .filter(|s| {
                    let mut p = Vec::new();
                    validate(root, s, v, path, &mut p);
                    p.is_empty()
                })
                .count();
            if passing == 0 || (key == "oneOf" && passing > 1) {
                problems.push(format!("{path}: {key} matched {passing} of {} alternatives", subs.len()));
            }
        }
    }
    if let Some(t) = schema.get("type") {
        let types: Vec<&str> = match t {
            Value::String(s) => vec![s.as_str()],
            Value::Array(a) => a.iter().filter_map(Value::as_str).collect(),
            _ => vec![],
        };
        let ok = types.iter().any(|t| match *t {
            "object" => v.is_object(),
            "array" => v.is_array(),
            "string" => v.is_string(),
            "boolean" => v.is_boolean(),
            "null" => v.is_null(),
            "number" => v.is_number(),
            "integer" => v.is_i64() || v.is_u64(),
            _ => false,
        });
        if !ok {
            problems.push(format!("{path}: expected {types:?}, got {v}"));
            return;
        }
    }
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        if !options.contains(v) {
            problems.push(format!("{path}: {v} is not one of {options:?}"));
        }
    }
    if let Some(n) = v.as_f64() {
        if schema.get("minimum").and_then(Value::as_f64).is_some_and(|m| n < m) {
            problems.push(format!("{path}: {n} is below the minimum"));
        }
        if schema.get("maximum").and_then(Value::as_f64).is_some_and(|m| n > m) {
            problems.push(format!("{path}: {n} is above the maximum"));
        }
    }
    if let Some(s) = v.as_str() {
        if schema.get("minLength").and_then(Value::as_u64).is_some_and(|m| (s.chars().count() as u64) < m) {
            problems.push(format!("{path}: too short"));
        }
        if let Some(p) = schema.get("pattern").and_then(Value::as_str) {
            if !simple_pattern_matches(p, s) {
                problems.push(format!("{path}: {s:?} does not match {p}"));
            }
        }
    }
    if let Some(items) = v.as_array() {
        if schema.get("minItems").and_then(Value::as_u64).is_some_and(|m| (items.len() as u64) < m) {
            problems.push(format!("{path}: too few items"));
        }
        if let Some(item_schema) = schema.get("items") {
            for (i, item) in items.iter().enumerate() {
                validate(root, item_schema, item, &format!("{path}[{i}]"), problems);
            }
        }
    }
    if let Some(obj) = v.as_object() {
        let props = schema.get("properties").and_then(Value::as_object);
        for req in schema.get("required").and_then(Value::as_array).into_iter().flatten() {
            if let Some(r) = req.as_str() {
                if !obj.contains_key(r) {
                    problems.push(format!("{path}: missing {r}"));
                }
            }
        }
        for (k, val) in obj {
            let p = format!("{path}.{k}");
            match props.and_then(|props| props.get(k)) {
                Some(s) => validate(root, s, val, &p, problems),
                None => match schema.get("additionalProperties") {
                    Some(Value::Bool(false)) => problems.push(format!("{p}: unknown key")),
                    Some(s @ Value::Object(_)) => validate(root, s, val, &p, problems),
                    _ => {}
                },
            }
        }
    }
}

/// Patterns the schema uses: `^` + a sequence of `[class]`, `[class]*`, `[class]{m,n}`,
/// `(...)+` groups are not supported except the duration pattern, which is checked with the
/// crate's own parser.
fn simple_pattern_matches(pattern: &str, s: &str) -> bool {
    match pattern {
        "^([0-9]+(ms|s|m|h|d))+$" => s.parse::<gpuci_core::Duration>().is_ok(),
        "^[A-Za-z0-9_-]{1,64}$" => {
            (1..=64).contains(&s.len()) && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        }
        "^[A-Za-z_][A-Za-z0-9_]*$" => {
            let mut c = s.chars();
            c.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
                && c.all(|c| c.is_ascii_alphanumeric() || c == '_')
        }
        other => panic!("the test validator does not know the pattern {other}; teach it"),
    }
}

fn problems(text: &str) -> Vec<String> {
    let schema = json_schema();
    let mut p = Vec::new();
    validate(&schema, &schema, &yaml_json(text), "", &mut p);
    p
}

#[test]
fn examples_and_fixtures_validate() {
    for file in
        ["examples/hello.gpuci.yml", "examples/gpu.gpuci.yml", "crates/core/tests/fixtures/pipelines/full.gpuci.yml"]
    {
        let text = std::fs::read_to_string(repo_file(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(problems(&text), Vec::<String>::new(), "{file} does not validate against the schema");
        assert!(parse(file, &text).is_ok(), "{file} does not parse");
    }
    assert_eq!(problems("- command: make\n"), Vec::<String>::new(), "the list shorthand");
}

#[test]
fn schema_rejects_shapes_the_parser_rejects() {
    for bad in [
        "steps:\n  - comand: make\n",
        "steps:\n  - command: make\n    gpus: 100\n",
        "steps:\n  - command: make\n    retry: {count: 11}\n",
        "steps:\n  - command: make\n    retry: {count: 1, on: [crashed]}\n",
        "steps:\n  - command: make\n    network: host\n",
        "steps:\n  - command: make\n    timeout: ten minutes\n",
        "steps:\n  - command: make\n    gpu: {memroy: 1}\n",
        "steps:\n  - command: {a: b}\n",
        "steps: []\n",
        "env: {A: b}\n",
        "steps:\n  - key: \"has space\"\n    command: make\n",
        "steps:\n  - command: make\n    secrets: [hf-token]\n",
    ] {
        assert!(!problems(bad).is_empty(), "schema accepts {bad:?}");
        assert!(parse("ci.yml", bad).is_err(), "parser accepts {bad:?}");
    }
}

/// Every property the schema names is a key the parser knows (no "unknown key" error), in
/// every map of the format. The reverse direction (every parser key is in the schema) is the
/// unit test `schema_and_parser_accept_the_same_keys`.
/// Puts a key into a document at the place of one map of the format.
type Wrap = fn(&str) -> String;

#[test]
fn every_schema_key_is_known_to_the_parser() {
    let schema = json_schema();
    let props = |def: &str| -> Vec<String> {
        schema["definitions"][def]["properties"].as_object().map(|o| o.keys().cloned().collect()).unwrap_or_default()
    };
    let wrap: [(&str, Wrap); 8] = [
        ("RawPipeline", |k| format!("{k}: 1\n")),
        ("RawStep", |k| format!("steps:\n  - {k}: 1\n")),
        ("RawRetryPolicy", |k| format!("steps:\n  - retry: {{{k}: 1}}\n")),
        ("RawConcurrencySettings", |k| format!("steps:\n  - concurrency: {{{k}: 1}}\n")),
        ("RawGpu", |k| format!("steps:\n  - gpu: {{{k}: 1}}\n")),
        ("RawResources", |k| format!("steps:\n  - resources: {{{k}: 1}}\n")),
        ("RawMatrix", |k| format!("steps:\n  - matrix: {{{k}: 1}}\n")),
        ("RawExitStatusMap", |k| format!("steps:\n  - soft_fail: [{{{k}: 1}}]\n")),
    ];
    for (def, make) in wrap {
        let keys = props(def);
        assert!(!keys.is_empty(), "{def} has no properties");
        for k in keys {
            let yaml = make(&k);
            if let Err(e) = parse("ci.yml", &yaml) {
                assert!(!e.to_string().contains("unknown key"), "{def}.{k} is in the schema but the parser says:\n{e}");
            }
        }
    }
}
