//! The HTTP API over real sockets on 127.0.0.1: nodes, map, resolve, errors,
//! auth, liveness and the map version.

mod common;

use common::{start, wait_until};
use reqwest::Method;
use serde_json::json;

const LEASE_MS: u64 = 3000;

#[test]
fn health() {
    let h = start(None, LEASE_MS);
    let answer = h.get("/v1/health");
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body, json!({ "status": "ok" }));
}

#[test]
fn nodes_register_list_get_delete() {
    let h = start(None, LEASE_MS);
    let node = h.register("node-b", "10.0.0.2:7000");
    assert_eq!(node["id"], "node-b");
    assert_eq!(node["tcp_addr"], "10.0.0.2:7000");
    assert!(node.get("rdma").is_none());
    h.register("node-a", "10.0.0.1:7000");

    let list = h.get("/v1/nodes");
    assert_eq!(list.status, 200);
    let ids: Vec<&str> = list
        .body
        .as_array()
        .expect("array")
        .iter()
        .map(|n| n["id"].as_str().expect("id"))
        .collect();
    assert_eq!(ids, ["node-a", "node-b"]);

    let one = h.get("/v1/nodes/node-a");
    assert_eq!(one.status, 200);
    assert_eq!(one.body["tcp_addr"], "10.0.0.1:7000");
    assert_eq!(h.get("/v1/nodes/ghost").error_code(), "not_found");
    assert_eq!(h.get("/v1/nodes/ghost").status, 404);

    // Re-registering replaces the address.
    assert_eq!(
        h.register("node-a", "10.0.0.9:7000")["tcp_addr"],
        "10.0.0.9:7000"
    );

    assert_eq!(h.add_range(0, 4096, "node-a", 0).status, 201);
    let deleted = h.call(Method::DELETE, "/v1/nodes/node-a", None);
    assert_eq!(deleted.status, 204);
    assert_eq!(h.get("/v1/nodes/node-a").status, 404);
    assert_eq!(
        h.get("/v1/resolve?gpa=0").status,
        404,
        "its ranges went with it"
    );
    let again = h.call(Method::DELETE, "/v1/nodes/node-a", None);
    assert_eq!((again.status, again.error_code()), (404, "not_found"));
}

#[test]
fn node_ids_and_registrations_are_validated() {
    let h = start(None, LEASE_MS);
    let body = json!({ "tcp_addr": "h:1" });
    for bad_id in ["has%20space", "a%2Fb", "%FF", &"x".repeat(65), "%C3%A9"] {
        let answer = h.call(
            Method::PUT,
            &format!("/v1/nodes/{bad_id}"),
            Some(body.clone()),
        );
        assert_eq!(
            (answer.status, answer.error_code()),
            (400, "bad_request"),
            "{bad_id}"
        );
    }
    assert_eq!(
        h.call(Method::POST, "/v1/nodes/bad%20id/heartbeat", None)
            .status,
        400
    );
    assert_eq!(h.get("/v1/nodes/bad%20id").status, 400);
    for bad_addr in ["", "nohost", "h:0", "h:99999"] {
        let answer = h.call(
            Method::PUT,
            "/v1/nodes/n",
            Some(json!({ "tcp_addr": bad_addr })),
        );
        assert_eq!(answer.status, 400, "{bad_addr:?}");
    }
    let bad_gid = json!({ "tcp_addr": "h:1", "rdma": { "device": "rxe0", "port": 1, "gid": "nope", "gid_index": 0, "lid": 0 } });
    assert_eq!(
        h.call(Method::PUT, "/v1/nodes/n", Some(bad_gid)).status,
        400
    );
}

#[test]
fn heartbeat_unknown_node_is_404() {
    let h = start(None, LEASE_MS);
    let answer = h.call(Method::POST, "/v1/nodes/ghost/heartbeat", None);
    assert_eq!((answer.status, answer.error_code()), (404, "not_found"));
    h.register("n1", "h:1");
    let answer = h.call(Method::POST, "/v1/nodes/n1/heartbeat", None);
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body["id"], "n1");
}

/// A heartbeat naming its process's epoch renews only that process's
/// lease: once another process of the node registered, the old one's is
/// refused (409 `superseded`) and renews nothing; without an epoch (older
/// page-servers) it renews whichever process registered.
#[test]
fn a_heartbeat_from_a_replaced_process_renews_nothing() {
    const SHORT_LEASE_MS: u64 = 300;
    let h = start(None, SHORT_LEASE_MS);
    let register = |epoch: u64| {
        let answer = h.call(
            Method::PUT,
            "/v1/nodes/n1",
            Some(json!({ "tcp_addr": "h:1", "epoch": epoch })),
        );
        assert_eq!(answer.status, 200, "{answer:?}");
    };
    register(0x11);
    let beat = h.call(Method::POST, "/v1/nodes/n1/heartbeat?epoch=0x11", None);
    assert_eq!(
        (beat.status, &beat.body["epoch"]),
        (200, &json!(0x11)),
        "{beat:?}"
    );

    register(0x22);
    wait_until("process 0x22's lease to run out", || {
        h.get("/v1/nodes/n1").body["alive"] == json!(false)
    });
    let old = h.call(Method::POST, "/v1/nodes/n1/heartbeat?epoch=17", None);
    assert_eq!(
        (old.status, old.error_code()),
        (409, "superseded"),
        "{old:?}"
    );
    let message = old.body["message"].as_str().expect("message");
    assert!(
        message.contains("0x22") && message.contains("h:1"),
        "{message}"
    );
    let after = h.get("/v1/nodes/n1").body;
    assert_eq!(
        after["alive"],
        json!(false),
        "refused, yet renewed: {after}"
    );
    assert!(
        after["last_seen_ms_ago"].as_u64().expect("ms") >= SHORT_LEASE_MS,
        "{after}"
    );
    let metrics = reqwest::blocking::get(h.url("/metrics"))
        .and_then(reqwest::blocking::Response::text)
        .expect("metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l == "coordinator_superseded_heartbeats_total 1"),
        "{metrics}"
    );

    let current = h.call(Method::POST, "/v1/nodes/n1/heartbeat?epoch=0x22", None);
    assert_eq!(
        (current.status, &current.body["alive"]),
        (200, &json!(true))
    );
    let unchecked = h.call(Method::POST, "/v1/nodes/n1/heartbeat", None);
    assert_eq!(unchecked.status, 200, "no epoch: renewed as before");
    for bad in ["x", "-1", "0x", "18446744073709551616"] {
        let answer = h.call(
            Method::POST,
            &format!("/v1/nodes/n1/heartbeat?epoch={bad}"),
            None,
        );
        assert_eq!(
            (answer.status, answer.error_code()),
            (400, "bad_request"),
            "{bad:?}"
        );
    }
    let ghost = h.call(Method::POST, "/v1/nodes/ghost/heartbeat?epoch=1", None);
    assert_eq!(ghost.status, 404);
}

#[test]
fn liveness_follows_the_lease() {
    const SHORT_LEASE_MS: u64 = 300;
    let h = start(None, SHORT_LEASE_MS);
    let registered = h.register("n1", "h:1");
    let ago_ms = registered["last_seen_ms_ago"].as_u64().expect("ms");
    assert_eq!(registered["alive"], json!(ago_ms < SHORT_LEASE_MS));

    wait_until("the lease to run out", || {
        h.get("/v1/nodes/n1").body["alive"] == json!(false)
    });
    let dead = h.get("/v1/nodes/n1").body;
    assert!(dead["last_seen_ms_ago"].as_u64().expect("ms") >= SHORT_LEASE_MS);

    let beat = h.call(Method::POST, "/v1/nodes/n1/heartbeat", None).body;
    let ago_ms = beat["last_seen_ms_ago"].as_u64().expect("ms");
    assert!(
        ago_ms < SHORT_LEASE_MS,
        "a heartbeat resets last_seen: {beat}"
    );
    assert_eq!(beat["alive"], json!(true));
}

#[test]
fn ranges_conflicts_and_idempotent_re_add() {
    let h = start(None, LEASE_MS);
    h.register("a", "h:1");
    h.register("b", "h:2");
    let created = h.add_range(0x10_0000, 0x4000, "a", 0x2000);
    assert_eq!(created.status, 201, "{created:?}");
    assert_eq!(
        created.body,
        json!({ "gpa_start": 0x10_0000, "length_bytes": 0x4000, "node_id": "a", "remote_offset": 0x2000,
                "valid_epoch": 0, "state": "live",
                "replicas": [{ "node_id": "a", "remote_offset": 0x2000, "valid_epoch": 0,
                               "state": "live", "recovery_seq": 0 }] })
    );

    // (The same start and length by "b" is a replica of the range: see
    // replicas.rs.)
    for (start, length, node) in [
        (0x10_0000, 0x1000, "b"),
        (0x10_1000, 0x1000, "b"),
        (0x0f_f000, 0x2000, "b"),
        (0x10_0000, 0x1000, "a"),
    ] {
        let answer = h.add_range(start, length, node, 0);
        assert_eq!(
            (answer.status, answer.error_code()),
            (409, "conflict"),
            "{start:#x}+{length:#x} {node}"
        );
    }

    // Same start, length and node: refreshed, 200.
    let version = h.version();
    let refreshed = h.call(
        Method::POST,
        "/v1/map",
        Some(json!({ "gpa_start": 0x10_0000, "length_bytes": 0x4000, "node_id": "a", "remote_offset": 0x8000, "rdma": { "addr": 0x7f00_0000_0000_u64, "rkey": 42 } })),
    );
    assert_eq!(refreshed.status, 200, "{refreshed:?}");
    assert_eq!(refreshed.body["remote_offset"], 0x8000);
    // An offered region key is neither stored nor published.
    assert_eq!(refreshed.body.get("rdma"), None, "{refreshed:?}");
    let map = h.call(Method::GET, "/v1/map", None);
    assert!(
        !map.body.to_string().contains("rkey"),
        "the map publishes a key: {map:?}"
    );
    assert!(h.version() > version);

    assert_eq!(
        h.add_range(0x10_4000, 0x1000, "b", 0).status,
        201,
        "adjacent"
    );
    assert_eq!(h.add_range(0, 0x1000, "b", 0).status, 201);
    let unknown = h.add_range(0x20_0000, 0x1000, "ghost", 0);
    assert_eq!((unknown.status, unknown.error_code()), (404, "not_found"));

    let map = h.get("/v1/map").body;
    let starts: Vec<u64> = map["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| e["gpa_start"].as_u64().expect("u64"))
        .collect();
    assert_eq!(starts, [0, 0x10_0000, 0x10_4000]);
    assert_eq!(map["nodes"].as_array().expect("nodes").len(), 2);

    assert_eq!(h.call(Method::DELETE, "/v1/map/0x104000", None).status, 204);
    assert_eq!(h.call(Method::DELETE, "/v1/map/1064960", None).status, 404);
    assert_eq!(h.call(Method::DELETE, "/v1/map/0", None).status, 204);
    assert_eq!(h.call(Method::DELETE, "/v1/map/zero", None).status, 400);
}

#[test]
fn ranges_are_validated() {
    let h = start(None, LEASE_MS);
    h.register("a", "h:1");
    let max = u64::MAX;
    for (start, length, offset) in [
        (1, 4096, 0),
        (0, 4096, 512),
        (0, 0, 0),
        (0, 4097, 0),
        (max - 4095, 4096, 0),
        (0, 8192, max - 4095),
    ] {
        let answer = h.add_range(start, length, "a", offset);
        assert_eq!(
            (answer.status, answer.error_code()),
            (400, "bad_request"),
            "{start} {length} {offset}"
        );
    }
    assert_eq!(h.add_range(0, 4096, "bad id", 0).status, 400);
    assert_eq!(
        h.add_range(max - 8191, 4096, "a", 0).status,
        201,
        "high addresses"
    );
    let hit = h.get(&format!("/v1/resolve?gpa={}", max - 5000));
    assert_eq!(hit.status, 200, "{hit:?}");
    assert_eq!(hit.body["entry"]["gpa_start"].as_u64(), Some(max - 8191));
}

#[test]
fn resolve_hits_misses_and_bad_input() {
    let h = start(None, LEASE_MS);
    h.register("a", "h:1");
    assert_eq!(h.add_range(0x1000, 0x2000, "a", 0x5000).status, 201);
    let version = h.version();
    for query in ["gpa=4096", "gpa=0x1000", "gpa=0X2FFF", "gpa=12287"] {
        let answer = h.get(&format!("/v1/resolve?{query}"));
        assert_eq!(answer.status, 200, "{query}: {answer:?}");
        assert_eq!(answer.body["entry"]["gpa_start"], 0x1000);
        assert_eq!(answer.body["entry"]["remote_offset"], 0x5000);
        assert_eq!(answer.body["node"]["id"], "a");
        assert_eq!(answer.body["version"].as_u64(), Some(version));
    }
    assert_eq!(h.get("/v1/resolve?gpa=0x1000").body["gpa"], 0x1000);
    for miss in [
        "gpa=0",
        "gpa=0xfff",
        "gpa=0x3000",
        "gpa=18446744073709551615",
    ] {
        let answer = h.get(&format!("/v1/resolve?{miss}"));
        assert_eq!(
            (answer.status, answer.error_code()),
            (404, "not_found"),
            "{miss}"
        );
    }
    for bad in [
        "",
        "?",
        "?gpa=",
        "?gpa=abc",
        "?gpa=-1",
        "?gpa=0x",
        "?gpa=18446744073709551616",
        "?other=1",
        "?gpa=1&gpa=2",
    ] {
        let answer = h.get(&format!("/v1/resolve{bad}"));
        assert_eq!(
            (answer.status, answer.error_code()),
            (400, "bad_request"),
            "{bad}"
        );
    }
}

#[test]
fn version_only_increases() {
    let h = start(None, LEASE_MS);
    let mut last = h.version();
    let mut expect_bump = |what: &str, bumped: bool| {
        let now = h.version();
        if bumped {
            assert!(now > last, "{what}: {last} -> {now}");
        } else {
            assert_eq!(now, last, "{what}");
        }
        last = now;
    };
    h.register("a", "h:1");
    expect_bump("new node", true);
    h.register("a", "h:1");
    expect_bump("same registration", false);
    h.call(Method::POST, "/v1/nodes/a/heartbeat", None);
    expect_bump("heartbeat", false);
    h.register("a", "h:2");
    expect_bump("new address", true);
    h.add_range(0, 4096, "a", 0);
    expect_bump("new range", true);
    h.add_range(0, 4096, "a", 0);
    expect_bump("identical range", false);
    h.call(Method::DELETE, "/v1/map/0", None);
    expect_bump("range removed", true);
    h.call(Method::DELETE, "/v1/nodes/a", None);
    expect_bump("node removed", true);
}

#[test]
fn rdma_endpoint_routes_with_and_without_v1() {
    let h = start(None, LEASE_MS);
    let endpoint =
        json!({ "device": "rxe0", "port": 1, "gid": "::ffff:127.0.0.1", "gid_index": 1, "lid": 0 });
    for prefix in ["", "/v1"] {
        let path = format!("{prefix}/nodes/n1/rdma/endpoint");
        assert_eq!(
            h.call(Method::POST, &path, Some(endpoint.clone())).status,
            404,
            "unknown node"
        );
        assert_eq!(h.get(&path).status, 404, "unknown node");
    }
    h.register("n1", "h:1");
    assert_eq!(
        h.get("/nodes/n1/rdma/endpoint").status,
        404,
        "no endpoint yet"
    );
    let version = h.version();
    let set = h.call(
        Method::POST,
        "/nodes/n1/rdma/endpoint",
        Some(endpoint.clone()),
    );
    assert_eq!(set.status, 200, "{set:?}");
    assert_eq!(set.body["rdma"], endpoint);
    assert!(h.version() > version);
    for path in ["/nodes/n1/rdma/endpoint", "/v1/nodes/n1/rdma/endpoint"] {
        let got = h.get(path);
        assert_eq!(got.status, 200);
        assert_eq!(got.body, endpoint);
    }
    assert_eq!(h.get("/v1/nodes/n1").body["rdma"], endpoint);
    let bad = json!({ "device": "rxe0", "port": 0, "gid": "::1", "gid_index": 0, "lid": 0 });
    assert_eq!(
        h.call(Method::POST, "/v1/nodes/n1/rdma/endpoint", Some(bad))
            .status,
        400
    );
}

#[test]
fn malformed_requests_get_json_errors() {
    let h = start(None, LEASE_MS);
    h.register("a", "h:1");
    let json = Some("application/json");
    let cases: [(&str, Option<&str>, &[u8]); 7] = [
        ("bad JSON", json, b"{not json"),
        ("missing field", json, br#"{"gpa_start":0,"length_bytes":4096}"#),
        ("wrong type", json, br#"{"gpa_start":"0","length_bytes":4096,"node_id":"a","remote_offset":0}"#),
        ("negative", json, br#"{"gpa_start":-4096,"length_bytes":4096,"node_id":"a","remote_offset":0}"#),
        ("too big for u64", json, br#"{"gpa_start":18446744073709551616,"length_bytes":4096,"node_id":"a","remote_offset":0}"#),
        ("wrong content type", Some("text/plain"), br#"{"gpa_start":0,"length_bytes":4096,"node_id":"a","remote_offset":0}"#),
        ("no content type", None, br#"{"gpa_start":0,"length_bytes":4096,"node_id":"a","remote_offset":0}"#),
    ];
    for (what, content_type, body) in cases {
        let answer = h.raw(Method::POST, "/v1/map", content_type, body.to_vec());
        assert_eq!(
            (answer.status, answer.error_code()),
            (400, "bad_request"),
            "{what}: {answer:?}"
        );
    }
    let empty = h.raw(Method::PUT, "/v1/nodes/b", json, Vec::new());
    assert_eq!((empty.status, empty.error_code()), (400, "bad_request"));

    let mut huge = br#"{"tcp_addr":"h:1","pad":""#.to_vec();
    huge.extend(vec![b'x'; 100 * 1024]);
    huge.extend(br#""}"#);
    let too_large = h.raw(Method::PUT, "/v1/nodes/b", json, huge);
    assert_eq!(
        (too_large.status, too_large.error_code()),
        (413, "payload_too_large")
    );

    let unknown = h.get("/v2/nothing");
    assert_eq!((unknown.status, unknown.error_code()), (404, "not_found"));
    let unknown = h.call(Method::POST, "/", None);
    assert_eq!((unknown.status, unknown.error_code()), (404, "not_found"));
    let wrong_method = h.call(Method::PATCH, "/v1/map", None);
    assert_eq!(
        (wrong_method.status, wrong_method.error_code()),
        (405, "method_not_allowed")
    );
}

#[test]
fn writes_need_the_token_reads_do_not() {
    let h = start(Some("s3cret"), LEASE_MS);
    assert_eq!(h.register("a", "h:1")["id"], "a");

    let anonymous = reqwest::blocking::Client::new();
    let send = |method: Method, path: &str, auth: Option<&str>, body: Option<serde_json::Value>| {
        let mut request = anonymous.request(method, h.url(path));
        if let Some(auth) = auth {
            request = request.header("authorization", auth);
        }
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body.to_string());
        }
        let response = request.send().expect("sent");
        let status = response.status().as_u16();
        let body: serde_json::Value = response.json().unwrap_or(serde_json::Value::Null);
        (status, body)
    };
    let registration = json!({ "tcp_addr": "h:2" });
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("s3cret"),
        Some("Basic czNjcmV0"),
    ] {
        let (status, body) = send(Method::PUT, "/v1/nodes/b", auth, Some(registration.clone()));
        assert_eq!(
            (status, body["error"].as_str()),
            (401, Some("unauthorized")),
            "{auth:?}"
        );
        let (status, _) = send(Method::POST, "/v1/nodes/a/heartbeat", auth, None);
        assert_eq!(status, 401);
        let (status, _) = send(Method::DELETE, "/v1/nodes/a", auth, None);
        assert_eq!(status, 401);
        let (status, _) = send(Method::POST, "/nodes/a/rdma/endpoint", auth, None);
        assert_eq!(status, 401);
    }
    let (status, _) = send(
        Method::PUT,
        "/v1/nodes/b",
        Some("Bearer s3cret"),
        Some(registration),
    );
    assert_eq!(status, 200);
    for path in ["/v1/health", "/v1/nodes", "/v1/nodes/a", "/v1/map"] {
        assert_eq!(send(Method::GET, path, None, None).0, 200, "{path}");
    }
}

#[test]
fn map_long_poll_answers_when_the_version_passes_or_at_the_timeout() {
    let h = start(None, LEASE_MS);
    h.register("first", "h:9");
    let before = h.version();
    assert!(before > 0);
    // Nothing changes: the poll answers the same version after its timeout.
    let started = std::time::Instant::now();
    let answer = h.get(&format!("/v1/map?after={before}&timeout_ms=300"));
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.body["version"].as_u64(), Some(before));
    assert!(started.elapsed() >= std::time::Duration::from_millis(300));
    // A version already passed answers at once.
    let answer = h.get(&format!("/v1/map?after={}&timeout_ms=60000", before - 1));
    assert_eq!(answer.body["version"].as_u64(), Some(before), "{answer:?}");
    // A change made while a poll waits ends it with the new map.
    let url = h.url(&format!("/v1/map?after={before}&timeout_ms=20000"));
    let poll = std::thread::spawn(move || {
        let started = std::time::Instant::now();
        let body: serde_json::Value = reqwest::blocking::Client::new()
            .get(url)
            .timeout(std::time::Duration::from_secs(30))
            .send()
            .expect("poll sent")
            .json()
            .expect("map");
        (body, started.elapsed())
    });
    // The poll is counted as waiting until it answers.
    let waiting = || {
        let text = reqwest::blocking::get(h.url("/metrics"))
            .and_then(reqwest::blocking::Response::text)
            .unwrap_or_default();
        text.lines()
            .find_map(|l| l.strip_prefix("coordinator_map_long_polls_waiting "))
            .and_then(|n| n.parse::<u64>().ok())
    };
    wait_until("the poll counted as waiting", || waiting() == Some(1));
    h.register("a", "h:1");
    let (body, waited) = poll.join().expect("poll thread");
    assert_eq!(waiting(), Some(0));
    assert!(body["version"].as_u64() > Some(before), "{body}");
    assert!(
        body["nodes"]
            .as_array()
            .is_some_and(|nodes| nodes.iter().any(|n| n["id"] == "a")),
        "{body}"
    );
    assert!(waited < std::time::Duration::from_secs(15), "{waited:?}");
    // Bad parameters are refused; the server keeps serving.
    for bad in ["after=x", "after=1&timeout_ms=-1"] {
        let answer = h.get(&format!("/v1/map?{bad}"));
        assert_eq!(answer.status, 400, "{bad}: {answer:?}");
        assert_eq!(answer.error_code(), "bad_request");
    }
    assert_eq!(h.get("/v1/map").status, 200);
}

#[test]
fn metrics_count_requests_errors_renewals_and_the_version() {
    let h = start(None, LEASE_MS);
    h.register("n1", "h:1");
    for _ in 0..2 {
        assert_eq!(
            h.call(Method::POST, "/v1/nodes/n1/heartbeat", None).status,
            200
        );
    }
    assert_eq!(
        h.call(Method::POST, "/v1/nodes/ghost/heartbeat", None)
            .status,
        404
    );
    assert_eq!(h.add_range(0, 4096, "n1", 0).status, 201);
    let version = h.version();

    let answer = h.raw(Method::GET, "/metrics", None, Vec::new());
    assert_eq!(answer.status, 200);
    assert!(answer
        .content_type
        .starts_with("application/openmetrics-text"));
    let text = reqwest::blocking::get(h.url("/metrics"))
        .expect("metrics")
        .text()
        .expect("text");
    let has = |line: &str| text.lines().any(|l| l == line);
    assert!(has("coordinator_lease_renewals_total 2"), "{text}");
    assert!(has(&format!("coordinator_map_version {version}")), "{text}");
    for line in [
        r#"coordinator_http_requests_total{method="PUT",route="/v1/nodes/{id}",status="200"} 1"#,
        r#"coordinator_http_requests_total{method="POST",route="/v1/nodes/{id}/heartbeat",status="200"} 2"#,
        r#"coordinator_http_requests_total{method="POST",route="/v1/nodes/{id}/heartbeat",status="404"} 1"#,
        r#"coordinator_http_errors_total{method="POST",route="/v1/nodes/{id}/heartbeat",kind="client"} 1"#,
        r#"coordinator_http_request_duration_seconds_count{method="POST",route="/v1/map"} 1"#,
    ] {
        assert!(has(line), "missing {line}:\n{text}");
    }
    assert!(text.trim_end().ends_with("# EOF"), "{text}");
}
