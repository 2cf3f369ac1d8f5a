//! The check that every recorded request matches GitHub's published OpenAPI description
//! (../shared/reference/github, when present): path template and method, declared query names,
//! the request body's schema. Only the small part of JSON Schema GitHub's bodies use.

use super::*;

pub(crate) fn openapi() -> Option<Value> {
    let path = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"))
        .join("../../../shared/reference/github/github-openapi-gpuci-subset.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => Some(serde_json::from_str(&text).expect("OpenAPI JSON")),
        Err(_) => {
            eprintln!("skipping OpenAPI check: {} not found", path.display());
            None
        }
    }
}

fn resolve<'a>(spec: &'a Value, node: &'a Value) -> &'a Value {
    match node["$ref"].as_str() {
        Some(reference) => reference.trim_start_matches("#/").split('/').fold(spec, |node, key| &node[key]),
        None => node,
    }
}

/// The operation whose path template matches `path` for `method`, preferring the template with the
/// most literal segments (`runners/generate-jitconfig` over `runners/{runner_id}`). A parameter marked
/// `x-multi-segment` at the end of a template takes the rest of the path.
fn find_operation<'a>(spec: &'a Value, method: &Method, path: &str) -> Option<(&'a str, &'a Value)> {
    let method = method.as_str().to_lowercase();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    let mut best: Option<(usize, &str, &Value)> = None;
    for (template, item) in spec["paths"].as_object()?.iter() {
        let Some(op) = item.get(&method) else { continue };
        let parts: Vec<&str> = template.trim_start_matches('/').split('/').collect();
        let multi_segment_tail = parts.last().is_some_and(|last| {
            let name = last.trim_start_matches('{').trim_end_matches('}');
            op["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| resolve(spec, p))
                .any(|p| p["name"] == name && p["in"] == "path" && p["x-multi-segment"] == json!(true))
        });
        let fits = if multi_segment_tail { segments.len() >= parts.len() } else { segments.len() == parts.len() };
        let matches =
            fits && parts.iter().zip(&segments).all(|(part, segment)| part.starts_with('{') || part == segment);
        if matches {
            let literals = parts.iter().filter(|p| !p.starts_with('{')).count();
            if best.as_ref().is_none_or(|(n, ..)| literals > *n) {
                best = Some((literals, template.as_str(), op));
            }
        }
    }
    best.map(|(_, template, op)| (template, op))
}

/// Checks a recorded request against its operation in GitHub's OpenAPI description: a path template
/// has the method, every query parameter is declared for the operation, and the JSON body satisfies
/// the request schema (required fields, types, enums, array bounds).
pub(crate) fn assert_matches_openapi(spec: &Value, req: &Recorded) {
    let Some((template, op)) = find_operation(spec, &req.method, &req.path) else {
        panic!("{} {} matches no operation in GitHub's description", req.method, req.path);
    };
    let declared: Vec<&str> = op["parameters"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| resolve(spec, p))
        .filter(|p| p["in"] == "query")
        .filter_map(|p| p["name"].as_str())
        .collect();
    for pair in req.query.as_deref().unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
        let name = pair.split('=').next().unwrap_or_default();
        assert!(declared.contains(&name), "{} {template}: query parameter `{name}` is not declared", req.method);
    }
    let request_body = &op["requestBody"];
    if request_body.is_null() {
        assert!(req.body.is_null(), "{} {template} takes no body, got {}", req.method, req.body);
        return;
    }
    let schema = &request_body["content"]["application/json"]["schema"];
    if request_body["required"] == json!(true) || !req.body.is_null() {
        let mut errors = Vec::new();
        validate(spec, schema, &req.body, "body", &mut errors);
        assert!(errors.is_empty(), "{} {template}: {errors:?}", req.method);
    }
}

/// The small part of JSON Schema that GitHub's request bodies for these operations use.
fn validate(spec: &Value, schema: &Value, value: &Value, at: &str, errors: &mut Vec<String>) {
    if schema["$ref"].is_string() {
        return validate(spec, resolve(spec, schema), value, at, errors);
    }
    if value.is_null() && schema["nullable"] == json!(true) {
        return;
    }
    let ok = match schema["type"].as_str() {
        Some("object") => value.is_object(),
        Some("array") => value.is_array(),
        Some("string") => value.is_string(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("boolean") => value.is_boolean(),
        _ => true,
    };
    if !ok {
        errors.push(format!("{at}: expected {}, got {value}", schema["type"]));
        return;
    }
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(value) {
            errors.push(format!("{at}: {value} is not one of {allowed:?}"));
        }
    }
    if let (Some(text), Some(max)) = (value.as_str(), schema["maxLength"].as_u64()) {
        if text.chars().count() as u64 > max {
            errors.push(format!("{at}: longer than {max} characters"));
        }
    }
    if let Some(object) = value.as_object() {
        for field in schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
            if !object.contains_key(field) {
                errors.push(format!("{at}: missing required `{field}`"));
            }
        }
        for (key, item) in object {
            match schema["properties"].get(key) {
                Some(property) => validate(spec, property, item, &format!("{at}.{key}"), errors),
                None if schema["additionalProperties"] == json!(false) => {
                    errors.push(format!("{at}: unknown property `{key}`"))
                }
                None => {}
            }
        }
    }
    if let Some(items) = value.as_array() {
        let len = items.len() as u64;
        if schema["minItems"].as_u64().is_some_and(|min| len < min)
            || schema["maxItems"].as_u64().is_some_and(|max| len > max)
        {
            errors.push(format!("{at}: {len} items is outside the allowed range"));
        }
        for (i, item) in items.iter().enumerate() {
            validate(spec, &schema["items"], item, &format!("{at}[{i}]"), errors);
        }
    }
}

#[test]
fn openapi_check_catches_bad_bodies_paths_and_query_names() {
    let Some(spec) = openapi() else { return };
    let schema = &spec["paths"]["/repos/{owner}/{repo}/actions/runners/generate-jitconfig"]["post"]["requestBody"]
        ["content"]["application/json"]["schema"];
    let mut errors = Vec::new();
    validate(&spec, schema, &json!({ "name": 5, "runner_group_id": 1, "labels": [] }), "body", &mut errors);
    assert_eq!(errors.len(), 2, "{errors:?}");

    let schema = &spec["paths"]["/repos/{owner}/{repo}/check-runs"]["post"]["requestBody"]["content"]
        ["application/json"]["schema"];
    let mut errors = Vec::new();
    validate(&spec, schema, &json!({ "name": "x", "head_sha": SHA, "status": "done" }), "body", &mut errors);
    assert_eq!(errors.len(), 1, "enum: {errors:?}");

    let request = |method: Method, path: &str, query: Option<&str>| Recorded {
        method,
        path: path.into(),
        query: query.map(String::from),
        headers: HeaderMap::new(),
        body: Value::Null,
    };
    let (template, _) = find_operation(&spec, &Method::DELETE, "/repos/o/r/actions/runners/5").expect("known");
    assert_eq!(template, "/repos/{owner}/{repo}/actions/runners/{runner_id}");
    let (template, _) = find_operation(&spec, &Method::GET, "/repos/o/r/contents/a/b/c.yml").expect("multi-segment");
    assert_eq!(template, "/repos/{owner}/{repo}/contents/{path}");
    assert!(find_operation(&spec, &Method::PUT, "/repos/o/r/actions/runners/5").is_none());
    assert!(find_operation(&spec, &Method::GET, "/repos/o/r/actions/runners/5/labels").is_none());
    let undeclared = request(Method::GET, "/repos/o/r/actions/runs", Some("per_page=100&sha=abc"));
    assert!(std::panic::catch_unwind(|| assert_matches_openapi(&spec, &undeclared)).is_err());
    let declared = request(Method::GET, "/repos/o/r/actions/runs", Some("per_page=100&head_sha=abc&page=2"));
    assert_matches_openapi(&spec, &declared);
}
