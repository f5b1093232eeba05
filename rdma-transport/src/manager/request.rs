//! One call's requests, end to end: resolve every address to the replicas
//! it goes to, submit them grouped by node (TCP or RDMA), wait, and settle.
//! A read that fails, or is not answered within the hedging delay, goes to
//! the range's next live replica; a write goes to every replica that takes
//! writes, and one that fails is marked stale (see `replicas.rs`). A
//! request whose connection died before answering runs once more on a new
//! one.

use std::time::Instant;

use smallvec::SmallVec;

use super::map_state::MapState;
use super::rdma_batch::Pages;
use super::tcp_chunk;
use super::Inner;
use crate::error::TransportError;
use crate::gpa_map::Location;
use crate::page::{is_page_aligned, PAGE_SIZE};
use crate::pool::PageFrame;
use crate::rdma::Deadline;
use crate::tcp::MAX_CHUNK;
use crate::wire::Opcode;

/// One request of a window: a page of the caller's and the replica it goes
/// to.
#[derive(Debug, Clone, Copy)]
pub(super) struct Target {
    pub(super) gpa: u64,
    /// The caller's page (READ: written on success; WRITE: sent).
    pub(super) page: *mut u8,
    pub(super) loc: Location,
}

impl Target {
    pub(super) const EMPTY: Self = Self {
        gpa: 0,
        page: std::ptr::null_mut(),
        loc: Location {
            node_index: 0,
            remote_offset: 0,
            rdma: None,
            valid_epoch: 0,
            range_start: 0,
            replica: 0,
            state: crate::coordinator::api::ReplicaState::Live,
            replicated: false,
        },
    };
}

/// What one round of a window's requests came to.
#[derive(Debug, Default)]
pub(super) struct Outcome {
    /// Bit k: target k did not complete.
    pub(super) failed: u64,
    /// Bit k: target k's connection died before it was answered.
    pub(super) lost: u64,
    /// Bit k: target k was not answered before the round's deadline.
    pub(super) timed_out: u64,
    /// The first error.
    pub(super) error: Option<TransportError>,
}

impl Outcome {
    pub(super) fn fail(&mut self, k: usize, err: TransportError) {
        self.failed |= 1 << k;
        if matches!(err, TransportError::Timeout { .. }) {
            self.timed_out |= 1 << k;
        }
        self.error.get_or_insert(err);
    }
}

impl Inner {
    /// Runs `count` requests of one kind; page i is at `pages + i * 4096`.
    /// `frame` (`read_frame` only, `count` 1): `pages` is that pool frame.
    pub(super) fn run(
        &self,
        opcode: Opcode,
        gpas: &[u64],
        pages: *mut u8,
        count: usize,
        mut frame: Option<&mut Option<PageFrame>>,
    ) -> Result<(), TransportError> {
        if count == 1 {
            // `read_frame` is not retried on a lost connection here: its
            // caller, the fault handler, retries on its own terms.
            let retry = frame.is_none();
            if let Some(result) = self.run_single(opcode, gpas[0], pages, &mut frame, retry) {
                return result;
            }
        }
        self.run_windows(opcode, &gpas[..count], pages, frame)
    }

    /// One page into or out of the caller's `page` (`read_page`,
    /// `write_page`, one-page batches): `run` with nothing to decide.
    pub(super) fn run_one(
        &self,
        opcode: Opcode,
        gpa: u64,
        page: *mut u8,
    ) -> Result<(), TransportError> {
        match self.run_single(opcode, gpa, page, &mut None, true) {
            Some(result) => result,
            None => self.run_windows(opcode, &[gpa], page, None),
        }
    }

    /// One page on a fast path (`None` when neither applies); with `retry`,
    /// one whose connection died is served again on a new one.
    #[inline(always)]
    fn run_single(
        &self,
        opcode: Opcode,
        gpa: u64,
        page: *mut u8,
        frame: &mut Option<&mut Option<PageFrame>>,
        retry: bool,
    ) -> Option<Result<(), TransportError>> {
        // Fixed when the request first has to wait, or fails: a READ that
        // completes inside `ibv_post_send` never reads the clock.
        let deadline = Deadline::lazy(self.config.request_timeout());
        let single = match self.run_single_rdma(opcode, gpa, page, frame, &deadline) {
            Some(result) => result,
            None => self.run_single_tcp(opcode, gpa, page, false, &deadline)?,
        };
        match single {
            // Served again, on a new connection, within what is left of
            // the same deadline.
            Err(e) if retry && connection_lost(&e) => Some(
                self.run_window(opcode, &[gpa], page, 0, None, deadline.get())
                    .1,
            ),
            result => Some(result),
        }
    }

    /// The general path: windows of up to `MAX_CHUNK` requests, each with
    /// its own deadline; returns the first error.
    fn run_windows(
        &self,
        opcode: Opcode,
        gpas: &[u64],
        pages: *mut u8,
        mut frame: Option<&mut Option<PageFrame>>,
    ) -> Result<(), TransportError> {
        let mut first_error = None;
        let mut next = 0;
        while next < gpas.len() {
            let deadline = Instant::now() + self.config.request_timeout();
            let (done, result) = self.run_window(opcode, gpas, pages, next, frame.take(), deadline);
            if let Err(e) = result {
                first_error.get_or_insert(e);
            }
            next = done;
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Runs the requests of `gpas[from..]` that fit in one window (up to
    /// `MAX_CHUNK` targets, a write counting once per replica); returns
    /// where the next window starts, and the window's first error.
    fn run_window(
        &self,
        opcode: Opcode,
        gpas: &[u64],
        pages: *mut u8,
        from: usize,
        mut frame: Option<&mut Option<PageFrame>>,
        deadline: Instant,
    ) -> (usize, Result<(), TransportError>) {
        let write = opcode == Opcode::Write;
        // Filled only as far as the window goes: zeroing 64 targets (5.5 KiB)
        // per window cost more than the rest of a 16-page batch's setup.
        let mut targets = SmallVec::<[Target; MAX_CHUNK]>::new();
        let (state, end) = match self.resolve(write, gpas, pages, from, &mut targets, deadline) {
            Ok(resolved) => resolved,
            // The address that failed is skipped; the next window starts
            // after it.
            Err((at, e)) => return (at + 1, Err(e)),
        };
        if write && self.owed_stale.any() {
            match self.settle_owed_stale(&state, &targets, deadline) {
                Err(e) => return (end, Err(e)),
                // The map in use has it stale now: resolve again on it.
                Ok(true) => return self.run_window(opcode, gpas, pages, from, frame, deadline),
                Ok(false) => {}
            }
        }
        let result = if write {
            self.write_replicas(&state, &mut targets, frame.is_none(), deadline)
        } else {
            self.read_failover(&state, &mut targets, &mut frame, deadline)
        };
        if result.is_err() && !write && self.newer_map_may_serve(&state, &targets, deadline) {
            // A replica this map shows as not serving (still recovering
            // here) may be live by now: once more, on the newer map.
            return self.run_window(opcode, gpas, pages, from, frame, deadline);
        }
        (end, result)
    }

    /// After a failed read: whether a newer map than `state`'s is installed
    /// now, possibly after fetching one within `deadline`: a replica that
    /// joined or finished recovering since may serve it. The fetch is
    /// strict when a target's range has a replica that does not serve reads
    /// in `state` (a recovery this map predates may have ended), else rate
    /// limited like any refresh on a miss.
    fn newer_map_may_serve(&self, state: &MapState, targets: &[Target], deadline: Instant) -> bool {
        let (generation, version) = (state.map.generation(), state.map.version());
        let newer = || self.state.load().map.supersedes(generation, version);
        if newer() {
            return true;
        }
        if self.coordinator.is_none() {
            return false;
        }
        let waiting_replica = targets
            .iter()
            .any(|t| state.map.replicas(t.gpa).any(|l| !l.state.serves_reads()));
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return false;
        }
        if waiting_replica {
            let _ = self.refresh(Some(remaining));
        } else {
            self.refresh_on_miss(deadline);
        }
        newer()
    }

    /// Resolves `gpas[from..]` into `targets` (reads: the replica to try
    /// first; writes: every replica that takes writes) until the window is
    /// full. Returns the map state the targets refer to and where the
    /// window ends; or the index of the address that cannot be served and
    /// why.
    #[allow(clippy::type_complexity)]
    fn resolve(
        &self,
        write: bool,
        gpas: &[u64],
        pages: *mut u8,
        from: usize,
        targets: &mut SmallVec<[Target; MAX_CHUNK]>,
        deadline: Instant,
    ) -> Result<(arc_swap::Guard<std::sync::Arc<MapState>>, usize), (usize, TransportError)> {
        // A refresh (on a miss, or an address whose range has no replica
        // to serve it) restarts the window on the new map: every target
        // must index the same map's nodes.
        let mut refreshed = false;
        let mut settled = false;
        'again: loop {
            let state = self.state.load();
            targets.clear();
            let mut i = from;
            while i < gpas.len() {
                let gpa = gpas[i];
                if !is_page_aligned(gpa) {
                    return Err((i, TransportError::Unaligned { gpa }));
                }
                // SAFETY: i < count and the caller's buffer holds count pages.
                let page = unsafe { pages.add(i * PAGE_SIZE) };
                let Some(primary) = state.map.lookup(gpa) else {
                    if !refreshed {
                        refreshed = true;
                        self.refresh_on_miss(deadline);
                        continue 'again;
                    }
                    return Err((i, TransportError::UnknownGpa { gpa }));
                };
                let lost = |this: &Self| TransportError::DataLost {
                    gpa,
                    node: this.node_name(&state, primary.node_index),
                };
                if write {
                    let takers = state.map.replicas(gpa).filter(|l| l.state.takes_writes());
                    let count = takers.clone().count();
                    if count < state.map.replica_count(gpa)
                        && !refreshed
                        && self.map_too_old_for_writes()
                    {
                        // A replica that takes no writes in this map may
                        // be recovering by now: learn that first, or fail.
                        refreshed = true;
                        let remaining = deadline.saturating_duration_since(Instant::now());
                        if let Err(e) = self.refresh(Some(remaining)) {
                            tracing::warn!(gpa, %e, "a write to a range with a stale replica needs a fresh map; the coordinator did not give one");
                            return Err((i, e));
                        }
                        continue 'again;
                    }
                    if count == 0 {
                        if !refreshed {
                            refreshed = true;
                            self.refresh_on_miss(deadline);
                            continue 'again;
                        }
                        return Err((i, lost(self)));
                    }
                    if targets.len() + count > MAX_CHUNK {
                        break;
                    }
                    targets.extend(takers.map(|loc| Target { gpa, page, loc }));
                } else {
                    let Some(loc) = self.read_choice(&state, gpa, primary) else {
                        if self.owed_stale.any() && !settled {
                            // The only replica left to read may be one
                            // this manager owes a stale mark, which no read
                            // goes to: the mark is made now (the read then
                            // fails, its pages gone) or the coordinator
                            // says it is the range's last live replica
                            // (nothing is owed: it is read).
                            settled = true;
                            let owed = [Target {
                                gpa,
                                page,
                                loc: primary,
                            }];
                            if let Err(e) = self.settle_owed_stale(&state, &owed, deadline) {
                                return Err((i, e));
                            }
                            continue 'again;
                        }
                        if !refreshed {
                            refreshed = true;
                            self.refresh_on_miss(deadline);
                            continue 'again;
                        }
                        return Err((i, lost(self)));
                    };
                    if targets.len() == MAX_CHUNK {
                        break;
                    }
                    targets.push(Target { gpa, page, loc });
                }
                i += 1;
            }
            return Ok((state, i));
        }
    }

    /// Reads `targets`; each one that fails, or is not answered within the
    /// hedging delay while its range has another live replica, is read
    /// from that replica, within `deadline`.
    fn read_failover(
        &self,
        state: &MapState,
        targets: &mut [Target],
        frame: &mut Option<&mut Option<PageFrame>>,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let mut n = targets.len();
        // Bit r of tried[k]: target k's replica r was tried.
        let mut tried = [0u32; MAX_CHUNK];
        for (t, tried) in targets.iter().zip(tried.iter_mut()) {
            *tried = 1 << t.loc.replica;
        }
        // Bit r of lost[k]: target k's replica r failed in this read with
        // its connection lost; of slow[k]: it was abandoned at the hedging
        // delay; of renewed[k]: it was tried again (once each, on a new
        // connection if its own died).
        let mut lost = [0u32; MAX_CHUNK];
        let mut slow = [0u32; MAX_CHUNK];
        let mut renewed = [0u32; MAX_CHUNK];
        loop {
            // Hedged only while every target has a replica left to try
            // whose node did not fail lately: the last one (or the last
            // but a node that just failed) gets the whole deadline. (A read
            // that hedged onto the survivor of a dead primary, and took a
            // little longer than the delay, used to go back to the dead
            // node and fail with its error.)
            let hedged = targets[..n].iter().any(|t| t.loc.replicated)
                && targets[..n].iter().zip(&tried).all(|(t, &tried)| {
                    self.other_reader(state, t, tried)
                        .is_some_and(|l| !self.avoided(state, l.node_index))
                });
            let round_deadline = if hedged {
                deadline.min(Instant::now() + self.hedge_delay())
            } else {
                deadline
            };
            let started = Instant::now();
            let pages = Pages {
                frame: frame.as_deref_mut(),
            };
            let outcome = self.run_targets(
                Opcode::Read,
                state,
                &targets[..n],
                pages,
                round_deadline,
                hedged && round_deadline < deadline,
            );
            if outcome.failed == 0 {
                if hedged {
                    self.latency.record(started.elapsed());
                }
                return Ok(());
            }
            // Next round: every failed target on another live replica of
            // its range; when there is none, once more on a replica that
            // only failed to answer within the hedging delay (it may just
            // be slow: it gets the rest of the deadline), or on a new
            // connection to a replica whose connection died during this
            // read (the server may have closed it, e.g. at the end of its
            // recovery, while the node lives on); once each.
            if hedged {
                self.counters.hedged(outcome.timed_out.count_ones());
            }
            let mut m = 0;
            for k in 0..n {
                if outcome.failed & (1 << k) == 0 {
                    continue;
                }
                let t = targets[k];
                if t.loc.replica < 32 {
                    if outcome.lost & (1 << k) != 0 {
                        lost[k] |= 1 << t.loc.replica;
                    }
                    if hedged && outcome.timed_out & (1 << k) != 0 {
                        slow[k] |= 1 << t.loc.replica;
                    }
                }
                self.avoid(state, t.loc.node_index);
                let next = match self.other_reader(state, &t, tried[k]) {
                    Some(loc) => Some(loc),
                    // `read_frame` is not retried on a lost connection:
                    // its caller, the fault handler, retries on its own.
                    None if frame.is_none() => {
                        renewable(state, &t, (lost[k] | slow[k]) & !renewed[k])
                    }
                    None => renewable(state, &t, slow[k] & !renewed[k]),
                };
                let Some(loc) = next else {
                    return Err(outcome.error.unwrap_or_else(|| self.no_answer(state, &t)));
                };
                tracing::debug!(gpa = t.gpa, from = %self.node_name(state, t.loc.node_index), to = %self.node_name(state, loc.node_index), "read goes to another replica");
                targets[m] = Target { loc, ..t };
                let bit = if loc.replica < 32 {
                    1 << loc.replica
                } else {
                    0
                };
                renewed[m] = renewed[k] | (tried[k] & bit);
                tried[m] = tried[k] | bit;
                lost[m] = lost[k];
                slow[m] = slow[k];
                m += 1;
            }
            n = m;
            if Instant::now() >= deadline {
                return Err(outcome
                    .error
                    .unwrap_or_else(|| self.no_answer(state, &targets[0])));
            }
            if let Some(slot) = frame.as_deref_mut() {
                // A failed or abandoned RDMA read kept `read_frame`'s frame:
                // the next round reads into a new one (waiting for one, as
                // the first round did: an abandoned read gives its frames
                // back when the device completes it).
                if slot.is_none() {
                    let new = self.alloc_frame(&Deadline::at(deadline)).ok_or(
                        TransportError::PoolExhausted {
                            capacity: self.pool.capacity(),
                        },
                    )?;
                    targets[0].page = new.as_ptr();
                    *slot = Some(new);
                }
            }
        }
    }

    /// Writes `targets` (every replica of each page that takes writes);
    /// a replica that fails is retried once on a new connection if its
    /// connection died, then marked stale. A page's write succeeds when a
    /// live replica took it and every replica that did not is stale.
    fn write_replicas(
        &self,
        state: &MapState,
        targets: &mut [Target],
        may_retry: bool,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let n = targets.len();
        let started = Instant::now();
        let mut outcome = self.run_targets(
            Opcode::Write,
            state,
            targets,
            Pages { frame: None },
            deadline,
            false,
        );
        if outcome.lost != 0 && may_retry {
            // Page writes are idempotent: the ones whose connection died
            // before answering go once more, on new connections.
            let mut again = [Target::EMPTY; MAX_CHUNK];
            let mut index = [0usize; MAX_CHUNK];
            let mut m = 0;
            for k in (0..n).filter(|k| outcome.lost & (1 << k) != 0) {
                again[m] = targets[k];
                index[m] = k;
                m += 1;
            }
            let retry = self.run_targets(
                Opcode::Write,
                state,
                &again[..m],
                Pages { frame: None },
                deadline,
                false,
            );
            for (j, &k) in index[..m].iter().enumerate() {
                if retry.failed & (1 << j) == 0 {
                    outcome.failed &= !(1 << k);
                }
            }
            outcome.error = retry.error.or(outcome.error);
        }
        if outcome.failed == 0 {
            return Ok(());
        }
        self.settle_failed_writes(state, targets, outcome, started, deadline)
    }

    /// The id of the node at `node_index` of `state`.
    pub(super) fn node_name(&self, state: &MapState, node_index: usize) -> String {
        state
            .nodes
            .get(node_index)
            .map_or_else(String::new, |n| n.id.clone())
    }

    /// The error of a request that failed without one (cannot happen: each
    /// failure records its error; kept so that no path returns Ok).
    fn no_answer(&self, state: &MapState, t: &Target) -> TransportError {
        TransportError::Timeout {
            node: self.node_name(state, t.loc.node_index),
            timeout_ms: self.config.request_timeout_ms,
        }
    }
}

/// The request failed because its connection died before it was answered
/// (EOF or a reset), not because the node refused it or timed out.
pub(super) fn connection_lost(err: &TransportError) -> bool {
    matches!(err, TransportError::NodeDown { reason, .. } if reason == tcp_chunk::CONNECTION_LOST)
}

/// A replica of `t`'s range in `mask` (bit r: replica r) that serves reads,
/// to try again: the target's own when its range has no replicas.
fn renewable(state: &MapState, t: &Target, mask: u32) -> Option<Location> {
    if mask == 0 {
        return None;
    }
    if !t.loc.replicated {
        return (t.loc.replica < 32 && mask & (1 << t.loc.replica) != 0).then_some(t.loc);
    }
    state
        .map
        .replicas(t.gpa)
        .find(|l| l.replica < 32 && mask & (1 << l.replica) != 0 && l.state.serves_reads())
}
