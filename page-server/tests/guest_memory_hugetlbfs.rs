//! Guest memory in a hugetlbfs file (an `MFD_HUGETLB` memfd): the huge page
//! is the unit of faults, dirty tracking, write-back and eviction, over a
//! real local cluster whose page-servers each hold half a huge page.
//!
//! These tests need free 2 MiB huge pages, which a machine does not have
//! unless they are reserved (`/proc/sys/vm/nr_hugepages`, as root): they are
//! ignored by a plain `cargo test`, and `deploy/test-all.sh` reserves the
//! pages and runs them with `--ignored`.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Barrier};

use common::*;
use rdma_transport::guest_memory::{
    GuestBacking, GuestMemory, GuestMemoryConfig, GuestMemoryError, SharedFile,
};
use rdma_transport::{TransportManager, PAGE_SIZE};

const HUGE: usize = 2 << 20;
const SUBPAGES: usize = HUGE / PAGE_SIZE;
/// Page-servers of `NODE_BYTES` (1 MiB) each: a huge page spans two nodes.
const NODES: usize = 4;
const REGION: usize = NODES * NODE_BYTES;
const NEEDS: &str = "needs free 2 MiB huge pages: reserve some as root \
     (echo 16 > /proc/sys/vm/nr_hugepages), as deploy/test-all.sh does";

struct Cluster {
    _db: tempfile::TempDir,
    _coord: coordinator::RunningCoordinator,
    _servers: Vec<page_server::RunningServer>,
    mgr: Arc<TransportManager>,
}

/// `NODES` page-servers of 1 MiB from GPA 0, every page filled with
/// `page_for(gpa, seed)`.
fn cluster(seed: u8) -> Cluster {
    assert!(free_huge_pages() >= 2 * REGION / HUGE, "{NEEDS}");
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let servers = (0..NODES)
        .map(|i| page_server(&coord.url(), &format!("n{i}"), (i * NODE_BYTES) as u64))
        .collect();
    let mgr = Arc::new(manager(&coord.url()));
    let gpas: Vec<u64> = (0..REGION / PAGE_SIZE)
        .map(|p| (p * PAGE_SIZE) as u64)
        .collect();
    let pages: Vec<_> = gpas.iter().map(|&g| page_for(g, seed)).collect();
    mgr.write_pages(&gpas, &pages).unwrap();
    Cluster {
        _db: db,
        _coord: coord,
        _servers: servers,
        mgr,
    }
}

fn huge_region(mgr: &Arc<TransportManager>) -> GuestMemory {
    GuestMemory::new(
        Arc::clone(mgr),
        GuestMemoryConfig {
            handler_cpus: Some(vec![]),
            backing: GuestBacking::SharedFile(SharedFile::new(huge_memfd(REGION), 0)),
            ..GuestMemoryConfig::new(0, REGION)
        },
    )
    .unwrap()
}

fn check_huge_page(ram: &GuestMemory, huge: usize, seed_of: impl Fn(u64) -> u8) {
    let mut page = [0u8; PAGE_SIZE];
    for k in 0..SUBPAGES {
        let gpa = (huge * HUGE + k * PAGE_SIZE) as u64;
        ram.read(gpa, &mut page).unwrap();
        assert!(
            page == page_for(gpa, seed_of(gpa)),
            "guest page {gpa:#x} differs"
        );
    }
}

#[test]
#[ignore = "needs reserved huge pages; deploy/test-all.sh reserves them and runs it"]
fn a_fault_brings_the_whole_huge_page_and_write_back_is_per_huge_page() {
    let c = cluster(3);
    let ram = huge_region(&c.mgr);

    // One touch faults in the whole huge page, from both nodes it spans.
    let mut word = [0u8; 8];
    ram.read(5 * PAGE_SIZE as u64, &mut word).unwrap();
    let stats = ram.stats();
    assert_eq!(
        (stats.missing_faults, stats.pages_fetched),
        (1, SUBPAGES as u64),
        "{stats:?}"
    );
    check_huge_page(&ram, 0, |_| 3);
    assert_eq!(
        ram.stats().missing_faults,
        1,
        "no more faults on a present huge page"
    );

    // A write to the present (clean) huge page 0: one write-protect fault.
    // A write that first touches huge page 1: fetched writable and dirty.
    let w0 = (7 * PAGE_SIZE) as u64;
    let w1 = (HUGE + 300 * PAGE_SIZE) as u64;
    ram.write(w0, &page_for(w0, 9)).unwrap();
    ram.write(w1, &page_for(w1, 9)).unwrap();
    let stats = ram.stats();
    assert_eq!((stats.missing_faults, stats.wp_faults), (2, 1), "{stats:?}");

    // Both huge pages are written back whole; the owners see the writes.
    assert_eq!(ram.flush().unwrap(), 2 * SUBPAGES as u64);
    assert_eq!(ram.flush().unwrap(), 0, "clean after the flush");
    let mut page = [0u8; PAGE_SIZE];
    for gpa in [w0, w1] {
        c.mgr.read_page(gpa, &mut page).unwrap();
        assert!(
            page == page_for(gpa, 9),
            "remote page {gpa:#x} lacks the write"
        );
    }
    let untouched = (HUGE + 301 * PAGE_SIZE) as u64;
    c.mgr.read_page(untouched, &mut page).unwrap();
    assert!(
        page == page_for(untouched, 3),
        "remote page {untouched:#x} changed"
    );

    // Evict works on whole huge pages; a 4 KiB range is refused.
    assert!(matches!(
        ram.evict(0, PAGE_SIZE as u64),
        Err(GuestMemoryError::OutOfRange { .. })
    ));
    assert_eq!(ram.evict(0, REGION as u64).unwrap(), 2 * SUBPAGES as u64);
    // Touching them again fetches what was written back.
    let seed = |gpa: u64| if gpa == w0 || gpa == w1 { 9 } else { 3 };
    check_huge_page(&ram, 1, seed);
    check_huge_page(&ram, 0, seed);
    assert_eq!(ram.stats().missing_faults, 4);
    assert_eq!(
        (ram.stats().fault_errors, ram.stats().sigbus_raised),
        (0, 0)
    );
}

#[test]
#[ignore = "needs reserved huge pages; deploy/test-all.sh reserves them and runs it"]
fn threads_faulting_on_one_huge_page_fetch_it_once() {
    let c = cluster(4);
    let ram = Arc::new(huge_region(&c.mgr));
    const THREADS: usize = 4;
    let start = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let ram = Arc::clone(&ram);
            let start = Arc::clone(&start);
            std::thread::spawn(move || {
                start.wait();
                // Each thread its own 4 KiB pages of huge page 1.
                let mut page = [0u8; PAGE_SIZE];
                for k in (t..SUBPAGES).step_by(97) {
                    let gpa = (HUGE + k * PAGE_SIZE) as u64;
                    ram.read(gpa, &mut page).unwrap();
                    assert!(page == page_for(gpa, 4), "guest page {gpa:#x} differs");
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let stats = ram.stats();
    assert_eq!(
        (stats.missing_faults, stats.pages_fetched),
        (1, SUBPAGES as u64),
        "one fetch for the huge page: {stats:?}"
    );
}

#[test]
#[ignore = "needs reserved huge pages; deploy/test-all.sh reserves them and runs it"]
fn scattered_writes_in_every_huge_page_are_all_written_back() {
    let c = cluster(5);
    let ram = huge_region(&c.mgr);
    let written = |gpa: u64| (gpa / PAGE_SIZE as u64) % 3 == 1;
    for round in 0..3u8 {
        let seed = 20 + round;
        for p in 0..REGION / PAGE_SIZE {
            let gpa = (p * PAGE_SIZE) as u64;
            if written(gpa) {
                ram.write(gpa, &page_for(gpa, seed)).unwrap();
            }
        }
        assert_eq!(ram.flush().unwrap(), (REGION / PAGE_SIZE) as u64);
        let gpas: Vec<u64> = (0..REGION / PAGE_SIZE)
            .map(|p| (p * PAGE_SIZE) as u64)
            .collect();
        let mut back = vec![[0u8; PAGE_SIZE]; gpas.len()];
        c.mgr.read_pages(&gpas, &mut back).unwrap();
        for (&gpa, got) in gpas.iter().zip(&back) {
            let want = if written(gpa) { seed } else { 5 };
            assert!(
                *got == page_for(gpa, want),
                "round {round}: remote page {gpa:#x} differs"
            );
        }
    }
}

#[test]
fn a_hugetlbfs_region_must_be_made_of_whole_huge_pages() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let mgr = Arc::new(manager(&coord.url()));
    // The memfd itself needs no huge page until it is mapped.
    let err = GuestMemory::new(
        mgr,
        GuestMemoryConfig {
            backing: GuestBacking::SharedFile(SharedFile::new(huge_memfd(HUGE), 0)),
            ..GuestMemoryConfig::new(0, HUGE / 2)
        },
    )
    .expect_err("half a huge page");
    assert!(
        matches!(&err, GuestMemoryError::Config(m) if m.contains("page size")),
        "{err}"
    );
}
