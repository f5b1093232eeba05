//! `GET /metrics` of a page-server (`--metrics-listen`): pages served,
//! bytes, durations and connections, after a manager's reads and writes;
//! connections closed by reason; the coherence home's counters.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::*;
use page_server::ServerConfig;
use rdma_transport::PAGE_SIZE;

#[test]
fn metrics_count_pages_bytes_and_durations() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let mut config = ServerConfig::new("a", NODE_BYTES);
    config.metrics_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let server = page_server_with(&coord.url(), config);
    let addr = server.metrics_addr().expect("metrics address");

    let mgr = manager(&coord.url());
    let gpas: Vec<u64> = (0..3).map(|i| i * PAGE_SIZE as u64).collect();
    for (i, gpa) in gpas.iter().enumerate() {
        mgr.write_page(*gpa, &page_for(*gpa, i as u8))
            .expect("write");
    }
    let mut page: rdma_transport::Page = [0u8; PAGE_SIZE];
    for _ in 0..2 {
        for gpa in &gpas {
            mgr.read_page(*gpa, &mut page).expect("read");
        }
    }

    // One connection that sends junk is closed as a protocol error.
    let mut junk = TcpStream::connect(server.addr()).expect("connect");
    junk.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    junk.write_all(&[0xAB; 64]).expect("send junk");
    let mut rest = Vec::new();
    let _ = junk.read_to_end(&mut rest);
    assert!(
        wait_until(Duration::from_secs(10), || server.stats().protocol_errors
            == 1),
        "{:?}",
        server.stats()
    );

    let answer = http(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    let (head, body) = answer.split_once("\r\n\r\n").expect("head and body");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.contains("application/openmetrics-text"), "{head}");
    let has = |line: &str| body.lines().any(|l| l == line);
    for line in [
        r#"page_server_pages_served_total{op="write"} 3"#,
        r#"page_server_pages_served_total{op="read"} 6"#,
        &format!(r#"page_server_bytes_total{{op="read"}} {}"#, 6 * PAGE_SIZE),
        r#"page_server_request_errors_total{op="read"} 0"#,
        // Checksummed writes keep their pages' sums: every read used one.
        r#"page_server_read_sums_kept_total 6"#,
        r#"page_server_request_duration_seconds_count{op="write"} 3"#,
        r#"page_server_connections{state="handshaken"} 1"#,
        r#"page_server_checksum_failures_total{carrier="write"} 0"#,
        r#"page_server_checksum_failures_total{carrier="coherence_frame"} 0"#,
        r#"page_server_connections_closed_total{reason="protocol_error"} 1"#,
        r#"page_server_connections_closed_total{reason="dead_peer"} 0"#,
        r#"page_server_connections_closed_total{reason="refused_full"} 0"#,
        r#"page_server_accept_errors_total 0"#,
        r#"page_server_replica_recoveries_total{outcome="done"} 0"#,
        r#"page_server_replica_recoveries_total{outcome="failed"} 0"#,
        r#"page_server_replica_recovered_pages_total 0"#,
        r#"page_server_replica_recovery_running 0"#,
    ] {
        assert!(has(line), "missing {line}:\n{body}");
    }
    assert!(body.trim_end().ends_with("# EOF"), "{body}");

    // Other paths and garbage are refused; it keeps serving.
    assert!(http(addr, "GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
    assert!(http(addr, "POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    let _ = http(addr, "\u{1}\u{2}garbage\r\n\r\n");
    assert!(http(addr, "GET /metrics HTTP/1.0\r\n\r\n").starts_with("HTTP/1.1 200"));
    drop(mgr);
    server.shutdown();
    assert!(
        TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_err(),
        "the metrics listener closes with the server"
    );
}

/// The coherence home's counters: two nodes take one page from each other
/// (`CoherentMemory`), and `/metrics` shows exactly what the home counted.
#[test]
fn metrics_count_coherence_events() {
    use rdma_transport::coherent::CoherenceConfig;
    use rdma_transport::guest_memory::{CoherentMemory, GuestMemoryConfig};

    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let mut config = ServerConfig::new("home", NODE_BYTES);
    config.metrics_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    let server = page_server_with(&coord.url(), config);
    let addr = server.metrics_addr().expect("metrics address");
    let mgr = manager(&coord.url());
    let node = || {
        CoherentMemory::new(
            &mgr,
            GuestMemoryConfig::new(0, NODE_BYTES),
            CoherenceConfig::default(),
        )
        .expect("coherent region")
    };
    let (a, b) = (node(), node());
    let mut word = [0u8; 8];
    for round in 0..3u64 {
        a.write(0, &(2 * round).to_le_bytes()).unwrap();
        b.read(0, &mut word).unwrap();
        assert_eq!(u64::from_le_bytes(word), 2 * round);
        b.write(0, &(2 * round + 1).to_le_bytes()).unwrap();
        a.read(0, &mut word).unwrap();
        assert_eq!(u64::from_le_bytes(word), 2 * round + 1);
    }
    let stats = server.coherence_stats();
    assert!(stats.home.exclusive_grants >= 6, "{stats:?}");
    assert!(stats.home.downgrades_sent >= 6, "{stats:?}");
    assert!(stats.bound_frames >= 12, "{stats:?}");

    let answer = http(addr, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    let (_, body) = answer.split_once("\r\n\r\n").expect("head and body");
    let has = |line: &str| body.lines().any(|l| l == line);
    for line in [
        format!(
            r#"page_server_coherence_events_total{{event="exclusive_grants"}} {}"#,
            stats.home.exclusive_grants
        ),
        format!(
            r#"page_server_coherence_events_total{{event="downgrades_sent"}} {}"#,
            stats.home.downgrades_sent
        ),
        format!(
            r#"page_server_coherence_events_total{{event="shared_grants"}} {}"#,
            stats.home.shared_grants
        ),
        r#"page_server_coherence_events_total{event="pages_lost"} 0"#.to_owned(),
        // The nodes' frames all carry offset-bound sums.
        format!(
            r#"page_server_coherence_events_total{{event="bound_frames"}} {}"#,
            stats.bound_frames
        ),
        "page_server_coherence_pages 1".to_owned(),
    ] {
        assert!(has(&line), "no {line:?} in:\n{body}");
    }
}
