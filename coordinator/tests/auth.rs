//! Credentials derived from the cluster key, over real sockets on
//! 127.0.0.1: every route but health needs one, a node's credential changes
//! only that node, the client credential only reads, admin does anything.

mod common;

use common::{start_keyed, Answer, Harness};
use coordinator::{route_table, HttpMethod, Limits};
use rdma_transport::auth::ClusterKey;
use reqwest::Method;
use serde_json::{json, Value};

fn key(h: &Harness) -> &ClusterKey {
    h.key.as_ref().expect("keyed harness")
}

fn node_bearer(key: &ClusterKey, id: &str) -> String {
    format!("node:{id}:{}", key.node_credential(id))
}

/// A keyed coordinator where nodes a and b registered themselves (with
/// their own credentials) and each claimed one range.
fn two_nodes() -> (Harness, String, String) {
    let h = start_keyed(Limits::default());
    let (a, b) = (node_bearer(key(&h), "a"), node_bearer(key(&h), "b"));
    for (id, bearer, gpa, addr) in [
        ("a", &a, 0u64, "10.0.0.1:7000"),
        ("b", &b, 0x10000, "10.0.0.2:7000"),
    ] {
        let put = h.call_as(
            Some(bearer),
            Method::PUT,
            &format!("/v1/nodes/{id}"),
            Some(json!({ "tcp_addr": addr })),
        );
        assert_eq!(put.status, 200, "{put:?}");
        let range = h.call_as(Some(bearer), Method::POST, "/v1/map", Some(range(gpa, id)));
        assert_eq!(range.status, 201, "{range:?}");
    }
    (h, a, b)
}

fn range(gpa_start: u64, node_id: &str) -> Value {
    json!({ "gpa_start": gpa_start, "length_bytes": 4096, "node_id": node_id, "remote_offset": 0 })
}

fn assert_refused(answer: &Answer, status: u16, code: &str, what: &str) {
    assert_eq!(
        (answer.status, answer.error_code()),
        (status, code),
        "{what}"
    );
}

#[test]
fn every_route_but_health_needs_a_credential() {
    let h = start_keyed(Limits::default());
    h.register("n1", "10.0.0.1:7000");
    let health = h.call_as(None, Method::GET, "/v1/health", None);
    assert_eq!(health.status, 200);
    for route in route_table() {
        let path = route
            .path
            .replace("{id}", "n1")
            .replace("{node_id}", "n1")
            .replace("{gpa_start}", "0")
            .replace("/v1/resolve", "/v1/resolve?gpa=0");
        let method = Method::from_bytes(route.method.as_str().as_bytes()).expect("method");
        let answer = h.call_as(None, method, &path, None);
        if route.access.is_public() {
            assert_eq!(answer.status, 200, "{path}");
        } else {
            assert_refused(&answer, 401, "unauthorized", &path);
        }
    }
    // Reads answer with any credential, and show nothing without one.
    let client = key(&h).client_credential();
    for bearer in [
        client,
        node_bearer(key(&h), "n1"),
        node_bearer(key(&h), "other"),
    ] {
        let nodes = h.call_as(Some(&bearer), Method::GET, "/v1/nodes", None);
        assert_eq!(nodes.status, 200, "{nodes:?}");
        assert_eq!(nodes.body[0]["tcp_addr"], "10.0.0.1:7000");
    }
    let routes_needing_auth = route_table()
        .iter()
        .filter(|r| !r.access.is_public())
        .count();
    assert_eq!(routes_needing_auth, route_table().len() - 1);
    assert!(route_table()
        .iter()
        .any(|r| r.access.is_public() && r.method == HttpMethod::Get && r.path == "/v1/health"));
}

#[test]
fn a_node_credential_cannot_change_another_node() {
    let (h, a, _b) = two_nodes();
    let before_b = h.get("/v1/nodes/b").body;
    let before_map = h.get("/v1/map").body;
    let endpoint = json!({ "device": "rxe0", "port": 1, "gid": "::1", "gid_index": 0, "lid": 0 });
    let attempts: [(Method, &str, Option<Value>); 8] = [
        (
            Method::PUT,
            "/v1/nodes/b",
            Some(json!({ "tcp_addr": "6.6.6.6:1" })),
        ),
        (Method::POST, "/v1/nodes/b/heartbeat", None),
        (
            Method::POST,
            "/v1/nodes/b/rdma/endpoint",
            Some(endpoint.clone()),
        ),
        (Method::POST, "/nodes/b/rdma/endpoint", Some(endpoint)),
        (Method::POST, "/v1/map", Some(range(0x20000, "b"))),
        (Method::DELETE, "/v1/map/0x10000", None),
        (Method::DELETE, "/v1/nodes/b", None),
        // Removing a whole node is for operators, even one's own.
        (Method::DELETE, "/v1/nodes/a", None),
    ];
    for (method, path, body) in attempts {
        let what = format!("{method} {path}");
        let answer = h.call_as(Some(&a), method, path, body);
        assert_refused(&answer, 403, "forbidden", &what);
    }
    // A percent-encoded spelling of another id is no way around it.
    let sneaky = h.call_as(
        Some(&a),
        Method::PUT,
        "/v1/nodes/%62",
        Some(json!({ "tcp_addr": "6.6.6.6:1" })),
    );
    assert_eq!(sneaky.status, 403, "{sneaky:?}");
    let now_b = h.get("/v1/nodes/b").body;
    assert_eq!(now_b["tcp_addr"], before_b["tcp_addr"]);
    assert_eq!(now_b["rdma"], before_b["rdma"]);
    let now_map = h.get("/v1/map").body;
    assert_eq!(now_map["version"], before_map["version"]);
    assert_eq!(now_map["entries"], before_map["entries"]);

    // Its own things, it may change.
    let own = |method: Method, path: &str, body: Option<Value>| {
        h.call_as(Some(&a), method, path, body).status
    };
    assert_eq!(own(Method::POST, "/v1/nodes/a/heartbeat", None), 200);
    assert_eq!(
        own(
            Method::PUT,
            "/v1/nodes/a",
            Some(json!({ "tcp_addr": "10.0.0.9:7000" }))
        ),
        200
    );
    assert_eq!(own(Method::POST, "/v1/map", Some(range(0x20000, "a"))), 201);
    assert_eq!(own(Method::DELETE, "/v1/map/0x20000", None), 204);
    assert_eq!(own(Method::DELETE, "/v1/map/0", None), 204);
}

#[test]
fn the_client_credential_only_reads() {
    let (h, _a, _b) = two_nodes();
    let client = key(&h).client_credential();
    assert_eq!(
        h.call_as(Some(&client), Method::GET, "/v1/map", None)
            .status,
        200
    );
    assert_eq!(
        h.call_as(Some(&client), Method::GET, "/v1/resolve?gpa=0x10000", None)
            .status,
        200
    );
    let writes: [(Method, &str, Option<Value>); 5] = [
        (
            Method::PUT,
            "/v1/nodes/c",
            Some(json!({ "tcp_addr": "h:1" })),
        ),
        (Method::POST, "/v1/nodes/a/heartbeat", None),
        (Method::POST, "/v1/map", Some(range(0x20000, "a"))),
        (Method::DELETE, "/v1/map/0", None),
        (Method::DELETE, "/v1/nodes/a", None),
    ];
    for (method, path, body) in writes {
        let what = format!("{method} {path}");
        assert_refused(
            &h.call_as(Some(&client), method, path, body),
            403,
            "forbidden",
            &what,
        );
    }
    assert_eq!(
        h.get("/v1/map").body["entries"].as_array().map(Vec::len),
        Some(2)
    );
}

#[test]
fn admin_may_do_anything() {
    let (h, _a, _b) = two_nodes();
    // `call` sends the admin credential.
    assert_eq!(h.register("b", "10.9.9.9:1")["tcp_addr"], "10.9.9.9:1");
    assert_eq!(h.add_range(0x30000, 4096, "a", 0).status, 201);
    assert_eq!(h.call(Method::DELETE, "/v1/map/0x10000", None).status, 204);
    assert_eq!(h.call(Method::DELETE, "/v1/nodes/a", None).status, 204);
    assert_eq!(h.get("/v1/nodes/a").status, 404);
}

#[test]
fn credentials_of_another_key_or_malformed_ones_are_401() {
    let (h, _a, _b) = two_nodes();
    let wrong = ClusterKey::generate().expect("key");
    let good_a = key(&h).node_credential("a");
    for bearer in [
        wrong.admin_credential(),
        wrong.client_credential(),
        node_bearer(&wrong, "a"),
        format!("node:b:{good_a}"),
        format!("node:a:{}", &good_a[..63]),
        "node:a".to_owned(),
        format!("node::{good_a}"),
        String::new(),
    ] {
        let put = h.call_as(
            Some(&bearer),
            Method::PUT,
            "/v1/nodes/a",
            Some(json!({ "tcp_addr": "6.6.6.6:1" })),
        );
        assert_refused(&put, 401, "unauthorized", &bearer);
        let read = h.call_as(Some(&bearer), Method::GET, "/v1/map", None);
        assert_refused(&read, 401, "unauthorized", &bearer);
    }
    assert_eq!(h.get("/v1/nodes/a").body["tcp_addr"], "10.0.0.1:7000");
}
