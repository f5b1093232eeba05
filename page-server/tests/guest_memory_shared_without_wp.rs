//! Guest memory in a shared file on a kernel whose userfaultfd cannot
//! write-protect shared memory at all (Linux 5.13-5.18: minor faults and
//! `UFFDIO_CONTINUE`, no `UFFD_FEATURE_WP_HUGETLBFS_SHMEM`; e.g. RHEL 9's
//! 5.14, Ubuntu 22.04's 5.15), acted out on this host's kernel with
//! `guest_memory::test_hooks`: every test of this binary hides that
//! feature. No write can be tracked there, so every mapped page counts as
//! dirty, and flush and evict unmap pages from the guest before they write
//! them back. Over a real local cluster, every page checked.

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use common::shared_cluster::{remote, shared_setup, SharedSetup, PAGES};
use common::*;
use rdma_transport::guest_memory::{
    test_hooks, DirtyTracking, GuestBacking, GuestMemory, GuestMemoryConfig, GuestMemoryError,
    SharedFile,
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
    test_hooks::hide_shared_write_protect(true);
    let setup = shared_setup(fd, prefetch_max_pages, DirtyTracking::Auto);
    assert!(
        !setup.ram.tracks_writes(),
        "the hook hides shmem write protection"
    );
    setup
}

/// Every page mapped counts as dirty, read or written: a flush sends all of
/// them (their owners get what the guest has) and unmaps them, and the
/// guest then reads every page again, fetched from its owner, written ones
/// included. No write-protect fault ever comes.
#[test]
fn every_mapped_page_is_dirty_and_a_flush_sends_and_unmaps_it() {
    let _one = ONE_AT_A_TIME.lock();
    for prefetch in [0, 16] {
        let SharedSetup { ram, mgr, .. } = &setup(prefetch);
        let mut page = [0u8; PAGE_SIZE];
        for p in 0..PAGES {
            let gpa = (p * PAGE_SIZE) as u64;
            ram.read(gpa, &mut page).unwrap();
            assert!(page == page_for(gpa, 3), "prefetch {prefetch}: {gpa:#x}");
        }
        let written: Vec<u64> = (0..PAGES)
            .step_by(37)
            .map(|p| (p * PAGE_SIZE) as u64)
            .collect();
        for &gpa in &written {
            ram.write(gpa, &page_for(gpa, 5)).unwrap();
        }
        assert_eq!(
            ram.flush().unwrap(),
            PAGES as u64,
            "prefetch {prefetch}: every mapped page is sent"
        );
        assert_eq!(ram.flush().unwrap(), 0, "all unmapped: nothing left");
        for &gpa in &written {
            assert!(remote(mgr, gpa) == page_for(gpa, 5), "remote {gpa:#x}");
        }
        let faults_before = ram.stats().missing_faults + ram.stats().prefetched_pages;
        for p in 0..PAGES {
            let gpa = (p * PAGE_SIZE) as u64;
            let seed = if written.contains(&gpa) { 5 } else { 3 };
            ram.read(gpa, &mut page).unwrap();
            assert!(page == page_for(gpa, seed), "again {gpa:#x}");
        }
        let stats = ram.stats();
        assert_eq!(
            stats.missing_faults + stats.prefetched_pages - faults_before,
            PAGES as u64,
            "every page came back from its owner: {stats:?}"
        );
        assert_eq!(stats.wp_faults, 0, "{stats:?}");
    }
}

/// A writer stores increasing values into pages through the guest mapping
/// (as a vCPU does), each time first checking that the page still holds
/// the value it wrote there last, while flushes and evicts run over and
/// over: no write is ever lost (a write landing after its page was sent
/// and before it was dropped would come back older), and at the end (the
/// writer stopped, one last flush) every page's owner has the last value
/// written to it, and so does the guest.
#[test]
fn writes_racing_flushes_and_evicts_are_never_lost() {
    let _one = ONE_AT_A_TIME.lock();
    const HOT: usize = 64;
    const WRITES: u64 = 20_000;
    let SharedSetup { ram, mgr, .. } = &setup(0);
    // Pages spread over both nodes.
    let gpas: Vec<u64> = (0..HOT)
        .map(|i| (i * (PAGES / HOT) * PAGE_SIZE) as u64)
        .collect();
    let first_word = |gpa: u64| u64::from_ne_bytes(page_for(gpa, 3)[..8].try_into().unwrap());
    let last: Vec<AtomicU64> = gpas
        .iter()
        .map(|&g| AtomicU64::new(first_word(g)))
        .collect();
    let lost = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    let passes = std::thread::scope(|s| {
        s.spawn(|| {
            for v in 1..=WRITES {
                let i = (v as usize * 7) % HOT;
                let at = ram.host_addr(gpas[i]).unwrap().cast::<u64>();
                // SAFETY: the first 8 bytes of a guest page, 8-aligned;
                // only this thread writes guest memory meanwhile.
                let seen = unsafe { at.read_volatile() };
                if seen != last[i].load(Ordering::Relaxed) {
                    lost.fetch_add(1, Ordering::Relaxed);
                }
                // SAFETY: as above.
                unsafe { at.write_volatile(v) };
                last[i].store(v, Ordering::Relaxed);
            }
            done.store(true, Ordering::SeqCst);
        });
        let mut passes = 0u32;
        while !done.load(Ordering::SeqCst) && passes < 100_000 {
            if passes % 2 == 0 {
                ram.flush().unwrap();
            } else {
                ram.evict(0, 2 * NODE).unwrap();
            }
            passes += 1;
        }
        passes
    });
    assert!(passes > 2, "flushes and evicts ran meanwhile ({passes})");
    assert_eq!(
        lost.load(Ordering::Relaxed),
        0,
        "writes lost ({passes} passes)"
    );
    ram.flush().unwrap();
    let mut page = [0u8; PAGE_SIZE];
    for (i, &gpa) in gpas.iter().enumerate() {
        let mut expected = page_for(gpa, 3);
        let v = last[i].load(Ordering::Relaxed);
        expected[..8].copy_from_slice(&v.to_ne_bytes());
        assert!(remote(mgr, gpa) == expected, "owner of {gpa:#x} (last {v})");
        ram.read(gpa, &mut page).unwrap();
        assert!(page == expected, "guest {gpa:#x} (last {v})");
    }
}

/// A flush whose write-back fails (the owner is gone) loses nothing: the
/// page stays in the file and dirty, the guest's next touch maps it again
/// from there, with its write (not a stale copy from anywhere), and the
/// next flush tries it again.
#[test]
fn a_failed_write_back_keeps_the_write_and_maps_the_page_again() {
    let _one = ONE_AT_A_TIME.lock();
    let SharedSetup {
        ram, mgr, servers, ..
    } = &mut setup(0);
    let gpa = NODE + 3 * PAGE_SIZE as u64;
    let mut written = page_for(gpa, 3);
    written[100..200].fill(0x5a);
    ram.write(gpa, &written).unwrap();
    drop(servers[1].take());
    let err = ram
        .flush()
        .expect_err("the owner of the second half is gone");
    assert!(
        matches!(err, GuestMemoryError::WriteBack { pages, .. } if pages >= 1),
        "{err:?}"
    );
    let mut page = [0u8; PAGE_SIZE];
    ram.read(gpa, &mut page).unwrap();
    assert!(page == written, "the guest still has its write");
    let other = 2 * PAGE_SIZE as u64;
    ram.read(other, &mut page).unwrap();
    assert!(
        page == page_for(other, 3),
        "the first node's pages are served"
    );
    // Still dirty: the next flush tries it again (and fails again), and
    // the other node's pages were written back and dropped meanwhile.
    let again = ram.flush().expect_err("still dirty, still no owner");
    assert!(
        matches!(again, GuestMemoryError::WriteBack { .. }),
        "{again:?}"
    );
    ram.read(gpa, &mut page).unwrap();
    assert!(page == written, "the guest still has its write");
    assert!(remote(mgr, other) == page_for(other, 3));
}

/// Coherent guest memory in a shared file is refused on such a kernel,
/// with the reason.
#[test]
fn coherent_memory_in_a_shared_file_is_refused() {
    use rdma_transport::coherent::CoherenceConfig;
    use rdma_transport::guest_memory::CoherentMemory;
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
}

/// The hypervisor's own userfaultfd, handed over, on such a kernel: its
/// handshake could not enable shmem write protection, and the region takes
/// it as it is (where the kernel offers the feature, the same descriptor is
/// refused: the hypervisor should have enabled it). The hypervisor's own
/// accesses are served, and its writes reach their owners.
#[test]
fn a_handed_over_userfaultfd_without_write_protection() {
    use common::vmm_view::VmmView;
    use rdma_transport::guest_memory::HandedOverUffd;
    use rdma_transport::uffd::{feature, FaultMode, RegisterMode, Userfaultfd};
    let _one = ONE_AT_A_TIME.lock();
    let SharedSetup { mgr, .. } = &setup(0);
    let fd = memfd(NODE_BYTES);
    let vmm = VmmView::new(&fd, NODE_BYTES);
    let uffd = Userfaultfd::open(FaultMode::KernelAndUser).unwrap();
    uffd.enable(
        feature::PAGEFAULT_FLAG_WP
            | feature::THREAD_ID
            | feature::MISSING_SHMEM
            | feature::MINOR_SHMEM,
    )
    .unwrap();
    uffd.register(vmm.ptr, NODE_BYTES, RegisterMode::MISSING)
        .unwrap();
    let uffd = Arc::new(
        std::os::fd::AsFd::as_fd(&uffd)
            .try_clone_to_owned()
            .unwrap(),
    );
    let new = || {
        // SAFETY: `vmm` maps the memfd at offset 0 for NODE_BYTES and
        // outlives the region; nothing else reads `uffd`.
        let handed = unsafe { HandedOverUffd::new(Arc::clone(&uffd), vmm.ptr) };
        GuestMemory::new(
            Arc::clone(mgr),
            GuestMemoryConfig {
                handler_cpus: Some(vec![]),
                fault_timeout_ms: 2000,
                prefetch_max_pages: 0,
                backing: GuestBacking::SharedFile(
                    SharedFile::new(Arc::clone(&fd), 0).with_uffd(handed),
                ),
                ..GuestMemoryConfig::new(0, NODE_BYTES)
            },
        )
    };
    test_hooks::hide_shared_write_protect(false);
    let refused = new();
    test_hooks::hide_shared_write_protect(true);
    assert!(
        matches!(&refused, Err(GuestMemoryError::Unsupported(m)) if m.contains("WP_HUGETLBFS_SHMEM")),
        "{:?}",
        refused.as_ref().err()
    );
    drop(refused);
    let ram = new().unwrap();
    assert!(!ram.tracks_writes());
    for p in 0..8 {
        let gpa = (p * PAGE_SIZE) as u64;
        assert!(vmm.page(p) == page_for(gpa, 3), "the VMM reads page {p}");
    }
    for p in 0..4 {
        vmm.fill(p, 0x77);
    }
    assert_eq!(ram.flush().unwrap(), 8, "every page it touched");
    for p in 0..8 {
        let gpa = (p * PAGE_SIZE) as u64;
        let expected = if p < 4 {
            vec![0x77; PAGE_SIZE]
        } else {
            page_for(gpa, 3).to_vec()
        };
        assert!(remote(mgr, gpa) == expected, "owner of page {p}");
        assert!(vmm.page(p) == expected, "the VMM reads page {p} again");
    }
}

/// On hugetlbfs (Linux 5.13-5.18 have its minor faults, not its write
/// protection) the huge page is what is mapped, dirty, sent whole and
/// unmapped: read in, a flush sends its 512 pages; written, the write
/// reaches its owner and comes back.
#[test]
#[ignore = "needs reserved huge pages; deploy/test-all.sh reserves them and runs it"]
fn a_huge_page_is_sent_whole_and_unmapped() {
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
    assert_eq!(
        ram.flush().unwrap(),
        (HUGE / PAGE_SIZE) as u64,
        "read in: sent whole"
    );
    assert_eq!(ram.flush().unwrap(), 0, "unmapped by the flush");
    let target_gpa = 300 * PAGE_SIZE as u64;
    let mut written = page_for(target_gpa, 3);
    written[..64].fill(0xef);
    ram.write(target_gpa, &written).unwrap();
    assert_eq!(
        ram.flush().unwrap(),
        (HUGE / PAGE_SIZE) as u64,
        "written: sent whole"
    );
    assert!(remote(mgr, target_gpa) == written);
    ram.read(target_gpa, &mut page).unwrap();
    assert!(page == written, "fetched again with the write");
    ram.read(PAGE_SIZE as u64, &mut page).unwrap();
    assert!(page == page_for(PAGE_SIZE as u64, 3));
}
