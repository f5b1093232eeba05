//! `RunningServer::abort`: the page-server stops like a killed process.
//! Its clients' connections end at once (EOF or reset), nobody can connect
//! any more, its heartbeats stop, and it stays registered.

mod common;

use std::io::{ErrorKind, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use page_server::ServerConfig;

/// Blocks until the server's side of `s` is gone: EOF or a reset, never a
/// timeout.
fn assert_dropped(s: &mut TcpStream) {
    let mut byte = [0u8; 1];
    match s.read(&mut byte) {
        Ok(0) => {}
        Ok(n) => panic!("read {n} bytes from an aborted server"),
        Err(err) => assert!(
            matches!(
                err.kind(),
                ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted
            ),
            "expected EOF or a reset, got {err}"
        ),
    }
}

#[test]
fn abort_drops_every_connection_closes_the_listener_and_stops_heartbeats() {
    let db = tempfile::tempdir().unwrap();
    let coordinator = coordinator_on(
        &db.path().join("c.db"),
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let url = coordinator.url();
    let mut cfg = ServerConfig::new("victim", NODE_BYTES);
    cfg.heartbeat_interval = Duration::from_millis(50);
    let server = page_server_with(&url, cfg);
    let addr = server.addr();

    let mut handshaken = TcpStream::connect(addr).unwrap();
    handshaken
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    common::raw::handshake(&mut handshaken, 1, "victim", None).expect("insecure handshake");
    let mut pending = TcpStream::connect(addr).unwrap();
    pending
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(5), || server.active_connections() == 2),
        "both connections are served"
    );

    let aborted_at = Instant::now();
    server.abort();
    assert!(
        aborted_at.elapsed() < Duration::from_secs(2),
        "abort does not wait on anything slow: {:?}",
        aborted_at.elapsed()
    );
    assert_dropped(&mut handshaken);
    assert_dropped(&mut pending);
    let refused = TcpStream::connect_timeout(&addr, Duration::from_millis(500));
    assert!(refused.is_err(), "the listener is closed after abort");

    // Still registered (no goodbye), but no longer heartbeating.
    let client = coordinator_client(&url);
    std::thread::sleep(Duration::from_millis(400));
    let node = client
        .node(&"victim".to_owned())
        .expect("an aborted node stays registered");
    assert!(
        node.last_seen_ms_ago >= 300,
        "heartbeats stopped: last seen {} ms ago",
        node.last_seen_ms_ago
    );
}
