//! `docs/coordinator-openapi.yaml` describes exactly the routes the router
//! serves, and each of them is served.

mod common;

use std::collections::BTreeSet;

use coordinator::route_table;
use serde_norway::Value;

const OPENAPI_YAML: &str = include_str!("../../docs/coordinator-openapi.yaml");
const METHODS: [&str; 8] = [
    "get", "put", "post", "delete", "patch", "head", "options", "trace",
];

fn document() -> Value {
    serde_norway::from_str(OPENAPI_YAML).expect("the OpenAPI document is valid YAML")
}

#[test]
fn document_lists_exactly_the_served_routes() {
    let doc = document();
    let version = doc["openapi"].as_str().expect("openapi field");
    assert!(
        version.starts_with("3."),
        "OpenAPI 3 expected, got {version}"
    );
    let paths = doc["paths"].as_mapping().expect("paths");
    let mut documented = BTreeSet::new();
    for (path, item) in paths {
        let path = path.as_str().expect("path key");
        for method in METHODS {
            if let Some(operation) = item.get(method) {
                assert!(
                    operation["responses"]
                        .as_mapping()
                        .is_some_and(|r| !r.is_empty()),
                    "{method} {path} has responses"
                );
                documented.insert((method.to_uppercase(), path.to_owned()));
            }
        }
    }
    let served: BTreeSet<(String, String)> = route_table()
        .iter()
        .map(|route| (route.method.as_str().to_owned(), route.path.to_owned()))
        .collect();
    assert_eq!(
        served.len(),
        route_table().len(),
        "no route is listed twice"
    );
    assert_eq!(documented, served);
}

#[test]
fn every_reference_resolves() {
    let doc = document();
    let mut refs = Vec::new();
    collect_refs(&doc, &mut refs);
    assert!(!refs.is_empty());
    for reference in refs {
        let pointer = reference.strip_prefix("#/").expect("local reference");
        let mut node = &doc;
        for key in pointer.split('/') {
            node = node
                .get(key)
                .unwrap_or_else(|| panic!("{reference} does not resolve"));
        }
    }
}

fn collect_refs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Mapping(map) => {
            for (key, item) in map {
                match (key.as_str(), item.as_str()) {
                    (Some("$ref"), Some(target)) => out.push(target.to_owned()),
                    _ => collect_refs(item, out),
                }
            }
        }
        Value::Sequence(items) => items.iter().for_each(|item| collect_refs(item, out)),
        _ => {}
    }
}

#[test]
fn every_route_in_the_table_is_served() {
    let h = common::start(None, 3000);
    for route in route_table() {
        let path = route
            .path
            .replace("{id}", "n1")
            .replace("{node_id}", "n1")
            .replace("{gpa_start}", "0");
        let method = reqwest::Method::from_bytes(route.method.as_str().as_bytes()).expect("method");
        let answer = h.call(method, &path, None);
        let message = answer.body["message"].as_str().unwrap_or("");
        assert!(
            !message.starts_with("no route for") && answer.status != 405,
            "{} {} is not served: {answer:?}",
            route.method.as_str(),
            route.path
        );
    }
}

#[test]
fn security_matches_each_routes_access() {
    let doc = document();
    assert!(
        doc["components"]["securitySchemes"]["bearerAuth"].is_mapping(),
        "bearer scheme"
    );
    assert!(doc["security"].as_sequence().is_some_and(|s| !s.is_empty()));
    for route in route_table() {
        let operation = &doc["paths"][route.path][route.method.as_str().to_lowercase().as_str()];
        let what = format!("{} {}", route.method.as_str(), route.path);
        let responses = &operation["responses"];
        let has = |code: &str| responses.get(code).is_some();
        let opted_out = operation["security"]
            .as_sequence()
            .is_some_and(|s| s.is_empty());
        if route.access.is_public() {
            assert!(opted_out, "{what} is public: `security: []`");
            assert!(!has("401"), "{what}");
        } else {
            assert!(!opted_out, "{what} needs a credential");
            assert!(has("401"), "{what} documents 401");
        }
        let writes = route.method != coordinator::HttpMethod::Get;
        assert_eq!(has("403"), writes, "{what} documents 403 iff it writes");
        if operation.get("requestBody").is_some() {
            assert!(has("408"), "{what} documents the body timeout");
        }
    }
    for (method, path) in [("put", "/v1/nodes/{id}"), ("post", "/v1/map")] {
        assert!(
            doc["paths"][path][method]["responses"].get("429").is_some(),
            "{method} {path} documents 429"
        );
    }
}
