//! A read of a replicated range that its replica has not answered within
//! the hedging delay goes on at the other replica. Over RDMA the READ given
//! up on keeps its queue pair: the other batches in flight on it go on,
//! and nothing is dialled again; its pool frames come back once the device
//! completes it.

use std::sync::atomic::{AtomicU64, Ordering};

use rdma_transport::Page;

use super::*;

/// Pages of the replicated range the load reads.
const PAGES: u64 = 64;
/// Pages per read (one batch per replica).
const BATCH: usize = 16;
/// Pages the load must see hedged: 20 batches (about one per 100 ms: a
/// replica that missed its delay is avoided that long).
const HEDGED_PAGES: u64 = 20 * BATCH as u64;

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_hedged_reads_keep_their_queue_pairs_and_give_their_frames_back() {
    hedged_reads(
        "rdma_hedged_reads_keep_their_queue_pairs_and_give_their_frames_back",
        PollMode::Busy,
    );
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_hedged_reads_event_mode() {
    hedged_reads("rdma_hedged_reads_event_mode", PollMode::Event);
}

/// A coordinator and two page-servers serving one range over RDMA (b
/// registers the same GPAs as a), both replicas live.
struct Pair {
    _db: tempfile::TempDir,
    coord: coordinator::RunningCoordinator,
    _a: RunningServer,
    _b: RunningServer,
}

impl Pair {
    fn start(test: &str) -> Self {
        require_device(test);
        let db = tempfile::tempdir().unwrap();
        let coord = coordinator(&db);
        let url = coord.url();
        let a = server(&url, "a", 0, true);
        let b = server(&url, "b", 0, true);
        wait_both_live(&url);
        Self {
            _db: db,
            coord,
            _a: a,
            _b: b,
        }
    }

    /// A manager with a 1 us hedging delay, which every READ misses (a
    /// SoftRoCE READ takes tens of microseconds), so that each read of the
    /// replica read first is abandoned and goes on at the other; `tune`
    /// sets the rest. Returned once its map holds the range.
    fn hedging_manager(
        &self,
        mode: PollMode,
        tune: impl FnOnce(&mut ManagerConfig),
    ) -> TransportManager {
        let mut cfg = ManagerConfig {
            read_hedge_delay_us: 1,
            ..config(&self.coord.url(), TransportKind::Rdma, mode)
        };
        tune(&mut cfg);
        let mgr = TransportManager::connect(cfg).expect("manager connects");
        assert!(wait_until(Duration::from_secs(10), || {
            mgr.refresh_map().is_ok() && mgr.map().len() == 1
        }));
        mgr
    }
}

fn hedged_reads(test: &str, mode: PollMode) {
    let pair = Pair::start(test);
    let mgr = pair.hedging_manager(mode, |_| {});
    let gpas: Vec<u64> = (0..PAGES).map(|p| p * PAGE_SIZE as u64).collect();
    let data: Vec<Page> = gpas.iter().map(|&g| page_for(g, 9)).collect();
    mgr.write_pages(&gpas, &data).unwrap();
    assert_all_rdma(&mgr);
    let qpns = (
        mgr.rdma_qpn_for_test("a").unwrap(),
        mgr.rdma_qpn_for_test("b").unwrap(),
    );
    let hedged_before = mgr.stats().reads_hedged;

    // Two readers, so that batches of one are in flight on a queue pair
    // when a batch of the other is abandoned on it.
    let reads = AtomicU64::new(0);
    let deadline = Instant::now() + Duration::from_secs(60);
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let (mgr, gpas, data, reads) = (&mgr, &gpas, &data, &reads);
            s.spawn(move || {
                let mut buf = vec![[0u8; PAGE_SIZE]; BATCH];
                let mut i = t as usize * BATCH;
                while mgr.stats().reads_hedged - hedged_before < HEDGED_PAGES {
                    assert!(
                        Instant::now() < deadline,
                        "{test}: {} pages hedged in 60 s",
                        mgr.stats().reads_hedged - hedged_before
                    );
                    let at = i % gpas.len();
                    let want = &gpas[at..at + BATCH];
                    mgr.read_pages(want, &mut buf)
                        .unwrap_or_else(|e| panic!("{test}: reading {BATCH} pages at {at}: {e}"));
                    for (k, page) in buf.iter().enumerate() {
                        assert!(*page == data[at + k], "{test}: page {} differs", at + k);
                    }
                    buf.iter_mut().for_each(|p| p.fill(0));
                    reads.fetch_add(1, Ordering::Relaxed);
                    i += 2 * BATCH;
                }
            });
        }
    });
    let stats = mgr.stats();
    say(&format!(
        "{test}: {} reads of {BATCH} pages, {} pages hedged",
        reads.load(Ordering::Relaxed),
        stats.reads_hedged - hedged_before
    ));
    assert_eq!(stats.calls_failed, 0, "{test}: {stats:?}");
    // No teardown: the same queue pairs serve on.
    assert_eq!(
        (mgr.rdma_qpn_for_test("a"), mgr.rdma_qpn_for_test("b")),
        (Some(qpns.0), Some(qpns.1)),
        "{test}: a queue pair was replaced"
    );
    // Every abandoned READ completes, and its frames go back to the pool,
    // with no request on the connections: the poller takes the completions.
    assert!(
        wait_until(Duration::from_secs(10), || {
            mgr.rdma_abandoned_reads_for_test("a") == Some(0)
                && mgr.rdma_abandoned_reads_for_test("b") == Some(0)
        }),
        "{test}: abandoned READs never completed: a {:?}, b {:?}",
        mgr.rdma_abandoned_reads_for_test("a"),
        mgr.rdma_abandoned_reads_for_test("b")
    );
    let stats = mgr.stats();
    assert_eq!(
        stats.pool_free_frames, stats.pool_frames,
        "{test}: frames kept from the pool"
    );
    // And the queue pairs still read right.
    let mut buf = vec![[0u8; PAGE_SIZE]; PAGES as usize];
    mgr.read_pages(&gpas, &mut buf).unwrap();
    assert!(buf == data, "{test}: a page differs after the load");
}

/// The frames of an abandoned READ come back when its completion comes,
/// even when nothing else is asked of its connection: the poller thread
/// takes the completion. Callers here spin for their answers rather than
/// park (so nothing else brings the poller to the queue pairs), and reads
/// are made until one is hedged off one replica and answered by the other.
#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_an_abandoned_read_gives_its_frames_back_with_nothing_else_on_its_connection() {
    let test = "rdma_an_abandoned_read_gives_its_frames_back_with_nothing_else_on_its_connection";
    let pair = Pair::start(test);
    // Spinning longer than the request deadline: a caller never parks,
    // but when its round's (hedging) deadline passed.
    let mgr = pair.hedging_manager(PollMode::Busy, |c| {
        c.wait_spin_us = 2 * 1000 * REQUEST_TIMEOUT_MS;
    });
    let gpas: Vec<u64> = (0..BATCH as u64).map(|p| p * PAGE_SIZE as u64).collect();
    let data: Vec<Page> = gpas.iter().map(|&g| page_for(g, 10)).collect();
    mgr.write_pages(&gpas, &data).unwrap();
    assert_all_rdma(&mgr);
    let hedged_before = mgr.stats().reads_hedged;
    // SoftRoCE may complete all of a batch within its post (then it is
    // not hedged): read until one read was, then nothing more.
    let mut buf = vec![[0u8; PAGE_SIZE]; BATCH];
    let mut reads = 0usize;
    let hedged = wait_until(Duration::from_secs(20), || {
        mgr.read_pages(&gpas, &mut buf)
            .unwrap_or_else(|e| panic!("{test}: read {reads}: {e}"));
        assert!(buf == data, "{test}: a page differs");
        buf.iter_mut().for_each(|p| p.fill(0));
        reads += 1;
        mgr.stats().reads_hedged > hedged_before
    });
    assert!(hedged, "{test}: none of {reads} reads was hedged");
    say(&format!("{test}: hedged at read {reads}"));
    let abandoned = || {
        mgr.rdma_abandoned_reads_for_test("a").unwrap_or(0)
            + mgr.rdma_abandoned_reads_for_test("b").unwrap_or(0)
    };
    assert!(
        wait_until(Duration::from_secs(10), || abandoned() == 0),
        "{test}: {} abandoned READ(s) never completed",
        abandoned()
    );
    let stats = mgr.stats();
    assert_eq!(
        stats.pool_free_frames, stats.pool_frames,
        "{test}: frames kept from the pool"
    );
}

/// `read_frame` on a pool of one frame: its READ is abandoned at the
/// hedging delay holding the pool's only frame, and the read goes on at
/// the other replica in that frame once the device has given it back (the
/// next round waits for a frame until the deadline, as the first does).
#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_a_hedged_read_frame_on_a_one_frame_pool_goes_on_in_its_abandoned_frame() {
    let test = "rdma_a_hedged_read_frame_on_a_one_frame_pool_goes_on_in_its_abandoned_frame";
    let pair = Pair::start(test);
    let writer = rdma_manager(&pair.coord.url(), PollMode::Busy);
    let gpas: Vec<u64> = (0..4).map(|p| p * PAGE_SIZE as u64).collect();
    let data: Vec<Page> = gpas.iter().map(|&g| page_for(g, 11)).collect();
    writer.write_pages(&gpas, &data).unwrap();
    let reader = pair.hedging_manager(PollMode::Busy, |c| c.pool_size_bytes = PAGE_SIZE);
    // A one-page READ may complete within the post (SoftRoCE serves it in
    // the system call) and then is not hedged: read until one was.
    let mut reads = 0usize;
    let hedged = wait_until(Duration::from_secs(20), || {
        let i = reads % gpas.len();
        let frame = reader
            .read_frame(gpas[i])
            .unwrap_or_else(|e| panic!("{test}: read_frame {reads}: {e}"));
        assert!(*frame == data[i], "{test}: the frame holds another page");
        assert_eq!(
            reader.stats().pool_free_frames,
            0,
            "{test}: the frame is ours"
        );
        drop(frame);
        reads += 1;
        reader.stats().reads_hedged > 0
    });
    assert!(hedged, "{test}: none of {reads} reads was hedged");
    say(&format!("{test}: hedged at read {reads}"));
    assert!(wait_until(Duration::from_secs(10), || reader
        .stats()
        .pool_free_frames
        == 1));
}
