//! The reference OpenAPI description and a small validator for the part of JSON Schema it uses
//! (`$ref`, `type`, `required`, `properties`, `additionalProperties`, `items`, `enum`, `nullable`,
//! `allOf`/`anyOf`/`oneOf`, `minItems`/`maxItems`, `minLength`/`maxLength`).
//!
//! Validation never fails a request: every problem becomes a message the test reads through
//! `TestGitHub::validation_errors()`, so one bad field does not hide the rest of a scenario.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The reference description's file name inside `reference/github/`.
const FILE_NAME: &str = "github-openapi-gpuci-subset.json";

/// A path template split into segments, e.g. `/repos/{owner}/{repo}/contents/{path}`.
#[derive(Debug, Clone)]
pub(crate) struct Template {
    pub text: String,
    segments: Vec<Segment>,
}

#[derive(Debug, Clone)]
enum Segment {
    Literal(String),
    /// `multi`: the parameter may span several segments (`x-multi-segment` in GitHub's description);
    /// only supported as the last segment, which is where GitHub puts such parameters.
    Param {
        name: String,
        multi: bool,
    },
}

impl Template {
    pub fn new(text: &str, multi_segment: &[&str]) -> Self {
        let segments = text
            .trim_start_matches('/')
            .split('/')
            .map(|s| match s.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
                Some(name) => Segment::Param { name: name.to_owned(), multi: multi_segment.contains(&name) },
                None => Segment::Literal(s.to_owned()),
            })
            .collect();
        Self { text: text.to_owned(), segments }
    }

    /// The path parameters if `path` (already percent-decoded per segment) matches.
    pub fn matches(&self, path: &str) -> Option<HashMap<String, String>> {
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let mut params = HashMap::new();
        for (i, seg) in self.segments.iter().enumerate() {
            match seg {
                Segment::Literal(lit) => {
                    if parts.get(i) != Some(&lit.as_str()) {
                        return None;
                    }
                }
                Segment::Param { name, multi } => {
                    if *multi && i == self.segments.len() - 1 {
                        let rest = parts.get(i..)?.join("/");
                        if rest.is_empty() {
                            return None;
                        }
                        params.insert(name.clone(), percent_decode(&rest));
                        return Some(params);
                    }
                    let value = parts.get(i).filter(|p| !p.is_empty())?;
                    params.insert(name.clone(), percent_decode(value));
                }
            }
        }
        (parts.len() == self.segments.len()).then_some(params)
    }

    fn literal_count(&self) -> usize {
        self.segments.iter().filter(|s| matches!(s, Segment::Literal(_))).count()
    }
}

/// Decodes `%XX` escapes (label names with spaces, `/` in refs); invalid escapes are kept as they are.
pub(crate) fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

struct Operation {
    method: String,
    template: Template,
    /// Parameters with `$ref`s resolved.
    params: Vec<Value>,
    request_body: Option<(bool, Value)>,
    /// Status code → JSON schema of the body (`None`: the status has no body).
    responses: HashMap<String, Option<Value>>,
}

/// The loaded reference description.
pub(crate) struct Spec {
    doc: Value,
    operations: Vec<Operation>,
}

/// Where the reference lives when the caller does not say: `shared/` beside the workspace root.
pub(crate) fn default_reference() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared")
}

/// Accepts the description file itself, a `reference/github/` directory holding it, or a directory
/// (such as `shared/`) with `reference/github/` inside.
pub(crate) fn locate(path: &Path) -> PathBuf {
    if path.is_dir() {
        let direct = path.join(FILE_NAME);
        if direct.is_file() {
            return direct;
        }
        return path.join("reference/github").join(FILE_NAME);
    }
    path.to_owned()
}

/// Where in a request or response a problem was found, for messages.
pub(crate) struct OpRef(usize);

impl Spec {
    pub fn load(path: &Path) -> Result<Spec, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let doc: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut spec = Spec { doc, operations: Vec::new() };
        let paths = spec.doc.get("paths").and_then(Value::as_object).cloned().unwrap_or_default();
        for (path, item) in &paths {
            let Some(item) = item.as_object() else { continue };
            let shared: Vec<Value> = item
                .get("parameters")
                .and_then(Value::as_array)
                .map(|a| a.iter().map(|p| spec.resolve(p).clone()).collect())
                .unwrap_or_default();
            for (method, op) in item {
                if method == "parameters" {
                    continue;
                }
                let mut params = shared.clone();
                if let Some(list) = op.get("parameters").and_then(Value::as_array) {
                    params.extend(list.iter().map(|p| spec.resolve(p).clone()));
                }
                let multi: Vec<&str> = params
                    .iter()
                    .filter(|p| p.get("x-multi-segment") == Some(&Value::Bool(true)))
                    .filter_map(|p| p.get("name").and_then(Value::as_str))
                    .collect();
                let template = Template::new(path, &multi);
                let request_body = op.get("requestBody").map(|rb| {
                    let rb = spec.resolve(rb);
                    let required = rb.get("required") == Some(&Value::Bool(true));
                    let schema = rb.pointer("/content/application~1json/schema").cloned().unwrap_or(Value::Null);
                    (required, schema)
                });
                let mut responses = HashMap::new();
                if let Some(map) = op.get("responses").and_then(Value::as_object) {
                    for (status, resp) in map {
                        let resp = spec.resolve(resp);
                        responses.insert(status.clone(), resp.pointer("/content/application~1json/schema").cloned());
                    }
                }
                spec.operations.push(Operation {
                    method: method.to_uppercase(),
                    template,
                    params,
                    request_body,
                    responses,
                });
            }
        }
        if spec.operations.is_empty() {
            return Err(format!("{}: no operations under `paths`", path.display()));
        }
        Ok(spec)
    }

    /// Follows `$ref` chains inside this document.
    fn resolve<'a>(&'a self, mut v: &'a Value) -> &'a Value {
        for _ in 0..32 {
            match v.get("$ref").and_then(Value::as_str) {
                Some(r) => match r.strip_prefix('#').and_then(|p| self.doc.pointer(p)) {
                    Some(target) => v = target,
                    None => return v,
                },
                None => return v,
            }
        }
        v
    }

    /// Checks a request; returns the operation it matched (if any) and the problems found.
    pub fn check_request(
        &self,
        method: &str,
        path: &str,
        query: &[(String, String)],
        body: &[u8],
    ) -> (Option<OpRef>, Vec<String>) {
        let mut errs = Vec::new();
        let candidates: Vec<(usize, HashMap<String, String>)> = self
            .operations
            .iter()
            .enumerate()
            .filter(|(_, op)| op.method == method)
            .filter_map(|(i, op)| op.template.matches(path).map(|p| (i, p)))
            .collect();
        let Some((idx, path_params)) =
            candidates.into_iter().max_by_key(|(i, _)| self.operations[*i].template.literal_count())
        else {
            errs.push(format!("{method} {path}: no such operation in the reference description"));
            return (None, errs);
        };
        let op = &self.operations[idx];
        let what = format!("{method} {}", op.template.text);
        for p in &op.params {
            let name = p.get("name").and_then(Value::as_str).unwrap_or_default();
            let schema = p.get("schema").cloned().unwrap_or(Value::Null);
            match p.get("in").and_then(Value::as_str) {
                Some("path") => {
                    if let Some(v) = path_params.get(name) {
                        self.check_param(&what, "path parameter", name, v, &schema, &mut errs);
                    }
                }
                Some("query") => {
                    let present = query.iter().filter(|(k, _)| k == name).collect::<Vec<_>>();
                    if present.is_empty() && p.get("required") == Some(&Value::Bool(true)) {
                        errs.push(format!("{what}: required query parameter `{name}` is missing"));
                    }
                    for (_, v) in present {
                        self.check_param(&what, "query parameter", name, v, &schema, &mut errs);
                    }
                }
                _ => {}
            }
        }
        for (k, _) in query {
            let declared = op.params.iter().any(|p| {
                p.get("in").and_then(Value::as_str) == Some("query") && p.get("name").and_then(Value::as_str) == Some(k)
            });
            if !declared {
                errs.push(format!("{what}: query parameter `{k}` is not declared"));
            }
        }
        let body_text = std::str::from_utf8(body).unwrap_or("").trim();
        match &op.request_body {
            Some((required, schema)) => {
                if body_text.is_empty() {
                    if *required {
                        errs.push(format!("{what}: request body is required"));
                    }
                } else {
                    match serde_json::from_str::<Value>(body_text) {
                        Ok(v) => self.validate(schema, &v, &format!("{what} request body"), "$", &mut errs),
                        Err(e) => errs.push(format!("{what}: request body is not JSON: {e}")),
                    }
                }
            }
            None => {
                // An empty JSON object is what generic clients send for body-less POSTs; GitHub ignores it.
                if !body_text.is_empty() && body_text != "{}" {
                    errs.push(format!("{what}: operation takes no request body but got {} bytes", body.len()));
                }
            }
        }
        (Some(OpRef(idx)), errs)
    }

    fn check_param(&self, what: &str, kind: &str, name: &str, raw: &str, schema: &Value, errs: &mut Vec<String>) {
        let schema = self.resolve(schema);
        let value = match schema.get("type").and_then(Value::as_str) {
            Some("integer") | Some("number") => match raw.parse::<i64>() {
                Ok(n) => Value::from(n),
                Err(_) => {
                    errs.push(format!("{what}: {kind} `{name}` = {raw:?} is not an integer"));
                    return;
                }
            },
            Some("boolean") => match raw {
                "true" => Value::Bool(true),
                "false" => Value::Bool(false),
                _ => {
                    errs.push(format!("{what}: {kind} `{name}` = {raw:?} is not a boolean"));
                    return;
                }
            },
            _ => Value::String(raw.to_owned()),
        };
        self.validate(schema, &value, &format!("{what} {kind} `{name}`"), "$", errs);
    }

    /// Checks a response body (`None`: no body was sent) against the schema for `status`.
    ///
    /// Errors (4xx/5xx) the operation does not list are checked against `basic-error`: GitHub answers
    /// any operation with 401/403/404 in that shape, and the description lists them only sometimes.
    pub fn check_response(&self, op: &OpRef, status: u16, body: Option<&Value>) -> Vec<String> {
        let op = &self.operations[op.0];
        let what = format!("response {status} to {} {}", op.method, op.template.text);
        let mut errs = Vec::new();
        let schema = match op.responses.get(&status.to_string()) {
            Some(s) => s.clone(),
            None if status >= 400 => Some(serde_json::json!({ "$ref": "#/components/schemas/basic-error" })),
            None => {
                errs.push(format!("{what}: status {status} is not documented for this operation"));
                return errs;
            }
        };
        match (schema, body) {
            (Some(schema), Some(body)) => self.validate(&schema, body, &what, "$", &mut errs),
            (Some(_), None) => errs.push(format!("{what}: documented with a JSON body, sent none")),
            (None, Some(_)) => errs.push(format!("{what}: documented without a body, sent one")),
            (None, None) => {}
        }
        errs
    }

    /// Validates `v` against `schema`, pushing one message per problem.
    pub fn validate(&self, schema: &Value, v: &Value, what: &str, at: &str, errs: &mut Vec<String>) {
        let schema = self.resolve(schema);
        let Some(obj) = schema.as_object() else { return };
        let nullable = obj.get("nullable") == Some(&Value::Bool(true));
        if v.is_null() && nullable {
            return;
        }
        if let Some(ty) = obj.get("type").and_then(Value::as_str) {
            let ok = match ty {
                "integer" => v.is_i64() || v.is_u64(),
                "number" => v.is_number(),
                "string" => v.is_string(),
                "boolean" => v.is_boolean(),
                "array" => v.is_array(),
                "object" => v.is_object(),
                "null" => v.is_null(),
                _ => true,
            };
            if !ok {
                errs.push(format!("{what}: {at}: expected {ty}, got {}", kind(v)));
                return;
            }
        }
        if let Some(options) = obj.get("enum").and_then(Value::as_array) {
            if !options.contains(v) {
                errs.push(format!("{what}: {at}: {v} is not one of {}", Value::Array(options.clone())));
            }
        }
        if let Some(all) = obj.get("allOf").and_then(Value::as_array) {
            for sub in all {
                self.validate(sub, v, what, at, errs);
            }
        }
        if let Some(any) = obj.get("anyOf").and_then(Value::as_array) {
            let results: Vec<Vec<String>> = any.iter().map(|s| self.sub_errors(s, v, what, at)).collect();
            if !results.iter().any(Vec::is_empty) {
                errs.push(format!("{what}: {at}: matches none of anyOf ({})", first_errors(&results)));
            }
        }
        if let Some(one) = obj.get("oneOf").and_then(Value::as_array) {
            let results: Vec<Vec<String>> = one.iter().map(|s| self.sub_errors(s, v, what, at)).collect();
            match results.iter().filter(|r| r.is_empty()).count() {
                1 => {}
                0 => errs.push(format!("{what}: {at}: matches none of oneOf ({})", first_errors(&results))),
                n => errs.push(format!("{what}: {at}: matches {n} branches of oneOf, expected exactly one")),
            }
        }
        match v {
            Value::Object(map) => {
                if let Some(required) = obj.get("required").and_then(Value::as_array) {
                    for r in required.iter().filter_map(Value::as_str) {
                        if !map.contains_key(r) {
                            errs.push(format!("{what}: {at}: required property `{r}` is missing"));
                        }
                    }
                }
                let props = obj.get("properties").and_then(Value::as_object);
                for (k, child) in map {
                    let path = format!("{at}.{k}");
                    match props.and_then(|p| p.get(k)) {
                        Some(s) => self.validate(s, child, what, &path, errs),
                        None => match obj.get("additionalProperties") {
                            Some(Value::Bool(false)) => {
                                errs.push(format!("{what}: {path}: property is not allowed"));
                            }
                            Some(s @ Value::Object(_)) => self.validate(s, child, what, &path, errs),
                            _ => {}
                        },
                    }
                }
            }
            Value::Array(items) => {
                if let Some(min) = obj.get("minItems").and_then(Value::as_u64) {
                    if (items.len() as u64) < min {
                        errs.push(format!("{what}: {at}: {} items, at least {min} required", items.len()));
                    }
                }
                if let Some(max) = obj.get("maxItems").and_then(Value::as_u64) {
                    if (items.len() as u64) > max {
                        errs.push(format!("{what}: {at}: {} items, at most {max} allowed", items.len()));
                    }
                }
                if let Some(item_schema) = obj.get("items") {
                    for (i, item) in items.iter().enumerate() {
                        self.validate(item_schema, item, what, &format!("{at}[{i}]"), errs);
                    }
                }
            }
            Value::String(s) => {
                let len = s.chars().count() as u64;
                if let Some(max) = obj.get("maxLength").and_then(Value::as_u64) {
                    if len > max {
                        errs.push(format!("{what}: {at}: {len} characters, at most {max} allowed"));
                    }
                }
                if let Some(min) = obj.get("minLength").and_then(Value::as_u64) {
                    if len < min {
                        errs.push(format!("{what}: {at}: {len} characters, at least {min} required"));
                    }
                }
            }
            _ => {}
        }
    }

    fn sub_errors(&self, schema: &Value, v: &Value, what: &str, at: &str) -> Vec<String> {
        let mut errs = Vec::new();
        self.validate(schema, v, what, at, &mut errs);
        errs
    }

    /// Validates `v` against the component schema `name` (for tests and webhook payload checks).
    pub fn validate_component(&self, name: &str, v: &Value) -> Vec<String> {
        let mut errs = Vec::new();
        let schema = serde_json::json!({ "$ref": format!("#/components/schemas/{name}") });
        if self.doc.pointer(&format!("/components/schemas/{name}")).is_none() {
            errs.push(format!("no component schema `{name}`"));
            return errs;
        }
        self.validate(&schema, v, name, "$", &mut errs);
        errs
    }
}

fn first_errors(results: &[Vec<String>]) -> String {
    results.iter().filter_map(|r| r.first()).cloned().collect::<Vec<_>>().join("; ")
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec() -> Spec {
        let doc = json!({
            "paths": {},
            "components": { "schemas": {
                "user": { "type": "object", "required": ["login", "id"], "properties": {
                    "login": { "type": "string" }, "id": { "type": "integer" } } },
                "maybe-user": { "type": "object", "nullable": true, "required": ["login"],
                    "properties": { "login": { "type": "string" } } },
                "thing": { "type": "object", "properties": {
                    "owner": { "$ref": "#/components/schemas/user" },
                    "editor": { "$ref": "#/components/schemas/maybe-user" },
                    "state": { "type": "string", "enum": ["open", "closed"] },
                    "tags": { "type": "array", "minItems": 1, "items": { "type": "string" } },
                    "either": { "oneOf": [ { "type": "string" }, { "type": "integer" } ] },
                    "any": { "anyOf": [ { "type": "string" }, { "type": "boolean" } ] },
                    "strict": { "type": "object", "additionalProperties": false, "properties": { "a": {} } }
                } }
            } }
        });
        Spec { doc, operations: Vec::new() }
    }

    #[test]
    fn template_matching_handles_multi_segment_and_literals() {
        let t = Template::new("/repos/{owner}/{repo}/contents/{path}", &["path"]);
        let p = t.matches("/repos/o/r/contents/a/b/c.yml").expect("matches");
        assert_eq!(p["path"], "a/b/c.yml");
        assert_eq!(p["owner"], "o");
        assert!(t.matches("/repos/o/r/contents").is_none());
        let t = Template::new("/repos/{owner}/{repo}/issues/{issue_number}/labels/{name}", &[]);
        assert_eq!(t.matches("/repos/o/r/issues/3/labels/gpu%20ok").expect("matches")["name"], "gpu ok");
        assert!(t.matches("/repos/o/r/issues/3/labels/x/y").is_none());
    }

    #[test]
    fn a_valid_value_passes() {
        let s = spec();
        let v = json!({ "owner": { "login": "a", "id": 1 }, "editor": null, "state": "open", "tags": ["x"],
            "either": 3, "any": true, "strict": { "a": 1 } });
        assert_eq!(s.validate_component("thing", &v), Vec::<String>::new());
    }

    #[test]
    fn bad_values_are_caught_with_their_path() {
        let s = spec();
        let v = json!({ "owner": { "login": 5 }, "state": "merged", "tags": [], "either": true,
            "any": 1, "strict": { "b": 1 } });
        let errs = s.validate_component("thing", &v).join("\n");
        for needle in [
            "$.owner.login: expected string, got integer",
            "$.owner: required property `id` is missing",
            "$.state: \"merged\" is not one of",
            "$.tags: 0 items, at least 1 required",
            "$.either: matches none of oneOf",
            "$.any: matches none of anyOf",
            "$.strict.b: property is not allowed",
        ] {
            assert!(errs.contains(needle), "missing {needle:?} in:\n{errs}");
        }
        let errs = s.validate_component("user", &Value::Null).join("\n");
        assert!(errs.contains("expected object, got null"), "{errs}");
    }
}
