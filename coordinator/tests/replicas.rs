//! Replicated ranges over real sockets on 127.0.0.1: a second holder's
//! claim, the stale / recovering / live routes, who may call them, and the
//! typed client's calls.

mod common;

use std::time::Duration;

use common::{start, start_keyed, Answer, Harness};
use coordinator::Limits;
use rdma_transport::auth::ClusterKey;
use rdma_transport::coordinator::api::{RangeRequest, ReplicaState};
use reqwest::Method;
use serde_json::{json, Value};

const GPA: u64 = 0x10000;

fn key(h: &Harness) -> &ClusterKey {
    h.key.as_ref().expect("keyed harness")
}

fn node_bearer(key: &ClusterKey, id: &str) -> String {
    format!("node:{id}:{}", key.node_credential(id))
}

fn register(h: &Harness, id: &str, epoch: u64) {
    let answer = h.call(
        Method::PUT,
        &format!("/v1/nodes/{id}"),
        Some(json!({ "tcp_addr": format!("10.0.0.1:{}", 7000 + epoch), "epoch": epoch })),
    );
    assert_eq!(answer.status, 200, "{answer:?}");
}

/// `(holder, state)` of each replica of `entry`.
fn states(entry: &Value) -> Vec<(String, String)> {
    entry["replicas"]
        .as_array()
        .expect("replicas")
        .iter()
        .map(|r| {
            (
                r["node_id"].as_str().unwrap_or("").to_owned(),
                r["state"].as_str().unwrap_or("").to_owned(),
            )
        })
        .collect()
}

fn pairs(expected: &[(&str, &str)]) -> Vec<(String, String)> {
    expected
        .iter()
        .map(|(n, s)| ((*n).to_owned(), (*s).to_owned()))
        .collect()
}

fn replica_path(node: &str, what: &str) -> String {
    format!("/v1/map/{GPA:#x}/replicas/{node}/{what}")
}

fn assert_refused(answer: &Answer, status: u16, code: &str, what: &str) {
    assert_eq!(
        (answer.status, answer.error_code()),
        (status, code),
        "{what}: {answer:?}"
    );
}

/// A keyed coordinator where a (epoch 1) holds the range live and b
/// (epoch 2) a stale replica of it.
fn a_live_b_stale() -> Harness {
    let h = start_keyed(Limits::default());
    register(&h, "a", 1);
    register(&h, "b", 2);
    assert_eq!(h.add_range(GPA, 0x4000, "a", 0).status, 201);
    let b = h.add_range(GPA, 0x4000, "b", 0x8000);
    assert_eq!(b.status, 201, "a new replica is created: {b:?}");
    assert_eq!(states(&b.body), pairs(&[("a", "live"), ("b", "stale")]));
    assert_eq!(b.body["node_id"], "a", "a is the primary");
    h
}

#[test]
fn the_replica_routes_follow_the_rules() {
    let h = a_live_b_stale();
    // The only live replica is never marked stale.
    assert_refused(
        &h.call(Method::POST, &replica_path("a", "stale"), None),
        409,
        "conflict",
        "last live",
    );
    // Recovery: numbered, then finished under its number only.
    let version = h.version();
    let recovering = replica_path("b", "recovering");
    let missing = h.call(Method::POST, &recovering, None);
    assert_refused(&missing, 400, "bad_request", "no epoch");
    // A process of b other than the current one (epoch 2) may not recover.
    let stranger = h.call(Method::POST, &recovering, Some(json!({ "epoch": 1 })));
    assert_refused(&stranger, 409, "conflict", "not the current epoch");
    assert!(stranger.body["message"]
        .as_str()
        .is_some_and(|m| m.contains("current epoch")));
    assert_eq!(h.version(), version, "a refusal changes nothing");
    let begun = h.call(Method::POST, &recovering, Some(json!({ "epoch": 2 })));
    assert_eq!(begun.status, 200, "{begun:?}");
    assert_eq!(begun.body["version"], json!(version + 1));
    let b = &begun.body["entry"]["replicas"][1];
    assert_eq!(
        (&b["state"], &b["recovery_seq"], &b["valid_epoch"]),
        (&json!("recovering"), &json!(1), &json!(2))
    );
    let live = replica_path("b", "live");
    let bad_json = h.raw(
        Method::POST,
        &live,
        Some("application/json"),
        b"{\"recovery_seq\":".to_vec(),
    );
    assert_refused(&bad_json, 400, "bad_request", "bad JSON");
    let wrong = h.call(
        Method::POST,
        &live,
        Some(json!({ "recovery_seq": 2, "epoch": 2 })),
    );
    assert_refused(&wrong, 409, "conflict", "wrong recovery_seq");
    assert!(wrong.body["message"]
        .as_str()
        .is_some_and(|m| m.contains("overtaken")));
    let stranger = h.call(
        Method::POST,
        &live,
        Some(json!({ "recovery_seq": 1, "epoch": 1 })),
    );
    assert_refused(&stranger, 409, "conflict", "finished by another epoch");
    let done = h.call(
        Method::POST,
        &live,
        Some(json!({ "recovery_seq": 1, "epoch": 2 })),
    );
    assert_eq!(done.status, 200, "{done:?}");
    assert_eq!(
        states(&done.body["entry"]),
        pairs(&[("a", "live"), ("b", "live")])
    );
    // Now a may go stale; b becomes the primary everywhere.
    let stale = h.call(Method::POST, &replica_path("a", "stale"), None);
    assert_eq!(stale.status, 200, "{stale:?}");
    let map = h.get("/v1/map").body;
    assert_eq!(map["version"], stale.body["version"]);
    let entry = &map["entries"][0];
    assert_eq!(states(entry), pairs(&[("a", "stale"), ("b", "live")]));
    assert_eq!(
        (&entry["node_id"], &entry["remote_offset"]),
        (&json!("b"), &json!(0x8000))
    );
    let resolved = h.get(&format!("/v1/resolve?gpa={GPA}")).body;
    assert_eq!(resolved["node"]["id"], "b");
    assert_eq!(states(&resolved["entry"]), states(entry));
    // Unknown range or holder: 404; bad address or id: 400.
    register(&h, "c", 3);
    for path in [
        "/v1/map/0x20000/replicas/a/stale".to_owned(),
        replica_path("c", "stale"),
        replica_path("nobody", "recovering"),
    ] {
        let body = Some(json!({ "epoch": 3 }));
        assert_refused(&h.call(Method::POST, &path, body), 404, "not_found", &path);
    }
    for path in [
        "/v1/map/xyz/replicas/a/stale",
        "/v1/map/0/replicas/a..b%2F/stale",
    ] {
        assert_refused(&h.call(Method::POST, path, None), 400, "bad_request", path);
    }
}

#[test]
fn who_may_change_a_replica() {
    let h = a_live_b_stale();
    let client = key(&h).client_credential();
    let (a, b) = (node_bearer(key(&h), "a"), node_bearer(key(&h), "b"));
    let as_ = |bearer: &str, path: String, body: Option<Value>| {
        h.call_as(Some(bearer), Method::POST, &path, body)
    };
    let epoch2 = Some(json!({ "epoch": 2 }));
    // Nodes do not mark replicas stale; the client does not recover.
    assert_refused(
        &as_(&a, replica_path("b", "stale"), None),
        403,
        "forbidden",
        "node stale",
    );
    assert_refused(
        &as_(&b, replica_path("b", "stale"), None),
        403,
        "forbidden",
        "own stale",
    );
    assert_refused(
        &as_(&client, replica_path("b", "recovering"), epoch2.clone()),
        403,
        "forbidden",
        "client begins",
    );
    // A node recovers only its own replica.
    assert_refused(
        &as_(&a, replica_path("b", "recovering"), epoch2.clone()),
        403,
        "forbidden",
        "a begins b's",
    );
    let begun = as_(&b, replica_path("b", "recovering"), epoch2);
    assert_eq!(begun.status, 200, "{begun:?}");
    let done = Some(json!({ "recovery_seq": 1, "epoch": 2 }));
    assert_refused(
        &as_(&a, replica_path("b", "live"), done.clone()),
        403,
        "forbidden",
        "a finishes b's",
    );
    assert_refused(
        &as_(&client, replica_path("b", "live"), done.clone()),
        403,
        "forbidden",
        "client finishes",
    );
    assert_eq!(as_(&b, replica_path("b", "live"), done).status, 200);
    // The client credential marks a replica stale.
    let stale = as_(&client, replica_path("a", "stale"), None);
    assert_eq!(stale.status, 200, "{stale:?}");
    assert_eq!(
        states(&stale.body["entry"]),
        pairs(&[("a", "stale"), ("b", "live")])
    );
    // A node removes only its own replica; the range stays with the other.
    let removed = h.call_as(Some(&a), Method::DELETE, &format!("/v1/map/{GPA}"), None);
    assert_eq!(removed.status, 204, "{removed:?}");
    let map = h.get("/v1/map").body;
    assert_eq!(states(&map["entries"][0]), pairs(&[("b", "live")]));
    let again = h.call_as(Some(&a), Method::DELETE, &format!("/v1/map/{GPA}"), None);
    assert_refused(&again, 403, "forbidden", "a holds none now");
}

#[test]
fn the_replica_limit_answers_429() {
    let h = start_keyed(Limits {
        max_replicas: 2,
        ..Limits::default()
    });
    for (id, epoch) in [("a", 1), ("b", 2), ("c", 3)] {
        register(&h, id, epoch);
    }
    assert_eq!(h.add_range(GPA, 0x1000, "a", 0).status, 201);
    assert_eq!(h.add_range(GPA, 0x1000, "b", 0).status, 201);
    assert_eq!(h.add_range(GPA, 0x1000, "b", 0).status, 200, "a refresh");
    let third = h.add_range(GPA, 0x1000, "c", 0);
    assert_refused(&third, 429, "limit_reached", "third replica");
    assert!(third.body["message"]
        .as_str()
        .is_some_and(|m| m.contains("replicas per range") && m.contains('2')));
}

#[test]
fn without_a_key_the_token_guards_the_replica_routes() {
    let h = start(Some("tok"), 3000);
    register(&h, "a", 1);
    register(&h, "b", 2);
    h.add_range(GPA, 0x1000, "a", 0);
    h.add_range(GPA, 0x1000, "b", 0);
    for (what, body) in [
        ("stale", None),
        ("recovering", Some(json!({ "epoch": 2 }))),
        ("live", Some(json!({ "recovery_seq": 1, "epoch": 2 }))),
    ] {
        let anonymous = h.call_as(None, Method::POST, &replica_path("b", what), body);
        assert_refused(&anonymous, 401, "unauthorized", what);
    }
}

#[test]
fn the_typed_client_calls_the_replica_routes() {
    let h = start(None, 3000);
    register(&h, "a", 1);
    register(&h, "b", 2);
    let c = h.client();
    for id in ["a", "b"] {
        c.add_range(&RangeRequest {
            gpa_start: GPA,
            length_bytes: 0x1000,
            node_id: id.to_owned(),
            remote_offset: 0,
            rdma: None,
            contents: Default::default(),
        })
        .expect("claim");
    }
    let error = c
        .mark_replica_stale(GPA, "a", Duration::from_secs(5))
        .expect_err("last live");
    assert!(error.is_conflict(), "{error:?}");
    let begun = c.begin_recovery(GPA, "b", 2).expect("begin");
    let seq = begun.entry.replicas[1].recovery_seq;
    assert_eq!(begun.entry.replicas[1].state, ReplicaState::Recovering);
    assert!(c
        .finish_recovery(GPA, "b", seq + 1, 2)
        .expect_err("wrong")
        .is_conflict());
    let done = c.finish_recovery(GPA, "b", seq, 2).expect("finish");
    assert_eq!(done.entry.replicas[1].state, ReplicaState::Live);
    let stale = c
        .mark_replica_stale(GPA, "a", Duration::from_secs(5))
        .expect("stale");
    assert_eq!(stale.entry.replicas[0].state, ReplicaState::Stale);
    assert_eq!(stale.entry.node_id, "b");
    assert!(stale.version > done.version);
    assert!(c
        .begin_recovery(GPA, "nobody", 2)
        .expect_err("no replica")
        .is_not_found());
}
