//! Counters of a manager's page I/O and the [`ManagerStats`] snapshot
//! (`TransportManager::stats`).
//!
//! Every public page-I/O call (`read_page`, `write_page`, `read_pages`,
//! `write_pages`, `read_frame`) goes through [`Inner::run_counted`], the one
//! place the counters are incremented.

use std::sync::atomic::{AtomicU64, Ordering};

use super::Inner;
use crate::error::TransportError;
use crate::pool::PageFrame;
use crate::wire::Opcode;

/// A snapshot of a manager's state and counters. Counters start at 0 when
/// the manager is built and only grow; the other fields are values of now.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ManagerStats {
    /// Version of the GPA map in use.
    pub map_version: u64,
    /// Nodes in the map.
    pub nodes: usize,
    /// Nodes with a live connection now.
    pub nodes_connected: usize,
    /// Nodes whose live connection moves pages by RDMA.
    pub nodes_rdma: usize,
    /// Frames of the page pool.
    pub pool_frames: usize,
    /// Frames of the page pool not handed out now.
    pub pool_free_frames: usize,
    /// How long a replicated read waits now before it is hedged, in
    /// microseconds (see `ManagerConfig::read_hedge_delay_us`).
    pub read_hedge_delay_us: u64,
    /// Page-I/O calls that succeeded (a batch counts once).
    pub calls_ok: u64,
    /// Page-I/O calls that failed, `calls_timed_out` included.
    pub calls_failed: u64,
    /// Page-I/O calls that failed with [`TransportError::Timeout`].
    pub calls_timed_out: u64,
    /// Pages read by calls that succeeded.
    pub pages_read: u64,
    /// Pages written by calls that succeeded.
    pub pages_written: u64,
    /// Reads of replicated pages sent on to another replica because theirs
    /// had not answered within the hedging delay (`read_hedge_delay_us`).
    pub reads_hedged: u64,
    /// Replicas this manager owes a stale mark now: each missed a write of
    /// its while the coordinator could not be told, and stays live at the
    /// coordinator until marked (`TransportManager::settle_owed_stale_marks`).
    pub owed_stale_marks: usize,
}

/// The counters of [`ManagerStats`], shared by every caller thread.
#[derive(Debug, Default)]
pub(super) struct Counters {
    calls_ok: AtomicU64,
    calls_failed: AtomicU64,
    calls_timed_out: AtomicU64,
    pages_read: AtomicU64,
    pages_written: AtomicU64,
    reads_hedged: AtomicU64,
}

/// Successful calls counted by one thread and added to the shared
/// [`Counters`] at once (`Counters::add`): a completion queue books its
/// completions per step, not with locked instructions per page.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Tally {
    pub(super) calls_ok: u64,
    pub(super) pages_read: u64,
    pub(super) pages_written: u64,
}

impl Tally {
    /// Counts one successful call of `pages` pages.
    pub(super) fn ok(&mut self, opcode: Opcode, pages: usize) {
        self.calls_ok += 1;
        if opcode == Opcode::Write {
            self.pages_written += pages as u64;
        } else {
            self.pages_read += pages as u64;
        }
    }
}

impl Counters {
    /// Adds a tally's counts (and leaves it empty).
    pub(super) fn add(&self, tally: &mut Tally) {
        let t = std::mem::take(tally);
        if t.calls_ok == 0 {
            return;
        }
        self.calls_ok.fetch_add(t.calls_ok, Ordering::Relaxed);
        if t.pages_read > 0 {
            self.pages_read.fetch_add(t.pages_read, Ordering::Relaxed);
        }
        if t.pages_written > 0 {
            self.pages_written
                .fetch_add(t.pages_written, Ordering::Relaxed);
        }
    }

    /// Counts one finished call of `pages` pages.
    pub(super) fn record(&self, opcode: Opcode, pages: usize, result: &Result<(), TransportError>) {
        match result {
            Ok(()) => {
                self.calls_ok.fetch_add(1, Ordering::Relaxed);
                let moved = if opcode == Opcode::Write {
                    &self.pages_written
                } else {
                    &self.pages_read
                };
                moved.fetch_add(pages as u64, Ordering::Relaxed);
            }
            Err(e) => {
                self.calls_failed.fetch_add(1, Ordering::Relaxed);
                if matches!(e, TransportError::Timeout { .. }) {
                    self.calls_timed_out.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    /// Counts `pages` reads hedged onto another replica.
    pub(super) fn hedged(&self, pages: u32) {
        self.reads_hedged
            .fetch_add(u64::from(pages), Ordering::Relaxed);
    }

    /// Copies the counters into `stats`.
    fn fill(&self, stats: &mut ManagerStats) {
        stats.calls_ok = self.calls_ok.load(Ordering::Relaxed);
        stats.calls_failed = self.calls_failed.load(Ordering::Relaxed);
        stats.calls_timed_out = self.calls_timed_out.load(Ordering::Relaxed);
        stats.pages_read = self.pages_read.load(Ordering::Relaxed);
        stats.pages_written = self.pages_written.load(Ordering::Relaxed);
        stats.reads_hedged = self.reads_hedged.load(Ordering::Relaxed);
    }
}

impl Inner {
    /// [`Inner::run`], counted.
    pub(super) fn run_counted(
        &self,
        opcode: Opcode,
        gpas: &[u64],
        pages: *mut u8,
        count: usize,
        frame: Option<&mut Option<PageFrame>>,
    ) -> Result<(), TransportError> {
        let result = self.run(opcode, gpas, pages, count, frame);
        self.counters.record(opcode, count, &result);
        result
    }

    /// `run_one`, counted.
    pub(super) fn run_one_counted(
        &self,
        opcode: Opcode,
        gpa: u64,
        page: *mut u8,
    ) -> Result<(), TransportError> {
        let result = self.run_one(opcode, gpa, page);
        self.counters.record(opcode, 1, &result);
        result
    }

    /// A snapshot of the state and counters.
    pub(super) fn stats(&self) -> ManagerStats {
        let state = self.state.load();
        let mut stats = ManagerStats {
            map_version: state.map.version(),
            nodes: state.nodes.len(),
            pool_frames: self.pool.capacity(),
            pool_free_frames: self.pool.available(),
            read_hedge_delay_us: u64::try_from(self.hedge_delay().as_micros()).unwrap_or(u64::MAX),
            ..ManagerStats::default()
        };
        for node in &state.nodes {
            let conn = node.conn.load();
            if let Some(link) = conn.as_ref().filter(|l| !l.is_broken()) {
                stats.nodes_connected += 1;
                if link.path() == crate::config::DataPath::Rdma {
                    stats.nodes_rdma += 1;
                }
            }
        }
        stats.owed_stale_marks = self.owed_stale.count();
        self.counters.fill(&mut stats);
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_and_pages_are_counted_by_outcome() {
        let c = Counters::default();
        c.record(Opcode::Read, 3, &Ok(()));
        c.record(Opcode::Write, 2, &Ok(()));
        c.record(
            Opcode::Read,
            1,
            &Err(TransportError::Timeout {
                node: "a".into(),
                timeout_ms: 5,
            }),
        );
        c.record(
            Opcode::Write,
            4,
            &Err(TransportError::UnknownGpa { gpa: 0x2000 }),
        );
        let mut s = ManagerStats::default();
        c.fill(&mut s);
        assert_eq!(
            (s.calls_ok, s.calls_failed, s.calls_timed_out),
            (2, 2, 1),
            "{s:?}"
        );
        assert_eq!((s.pages_read, s.pages_written), (3, 2), "{s:?}");
    }
}
