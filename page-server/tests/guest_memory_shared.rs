//! Guest memory in a shared-memory file the hypervisor owns (memfd), over a
//! real local cluster: faults are fetched straight into the region's alias
//! and mapped with UFFDIO_CONTINUE, write-back goes out of guest memory,
//! evict punches holes, and concurrent faults on one page fetch it once.

mod common;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Duration;

use common::vmm_view::VmmView;
use common::*;
use rdma_transport::guest_memory::{
    DirtyTracking, GuestBacking, GuestMemory, GuestMemoryConfig, GuestMemoryError, HandedOverUffd,
    SharedFile,
};
use rdma_transport::uffd::{feature, FaultMode, RegisterMode, Userfaultfd};
use rdma_transport::{ManagerConfig, TransportManager, PAGE_SIZE};

const NODE: u64 = NODE_BYTES as u64;
const PAGES_PER_NODE: usize = NODE_BYTES / PAGE_SIZE;

fn shared_config(
    fd: &Arc<OwnedFd>,
    offset_bytes: u64,
    gpa_base: u64,
    size_bytes: usize,
) -> GuestMemoryConfig {
    GuestMemoryConfig {
        handler_cpus: Some(vec![]),
        fault_timeout_ms: 500,
        backing: GuestBacking::SharedFile(SharedFile::new(Arc::clone(fd), offset_bytes)),
        ..GuestMemoryConfig::new(gpa_base, size_bytes)
    }
}

/// Bytes of the file backed by memory (`st_blocks` counts 512-byte units).
fn file_resident_bytes(fd: &OwnedFd) -> u64 {
    // SAFETY: `st` is plain data the kernel fills in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is live and writable.
    assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
    st.st_blocks as u64 * 512
}

#[test]
fn memfd_pages_fault_in_write_back_and_evict_frees_the_file() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let _b = page_server(&coord.url(), "b", NODE);
    let mgr = Arc::new(manager(&coord.url()));
    // The region is the file's second half: offsets are honoured.
    let fd = memfd(4 * NODE_BYTES);
    let offset = 2 * NODE;
    // Write-protect faults track dirty pages here (guest_memory_scan.rs
    // covers PAGEMAP_SCAN).
    let ram = GuestMemory::new(
        Arc::clone(&mgr),
        GuestMemoryConfig {
            dirty_tracking: DirtyTracking::WriteFaults,
            ..shared_config(&fd, offset, 0, 2 * NODE_BYTES)
        },
    )
    .unwrap();
    let vmm = VmmView::new(&fd, 4 * NODE_BYTES);

    // Half the pages are read first (mapped clean, then a write-protect
    // fault on the write), half are written first.
    let mut page = [0u8; PAGE_SIZE];
    for p in 0..2 * PAGES_PER_NODE {
        let gpa = (p * PAGE_SIZE) as u64;
        if p % 2 == 0 {
            ram.read(gpa, &mut page).unwrap();
            assert!(page.iter().all(|&b| b == 0), "fresh remote memory is zero");
        }
        ram.write(gpa, &page_for(gpa, 7)).unwrap();
    }
    let stats = ram.stats();
    assert_eq!(
        stats.missing_faults + stats.prefetched_pages,
        512,
        "{stats:?}"
    );
    assert!(stats.wp_faults >= 128, "write-protect tracking: {stats:?}");
    // A fault alone in flight (the first one always is) has its answer
    // read from the socket straight into the alias (page checksums on),
    // not copied from a receive buffer. (Here every fault is, ~11 of them;
    // a prefetch batch in flight beside a fault makes it copy.)
    let landed = mgr.zero_copy_stats().tcp_direct_pages;
    assert!(
        landed >= 1 && landed <= stats.missing_faults + stats.prefetched_pages,
        "{landed} pages read straight into guest memory: {stats:?}"
    );
    // The guest's pages are the file's: the VMM's own mapping sees them.
    for p in (0..2 * PAGES_PER_NODE).step_by(7) {
        let gpa = (p * PAGE_SIZE) as u64;
        assert!(
            vmm.page(2 * PAGES_PER_NODE + p) == page_for(gpa, 7),
            "file page for gpa {gpa:#x} differs"
        );
    }

    // Flush writes each dirty page once, straight out of guest memory.
    assert_eq!(ram.flush().unwrap(), 512);
    assert_eq!(ram.flush().unwrap(), 0, "clean after a flush");
    let gpas: Vec<u64> = (0..2 * PAGES_PER_NODE)
        .map(|p| (p * PAGE_SIZE) as u64)
        .collect();
    let mut remote = vec![[0u8; PAGE_SIZE]; gpas.len()];
    mgr.read_pages(&gpas, &mut remote).unwrap();
    for (gpa, got) in gpas.iter().zip(&remote) {
        assert!(*got == page_for(*gpa, 7), "remote page {gpa:#x} differs");
    }

    // A write after the flush is tracked again; evict writes it back and
    // frees the file's memory (a hole), and the next touch fetches it.
    ram.write(0x3000, &page_for(0x3000, 9)).unwrap();
    assert!(file_resident_bytes(&fd) >= 2 * NODE);
    assert_eq!(ram.evict(0, 2 * NODE).unwrap(), 512);
    assert_eq!(
        file_resident_bytes(&fd),
        0,
        "evict punched the file's pages"
    );
    assert!(
        vmm.page(0).iter().all(|&b| b == 0),
        "before the offset: untouched"
    );
    mgr.read_page(0x3000, &mut page).unwrap();
    assert!(
        page == page_for(0x3000, 9),
        "evict wrote the dirty page back"
    );
    let before = ram.stats().missing_faults;
    for p in (0..2 * PAGES_PER_NODE).rev() {
        let gpa = (p * PAGE_SIZE) as u64;
        let seed = if gpa == 0x3000 { 9 } else { 7 };
        ram.read(gpa, &mut page).unwrap();
        assert!(
            page == page_for(gpa, seed),
            "guest page {gpa:#x} after evict"
        );
    }
    assert!(ram.stats().missing_faults > before);
    assert_eq!(ram.flush().unwrap(), 0, "clean pages need no write-back");
}

#[test]
fn pages_the_vmm_left_in_the_file_are_fetched_not_trusted() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let mgr = Arc::new(manager(&coord.url()));
    for p in 0..4u64 {
        mgr.write_page(p * 4096, &page_for(p * 4096, 5)).unwrap();
    }
    let fd = memfd(NODE_BYTES);
    let vmm = VmmView::new(&fd, NODE_BYTES);
    // Stale contents in the page cache: a touch is a MINOR fault, and the
    // owner's page must replace them.
    for p in 0..4 {
        vmm.fill(p, 0xee);
    }
    let ram = GuestMemory::new(
        Arc::clone(&mgr),
        GuestMemoryConfig {
            prefetch_max_pages: 0,
            ..shared_config(&fd, 0, 0, NODE_BYTES)
        },
    )
    .unwrap();
    let mut page = [0u8; PAGE_SIZE];
    for p in 0..4u64 {
        ram.read(p * 4096, &mut page).unwrap();
        assert!(page == page_for(p * 4096, 5), "page {p} is the owner's");
        assert!(vmm.page(p as usize) == page_for(p * 4096, 5));
    }
    // `missing_faults` is counted right after the CONTINUE that wakes the
    // reader, so it may trail the last read by a moment.
    wait_until(Duration::from_secs(5), || ram.stats().missing_faults >= 4);
    let stats = ram.stats();
    assert_eq!(
        (stats.missing_faults, stats.pages_fetched),
        (4, 4),
        "{stats:?}"
    );
}

#[test]
fn concurrent_faults_on_one_shared_page_fetch_it_once() {
    let (_db, coord) = loopback_coordinator();
    let server = ChildServer::start(&coord.url(), "a", 0);
    let gpa = 5 * PAGE_SIZE as u64;
    // Long deadlines: the owner is stopped while the faults pile up.
    let mgr = Arc::new(
        TransportManager::connect(ManagerConfig {
            coordinator_url: coord.url(),
            request_timeout_ms: 20_000,
            poller_cpus: Some(vec![]),
            ..ManagerConfig::default()
        })
        .unwrap(),
    );
    assert!(wait_until(Duration::from_secs(10), || {
        mgr.refresh_map().is_ok() && mgr.map().lookup(gpa).is_some()
    }));
    mgr.write_page(gpa, &page_for(gpa, 3)).unwrap();
    let fd = memfd(NODE_BYTES);
    let ram = Arc::new(
        GuestMemory::new(
            Arc::clone(&mgr),
            GuestMemoryConfig {
                handler_threads: 3,
                fault_timeout_ms: 30_000,
                prefetch_max_pages: 0,
                ..shared_config(&fd, 0, 0, NODE_BYTES)
            },
        )
        .unwrap(),
    );
    server.pause();
    let touch = |ram: Arc<GuestMemory>| {
        std::thread::spawn(move || {
            let mut page = [0u8; PAGE_SIZE];
            ram.read(gpa, &mut page).unwrap();
            page
        })
    };
    // The first fault's handler starts the fetch and waits on the stopped
    // owner; then two more threads fault on the page and go to the other
    // handlers, which must wait for it rather than fetch again.
    let mut threads = vec![touch(Arc::clone(&ram))];
    assert!(
        wait_until(Duration::from_secs(10), || ram.stats().pages_fetched == 1),
        "{:?}",
        ram.stats()
    );
    threads.push(touch(Arc::clone(&ram)));
    threads.push(touch(Arc::clone(&ram)));
    assert!(
        wait_until(Duration::from_secs(10), || ram.stats().deferred_faults >= 2),
        "the later faults were not deferred: {:?}",
        ram.stats()
    );
    server.resume();
    for t in threads {
        assert!(t.join().unwrap() == page_for(gpa, 3), "wrong page content");
    }
    let stats = ram.stats();
    assert_eq!(stats.pages_fetched, 1, "fetched once: {stats:?}");
    assert_eq!(stats.missing_faults, 1, "{stats:?}");
}

#[test]
fn bad_shared_files_are_refused_with_their_reason() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let mgr = Arc::new(manager(&coord.url()));
    let new = |config| GuestMemory::new(Arc::clone(&mgr), config).map(|_| ());

    let small = memfd(NODE_BYTES / 2);
    let err = new(shared_config(&small, 0, 0, NODE_BYTES)).unwrap_err();
    assert!(
        matches!(
            err,
            GuestMemoryError::FileTooSmall { file_bytes, needed_bytes }
                if file_bytes == NODE / 2 && needed_bytes == NODE
        ),
        "{err:?}"
    );
    let fd = memfd(2 * NODE_BYTES);
    let err = new(shared_config(&fd, NODE + 1, 0, NODE_BYTES)).unwrap_err();
    assert!(
        matches!(&err, GuestMemoryError::Config(m) if m.contains("offset")),
        "{err:?}"
    );
    let err = new(shared_config(&fd, 0, 0, NODE_BYTES + 100)).unwrap_err();
    assert!(
        matches!(&err, GuestMemoryError::Config(m) if m.contains("page aligned")),
        "{err:?}"
    );
    let err = new(shared_config(&fd, 2 * NODE, 0, PAGE_SIZE)).unwrap_err();
    assert!(
        matches!(err, GuestMemoryError::FileTooSmall { .. }),
        "{err:?}"
    );

    // Not shared memory: a pipe.
    let mut ends = [0; 2];
    // SAFETY: `ends` is a live array of two ints.
    assert_eq!(unsafe { libc::pipe(ends.as_mut_ptr()) }, 0);
    // SAFETY: just created and owned by nobody else.
    let pipe_read = Arc::new(unsafe { OwnedFd::from_raw_fd(ends[0]) });
    // SAFETY: as above.
    let _pipe_write = unsafe { OwnedFd::from_raw_fd(ends[1]) };
    let err = new(shared_config(&pipe_read, 0, 0, NODE_BYTES)).unwrap_err();
    assert!(
        matches!(err, GuestMemoryError::NotSharedMemory { .. }),
        "{err:?}"
    );

    // The memfd opened read-only.
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    let read_only = Arc::new(OwnedFd::from(std::fs::File::open(path).unwrap()));
    let err = new(shared_config(&read_only, 0, 0, NODE_BYTES)).unwrap_err();
    assert!(matches!(err, GuestMemoryError::FileNotWritable), "{err:?}");

    // And a good one works.
    new(shared_config(&fd, NODE, 0, NODE_BYTES)).unwrap();
}

/// The VMM's side of the handler model: a userfaultfd with `features`
/// enabled (none: no handshake), its mapping registered for MISSING faults.
fn vmm_uffd(features: Option<u64>, view: &VmmView) -> Arc<OwnedFd> {
    let uffd = Userfaultfd::open(FaultMode::KernelAndUser).unwrap();
    if let Some(features) = features {
        uffd.enable(features).unwrap();
        uffd.register(view.ptr, view.len_bytes, RegisterMode::MISSING)
            .unwrap();
    }
    Arc::new(
        std::os::fd::AsFd::as_fd(&uffd)
            .try_clone_to_owned()
            .unwrap(),
    )
}

const VMM_FEATURES: u64 = feature::PAGEFAULT_FLAG_WP
    | feature::THREAD_ID
    | feature::MISSING_SHMEM
    | feature::MINOR_SHMEM
    | feature::WP_HUGETLBFS_SHMEM
    | feature::POISON;

#[test]
fn handed_over_uffd_and_mapping_serve_faults_and_write_back() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let mgr = Arc::new(manager(&coord.url()));
    for p in 0..8u64 {
        mgr.write_page(p * 4096, &page_for(p * 4096, 4)).unwrap();
    }
    let fd = memfd(NODE_BYTES);
    let vmm = VmmView::new(&fd, NODE_BYTES);
    let uffd = vmm_uffd(Some(VMM_FEATURES), &vmm);
    // SAFETY: `vmm` maps the memfd at offset 0 for NODE_BYTES and outlives
    // `ram`; nothing else reads `uffd`.
    let handed = unsafe { HandedOverUffd::new(Arc::clone(&uffd), vmm.ptr) };
    let ram = GuestMemory::new(
        Arc::clone(&mgr),
        GuestMemoryConfig {
            backing: GuestBacking::SharedFile(
                SharedFile::new(Arc::clone(&fd), 0).with_uffd(handed),
            ),
            ..shared_config(&fd, 0, 0, NODE_BYTES)
        },
    )
    .unwrap();
    assert_eq!(ram.as_ptr(), vmm.ptr, "guest memory is the VMM's mapping");
    // The VMM's own accesses fault and are served.
    for p in 0..8 {
        assert!(vmm.page(p) == page_for(p as u64 * 4096, 4), "page {p}");
    }
    for p in 0..PAGES_PER_NODE {
        let gpa = (p * PAGE_SIZE) as u64;
        ram.write(gpa, &page_for(gpa, 6)).unwrap();
    }
    assert!(ram.stats().wp_faults >= 8, "{:?}", ram.stats());
    assert_eq!(ram.flush().unwrap(), PAGES_PER_NODE as u64);
    assert_eq!(ram.evict(0, NODE).unwrap(), PAGES_PER_NODE as u64);
    let mut page = [0u8; PAGE_SIZE];
    for p in (0..PAGES_PER_NODE).step_by(3) {
        let gpa = (p * PAGE_SIZE) as u64;
        mgr.read_page(gpa, &mut page).unwrap();
        assert!(page == page_for(gpa, 6), "remote page {gpa:#x}");
        assert!(vmm.page(p) == page_for(gpa, 6), "guest page {gpa:#x}");
    }
}

#[test]
fn handed_over_uffd_without_the_features_or_the_file_is_refused() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let mgr = Arc::new(manager(&coord.url()));
    let fd = memfd(2 * NODE_BYTES);
    let vmm = VmmView::new(&fd, NODE_BYTES);
    let new = |uffd: &Arc<OwnedFd>, mapping: *mut u8, offset_bytes: u64| {
        // SAFETY: only checked here: each mapping outlives the call and no
        // region is left serving it.
        let handed = unsafe { HandedOverUffd::new(Arc::clone(uffd), mapping) };
        GuestMemory::new(
            Arc::clone(&mgr),
            GuestMemoryConfig {
                backing: GuestBacking::SharedFile(
                    SharedFile::new(Arc::clone(&fd), offset_bytes).with_uffd(handed),
                ),
                ..shared_config(&fd, offset_bytes, 0, NODE_BYTES)
            },
        )
        .map(|_| ())
    };
    let basic = vmm_uffd(Some(feature::PAGEFAULT_FLAG_WP | feature::THREAD_ID), &vmm);
    let err = new(&basic, vmm.ptr, 0).unwrap_err();
    assert!(
        matches!(&err, GuestMemoryError::Unsupported(m) if m.contains("MINOR_SHMEM")),
        "{err:?}"
    );
    let fresh = vmm_uffd(None, &vmm);
    let err = new(&fresh, vmm.ptr, 0).unwrap_err();
    assert!(
        matches!(&err, GuestMemoryError::Config(m) if m.contains("UFFDIO_API")),
        "{err:?}"
    );
    // Closing them releases the mapping's registration.
    drop((basic, fresh));
    let good = vmm_uffd(Some(VMM_FEATURES), &vmm);
    // The mapping is the file at offset 0, not NODE_BYTES.
    let err = new(&good, vmm.ptr, NODE).unwrap_err();
    assert!(
        matches!(&err, GuestMemoryError::Config(m) if m.contains("not the shared file")),
        "{err:?}"
    );
    // Not a mapping of the file at all.
    let mut elsewhere = vec![0u8; 3 * PAGE_SIZE];
    let aligned = elsewhere
        .as_mut_ptr()
        .wrapping_add(elsewhere.as_ptr().align_offset(PAGE_SIZE));
    let err = new(&good, aligned, 0).unwrap_err();
    assert!(matches!(&err, GuestMemoryError::Config(_)), "{err:?}");
    // A plain file descriptor is no userfaultfd.
    let err = new(&fd, vmm.ptr, 0).unwrap_err();
    assert!(
        matches!(&err, GuestMemoryError::Config(m) if m.contains("not a usable userfaultfd")),
        "{err:?}"
    );
    new(&good, vmm.ptr, 0).unwrap();
}

#[test]
fn long_dirty_runs_go_out_in_place_and_scattered_pages_in_one_batch() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let mgr = Arc::new(manager(&coord.url()));
    for shared in [false, true] {
        let fd = memfd(NODE_BYTES);
        let backing = if shared {
            GuestBacking::SharedFile(SharedFile::new(Arc::clone(&fd), 0))
        } else {
            GuestBacking::Anonymous
        };
        let ram = GuestMemory::new(
            Arc::clone(&mgr),
            GuestMemoryConfig {
                backing,
                prefetch_max_pages: 0,
                // In place vs bounce is the write-fault method's split
                // (guest_memory_scan.rs covers the other).
                dirty_tracking: DirtyTracking::WriteFaults,
                ..shared_config(&fd, 0, 0, NODE_BYTES)
            },
        )
        .unwrap();
        let seed = if shared { 21 } else { 20 };
        let write = |pages: &[usize], seed: u8| {
            for &p in pages {
                let gpa = (p * PAGE_SIZE) as u64;
                ram.write(gpa, &page_for(gpa, seed)).unwrap();
            }
        };
        let check_remote = |pages: &[usize], seed: u8| {
            let mut page = [0u8; PAGE_SIZE];
            for &p in pages {
                let gpa = (p * PAGE_SIZE) as u64;
                mgr.read_page(gpa, &mut page).unwrap();
                assert!(page == page_for(gpa, seed), "remote {gpa:#x} ({shared})");
            }
        };
        // One run of 64 pages, and 16 pages one apart.
        let run: Vec<usize> = (0..64).collect();
        let scattered: Vec<usize> = (100..132).step_by(2).collect();
        write(&run, seed);
        write(&scattered, seed);
        assert_eq!(ram.flush().unwrap(), 80);
        let stats = ram.stats();
        assert_eq!(
            (stats.pages_written_back, stats.pages_written_in_place),
            (80, 64),
            "shared {shared}: {stats:?}"
        );
        check_remote(&run, seed);
        check_remote(&scattered, seed);

        // Evict: a run of 30 goes out in place, a lone page by copy.
        let run: Vec<usize> = (10..40).collect();
        write(&run, seed + 2);
        write(&[200], seed + 2);
        assert_eq!(ram.evict(0, NODE).unwrap(), 81);
        let stats = ram.stats();
        assert_eq!(
            (stats.pages_written_back, stats.pages_written_in_place),
            (111, 94),
            "shared {shared}: {stats:?}"
        );
        check_remote(&run, seed + 2);
        check_remote(&[200], seed + 2);
    }
}

#[test]
fn evict_during_a_shared_fetch_does_not_wait_for_it_and_the_copy_is_fetched_again() {
    let (_db, coord) = loopback_coordinator();
    let server = ChildServer::start(&coord.url(), "a", 0);
    let gpa = 7 * PAGE_SIZE as u64;
    let mgr = Arc::new(
        TransportManager::connect(ManagerConfig {
            coordinator_url: coord.url(),
            request_timeout_ms: 20_000,
            poller_cpus: Some(vec![]),
            ..ManagerConfig::default()
        })
        .unwrap(),
    );
    assert!(wait_until(Duration::from_secs(10), || {
        mgr.refresh_map().is_ok() && mgr.map().lookup(gpa).is_some()
    }));
    mgr.write_page(gpa, &page_for(gpa, 8)).unwrap();
    let fd = memfd(NODE_BYTES);
    let ram = Arc::new(
        GuestMemory::new(
            Arc::clone(&mgr),
            GuestMemoryConfig {
                fault_timeout_ms: 30_000,
                prefetch_max_pages: 0,
                ..shared_config(&fd, 0, 0, NODE_BYTES)
            },
        )
        .unwrap(),
    );
    server.pause();
    let toucher = {
        let ram = Arc::clone(&ram);
        std::thread::spawn(move || {
            let mut page = [0u8; PAGE_SIZE];
            ram.read(gpa, &mut page).unwrap();
            page
        })
    };
    assert!(wait_until(Duration::from_secs(10), || ram
        .stats()
        .pages_fetched
        == 1));
    // The fetch waits on the stopped owner; evicting the page must not.
    let evicter = {
        let ram = Arc::clone(&ram);
        std::thread::spawn(move || ram.evict(gpa, PAGE_SIZE as u64).unwrap())
    };
    assert!(
        wait_until(Duration::from_secs(5), || evicter.is_finished()),
        "evict waited for a fetch in flight"
    );
    assert_eq!(evicter.join().unwrap(), 0, "the page was not mapped yet");
    server.resume();
    assert!(toucher.join().unwrap() == page_for(gpa, 8));
    // The copy fetched across the drop was not mapped: fetched again.
    let stats = ram.stats();
    assert_eq!(
        (stats.pages_fetched, stats.missing_faults),
        (2, 1),
        "{stats:?}"
    );
}
