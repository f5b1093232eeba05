//! Two live clients that share one client id (an embedder's
//! `ManagerConfig::client_id` set to a constant): each one's new connection
//! ends the other's (`late_writes.rs` says why a page-server does that).
//! Neither may read a page out of order, and the page-server must say what
//! is going on.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use page_server::ServerConfig;
use rdma_transport::{TransportManager, PAGE_SIZE};

const SHARED_ID: u64 = 42;

/// Writes then reads page `index` `rounds` times, each time a new
/// version, until `stop` is set. Every read that succeeds must be the last
/// write acknowledged or one that failed since (a failed write may have
/// been applied). Returns (writes acknowledged, calls failed).
fn write_and_read(
    mgr: &TransportManager,
    index: u64,
    rounds: u64,
    stop: &AtomicBool,
) -> (u64, u64) {
    let gpa = index * PAGE_SIZE as u64;
    let (mut acked, mut failed_since) = (None::<u64>, Vec::new());
    let (mut oks, mut errors) = (0, 0);
    for version in 1..=rounds {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        match mgr.write_page(gpa, &page_indexed(index, version)) {
            Ok(()) => {
                acked = Some(version);
                failed_since.clear();
                oks += 1;
            }
            Err(_) => {
                failed_since.push(version);
                errors += 1;
            }
        }
        let mut page = [0u8; PAGE_SIZE];
        if mgr.read_page(gpa, &mut page).is_err() {
            errors += 1;
            continue;
        }
        let matched = acked
            .into_iter()
            .chain(failed_since.iter().copied())
            .find(|&v| page == page_indexed(index, v));
        assert!(
            matched.is_some() || (acked.is_none() && page == [0u8; PAGE_SIZE]),
            "page {index} read after version {version}: not the last acknowledged write \
             ({acked:?}) nor one that failed since ({failed_since:?})"
        );
    }
    (oks, errors)
}

/// Two managers alive at once with one client id, each writing and reading
/// its own page: their connections end each other's. Every read is still
/// a write of that page in order, the page-server counts the replaced
/// connections and reports the clash (the metric and, once per 10 s, a
/// warning); a single manager with that id afterwards works without an
/// error and clashes with nobody.
#[test]
fn two_live_clients_sharing_a_client_id_read_nothing_out_of_order_and_the_server_reports_the_clash()
{
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let mut config = ServerConfig::new("n", NODE_BYTES);
    config.metrics_listen = Some(std::net::SocketAddr::from(([127, 0, 0, 1], 0)));
    let server = page_server_with(&url, config);
    let before = server.stats();
    assert_eq!(before.client_id_clashes, 0);

    let (a, b) = (
        manager_with_id(&url, SHARED_ID),
        manager_with_id(&url, SHARED_ID),
    );
    // Both run until the server has seen the clash (or for 20 s at most).
    let stop = AtomicBool::new(false);
    let ((a_ok, a_err), (b_ok, b_err)) = std::thread::scope(|s| {
        let a = s.spawn(|| write_and_read(&a, 1, u64::MAX, &stop));
        let b = s.spawn(|| write_and_read(&b, 2, u64::MAX, &stop));
        wait_until(Duration::from_secs(20), || {
            server.stats().client_id_clashes > 0
        });
        stop.store(true, Ordering::Relaxed);
        (a.join().unwrap(), b.join().unwrap())
    });
    let stats = server.stats();
    eprintln!(
        "a: {a_ok} acknowledged, {a_err} failed; b: {b_ok} acknowledged, {b_err} failed; \
         connections replaced {}, clashes {}",
        stats.superseded_connections, stats.client_id_clashes
    );
    assert!(
        stats.superseded_connections >= 20,
        "the two clients' connections were replaced only {} times",
        stats.superseded_connections
    );
    assert!(
        stats.client_id_clashes >= 1,
        "{} replacements, and no clash reported",
        stats.superseded_connections
    );
    let metrics = http(
        server.metrics_addr().expect("metrics address"),
        "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
    );
    assert!(
        metrics.contains(&format!(
            "page_server_client_id_clashes_total {}",
            stats.client_id_clashes
        )),
        "the clash is not in the metrics:\n{metrics}"
    );
    drop((a, b));

    let alone = manager_with_id(&url, SHARED_ID);
    let (ok, errors) = write_and_read(&alone, 1, 50, &AtomicBool::new(false));
    assert_eq!((ok, errors), (50, 0), "one client with the id, alone");
    assert_eq!(
        server.stats().client_id_clashes,
        stats.client_id_clashes,
        "a client alone with its id was reported as a clash"
    );
}
