//! A read/write load that checks every page it reads against the last
//! acknowledged write of that page, and the checks of every page after it:
//! shared by the replication tests over TCP (`replication.rs`) and over
//! RDMA (`rdma_cluster/replication.rs`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::Mutex;
use rdma_transport::{Page, Reap, TransportError, TransportManager, PAGE_SIZE};

use super::{page_indexed, replica_manager, wait_until};

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

/// The version of [`content`] that `page` holds (meaningless for other
/// contents).
pub fn version_in(page: &Page) -> u64 {
    let word = u64::from_le_bytes(page[..8].try_into().expect("8 bytes"));
    (word >> 20) & 0xf_ffff
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
    /// Pages in flight at once: 1, one blocking call at a time; more, that
    /// many distinct pages per step through a completion queue.
    depth: usize,
    stop: AtomicBool,
    pub ops: AtomicU64,
    errors: Mutex<Vec<String>>,
    /// The operation count when each version was submitted (by version).
    submitted_at: Mutex<Vec<u64>>,
    wrong: AtomicU64,
    first_wrong: Mutex<Option<String>>,
}

/// The load's random numbers (xorshift: the same sequence every run).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

impl Load {
    /// Starts the load over pages whose contents are `expected` (versions
    /// below 2 only: the load writes from version 2 on), one blocking call
    /// at a time.
    pub fn start(
        mgr: Arc<TransportManager>,
        expected: Expected,
    ) -> (Arc<Self>, JoinHandle<Expected>) {
        Self::start_in_flight(mgr, expected, 1)
    }

    /// As [`Load::start`], with `depth` distinct pages in flight at once on
    /// the asynchronous API (`depth` 1: blocking calls): each step submits
    /// a read or a write of each, then reaps them all. Pages in flight
    /// together are distinct, so each read's expected contents are known.
    pub fn start_in_flight(
        mgr: Arc<TransportManager>,
        expected: Expected,
        depth: usize,
    ) -> (Arc<Self>, JoinHandle<Expected>) {
        let load = Arc::new(Self {
            pages: expected.len() as u64,
            depth: depth.clamp(1, expected.len()),
            stop: AtomicBool::new(false),
            ops: AtomicU64::new(0),
            errors: Mutex::new(Vec::new()),
            submitted_at: Mutex::new(vec![0; 2]),
            wrong: AtomicU64::new(0),
            first_wrong: Mutex::new(None),
        });
        let shared = Arc::clone(&load);
        let handle = std::thread::spawn(move || {
            if shared.depth == 1 {
                shared.run(&mgr, expected)
            } else {
                shared.run_in_flight(&mgr, expected)
            }
        });
        (load, handle)
    }

    /// Whether the load writes page `p` when its random number is `r`.
    fn writes(p: u64, r: u64) -> bool {
        r & (1 << 40) != 0 && p % COLD_EVERY != COLD_EVERY - 1
    }

    fn run(&self, mgr: &TransportManager, mut expected: Expected) -> Expected {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut version = 1u64;
        let mut page = [0u8; PAGE_SIZE];
        while !self.stop.load(Ordering::Relaxed) {
            let r = rng.next();
            let p = r % self.pages;
            if Self::writes(p, r) {
                version += 1;
                assert!(version < 1 << 20, "versions must fit content()");
                self.submitted(version);
                let result = mgr.write_page(gpa(p), &content(p, version));
                self.written(&mut expected, p, version, result);
            } else {
                match mgr.read_page(gpa(p), &mut page) {
                    Ok(()) => self.check(p, expected[p as usize], &page),
                    Err(e) => self.failed("read", p, &e),
                }
            }
            self.ops.fetch_add(1, Ordering::Relaxed);
        }
        expected
    }

    fn run_in_flight(&self, mgr: &TransportManager, mut expected: Expected) -> Expected {
        const REAP_LIMIT: Duration = Duration::from_secs(60);
        let queue = mgr
            .completion_queue(Reap::Poll)
            .expect("a completion queue");
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let mut version = 1u64;
        // Per page in flight: its index, and the version it writes (0: a
        // read).
        let mut step: Vec<(u64, u64)> = Vec::with_capacity(self.depth);
        let mut done = Vec::with_capacity(self.depth);
        while !self.stop.load(Ordering::Relaxed) {
            step.clear();
            while step.len() < self.depth {
                let r = rng.next();
                let p = r % self.pages;
                if step.iter().any(|&(q, _)| q == p) {
                    continue;
                }
                let tag = step.len() as u64;
                if Self::writes(p, r) {
                    version += 1;
                    assert!(version < 1 << 20, "versions must fit content()");
                    self.submitted(version);
                    queue
                        .submit_write(&[gpa(p)], Box::new([content(p, version)]), tag)
                        .expect("a write submitted");
                    step.push((p, version));
                } else {
                    queue
                        .submit_read(&[gpa(p)], Box::new([[0u8; PAGE_SIZE]]), tag)
                        .expect("a read submitted");
                    step.push((p, 0));
                }
            }
            done.clear();
            while done.len() < step.len() {
                let before = done.len();
                queue.wait(&mut done, step.len() - before, REAP_LIMIT);
                assert!(
                    done.len() > before,
                    "no completion within {REAP_LIMIT:?}: {} of {} in flight",
                    step.len() - before,
                    step.len()
                );
            }
            for c in done.drain(..) {
                let (p, written) = step[c.user_data as usize];
                if written > 0 {
                    self.written(&mut expected, p, written, c.result);
                } else {
                    match (c.result, c.pages) {
                        (Ok(()), Some(pages)) => self.check(p, expected[p as usize], &pages[0]),
                        (Ok(()), None) => panic!("a read of page {p} came back without its buffer"),
                        (Err(e), _) => self.failed("read", p, &e),
                    }
                }
                self.ops.fetch_add(1, Ordering::Relaxed);
            }
        }
        expected
    }

    /// Books the outcome of a write of `version` to page `p`.
    fn written(
        &self,
        expected: &mut Expected,
        p: u64,
        version: u64,
        result: Result<(), TransportError>,
    ) {
        match result {
            Ok(()) => expected[p as usize] = Slot::Written(version),
            Err(e) => {
                self.failed("write", p, &e);
                // Unknown now whether it landed: never checked again.
                expected[p as usize] = Slot::Unknown;
            }
        }
    }

    fn submitted(&self, version: u64) {
        let at = self.ops.load(Ordering::Relaxed);
        let mut submitted_at = self.submitted_at.lock();
        debug_assert_eq!(submitted_at.len() as u64, version);
        submitted_at.push(at);
    }

    /// The operation count when `version` was submitted (0 for the fill's).
    pub fn submitted_at(&self, version: u64) -> Option<u64> {
        self.submitted_at.lock().get(version as usize).copied()
    }

    /// Books an error that reached the caller, with the operation count.
    fn failed(&self, op: &str, p: u64, e: &TransportError) {
        let at = self.ops.load(Ordering::Relaxed);
        self.errors
            .lock()
            .push(format!("{op} {p} at operation {at}: {e}"));
    }

    /// Checks what a read of page `p` returned against `slot`.
    fn check(&self, p: u64, slot: Slot, page: &Page) {
        let want = expected_page(p, slot);
        // Counted only when wrong (`&&` short-circuits).
        if want.is_some_and(|want| *page != want) && self.wrong.fetch_add(1, Ordering::Relaxed) == 0
        {
            *self.first_wrong.lock() = Some(format!(
                "first wrong page {p} (expected {slot:?}, zeroed: {})",
                *page == [0u8; PAGE_SIZE]
            ));
        }
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
    verify_pages_of(None, mgr, expected, pages, what)
}

/// As [`verify_pages`]; a failure also says when `load` submitted the
/// version the page should hold and the one it holds.
pub fn verify_pages_of(
    load: Option<&Load>,
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
        if page != want {
            let found = version_in(&page);
            let when = load.map_or_else(String::new, |load| {
                let wanted = match slot {
                    Slot::Written(v) => load.submitted_at(v),
                    Slot::Unknown => None,
                };
                format!(
                    "; submitted at operation {wanted:?}, the one it holds at {:?}",
                    load.submitted_at(found)
                )
            });
            panic!(
                "{what}page {p} is not {slot:?} (zeroed: {}, holds version {found}{when})",
                page == [0u8; PAGE_SIZE]
            );
        }
        written += usize::from(matches!(slot, Slot::Written(_)));
    }
    written
}

/// The seed of a test of random faults: `CHAOS_SEED` when set (a replay),
/// else the time.
pub fn chaos_seed() -> u64 {
    std::env::var("CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_secs())
        })
}

/// Reads the pages `0..pages` of `map`'s only range from each of `nodes`'
/// replicas alone: each must hold the known pages as last written (by
/// `load`, if one ran: a failure then says when), and every page the same
/// as the others (a replica that diverged would serve an older page at the
/// next failover). `context` names the run in a failure.
pub fn verify_each_replica_alone(
    load: Option<&Load>,
    map: &rdma_transport::coordinator::api::MapResponse,
    nodes: &[&str],
    expected: &Expected,
    pages: u64,
    context: &str,
) {
    let alone: Vec<TransportManager> = nodes.iter().map(|n| replica_manager(map, n)).collect();
    for (node, only) in nodes.iter().zip(&alone) {
        verify_pages_of(
            load,
            only,
            expected,
            0..pages,
            &format!("{node} alone ({context}): "),
        );
    }
    let (mut first, mut other) = ([0u8; PAGE_SIZE], [0u8; PAGE_SIZE]);
    for p in 0..pages {
        alone[0]
            .read_page(gpa(p), &mut first)
            .unwrap_or_else(|e| panic!("page {p} from {}: {e}", nodes[0]));
        for (node, only) in nodes.iter().zip(&alone).skip(1) {
            only.read_page(gpa(p), &mut other)
                .unwrap_or_else(|e| panic!("page {p} from {node}: {e}"));
            assert!(
                first == other,
                "page {p} ({:?}) differs between {} and {node} ({context})",
                expected[p as usize],
                nodes[0]
            );
        }
    }
}
