//! Zero-copy RDMA: pages of caller memory registered with
//! `TransportManager::register_memory` are read into and written from by
//! RDMA directly, with no pool frame; other buffers still bounce through
//! the pool; a failure on registered memory drains the QP before the call
//! returns, so the device writes nothing into the caller's pages after.

use rdma_transport::{Page, Reap, RegisterError, ZeroCopyStats};

use super::*;

const N: usize = 16;
const SENTINEL: u8 = 0xab;

fn gpas() -> Vec<u64> {
    (0..N as u64).map(|p| p * PAGE_SIZE as u64).collect()
}

fn stats_delta(after: ZeroCopyStats, before: ZeroCopyStats) -> (u64, u64) {
    (
        after.direct_pages - before.direct_pages,
        after.framed_pages - before.framed_pages,
    )
}

fn zero_copy_round_trip(test: &str, mode: PollMode) {
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let _a = server(&coord.url(), "a", 0, true);
    let mgr = rdma_manager(&coord.url(), mode);
    assert_all_rdma(&mgr);
    let gpas = gpas();
    let mut src: Vec<Page> = gpas.iter().map(|&g| page_for(g, 31)).collect();
    let mut dst: Vec<Page> = vec![[SENTINEL; PAGE_SIZE]; N];
    // SAFETY: both vectors are neither moved nor resized and outlive their
    // handles (dropped explicitly below); every call on them has returned
    // before the test reads them.
    let src_reg = unsafe { mgr.register_memory(src.as_mut_ptr().cast(), N * PAGE_SIZE) }.unwrap();
    // SAFETY: as above.
    let dst_reg = unsafe { mgr.register_memory(dst.as_mut_ptr().cast(), N * PAGE_SIZE) }.unwrap();
    assert!(src_reg.is_rdma() && dst_reg.is_rdma());
    let inside = dst[1..].as_mut_ptr().cast::<u8>();
    // SAFETY: a page inside `dst`, which outlives this call; the overlap
    // is refused before anything is registered.
    let overlap = unsafe { mgr.register_memory(inside, PAGE_SIZE) };
    assert!(
        matches!(overlap, Err(RegisterError::Overlap { .. })),
        "{overlap:?}"
    );
    let s0 = mgr.zero_copy_stats();
    assert_eq!(s0.regions, 2);

    // WRITE out of registered memory: a batch and the one-page path.
    mgr.write_pages(&gpas[..N - 1], &src[..N - 1]).unwrap();
    mgr.write_page(gpas[N - 1], &src[N - 1]).unwrap();
    let s1 = mgr.zero_copy_stats();
    assert_eq!(stats_delta(s1, s0), (N as u64, 0), "{test}: writes");
    // Read back into plain memory (the bounce): the writes landed.
    let mut plain: Vec<Page> = vec![[0u8; PAGE_SIZE]; N];
    mgr.read_pages(&gpas, &mut plain).unwrap();
    for i in 0..N {
        assert!(
            plain[i] == src[i],
            "{test}: page {i} read back through the pool"
        );
    }
    let s2 = mgr.zero_copy_stats();
    assert_eq!(stats_delta(s2, s1), (0, N as u64), "{test}: bounced reads");

    // READ into registered memory with every pool frame taken: none needed.
    let held: Vec<_> = std::iter::from_fn(|| mgr.pool().alloc()).collect();
    assert_eq!(mgr.pool().available(), 0);
    assert_eq!(held.len(), mgr.pool().capacity());
    mgr.read_page(gpas[2], &mut dst[2]).unwrap();
    assert!(dst[2] == src[2], "{test}: one-page read");
    assert!(
        dst[3] == [SENTINEL; PAGE_SIZE],
        "{test}: only page 2 was read"
    );
    mgr.read_pages(&gpas, &mut dst).unwrap();
    for i in 0..N {
        assert!(dst[i] == src[i], "{test}: batch page {i}");
    }
    // The asynchronous API takes the same path.
    dst.iter_mut().for_each(|p| p.fill(SENTINEL));
    let queue = mgr.completion_queue(Reap::Poll).unwrap();
    // SAFETY: `dst` holds N pages and is not touched until the completion
    // is reaped below.
    unsafe { queue.submit_read_raw(&gpas, dst.as_mut_ptr(), 7) }.unwrap();
    let mut done = Vec::new();
    let until = Instant::now() + Duration::from_millis(4 * REQUEST_TIMEOUT_MS);
    while done.is_empty() && Instant::now() < until {
        queue.wait(&mut done, 1, Duration::from_millis(REQUEST_TIMEOUT_MS));
    }
    assert_eq!(done.len(), 1, "{test}: the submission completed");
    if let Err(e) = &done[0].result {
        panic!("{test}: async read failed: {e}");
    }
    for i in 0..N {
        assert!(dst[i] == src[i], "{test}: async page {i}");
    }
    // A page outside registered memory needs a frame, and none is free.
    let err = mgr.read_page(gpas[1], &mut plain[1]).unwrap_err();
    assert!(
        matches!(err, TransportError::PoolExhausted { .. }),
        "{test}: {err:?}"
    );
    let s3 = mgr.zero_copy_stats();
    assert_eq!(
        stats_delta(s3, s2),
        (1 + 2 * N as u64, 0),
        "{test}: zero-copy reads"
    );
    drop(held);
    assert_eq!(mgr.pool().available(), mgr.pool().capacity());

    // Unregistered, the same memory goes through the pool again.
    drop(dst_reg);
    assert_eq!(mgr.zero_copy_stats().regions, 1);
    dst[4].fill(SENTINEL);
    mgr.read_page(gpas[4], &mut dst[4]).unwrap();
    assert!(dst[4] == src[4]);
    assert_eq!(stats_delta(mgr.zero_copy_stats(), s3), (0, 1));
    drop(src_reg);
    assert_eq!(mgr.zero_copy_stats().regions, 0);
    assert_eq!(mgr.zero_copy_stats().drains, 0, "{test}: nothing failed");
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_zero_copy_reads_and_writes_use_registered_memory_and_no_pool_frame() {
    zero_copy_round_trip(
        "rdma_zero_copy_reads_and_writes_use_registered_memory_and_no_pool_frame",
        PollMode::Busy,
    );
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_zero_copy_event_mode() {
    zero_copy_round_trip("rdma_zero_copy_event_mode", PollMode::Event);
}

/// Failures on registered memory (a wrong rkey: an error completion; a
/// dead server QP: retries exhausted or the deadline) return only after
/// the QP was drained; the caller's pages stay untouched, and the next
/// request reads into the same memory over a new QP.
#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_zero_copy_failure_drains_the_qp_and_leaves_the_caller_pages_untouched() {
    let test = "rdma_zero_copy_failure_drains_the_qp_and_leaves_the_caller_pages_untouched";
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let a = server(&coord.url(), "a", 0, true);
    let mgr = rdma_manager(&coord.url(), PollMode::Busy);
    let gpas = gpas();
    let pages: Vec<Page> = gpas.iter().map(|&g| page_for(g, 41)).collect();
    mgr.write_pages(&gpas, &pages).unwrap();
    let mut dst: Vec<Page> = vec![[SENTINEL; PAGE_SIZE]; N];
    // SAFETY: `dst` is neither moved nor resized and outlives the handle
    // (dropped at the end); the test reads it only between calls.
    let reg = unsafe { mgr.register_memory(dst.as_mut_ptr().cast(), N * PAGE_SIZE) }.unwrap();

    for round in 0..4 {
        let qpn = mgr.rdma_qpn_for_test("a").expect("RDMA connection");
        let before = mgr.zero_copy_stats();
        let how = if round < 2 {
            assert!(mgr.corrupt_rkey_for_test("a"));
            "wrong rkey"
        } else {
            assert_eq!(a.break_rdma_qps_for_test(), 1);
            "server QP broken"
        };
        let started = Instant::now();
        let err = if round % 2 == 0 {
            mgr.read_page(gpas[1], &mut dst[1]).unwrap_err()
        } else {
            mgr.read_pages(&gpas[1..], &mut dst[1..]).unwrap_err()
        };
        let took = started.elapsed();
        say(&format!(
            "{test}: round {round} ({how}): {err} after {took:?}"
        ));
        match &err {
            TransportError::RdmaCompletion { node, status } => {
                assert_eq!(node, "a");
                assert_ne!(*status, WcStatus::Success);
            }
            TransportError::Timeout { node, .. } if round >= 2 => assert_eq!(node, "a"),
            other => panic!("{test}: round {round}: unexpected error {other:?}"),
        }
        let after = mgr.zero_copy_stats();
        assert_eq!(
            after.drains,
            before.drains + 1,
            "{test}: round {round}: the QP was drained before the call returned"
        );
        assert_eq!(after.drain_failures, 0, "{test}: round {round}");
        assert_eq!(after.direct_pages, before.direct_pages);
        for (i, p) in dst.iter().enumerate() {
            assert!(
                p == &[SENTINEL; PAGE_SIZE],
                "{test}: round {round}: page {i} was written"
            );
        }
        // A new QP reads into the same registered memory.
        mgr.read_page(gpas[0], &mut dst[0]).unwrap();
        assert!(dst[0] == pages[0], "{test}: round {round}");
        assert_ne!(
            mgr.rdma_qpn_for_test("a").unwrap(),
            qpn,
            "{test}: QP not rebuilt"
        );
        assert_eq!(mgr.zero_copy_stats().direct_pages, before.direct_pages + 1);
        for (i, p) in dst.iter().enumerate().skip(1) {
            assert!(
                p == &[SENTINEL; PAGE_SIZE],
                "{test}: round {round}: page {i} written late"
            );
        }
        dst[0].fill(SENTINEL);
    }

    // A WRITE out of registered memory that fails changes nothing remote.
    dst[5] = page_for(gpas[5], 99);
    assert!(mgr.corrupt_rkey_for_test("a"));
    let drains = mgr.zero_copy_stats().drains;
    let err = mgr.write_page(gpas[5], &dst[5]).unwrap_err();
    assert!(
        matches!(err, TransportError::RdmaCompletion { .. }),
        "{err:?}"
    );
    assert_eq!(mgr.zero_copy_stats().drains, drains + 1);
    let mut back = [0u8; PAGE_SIZE];
    mgr.read_page(gpas[5], &mut back).unwrap();
    assert!(back == pages[5], "{test}: a failed write changed the page");
    drop(reg);
}

/// Without RDMA (TCP transport) registration is accepted and does nothing:
/// pages still move straight between the socket and the caller's memory.
#[test]
fn registered_memory_over_tcp_is_accepted_and_pages_move() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let _a = server(&coord.url(), "a", 0, false);
    let mgr = TransportManager::connect(config(&coord.url(), TransportKind::Tcp, PollMode::Busy))
        .expect("manager connects");
    let gpas = gpas();
    let mut buf: Vec<Page> = gpas.iter().map(|&g| page_for(g, 51)).collect();
    // SAFETY: `buf` is neither moved nor resized and outlives the handle
    // (dropped at the end); the test reads it only between calls.
    let reg = unsafe { mgr.register_memory(buf.as_mut_ptr().cast(), N * PAGE_SIZE) }.unwrap();
    assert!(!reg.is_rdma());
    assert_eq!(reg.len_bytes(), N * PAGE_SIZE);
    // SAFETY: refused before anything is registered.
    let empty = unsafe { mgr.register_memory(std::ptr::null_mut(), PAGE_SIZE) };
    assert!(
        matches!(empty, Err(RegisterError::InvalidRange { .. })),
        "{empty:?}"
    );
    mgr.write_pages(&gpas, &buf).unwrap();
    buf.iter_mut().for_each(|p| p.fill(SENTINEL));
    mgr.read_pages(&gpas, &mut buf).unwrap();
    mgr.read_page(gpas[3], &mut buf[3]).unwrap();
    for (i, &g) in gpas.iter().enumerate() {
        assert!(buf[i] == page_for(g, 51), "page {i}");
    }
    assert_eq!(mgr.zero_copy_stats(), ZeroCopyStats::default());
    drop(reg);
}
