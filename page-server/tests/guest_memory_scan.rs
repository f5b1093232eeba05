//! Dirty tracking with `PAGEMAP_SCAN` (asynchronous write protection, since
//! Linux 6.7), the default for a shared-memory file of 4 KiB pages: writes
//! take no fault, flush and evict still lose none of them, even while a
//! writer keeps writing.

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::*;
use rdma_transport::guest_memory::{
    DirtyTracking, GuestBacking, GuestMemory, GuestMemoryConfig, GuestMemoryError, SharedFile,
};
use rdma_transport::{TransportManager, PAGE_SIZE};

const PAGES: usize = NODE_BYTES / PAGE_SIZE;

struct Node {
    _db: tempfile::TempDir,
    _coord: coordinator::RunningCoordinator,
    _server: page_server::RunningServer,
    mgr: Arc<TransportManager>,
}

fn node() -> Node {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let server = page_server(&coord.url(), "a", 0);
    let mgr = Arc::new(manager(&coord.url()));
    Node {
        _db: db,
        _coord: coord,
        _server: server,
        mgr,
    }
}

fn scan_region(mgr: &Arc<TransportManager>) -> GuestMemory {
    let ram = GuestMemory::new(
        Arc::clone(mgr),
        GuestMemoryConfig {
            handler_cpus: Some(vec![]),
            fault_timeout_ms: 5000,
            prefetch_max_pages: 0,
            backing: GuestBacking::SharedFile(SharedFile::new(memfd(NODE_BYTES), 0)),
            ..GuestMemoryConfig::new(0, NODE_BYTES)
        },
    )
    .unwrap();
    assert_eq!(
        ram.dirty_tracking(),
        DirtyTracking::PagemapScan,
        "the default on Linux >= 6.7"
    );
    ram
}

#[test]
fn writes_take_no_fault_and_flush_finds_exactly_the_written_pages() {
    let n = node();
    let ram = scan_region(&n.mgr);
    // Every page read in first (mapped clean), then a scattered third of
    // them written, and a run of 40.
    let mut page = [0u8; PAGE_SIZE];
    for p in 0..PAGES {
        ram.read((p * PAGE_SIZE) as u64, &mut page).unwrap();
    }
    let written: Vec<usize> = (0..PAGES)
        .filter(|p| p % 3 == 1 || (100..140).contains(p))
        .collect();
    for &p in &written {
        let gpa = (p * PAGE_SIZE) as u64;
        ram.write(gpa, &page_for(gpa, 5)).unwrap();
    }
    let stats = ram.stats();
    assert_eq!(
        stats.wp_faults, 0,
        "writes to clean pages fault no handler: {stats:?}"
    );
    assert_eq!(ram.flush().unwrap(), written.len() as u64);
    assert_eq!(ram.flush().unwrap(), 0, "protected again by the flush");
    for p in 0..PAGES {
        let gpa = (p * PAGE_SIZE) as u64;
        n.mgr.read_page(gpa, &mut page).unwrap();
        let want = if written.binary_search(&p).is_ok() {
            page_for(gpa, 5)
        } else {
            [0u8; PAGE_SIZE]
        };
        assert!(page == want, "remote page {gpa:#x}");
    }
    // A write after the flush is found by the next one.
    ram.write(7 * PAGE_SIZE as u64, &page_for(7 * PAGE_SIZE as u64, 6))
        .unwrap();
    assert_eq!(ram.flush().unwrap(), 1);
    // Evict writes back only what was written since, then drops all.
    ram.write(9 * PAGE_SIZE as u64, &[1u8; 8]).unwrap();
    let before = ram.stats().pages_written_back;
    assert_eq!(ram.evict(0, NODE_BYTES as u64).unwrap(), PAGES as u64);
    assert_eq!(ram.stats().pages_written_back - before, 1);
    let mut word = [0u8; 8];
    ram.read(9 * PAGE_SIZE as u64, &mut word).unwrap();
    assert_eq!(word, [1u8; 8], "faulted back in from its owner");
}

/// A writer increments counters in guest memory (read, add one, write) as
/// fast as it can while this thread evicts (or flushes) the whole region
/// again and again. A write lost between looking for written pages and
/// dropping them would make a counter go back: at the end every counter
/// must equal the increments made, in guest memory and at the owner.
fn counters_survive(evicting: bool) {
    let n = node();
    let ram = Arc::new(scan_region(&n.mgr));
    const COUNTERS: usize = 16;
    const INCREMENTS: u64 = 3000;
    let gpa_of = |c: usize| (c * (PAGES / COUNTERS) * PAGE_SIZE + 8 * c) as u64;
    let done = Arc::new(AtomicBool::new(false));
    let increments = Arc::new(AtomicU64::new(0));
    let writer = {
        let ram = Arc::clone(&ram);
        let done = Arc::clone(&done);
        let increments = Arc::clone(&increments);
        std::thread::spawn(move || {
            for i in 0..INCREMENTS * COUNTERS as u64 {
                let gpa = gpa_of((i % COUNTERS as u64) as usize);
                let mut word = [0u8; 8];
                ram.read(gpa, &mut word).unwrap();
                let next = u64::from_le_bytes(word) + 1;
                ram.write(gpa, &next.to_le_bytes()).unwrap();
                increments.fetch_add(1, Ordering::SeqCst);
            }
            done.store(true, Ordering::SeqCst);
        })
    };
    let mut passes = 0u64;
    while !done.load(Ordering::SeqCst) {
        let before = increments.load(Ordering::SeqCst);
        if evicting {
            ram.evict(0, NODE_BYTES as u64).unwrap();
        } else {
            ram.flush().unwrap();
        }
        passes += 1;
        // The next pass waits for the writer's next increment (it runs
        // meanwhile, as it did during this pass): passes back to back
        // starved the writer on two CPUs (one run of this test took
        // 5 minutes, another did not end in 8).
        while increments.load(Ordering::SeqCst) == before && !done.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
    }
    writer.join().unwrap();
    assert!(passes > 1, "the writer finished before a second pass");
    ram.flush().unwrap();
    for c in 0..COUNTERS {
        let gpa = gpa_of(c);
        let mut word = [0u8; 8];
        ram.read(gpa, &mut word).unwrap();
        assert_eq!(
            u64::from_le_bytes(word),
            INCREMENTS,
            "counter {c} in guest memory"
        );
        let mut page = [0u8; PAGE_SIZE];
        n.mgr
            .read_page(gpa & !(PAGE_SIZE as u64 - 1), &mut page)
            .unwrap();
        let at = (gpa % PAGE_SIZE as u64) as usize;
        let remote = u64::from_le_bytes(page[at..at + 8].try_into().unwrap());
        assert_eq!(remote, INCREMENTS, "counter {c} at its owner");
    }
    assert_eq!(ram.stats().wp_faults, 0);
}

#[test]
fn evicting_while_a_writer_writes_loses_no_write() {
    counters_survive(true);
}

#[test]
fn flushing_while_a_writer_writes_loses_no_write() {
    counters_survive(false);
}

#[test]
fn pagemap_scan_is_refused_where_it_cannot_work() {
    let n = node();
    let err = GuestMemory::new(
        Arc::clone(&n.mgr),
        GuestMemoryConfig {
            dirty_tracking: DirtyTracking::PagemapScan,
            ..GuestMemoryConfig::new(0, NODE_BYTES)
        },
    )
    .expect_err("anonymous memory");
    assert!(matches!(err, GuestMemoryError::Unsupported(_)), "{err}");
    // Asked for write faults on a shared file, it gets them.
    let ram = GuestMemory::new(
        Arc::clone(&n.mgr),
        GuestMemoryConfig {
            dirty_tracking: DirtyTracking::WriteFaults,
            backing: GuestBacking::SharedFile(SharedFile::new(memfd(NODE_BYTES), 0)),
            ..GuestMemoryConfig::new(0, NODE_BYTES)
        },
    )
    .unwrap();
    assert_eq!(ram.dirty_tracking(), DirtyTracking::WriteFaults);
    let mut word = [0u8; 8];
    ram.read(0, &mut word).unwrap();
    ram.write(0, &[2u8; 8]).unwrap();
    assert_eq!(ram.stats().wp_faults, 1);
}
