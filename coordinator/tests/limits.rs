//! Bounds that keep one local caller from starving the others: node and
//! range counts (429 with a JSON error), the header and body read timeouts
//! and the connection limit. Real sockets on 127.0.0.1.

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::start_keyed;
use coordinator::Limits;
use reqwest::Method;
use serde_json::json;

fn limits(change: impl FnOnce(&mut Limits)) -> Limits {
    let mut limits = Limits::default();
    change(&mut limits);
    limits
}

#[test]
fn node_and_range_counts_are_bounded() {
    let h = start_keyed(limits(|l| {
        l.max_nodes = 2;
        l.max_ranges = 3;
        l.max_ranges_per_node = 2;
    }));
    h.register("a", "h:1");
    h.register("b", "h:2");
    let third = h.call(
        Method::PUT,
        "/v1/nodes/c",
        Some(json!({ "tcp_addr": "h:3" })),
    );
    assert_eq!((third.status, third.error_code()), (429, "limit_reached"));
    assert!(third.body["message"]
        .as_str()
        .is_some_and(|m| m.contains('2')));
    // Known nodes still re-register.
    h.register("a", "h:9");

    assert_eq!(h.add_range(0, 4096, "a", 0).status, 201);
    assert_eq!(h.add_range(4096, 4096, "a", 0).status, 201);
    let per_node = h.add_range(8192, 4096, "a", 0);
    assert_eq!(
        (per_node.status, per_node.error_code()),
        (429, "limit_reached")
    );
    assert_eq!(
        h.add_range(0, 4096, "a", 0).status,
        200,
        "a refresh is no new range"
    );
    assert_eq!(h.add_range(8192, 4096, "b", 0).status, 201);
    let total = h.add_range(12288, 4096, "b", 0);
    assert_eq!((total.status, total.error_code()), (429, "limit_reached"));
    assert_eq!(
        h.get("/v1/map").body["entries"].as_array().map(Vec::len),
        Some(3)
    );
    // Removing one makes room again.
    assert_eq!(h.call(Method::DELETE, "/v1/map/0", None).status, 204);
    assert_eq!(h.add_range(12288, 4096, "b", 0).status, 201);
}

/// Connects and sends a request head without its final empty line.
fn half_a_head(addr: std::net::SocketAddr) -> TcpStream {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")
        .expect("write");
    stream
}

/// True when the server closed `stream` within `limit`; false when it was
/// still open then.
fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    stream.set_read_timeout(Some(limit)).expect("timeout");
    let mut buf = [0u8; 256];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return true,
            // Whatever it answers (hyper may say 408), it must then close.
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::ConnectionReset => return true,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false
            }
            Err(e) => panic!("read: {e}"),
        }
    }
}

#[test]
fn a_client_that_never_finishes_its_head_is_cut_off_while_others_are_served() {
    let h = start_keyed(limits(|l| l.header_timeout_ms = 300));
    let started = Instant::now();
    let mut slow = half_a_head(h.coordinator.addr());
    // Another client is served meanwhile.
    assert_eq!(h.get("/v1/nodes").status, 200);
    assert!(
        closed_within(&mut slow, Duration::from_secs(10)),
        "never cut off"
    );
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(h.get("/v1/nodes").status, 200);
}

#[test]
fn connections_past_the_limit_wait_until_a_slot_frees() {
    let h = start_keyed(limits(|l| {
        l.max_connections = 1;
        l.header_timeout_ms = 1000;
    }));
    // One client takes the only slot: served once, then idle on keep-alive.
    let mut idle = TcpStream::connect(h.coordinator.addr()).expect("connect");
    idle.write_all(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("write");
    let mut buf = [0u8; 512];
    let n = idle.read(&mut buf).expect("answer");
    assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
    let served_at = Instant::now();
    // The next one waits until the idle connection is closed by the
    // header timeout, then is served.
    assert_eq!(h.get("/v1/health").status, 200);
    assert!(
        served_at.elapsed() >= Duration::from_millis(800),
        "served while the only slot was taken"
    );
    assert!(closed_within(&mut idle, Duration::from_secs(10)));
}

#[test]
fn a_body_that_does_not_arrive_in_time_is_408() {
    let h = start_keyed(limits(|l| l.body_timeout_ms = 300));
    let admin = h.key.as_ref().expect("key").admin_credential();
    let mut stream = TcpStream::connect(h.coordinator.addr()).expect("connect");
    let head = format!(
        "PUT /v1/nodes/a HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {admin}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"tcp"
    );
    stream.write_all(head.as_bytes()).expect("write");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream
            .read(&mut buf)
            .expect("an answer before the read timeout");
        assert!(n > 0, "closed without an answer");
        answer.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert_eq!(h.get("/v1/nodes/a").status, 404, "nothing registered");
}
