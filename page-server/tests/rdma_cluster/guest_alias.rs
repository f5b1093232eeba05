//! Guest memory in a memfd over RDMA: the region's second mapping of the
//! file (the alias) is registered with the device once, so a fault's RDMA
//! READ lands straight in guest RAM (then `UFFDIO_CONTINUE` maps it) and
//! write-backs go out of it, with no pool frame. Evict keeps the file's
//! pages: the memory region holds the physical pages it pinned, and a hole
//! would leave later READs landing where the guest never looks. The test
//! forges exactly that case: pages are evicted, another writer changes them
//! at their owner, and the guest must see the new contents.
//!
//! Needs Linux >= 6.4 in the VM (`UFFDIO_CONTINUE_MODE_WP`): the SoftRoCE
//! VM boots bookworm-backports' 6.12.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;

use rdma_transport::guest_memory::{
    DirtyTracking, GuestBacking, GuestMemory, GuestMemoryConfig, SharedFile,
};
use rdma_transport::{Page, ZeroCopyStats};

use super::*;

/// Pages of the region: all of node a.
const PAGES: usize = PAGES_PER_NODE as usize;
/// A dirty run this long is written back in place (from the alias, by
/// RDMA WRITE); shorter ones go through the bounce batch.
const RUN: usize = 32;

fn gpa(page: usize) -> u64 {
    (page * PAGE_SIZE) as u64
}

fn delta(after: ZeroCopyStats, before: ZeroCopyStats) -> (u64, u64) {
    (
        after.direct_pages - before.direct_pages,
        after.framed_pages - before.framed_pages,
    )
}

/// Bytes of the file backed by memory (`st_blocks` counts 512-byte units).
fn file_resident_bytes(fd: &OwnedFd) -> u64 {
    // SAFETY: `st` is plain data the kernel fills in.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is live and writable.
    assert_eq!(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) }, 0);
    st.st_blocks as u64 * 512
}

fn region(
    mgr: &Arc<TransportManager>,
    fd: &Arc<OwnedFd>,
    tracking: DirtyTracking,
    register: bool,
) -> GuestMemory {
    GuestMemory::new(
        Arc::clone(mgr),
        GuestMemoryConfig {
            handler_cpus: Some(vec![]),
            fault_timeout_ms: 20_000,
            // One READ per fault: every page is counted by the test.
            prefetch_max_pages: 0,
            dirty_tracking: tracking,
            rdma_register_alias: register,
            backing: GuestBacking::SharedFile(SharedFile::new(Arc::clone(fd), 0)),
            ..GuestMemoryConfig::new(0, PAGES * PAGE_SIZE)
        },
    )
    .expect("guest memory on a memfd")
}

/// Every page of the region read through the guest mapping equals
/// `page_for(gpa, seed)`, except the pages of `other` (seed `other_seed`).
fn check_all(test: &str, ram: &GuestMemory, seed: u8, other: &[usize], other_seed: u8) {
    let mut page = [0u8; PAGE_SIZE];
    for p in 0..PAGES {
        ram.read(gpa(p), &mut page).unwrap();
        let want = if other.contains(&p) { other_seed } else { seed };
        assert!(
            page == page_for(gpa(p), want),
            "{test}: guest page {p} is not the owner's (seed {want})"
        );
    }
}

/// A coordinator and page-server "a" (RDMA) owning every page of the
/// region, each filled with `page_for(gpa, seed)`; an RDMA manager and the
/// region's GPAs. Keep the first value alive for the test.
fn owner_node(
    test: &str,
    seed: u8,
) -> (
    (
        tempfile::TempDir,
        coordinator::RunningCoordinator,
        RunningServer,
    ),
    Arc<TransportManager>,
    Vec<u64>,
) {
    require_device(test);
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator(&db);
    let a = server(&coord.url(), "a", 0, true);
    let mgr = Arc::new(rdma_manager(&coord.url(), PollMode::Busy));
    assert_all_rdma(&mgr);
    let gpas: Vec<u64> = (0..PAGES).map(gpa).collect();
    let owner: Vec<Page> = (0..PAGES).map(|p| page_for(gpa(p), seed)).collect();
    mgr.write_pages(&gpas, &owner).unwrap();
    ((db, coord, a), mgr, gpas)
}

fn faults_land_in_guest_ram(test: &str, tracking: DirtyTracking) {
    let (_cluster, mgr, gpas) = owner_node(test, 11);

    let fd = memfd(PAGES * PAGE_SIZE);
    let ram = region(&mgr, &fd, tracking, true);
    assert!(ram.rdma_zero_copy(), "{test}: alias registered");
    assert_eq!(
        file_resident_bytes(&fd),
        (PAGES * PAGE_SIZE) as u64,
        "{test}: registration pins (allocates) the whole file"
    );

    // Faults: one RDMA READ each, straight into the alias.
    let s0 = mgr.zero_copy_stats();
    check_all(test, &ram, 11, &[], 0);
    let faults = ram.stats().missing_faults;
    assert_eq!(faults, PAGES as u64, "{test}: one fault per page");
    assert_eq!(
        delta(mgr.zero_copy_stats(), s0),
        (PAGES as u64, 0),
        "{test}: every fault read straight into guest RAM"
    );

    // Flush: with write-fault tracking a dirty run is written back in
    // place, by RDMA WRITE out of guest RAM; a PAGEMAP_SCAN flush copies
    // what its walk lists into its bounce batch (the guest runs on).
    for p in 0..RUN {
        ram.write(gpa(p), &page_for(gpa(p), 12)).unwrap();
    }
    let s1 = mgr.zero_copy_stats();
    assert_eq!(ram.flush().unwrap(), RUN as u64, "{test}: flush");
    let want = match tracking {
        DirtyTracking::PagemapScan => (0, RUN as u64),
        _ => (RUN as u64, 0),
    };
    assert_eq!(
        delta(mgr.zero_copy_stats(), s1),
        want,
        "{test}: flush's write-back"
    );
    let mut back = vec![[0u8; PAGE_SIZE]; RUN];
    mgr.read_pages(&gpas[..RUN], &mut back).unwrap();
    for (p, got) in back.iter().enumerate() {
        assert!(
            *got == page_for(gpa(p), 12),
            "{test}: owner's page {p} after flush"
        );
    }

    // Evict everything (a dirty run: written back in place, out of guest
    // RAM), then another writer changes every page at the owner. The file
    // keeps its pinned pages; the next faults READ the new contents into
    // them.
    let dirty = PAGES - RUN..PAGES;
    for p in dirty.clone() {
        ram.write(gpa(p), &page_for(gpa(p), 13)).unwrap();
    }
    let s2 = mgr.zero_copy_stats();
    assert_eq!(
        ram.evict(0, (PAGES * PAGE_SIZE) as u64).unwrap(),
        PAGES as u64
    );
    assert_eq!(
        delta(mgr.zero_copy_stats(), s2),
        (RUN as u64, 0),
        "{test}: evict's write-back went out of guest RAM"
    );
    assert_eq!(
        file_resident_bytes(&fd),
        (PAGES * PAGE_SIZE) as u64,
        "{test}: evict keeps the registered file's pages"
    );
    let mut back = vec![[0u8; PAGE_SIZE]; RUN];
    mgr.read_pages(&gpas[dirty.clone()], &mut back).unwrap();
    for (p, got) in dirty.zip(&back) {
        assert!(
            *got == page_for(gpa(p), 13),
            "{test}: evict wrote dirty page {p} back"
        );
    }
    let forged: Vec<Page> = (0..PAGES).map(|p| page_for(gpa(p), 14)).collect();
    mgr.write_pages(&gpas, &forged).unwrap();
    let s3 = mgr.zero_copy_stats();
    check_all(test, &ram, 14, &[], 0);
    assert_eq!(
        delta(mgr.zero_copy_stats(), s3),
        (PAGES as u64, 0),
        "{test}: refaults read straight into guest RAM"
    );
    assert_eq!(ram.flush().unwrap(), 0, "{test}: clean after refaults");
    say(&format!(
        "{test}: {PAGES} faults and {RUN} write-backs by RDMA straight into/out of a memfd, \
         {} wp faults",
        ram.stats().wp_faults
    ));
}

#[test]
#[ignore = "needs an RDMA device and Linux >= 6.4: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_memfd_guest_memory_faults_land_in_guest_ram_write_faults() {
    faults_land_in_guest_ram(
        "rdma_memfd_guest_memory_faults_land_in_guest_ram_write_faults",
        DirtyTracking::WriteFaults,
    );
}

#[test]
#[ignore = "needs an RDMA device and Linux >= 6.7: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_memfd_guest_memory_faults_land_in_guest_ram_pagemap_scan() {
    faults_land_in_guest_ram(
        "rdma_memfd_guest_memory_faults_land_in_guest_ram_pagemap_scan",
        DirtyTracking::PagemapScan,
    );
}

/// Without registration the same region bounces every page through the
/// pool, and evict frees the file's pages (a hole).
#[test]
#[ignore = "needs an RDMA device and Linux >= 6.4: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_memfd_guest_memory_unregistered_bounces_and_frees() {
    let test = "rdma_memfd_guest_memory_unregistered_bounces_and_frees";
    let (_cluster, mgr, _) = owner_node(test, 21);

    let fd = memfd(PAGES * PAGE_SIZE);
    let ram = region(&mgr, &fd, DirtyTracking::Auto, false);
    assert!(!ram.rdma_zero_copy(), "{test}: not registered");
    let s0 = mgr.zero_copy_stats();
    check_all(test, &ram, 21, &[], 0);
    assert_eq!(
        delta(mgr.zero_copy_stats(), s0),
        (0, PAGES as u64),
        "{test}: every fault bounced through the pool"
    );
    assert_eq!(
        ram.evict(0, (PAGES * PAGE_SIZE) as u64).unwrap(),
        PAGES as u64
    );
    assert_eq!(
        file_resident_bytes(&fd),
        0,
        "{test}: evict punched the file"
    );
    mgr.write_page(gpa(3), &page_for(gpa(3), 22)).unwrap();
    check_all(test, &ram, 21, &[3], 22);
}
