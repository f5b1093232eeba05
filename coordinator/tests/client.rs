//! `rdma_transport::coordinator::CoordinatorClient` against a real coordinator.

mod common;

use std::net::TcpListener;
use std::time::Duration;

use common::start;
use rdma_transport::coordinator::api::{NodeRegistration, RangeRequest, RdmaEndpoint, RdmaRegion};
use rdma_transport::coordinator::{CoordinatorClient, CoordinatorError};

fn registration(tcp_addr: &str) -> NodeRegistration {
    NodeRegistration {
        tcp_addr: tcp_addr.to_owned(),
        rdma: None,
        epoch: 0,
    }
}

fn range(gpa_start: u64, length_bytes: u64, node_id: &str) -> RangeRequest {
    RangeRequest {
        gpa_start,
        length_bytes,
        node_id: node_id.to_owned(),
        remote_offset: 0,
        rdma: None,
        contents: Default::default(),
    }
}

#[test]
fn every_call_round_trips() {
    let h = start(Some("tok"), 3000);
    let c = h.client();
    assert_eq!(c.health().expect("health").status, "ok");
    let a = "a".to_owned();
    let b = "b".to_owned();
    let info = c
        .register_node(&a, &registration("127.0.0.1:1"))
        .expect("register");
    assert_eq!((info.id.as_str(), info.alive), ("a", true));
    c.register_node(&b, &registration("127.0.0.1:2"))
        .expect("register");
    assert_eq!(c.heartbeat(&a).expect("heartbeat").id, "a");
    assert_eq!(c.nodes().expect("nodes").len(), 2);
    assert_eq!(c.node(&b).expect("node").tcp_addr, "127.0.0.1:2");

    let endpoint = RdmaEndpoint {
        device: "mlx5_0".to_owned(),
        port: 1,
        gid: "fe80::1".to_owned(),
        gid_index: 0,
        lid: 7,
    };
    assert!(c.rdma_endpoint(&a).expect_err("none yet").is_not_found());
    assert_eq!(
        c.set_rdma_endpoint(&a, &endpoint).expect("set").rdma,
        Some(endpoint.clone())
    );
    assert_eq!(c.rdma_endpoint(&a).expect("get"), endpoint);

    let mut request = range(0x4000_0000, 0x10_0000, "a");
    let entry = c.add_range(&request).expect("add");
    assert_eq!(entry.gpa_start, 0x4000_0000);
    request.rdma = Some(RdmaRegion {
        addr: 0x1000,
        rkey: 3,
    });
    assert_eq!(
        c.add_range(&request).expect("re-add").rdma,
        None,
        "an offered region key is neither stored nor published"
    );
    assert!(c
        .add_range(&range(0x4000_0000, 0x1000, "b"))
        .expect_err("overlap")
        .is_conflict());
    assert!(c
        .add_range(&range(0, 0x1000, "nobody"))
        .expect_err("unknown")
        .is_not_found());
    assert!(c
        .add_range(&range(1, 0x1000, "a"))
        .expect_err("misaligned")
        .is_bad_request());

    let hit = c.resolve(0x4000_0000 + 0xf_ffff).expect("resolve");
    assert_eq!(
        (hit.entry.node_id.as_str(), hit.node.id.as_str()),
        ("a", "a")
    );
    assert!(c.resolve(0x4010_0000).expect_err("miss").is_not_found());
    let map = c.map().expect("map");
    assert_eq!(map.entries.len(), 1);
    assert_eq!(hit.version, map.version);

    c.remove_range(0x4000_0000).expect("remove");
    assert!(c
        .remove_range(0x4000_0000)
        .expect_err("gone")
        .is_not_found());
    c.remove_node(&b).expect("remove node");
    assert!(c.remove_node(&b).expect_err("gone").is_not_found());
    assert!(c.heartbeat(&b).expect_err("gone").is_not_found());
}

#[test]
fn errors_are_classified() {
    let h = start(Some("tok"), 3000);
    let anonymous = CoordinatorClient::new(&h.coordinator.url(), None, common::REQUEST_TIMEOUT)
        .expect("client");
    anonymous.health().expect("reads are open");
    let error = anonymous
        .register_node(&"a".to_owned(), &registration("h:1"))
        .expect_err("no token");
    assert!(error.is_unauthorized(), "{error:?}");
    match error {
        CoordinatorError::Http {
            status,
            code,
            message,
        } => {
            assert_eq!((status, code.as_str()), (401, "unauthorized"));
            assert!(!message.is_empty());
        }
        other => panic!("expected Http, got {other:?}"),
    }
    let wrong = CoordinatorClient::new(
        &h.coordinator.url(),
        Some("nope".to_owned()),
        common::REQUEST_TIMEOUT,
    )
    .expect("client");
    assert!(wrong
        .heartbeat(&"a".to_owned())
        .expect_err("bad token")
        .is_unauthorized());
    let error = h
        .client()
        .heartbeat(&"bad id".to_owned())
        .expect_err("invalid id");
    assert!(
        matches!(error, CoordinatorError::InvalidNodeId(_)),
        "{error:?}"
    );
}

#[test]
fn a_stopped_coordinator_is_unreachable() {
    // A port that was free a moment ago and has no listener now.
    let port = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let c = CoordinatorClient::new(
        &format!("http://127.0.0.1:{port}"),
        None,
        Duration::from_secs(2),
    )
    .expect("client");
    let error = c.map().expect_err("nothing listens");
    assert!(error.is_unreachable(), "{error:?}");

    let h = start(None, 3000);
    let c = h.client();
    c.health().expect("up");
    h.coordinator.shutdown().expect("clean shutdown");
    assert!(c.health().expect_err("down").is_unreachable());
}

#[test]
fn several_coordinators_are_tried_in_turn() {
    let port = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let dead = format!("http://127.0.0.1:{port}");
    let h = start(None, 3000);
    let live = h.coordinator.url();
    let c = CoordinatorClient::new(&format!("{dead}, {live}/"), None, Duration::from_secs(2))
        .expect("client");
    // The dead one is skipped, and the live one is asked first from then on.
    let info = c
        .register_node(&"a".to_owned(), &registration("127.0.0.1:1"))
        .expect("register through the live coordinator");
    assert_eq!(info.id, "a");
    assert_eq!(c.base_url(), live);
    assert_eq!(c.map().expect("map").nodes.len(), 1);
    // Refusals are answers: they do not move on to another coordinator.
    let error = c.heartbeat(&"ghost".to_owned()).expect_err("unknown node");
    assert!(error.is_not_found(), "{error:?}");
    assert_eq!(c.base_url(), live);
    // With every coordinator down, the last error is returned.
    h.coordinator.shutdown().expect("clean shutdown");
    assert!(c.health().expect_err("all down").is_unreachable());
}
