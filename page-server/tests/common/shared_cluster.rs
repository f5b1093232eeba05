//! Guest memory in a shared-memory file over two local page-servers, for
//! the tests that act an older kernel out with `guest_memory::test_hooks`
//! (the caller sets its hooks first).

use std::os::fd::OwnedFd;
use std::sync::Arc;

use coordinator::RunningCoordinator;
use page_server::RunningServer;
use rdma_transport::guest_memory::{
    DirtyTracking, GuestBacking, GuestMemory, GuestMemoryConfig, SharedFile,
};
use rdma_transport::{TransportManager, PAGE_SIZE};

use super::{loopback_coordinator, manager, page_for, page_server, NODE_BYTES};

/// 4 KiB pages of the guest memory (both nodes).
pub const PAGES: usize = 2 * NODE_BYTES / PAGE_SIZE;

/// The cluster and its guest memory. Fields drop in order: the guest
/// memory first, the cluster last.
pub struct SharedSetup {
    pub ram: GuestMemory,
    pub mgr: Arc<TransportManager>,
    pub fd: Arc<OwnedFd>,
    /// `a` holds the first `NODE_BYTES`, `b` the next (a test may stop one).
    pub servers: [Option<RunningServer>; 2],
    pub coord: RunningCoordinator,
    pub db: tempfile::TempDir,
}

/// Two page-servers holding `page_for(gpa, 3)` everywhere, and guest memory
/// over both in the first 2 MiB of `fd` (a memfd, or one huge page of a
/// hugetlbfs file), with read-ahead of up to `prefetch_max_pages` and
/// `tracking`.
pub fn shared_setup(
    fd: Arc<OwnedFd>,
    prefetch_max_pages: usize,
    tracking: DirtyTracking,
) -> SharedSetup {
    let node = NODE_BYTES as u64;
    let (db, coord) = loopback_coordinator();
    let servers = [
        Some(page_server(&coord.url(), "a", 0)),
        Some(page_server(&coord.url(), "b", node)),
    ];
    let mgr = Arc::new(manager(&coord.url()));
    let gpas: Vec<u64> = (0..PAGES).map(|p| (p * PAGE_SIZE) as u64).collect();
    let pages: Vec<_> = gpas.iter().map(|&g| page_for(g, 3)).collect();
    mgr.write_pages(&gpas, &pages).unwrap();
    let ram = GuestMemory::new(
        Arc::clone(&mgr),
        GuestMemoryConfig {
            handler_cpus: Some(vec![]),
            fault_timeout_ms: 2000,
            prefetch_max_pages,
            dirty_tracking: tracking,
            backing: GuestBacking::SharedFile(SharedFile::new(Arc::clone(&fd), 0)),
            ..GuestMemoryConfig::new(0, 2 * NODE_BYTES)
        },
    )
    .unwrap();
    SharedSetup {
        ram,
        mgr,
        fd,
        servers,
        coord,
        db,
    }
}

/// The page at `gpa` as its owner has it.
pub fn remote(mgr: &TransportManager, gpa: u64) -> Vec<u8> {
    let mut page = [0u8; PAGE_SIZE];
    mgr.read_page(gpa, &mut page).unwrap();
    page.to_vec()
}
