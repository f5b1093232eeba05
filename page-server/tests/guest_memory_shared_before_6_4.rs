//! Guest memory in a shared file on a kernel whose `UFFDIO_CONTINUE` cannot
//! map pages write-protected (Linux 5.19-6.3, e.g. Debian 12's 6.1), acted
//! out on this host's kernel with `guest_memory::test_hooks`: every test of
//! this binary hides `UFFDIO_CONTINUE_MODE_WP`. A clean page is then mapped
//! writable, write-protected, then woken, and a write that lands in
//! between must still count as dirty. Over a real local cluster, every
//! page checked.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::shared_cluster::{remote, shared_setup, SharedSetup, PAGES};
use common::*;
use rdma_transport::guest_memory::{
    test_hooks, DirtyTracking, GuestBacking, GuestMemoryConfig, SharedFile,
};
use rdma_transport::PAGE_SIZE;

const NODE: u64 = NODE_BYTES as u64;

/// The hooks are process-wide: the tests of this binary run one at a time.
static ONE_AT_A_TIME: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

/// [`SharedSetup`] on a memfd, with read-ahead of up to `prefetch_max_pages`.
fn setup(prefetch_max_pages: usize) -> SharedSetup {
    setup_on(memfd(2 * NODE_BYTES), prefetch_max_pages)
}

/// [`SharedSetup`] on `fd` (2 MiB of it: one huge page of a hugetlbfs file).
fn setup_on(fd: Arc<std::os::fd::OwnedFd>, prefetch_max_pages: usize) -> SharedSetup {
    test_hooks::hide_continue_write_protect(true);
    let setup = shared_setup(fd, prefetch_max_pages, DirtyTracking::WriteFaults);
    assert_eq!(setup.ram.dirty_tracking(), DirtyTracking::WriteFaults);
    setup
}

/// Pages read in (one by one, and in read-ahead runs) are clean and
/// protected: a flush sends nothing until the guest writes, then exactly the
/// pages written, whose contents reach their owners.
#[test]
fn pages_mapped_then_protected_are_clean_and_their_writes_are_tracked() {
    let _one = ONE_AT_A_TIME.lock();
    for prefetch in [0, 16] {
        let SharedSetup { ram, mgr, .. } = &setup(prefetch);
        let mut page = [0u8; PAGE_SIZE];
        for p in 0..PAGES {
            let gpa = (p * PAGE_SIZE) as u64;
            ram.read(gpa, &mut page).unwrap();
            assert!(
                page == page_for(gpa, 3),
                "prefetch {prefetch}: page {gpa:#x}"
            );
        }
        let stats = ram.stats();
        assert_eq!(
            stats.missing_faults + stats.prefetched_pages,
            PAGES as u64,
            "prefetch {prefetch}: {stats:?}"
        );
        if prefetch > 0 {
            assert!(stats.prefetched_pages > 0, "read-ahead ran: {stats:?}");
        }
        assert_eq!(
            ram.flush().unwrap(),
            0,
            "prefetch {prefetch}: read pages are clean"
        );
        let written: Vec<u64> = (0..PAGES)
            .step_by(37)
            .map(|p| (p * PAGE_SIZE) as u64)
            .collect();
        for &gpa in &written {
            ram.write(gpa, &page_for(gpa, 5)).unwrap();
        }
        assert!(
            ram.stats().wp_faults >= written.len() as u64,
            "each first write faulted: {:?}",
            ram.stats()
        );
        assert_eq!(
            ram.flush().unwrap(),
            written.len() as u64,
            "prefetch {prefetch}"
        );
        for &gpa in &written {
            assert!(remote(mgr, gpa) == page_for(gpa, 5), "remote {gpa:#x}");
        }
        assert!(
            remote(mgr, PAGE_SIZE as u64) == page_for(PAGE_SIZE as u64, 3),
            "an unwritten page is as it was"
        );
    }
}

/// Another vCPU writes a page in the moment between its mapping and its
/// write protection (forged: the hook writes it on the handler's thread
/// then). The write makes the page dirty: flush sends it, and after an
/// evict the guest reads it back. Pages nothing wrote stay clean. Once for
/// a page mapped by its own fault, once for one of a read-ahead run.
#[test]
fn a_write_between_mapping_and_protection_is_not_lost() {
    let _one = ONE_AT_A_TIME.lock();
    for (prefetch, lead) in [(0, 0), (16, 4)] {
        let SharedSetup { ram, mgr, .. } = &setup(prefetch);
        let target_gpa = NODE + 5 * PAGE_SIZE as u64;
        let target = ram.host_addr(target_gpa).unwrap() as usize;
        // Calls that mapped the target, and the bytes the last one mapped.
        let hits = Arc::new((AtomicUsize::new(0), AtomicUsize::new(0)));
        let seen = Arc::clone(&hits);
        test_hooks::set_before_write_protect(Some(Box::new(move |start, len| {
            let start = start as usize;
            if (start..start + len).contains(&target) {
                // SAFETY: the page is mapped writable in the guest range
                // right now (that is the moment this hook runs in), and
                // nothing else touches its first bytes.
                unsafe { std::ptr::write_bytes(target as *mut u8, 0xab, 64) };
                seen.0.fetch_add(1, Ordering::SeqCst);
                seen.1.store(len, Ordering::SeqCst);
            }
        })));
        // The pages before it in order, then it: with read-ahead, it comes
        // in a run.
        let mut page = [0u8; PAGE_SIZE];
        for p in (0..=lead).rev() {
            ram.read(target_gpa - p * PAGE_SIZE as u64, &mut page)
                .unwrap();
        }
        test_hooks::set_before_write_protect(None);
        assert_eq!(hits.0.load(Ordering::SeqCst), 1, "mapped once");
        let len = hits.1.load(Ordering::SeqCst);
        if prefetch == 0 {
            assert_eq!(len, PAGE_SIZE, "mapped by its own fault");
        } else {
            assert!(len > PAGE_SIZE, "mapped in a read-ahead run: {len} bytes");
        }
        let mut expected = page_for(target_gpa, 3);
        expected[..64].fill(0xab);
        assert!(
            page == expected,
            "prefetch {prefetch}: the guest sees the write"
        );
        // Its neighbours, read in with it or after it, are clean.
        for p in 1..8 {
            let gpa = target_gpa + p * PAGE_SIZE as u64;
            ram.read(gpa, &mut page).unwrap();
            assert!(page == page_for(gpa, 3), "page {gpa:#x}");
        }
        assert_eq!(
            ram.flush().unwrap(),
            1,
            "prefetch {prefetch}: only the written page"
        );
        assert!(
            remote(mgr, target_gpa) == expected,
            "prefetch {prefetch}: sent"
        );
        assert!(ram.evict(0, 2 * NODE).unwrap() > 0);
        ram.read(target_gpa, &mut page).unwrap();
        assert!(
            page == expected,
            "prefetch {prefetch}: fetched again after evict"
        );
    }
}

/// A flush that starts while a page is between its mapping and its write
/// protection, after a write to it, waits for the page and sends that
/// write: the page counts as dirty from before it is writable.
#[test]
fn a_flush_in_that_moment_waits_for_the_page_and_sends_its_write() {
    let _one = ONE_AT_A_TIME.lock();
    use std::sync::mpsc;
    let SharedSetup { ram, mgr, .. } = &setup(0);
    let target_gpa = 9 * PAGE_SIZE as u64;
    let target = ram.host_addr(target_gpa).unwrap() as usize;
    let (opened_tx, opened) = mpsc::channel::<()>();
    let (go_on, go_on_rx) = mpsc::channel::<()>();
    let go_on_rx = parking_lot::Mutex::new(go_on_rx);
    test_hooks::set_before_write_protect(Some(Box::new(move |start, len| {
        let start = start as usize;
        if (start..start + len).contains(&target) {
            // SAFETY: as in the test above.
            unsafe { std::ptr::write_bytes(target as *mut u8, 0xcd, 64) };
            let _ = opened_tx.send(());
            // Held here until the test has started its flush (bounded, in
            // case the test failed first).
            let _ = go_on_rx
                .lock()
                .recv_timeout(std::time::Duration::from_secs(10));
        }
    })));
    let mut expected = page_for(target_gpa, 3);
    expected[..64].fill(0xcd);
    let (flushed, finished_early) = std::thread::scope(|s| {
        let reader = s.spawn(|| {
            let mut page = [0u8; PAGE_SIZE];
            ram.read(target_gpa, &mut page).unwrap();
            page
        });
        opened
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the page was mapped");
        let (done_tx, done) = mpsc::channel();
        let flusher = s.spawn(move || {
            let n = ram.flush().unwrap();
            let _ = done_tx.send(());
            n
        });
        // A flush that skipped the page would be done by now; one that
        // waits for it cannot be.
        let finished_early = done
            .recv_timeout(std::time::Duration::from_millis(50))
            .is_ok();
        go_on.send(()).unwrap();
        assert!(
            reader.join().unwrap() == expected,
            "the guest sees the write"
        );
        (flusher.join().unwrap(), finished_early)
    });
    test_hooks::set_before_write_protect(None);
    assert!(!finished_early, "the flush went past the page being mapped");
    assert_eq!(
        flushed, 1,
        "the flush sent the page written before it began"
    );
    assert!(remote(mgr, target_gpa) == expected);
    assert_eq!(ram.flush().unwrap(), 0);
}

/// Coherent guest memory in a shared file is refused on such a kernel (its
/// shared copies must never be writable, even for a moment); in anonymous
/// memory it is made as anywhere.
#[test]
fn coherent_memory_in_a_shared_file_needs_continue_with_write_protection() {
    use rdma_transport::coherent::CoherenceConfig;
    use rdma_transport::guest_memory::{CoherentMemory, GuestMemoryError};
    let _one = ONE_AT_A_TIME.lock();
    let SharedSetup { mgr, .. } = &setup(0);
    let shared = GuestMemoryConfig {
        backing: GuestBacking::SharedFile(SharedFile::new(memfd(NODE_BYTES), 0)),
        ..GuestMemoryConfig::new(0, NODE_BYTES)
    };
    let refused = CoherentMemory::new(mgr, shared, CoherenceConfig::default());
    assert!(
        matches!(&refused, Err(GuestMemoryError::Unsupported(m)) if m.contains("UFFDIO_CONTINUE_MODE_WP")),
        "{:?}",
        refused.err()
    );
    CoherentMemory::new(
        mgr,
        GuestMemoryConfig::new(0, NODE_BYTES),
        CoherenceConfig::default(),
    )
    .unwrap();
}

/// On hugetlbfs the huge page is what is mapped, protected and checked
/// (its 2 MiB summed twice): read in, it is clean; written in that moment,
/// all of it is sent.
#[test]
#[ignore = "needs reserved huge pages; deploy/test-all.sh reserves them and runs it"]
fn a_huge_page_written_in_that_moment_is_sent_whole() {
    let _one = ONE_AT_A_TIME.lock();
    const HUGE: usize = 2 << 20;
    assert!(
        free_huge_pages() >= 2,
        "needs free 2 MiB huge pages (echo 16 > /proc/sys/vm/nr_hugepages)"
    );
    let SharedSetup { ram, mgr, .. } = &setup_on(huge_memfd(HUGE), 0);
    let mut page = [0u8; PAGE_SIZE];
    ram.read(0, &mut page).unwrap();
    assert!(page == page_for(0, 3));
    assert_eq!(ram.flush().unwrap(), 0, "read in: clean");
    assert_eq!(
        ram.evict(0, HUGE as u64).unwrap(),
        (HUGE / PAGE_SIZE) as u64
    );

    let target_gpa = 300 * PAGE_SIZE as u64;
    let target = ram.host_addr(target_gpa).unwrap() as usize;
    let hits = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&hits);
    test_hooks::set_before_write_protect(Some(Box::new(move |start, len| {
        let start = start as usize;
        if (start..start + len).contains(&target) {
            // SAFETY: as in the tests above.
            unsafe { std::ptr::write_bytes(target as *mut u8, 0xef, 64) };
            seen.store(len, Ordering::SeqCst);
        }
    })));
    ram.read(0, &mut page).unwrap();
    test_hooks::set_before_write_protect(None);
    assert_eq!(
        hits.load(Ordering::SeqCst),
        HUGE,
        "the whole huge page was mapped"
    );
    let mut expected = page_for(target_gpa, 3);
    expected[..64].fill(0xef);
    assert_eq!(
        ram.flush().unwrap(),
        (HUGE / PAGE_SIZE) as u64,
        "sent whole"
    );
    assert!(remote(mgr, target_gpa) == expected);
    assert_eq!(ram.flush().unwrap(), 0);
    ram.read(target_gpa, &mut page).unwrap();
    assert!(page == expected);
}
