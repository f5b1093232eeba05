//! A read/write load that checks every page it reads against the last
//! acknowledged write of that page, and the checks of every page after it:
//! shared by the replication tests over TCP (`replication.rs`) and over
//! RDMA (`rdma_cluster/replication.rs`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use rdma_transport::{Page, TransportManager, PAGE_SIZE};

use super::{page_indexed, wait_until};

/// The GPA of page `page` (from GPA 0).
pub fn gpa(page: u64) -> u64 {
    page * PAGE_SIZE as u64
}

/// What a page must hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// [`content`] of its last acknowledged write, by version.
    Written(u64),
    /// A write of it failed: it may or may not have landed.
    Unknown,
}

/// The expected contents of every page, by page index from GPA 0.
pub type Expected = Vec<Slot>;

/// The contents of version `version` of page `page` (each u64 holds the
/// page index, the version and its own index; versions stay below 2^20).
pub fn content(page: u64, version: u64) -> Page {
    page_indexed(page, version)
}

/// What `page` must read as, when known.
pub fn expected_page(page: u64, slot: Slot) -> Option<Page> {
    match slot {
        Slot::Written(version) => Some(content(page, version)),
        Slot::Unknown => None,
    }
}

/// Every `COLD_EVERY`-th page (index % COLD_EVERY == COLD_EVERY - 1) is
/// only read by the load, never written: it keeps what [`fill`] wrote, so a
/// replica that recovers during the load must copy it from the source (the
/// load rewrites every other page within a grace period, which the copy
/// then rightly skips).
pub const COLD_EVERY: u64 = 4;

/// Writes version 1 of every page `0..pages` (from GPA 0) and returns what
/// they hold.
pub fn fill(mgr: &TransportManager, pages: u64) -> Expected {
    let gpas: Vec<u64> = (0..pages).map(gpa).collect();
    let contents: Vec<Page> = (0..pages).map(|p| content(p, 1)).collect();
    mgr.write_pages(&gpas, &contents).expect("fill every page");
    vec![Slot::Written(1); pages as usize]
}

/// A mixed read/write load from one thread over the pages of `expected`
/// (from GPA 0; the cold ones only read): every read is checked against
/// the last acknowledged write of its page.
pub struct Load {
    pages: u64,
    stop: AtomicBool,
    pub ops: AtomicU64,
    errors: Mutex<Vec<String>>,
    wrong: AtomicU64,
    first_wrong: Mutex<Option<String>>,
}

impl Load {
    /// Starts the load over pages whose contents are `expected` (versions
    /// below 2 only: the load writes from version 2 on).
    pub fn start(
        mgr: Arc<TransportManager>,
        expected: Expected,
    ) -> (Arc<Self>, JoinHandle<Expected>) {
        let load = Arc::new(Self {
            pages: expected.len() as u64,
            stop: AtomicBool::new(false),
            ops: AtomicU64::new(0),
            errors: Mutex::new(Vec::new()),
            wrong: AtomicU64::new(0),
            first_wrong: Mutex::new(None),
        });
        let shared = Arc::clone(&load);
        let handle = std::thread::spawn(move || shared.run(&mgr, expected));
        (load, handle)
    }

    fn run(&self, mgr: &TransportManager, mut expected: Expected) -> Expected {
        let mut rng = 0x9e37_79b9_7f4a_7c15u64;
        let mut version = 1u64;
        let mut page = [0u8; PAGE_SIZE];
        while !self.stop.load(Ordering::Relaxed) {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let p = rng % self.pages;
            if rng & (1 << 40) != 0 && p % COLD_EVERY != COLD_EVERY - 1 {
                version += 1;
                assert!(version < 1 << 20, "versions must fit content()");
                match mgr.write_page(gpa(p), &content(p, version)) {
                    Ok(()) => expected[p as usize] = Slot::Written(version),
                    Err(e) => {
                        self.errors.lock().push(format!("write {p}: {e}"));
                        // Unknown now whether it landed: never checked again.
                        expected[p as usize] = Slot::Unknown;
                    }
                }
            } else {
                match mgr.read_page(gpa(p), &mut page) {
                    Ok(()) => {
                        let want = expected_page(p, expected[p as usize]);
                        // Counted only when wrong (`&&` short-circuits).
                        if want.is_some_and(|want| page != want)
                            && self.wrong.fetch_add(1, Ordering::Relaxed) == 0
                        {
                            *self.first_wrong.lock() = Some(format!(
                                "first wrong page {p} (expected {:?}, zeroed: {})",
                                expected[p as usize],
                                page == [0u8; PAGE_SIZE]
                            ));
                        }
                    }
                    Err(e) => self.errors.lock().push(format!("read {p}: {e}")),
                }
            }
            self.ops.fetch_add(1, Ordering::Relaxed);
        }
        expected
    }

    /// Stops the load; asserts that no call returned an error and no read
    /// was wrong. Returns the expected contents of every page.
    pub fn finish(&self, handle: JoinHandle<Expected>) -> Expected {
        let (expected, errors) = self.finish_with_errors(handle);
        assert!(
            errors.is_empty(),
            "{} errors reached the caller: {:?}",
            errors.len(),
            &errors[..errors.len().min(5)]
        );
        expected
    }

    /// Stops the load; asserts that no read was wrong. Returns the expected
    /// contents of every page and the errors that reached the caller.
    pub fn finish_with_errors(&self, handle: JoinHandle<Expected>) -> (Expected, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let expected = handle.join().expect("load thread");
        assert_eq!(
            self.wrong.load(Ordering::Relaxed),
            0,
            "wrong pages were read: {:?}",
            self.first_wrong.lock()
        );
        let errors = self.errors.lock().clone();
        (expected, errors)
    }

    /// Waits until `more` operations were done since now.
    pub fn wait_ops(&self, more: u64) {
        let target = self.ops.load(Ordering::Relaxed) + more;
        assert!(
            wait_until(Duration::from_secs(60), || self.ops.load(Ordering::Relaxed)
                >= target),
            "the load stalled at {} operations",
            self.ops.load(Ordering::Relaxed)
        );
    }
}

/// Reads every page whose contents are known back through `mgr` and checks
/// it. Returns the pages that hold a write.
pub fn verify_all(mgr: &TransportManager, expected: &Expected) -> usize {
    verify_pages(mgr, expected, 0..expected.len() as u64, "")
}

/// Reads the pages `pages` whose contents are known back through `mgr` and
/// checks them (`what` names the reader in a failure). Returns the pages
/// that hold a write.
pub fn verify_pages(
    mgr: &TransportManager,
    expected: &Expected,
    pages: std::ops::Range<u64>,
    what: &str,
) -> usize {
    let mut page = [0u8; PAGE_SIZE];
    let mut written = 0;
    for p in pages {
        let slot = expected[p as usize];
        let Some(want) = expected_page(p, slot) else {
            continue;
        };
        mgr.read_page(gpa(p), &mut page)
            .unwrap_or_else(|e| panic!("{what}page {p} unreadable: {e}"));
        assert!(
            page == want,
            "{what}page {p} is not {slot:?} (zeroed: {})",
            page == [0u8; PAGE_SIZE]
        );
        written += usize::from(matches!(slot, Slot::Written(_)));
    }
    written
}
