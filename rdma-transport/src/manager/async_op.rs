//! One lane of an asynchronous submission. A submission of `count` pages is
//! cut into windows of up to `MAX_CHUNK` addresses; up to `LANES` lanes
//! take the windows in turn (a sliding window: a slow window holds back
//! only its own lane). A lane puts a window on the wire as one round and
//! goes on with the next window when the round settles.
//!
//! The fast path never blocks: a window whose addresses all resolve, in
//! the map in use, to single-holder ranges on nodes with a live connection
//! in the range's epoch goes out at once. Anything else (a map miss, a
//! replicated range with its failover and hedging, a node to dial, a
//! connection lost mid-round) is served by the blocking engine
//! (`Inner::run`) on a worker thread, and the lane goes on when it is done.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::Guard;
use parking_lot::Mutex;

use super::fast_view::FastView;
use super::map_state::MapState;
use super::request::Target;
use super::round::{OnMap, Round};
use super::Inner;
use crate::error::TransportError;
use crate::page::{is_page_aligned, Page, PAGE_SIZE};
use crate::tcp::{Waiter, MAX_CHUNK};
use crate::wire::Opcode;

/// Lanes (windows in flight) per submission.
pub(super) const LANES: usize = 8;

/// What every lane of one submission shares. A queue keeps the batches
/// of delivered submissions for its next ones (`Stepper::spare`): a
/// submission then allocates nothing, neither the batch nor its address
/// list.
pub(super) struct Batch {
    pub(super) opcode: Opcode,
    pub(super) gpas: Vec<u64>,
    /// Page i is at `pages + i * PAGE_SIZE` (the caller's, or `owned`'s).
    pub(super) pages: *mut u8,
    pub(super) owned: Mutex<Option<Box<[Page]>>>,
    pub(super) user_data: u64,
    next_window: AtomicUsize,
    windows_left: AtomicUsize,
    first_error: Mutex<Option<TransportError>>,
}

// SAFETY: `pages` points at memory the submitter lent for the whole
// submission (`submit_*`'s contract) or at `owned`; lanes write disjoint
// pages of it, each from one thread at a time. A spare batch's `pages` is
// never used before `fill` sets it again.
unsafe impl Send for Batch {}
// SAFETY: as above; every other field is `Sync`.
unsafe impl Sync for Batch {}

/// Longest address list a spare batch keeps its room for: a batch that
/// carried more gives it back when it is delivered.
pub(super) const SPARE_GPAS: usize = 8 * MAX_CHUNK;

impl Batch {
    /// A batch with no submission yet (see `fill`).
    pub(super) fn empty() -> Self {
        Self {
            opcode: Opcode::Read,
            gpas: Vec::new(),
            pages: std::ptr::null_mut(),
            owned: Mutex::new(None),
            user_data: 0,
            next_window: AtomicUsize::new(0),
            windows_left: AtomicUsize::new(0),
            first_error: Mutex::new(None),
        }
    }

    /// Makes this batch, which nobody shares, the submission of `gpas`.
    pub(super) fn fill(
        &mut self,
        opcode: Opcode,
        gpas: &[u64],
        pages: *mut u8,
        owned: Option<Box<[Page]>>,
        user_data: u64,
    ) {
        self.opcode = opcode;
        self.gpas.clear();
        self.gpas.extend_from_slice(gpas);
        self.pages = pages;
        *self.owned.get_mut() = owned;
        self.user_data = user_data;
        *self.next_window.get_mut() = 0;
        *self.windows_left.get_mut() = gpas.len().div_ceil(MAX_CHUNK);
        *self.first_error.get_mut() = None;
    }

    /// Whether this delivered batch is worth keeping for the next
    /// submission (`fill` resets all of it): not when its address list
    /// was long.
    pub(super) fn worth_keeping(&self) -> bool {
        self.gpas.capacity() <= SPARE_GPAS
    }

    /// How many lanes the submission needs.
    pub(super) fn lanes(&self) -> usize {
        self.gpas.len().div_ceil(MAX_CHUNK).min(LANES)
    }

    /// The next window nobody took yet, as an address range.
    ///
    /// The window counters are plain loads and stores, not
    /// read-modify-writes: lanes move on (`advance`) only under their
    /// queue's stepper lock, so no two threads ever count at once (a
    /// locked instruction per window was a measurable share of a one-page
    /// submission).
    fn take_window(&self) -> Option<(usize, usize)> {
        let w = self.next_window.load(Ordering::Relaxed);
        self.next_window.store(w + 1, Ordering::Relaxed);
        let from = w.checked_mul(MAX_CHUNK)?;
        (from < self.gpas.len()).then(|| (from, (from + MAX_CHUNK).min(self.gpas.len())))
    }

    pub(super) fn record(&self, err: TransportError) {
        self.first_error.lock().get_or_insert(err);
    }

    /// One window is done; true when it was the last. (Under the stepper
    /// lock, as `take_window`.)
    fn window_done(&self) -> bool {
        let left = self.windows_left.load(Ordering::Relaxed);
        self.windows_left
            .store(left.saturating_sub(1), Ordering::Relaxed);
        left == 1
    }

    /// The submission's result (after its last window).
    pub(super) fn result(&self) -> Result<(), TransportError> {
        self.first_error.lock().take().map_or(Ok(()), Err)
    }

    /// `result` of a batch nobody shares (no lock taken).
    pub(super) fn take_result(&mut self) -> Result<(), TransportError> {
        self.first_error.get_mut().take().map_or(Ok(()), Err)
    }

    fn page(&self, i: usize) -> *mut u8 {
        // SAFETY: i < gpas.len() and the buffer holds that many pages.
        unsafe { self.pages.add(i * PAGE_SIZE) }
    }
}

/// `Lane::active_at` of a lane not in its queue's active list.
pub(super) const NOT_ACTIVE: usize = usize::MAX;

/// Where a lane is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Phase {
    /// In the free list.
    Free,
    /// Its round is on the wire.
    Round,
    /// A worker thread runs its window on the blocking engine.
    Fallback,
}

/// One lane: its round, its waiter and where it is in its batch.
pub(super) struct Lane {
    // Field order is drop order: the round's guards cancel its requests
    // before the waiter they count on goes.
    pub(super) round: Round,
    pub(super) waiter: Waiter,
    targets: [Target; MAX_CHUNK],
    n: usize,
    state: Option<Arc<MapState>>,
    pub(super) batch: Option<Arc<Batch>>,
    /// This lane's window: addresses `from..end` are left to do.
    from: usize,
    end: usize,
    /// Where the round in flight ends (addresses `from..round_end`).
    round_end: usize,
    pub(super) deadline: Instant,
    pub(super) seq: u64,
    pub(super) phase: Phase,
    /// Requests this lane counts in its queue's total (see `requests`).
    pub(super) counted: usize,
    /// Where its token is in its queue's list of active lanes
    /// (`Stepper::active`), or `NOT_ACTIVE`.
    pub(super) active_at: usize,
    /// A fallback's result, set by its worker thread.
    pub(super) fallback: Option<Result<(), TransportError>>,
    /// The connections this lane is counted on in its queue's `OnWire`
    /// while it is active.
    pub(super) on_wire: super::completion::Held,
}

// SAFETY: the raw pointers in `targets` point into the batch's pages (see
// `Batch`); a lane is used by one thread at a time (the queue's stepper,
// or the worker of its fallback).
unsafe impl Send for Lane {}

/// What a lane needs next.
pub(super) enum Next {
    /// Its round is on the wire: wait for the waiter or the deadline.
    Wait,
    /// Run `from..end` of its batch on the blocking engine, off this thread.
    Fallback,
    /// Its batch has no window left for it: the lane is free again; with
    /// the batch when this lane finished its last window.
    Idle(Option<Arc<Batch>>),
}

impl Lane {
    pub(super) fn new(waiter: Waiter) -> Self {
        Self {
            round: Round::new(),
            waiter,
            targets: [Target::EMPTY; MAX_CHUNK],
            n: 0,
            state: None,
            batch: None,
            from: 0,
            end: 0,
            round_end: 0,
            deadline: Instant::now(),
            seq: 0,
            phase: Phase::Free,
            counted: 0,
            active_at: NOT_ACTIVE,
            fallback: None,
            on_wire: super::completion::Held::new(),
        }
    }

    /// Requests of the round on the wire.
    pub(super) fn requests(&self) -> usize {
        if self.phase == Phase::Round {
            self.n
        } else {
            0
        }
    }

    /// The fallback's range of its batch.
    pub(super) fn fallback_range(&self) -> (usize, usize) {
        (self.from, self.end)
    }
}

impl Inner {
    /// Moves `lane` on: finishes its window when nothing is left of it,
    /// takes the next window, and puts the next round on the wire (or
    /// says it needs the blocking engine).
    pub(super) fn advance(&self, lane: &mut Lane) -> Next {
        // Taken out while the lane moves on and put back (or handed over
        // with the completion) as it stops: no reference count is touched.
        let Some(batch) = lane.batch.take() else {
            return Next::Idle(None);
        };
        loop {
            if lane.from >= lane.end {
                if lane.end > 0 && batch.window_done() {
                    lane.end = 0;
                    lane.phase = Phase::Free;
                    return Next::Idle(Some(batch));
                }
                let Some((from, end)) = batch.take_window() else {
                    lane.end = 0;
                    lane.phase = Phase::Free;
                    return Next::Idle(None);
                };
                lane.from = from;
                lane.end = end;
                lane.deadline = Instant::now() + self.config.request_timeout();
            }
            match self.resolve_fast(&batch, lane) {
                Fast::Skip(at, err) => {
                    batch.record(err);
                    lane.from = at + 1;
                }
                Fast::Blocked => {
                    lane.phase = Phase::Fallback;
                    lane.batch = Some(batch);
                    return Next::Fallback;
                }
                Fast::Ready(view, n, end) => {
                    let state = Arc::clone(&view.state);
                    lane.seq += 1;
                    lane.waiter.start_round(lane.seq);
                    lane.n = n;
                    lane.round_end = end;
                    let mut pages = super::rdma_batch::Pages { frame: None };
                    lane.round.opcode = batch.opcode;
                    lane.round.deferred = true;
                    lane.round.land_direct = true;
                    // Held across the submission: answers from the first
                    // nodes of the round must not look like the end of it
                    // (and queue it) while later nodes are still to go. A
                    // one-page round has no later node and takes no hold
                    // (two locked instructions per page).
                    let hold = n > 1;
                    if hold {
                        lane.waiter.add(1);
                    }
                    self.submit_round(
                        &mut lane.round,
                        OnMap {
                            state: &state,
                            links: &view.links,
                            regions: view.regions.as_ref(),
                        },
                        &lane.targets[..n],
                        &mut pages,
                        &lane.waiter,
                        lane.deadline,
                    );
                    lane.state = Some(state);
                    lane.phase = Phase::Round;
                    if hold || lane.waiter.is_done() {
                        // Without a hold, a request that could not go out
                        // (or was answered already) still tells the queue
                        // its round is done. Told twice is harmless: the
                        // second finds the lane in another round or free.
                        if !hold {
                            lane.waiter.add(1);
                        }
                        lane.waiter.release_hold();
                    }
                    lane.batch = Some(batch);
                    return Next::Wait;
                }
            }
        }
    }

    /// Settles `lane`'s round (its waiter reached zero, or its deadline
    /// passed) and moves it on. A round that lost a connection goes to the
    /// blocking engine, which retries it on a new one.
    pub(super) fn settle_lane(&self, lane: &mut Lane) -> Next {
        let answered = lane.waiter.is_done();
        let Some(state) = lane.state.take() else {
            return self.advance(lane);
        };
        let mut pages = super::rdma_batch::Pages { frame: None };
        let outcome = self.settle_round(&mut lane.round, &state, answered, &mut pages);
        if outcome.failed != 0 && outcome.lost != 0 {
            // `from..end` again, on the blocking engine (page reads and
            // writes are idempotent).
            lane.phase = Phase::Fallback;
            return Next::Fallback;
        }
        if let (Some(batch), Some(err)) = (&lane.batch, outcome.error) {
            batch.record(err);
        }
        lane.from = lane.round_end;
        self.advance(lane)
    }

    /// Settles the lane's round, whatever it came to, and drops its batch
    /// (the queue is going away).
    pub(super) fn cancel_lane(&self, lane: &mut Lane) {
        let answered = lane.waiter.is_done();
        if let Some(state) = lane.state.take() {
            let mut pages = super::rdma_batch::Pages { frame: None };
            let _ = self.settle_round(&mut lane.round, &state, answered, &mut pages);
        }
        lane.batch = None;
        lane.end = 0;
        lane.phase = Phase::Free;
    }

    /// After a fallback: records its result and moves the lane on.
    pub(super) fn fallback_done(&self, lane: &mut Lane) -> Next {
        if let (Some(batch), Some(Err(err))) = (&lane.batch, lane.fallback.take()) {
            batch.record(err);
        }
        lane.from = lane.end;
        self.advance(lane)
    }

    /// Runs `from..end` of `batch` on the blocking engine (a worker
    /// thread's job).
    pub(super) fn run_fallback(
        &self,
        batch: &Batch,
        from: usize,
        end: usize,
    ) -> Result<(), TransportError> {
        self.run(
            batch.opcode,
            &batch.gpas[from..end],
            batch.page(from),
            end - from,
            None,
        )
    }

    /// Resolves the lane's addresses from `from` on, without blocking: the
    /// targets of one round, or why the blocking engine must do it.
    fn resolve_fast(&self, batch: &Batch, lane: &mut Lane) -> Fast {
        let write = batch.opcode == Opcode::Write;
        // One guard on the published view (`fast_view.rs`) instead of a
        // map load plus a link load per address.
        let view = self.view.load();
        let state = &view.state;
        let mut n = 0;
        for i in lane.from..lane.end {
            let gpa = batch.gpas[i];
            if !is_page_aligned(gpa) {
                if n == 0 {
                    return Fast::Skip(i, TransportError::Unaligned { gpa });
                }
                return Fast::Ready(view, n, i);
            }
            let Some(loc) = state.map.lookup(gpa) else {
                return Fast::Blocked;
            };
            let usable = if write {
                loc.state.takes_writes()
            } else {
                loc.state.serves_reads()
            };
            if loc.replicated || !usable {
                return Fast::Blocked;
            }
            let ready = view.link(loc.node_index).is_some_and(|link| {
                !link.is_broken() && super::epoch::serves(loc.valid_epoch, link.epoch())
            });
            if !ready {
                return Fast::Blocked;
            }
            lane.targets[n] = Target {
                gpa,
                page: batch.page(i),
                loc,
            };
            n += 1;
        }
        Fast::Ready(view, n, lane.end)
    }
}

/// What `resolve_fast` found.
enum Fast {
    /// Targets `0..n` go out now, on the view's links; the round covers
    /// addresses up to `end`.
    Ready(Guard<Arc<FastView>>, usize, usize),
    /// Address `at` fails on its own: skip it.
    Skip(usize, TransportError),
    /// Needs the blocking engine.
    Blocked,
}
