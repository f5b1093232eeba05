//! Replicated ranges, client side: which replica a read goes to first and
//! next, how long a read waits before it goes to another one (the hedging
//! delay), and what becomes of a write that some replicas missed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::map_state::MapState;
use super::request::{Outcome, Target};
use super::{Inner, RETRY_INTERVAL};
use crate::coordinator::api::ReplicaState;
use crate::error::TransportError;
use crate::gpa_map::{other_generation, Location};

/// Shortest automatic hedging delay: below it, the scheduling noise of a
/// busy host would send reads to a second replica for nothing.
const MIN_HEDGE_DELAY: Duration = Duration::from_millis(1);

/// The automatic hedging delay is this many times the recent p99.
const HEDGE_P99_FACTOR: u32 = 4;
/// The least time a stale mark gets, whatever is left of its write's
/// deadline (with a quarter of the request timeout, if more).
const STALE_MARK_FLOOR: Duration = Duration::from_millis(100);

/// What the coordinator made of a request to mark a replica stale.
enum Marked {
    Stale,
    /// Refused: it is its range's only live replica.
    LastLive(TransportError),
}

/// Replicas that missed a write of this manager's while the coordinator
/// could not be told (their write failed): range start and node id. Such a
/// replica lacks pages another replica of its range has taken, yet stays
/// live: reads of those pages would go back in time at the next failover.
/// So no later write to its range counts as done until it is marked stale
/// (it then recovers from a live replica), and no read of its range goes
/// to it meanwhile (one that took the write serves them, or the read
/// fails). (That the write it missed may
/// still reach it late, on a connection this manager has since replaced,
/// is the page-server's to refuse: a client's new connection ends its
/// older ones, docs/wire-protocol.md.)
#[derive(Debug, Default)]
pub(super) struct OwedStale {
    /// Whether `list` is not empty (the write path's one check).
    any: AtomicBool,
    list: Mutex<Vec<(u64, String)>>,
}

impl OwedStale {
    fn owe(&self, range_start: u64, node: String) {
        let mut list = self.list.lock();
        if !list.iter().any(|(r, n)| *r == range_start && *n == node) {
            list.push((range_start, node));
        }
        self.any.store(true, Ordering::Release);
    }

    fn settled(&self, range_start: u64, node: &str) {
        let mut list = self.list.lock();
        list.retain(|(r, n)| !(*r == range_start && n == node));
        self.any.store(!list.is_empty(), Ordering::Release);
    }

    /// Whether a replica is owed a stale mark.
    pub(super) fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    fn owes(&self, range_start: u64, node: &str) -> bool {
        self.list
            .lock()
            .iter()
            .any(|(r, n)| *r == range_start && n == node)
    }

    /// How many replicas are owed a mark.
    pub(super) fn count(&self) -> usize {
        self.list.lock().len()
    }

    /// The ranges with a replica owed a mark, each once.
    fn ranges(&self) -> Vec<u64> {
        let mut ranges: Vec<u64> = self.list.lock().iter().map(|(r, _)| *r).collect();
        ranges.sort_unstable();
        ranges.dedup();
        ranges
    }

    fn of_range(&self, range_start: u64) -> Vec<String> {
        self.list
            .lock()
            .iter()
            .filter(|(r, _)| *r == range_start)
            .map(|(_, n)| n.clone())
            .collect()
    }
}

/// When the last mark of each replica that the coordinator took was sent.
#[derive(Debug, Default)]
pub(super) struct SentMarks(Vec<(u64, String, Instant)>);

impl SentMarks {
    /// Whether a mark of `node`'s replica of the range at `range_start`
    /// was sent at or after `after`.
    fn since(&self, range_start: u64, node: &str, after: Instant) -> bool {
        self.0
            .iter()
            .any(|(r, n, sent)| *r == range_start && n == node && *sent >= after)
    }

    fn record(&mut self, range_start: u64, node: &str, sent: Instant) {
        match self
            .0
            .iter_mut()
            .find(|(r, n, _)| *r == range_start && n == node)
        {
            Some(entry) => entry.2 = sent,
            None => self.0.push((range_start, node.to_owned(), sent)),
        }
    }
}

impl Inner {
    /// The replica a read of `gpa` (whose primary is `primary`) goes to
    /// first: the primary, unless its node failed a request in the last
    /// `RETRY_INTERVAL` and another live replica's did not. Never a replica
    /// this manager owes a stale mark ([`OwedStale`]). `None` when no
    /// replica of the range serves reads.
    pub(super) fn read_choice(
        &self,
        state: &MapState,
        gpa: u64,
        primary: Location,
    ) -> Option<Location> {
        if !primary.state.serves_reads() {
            return None;
        }
        if !primary.replicated
            || (!self.avoided(state, primary.node_index) && !self.owed_stale.any())
        {
            return Some(primary);
        }
        let mut readers = state
            .map
            .replicas(gpa)
            .filter(|l| l.state.serves_reads() && !self.missed_own_write(state, l));
        readers
            .clone()
            .find(|l| !self.avoided(state, l.node_index))
            .or_else(|| Some(primary).filter(|p| !self.missed_own_write(state, p)))
            .or_else(|| readers.next())
    }

    /// Whether `loc` is a replica this manager owes a stale mark: it
    /// missed a write of this manager's that another replica took.
    fn missed_own_write(&self, state: &MapState, loc: &Location) -> bool {
        self.owed_stale.any()
            && self
                .owed_stale
                .owes(loc.range_start, &self.node_name(state, loc.node_index))
    }

    /// Another replica that serves reads of `t`'s page and is not in
    /// `tried` (bit r: replica r), preferring one whose node did not fail
    /// lately.
    pub(super) fn other_reader(
        &self,
        state: &MapState,
        t: &Target,
        tried: u32,
    ) -> Option<Location> {
        if !t.loc.replicated {
            return None;
        }
        let tried = tried | 1 << t.loc.replica;
        let mut readers = state
            .map
            .replicas(t.gpa)
            .filter(|l| l.replica >= 32 || tried & (1 << l.replica) == 0)
            .filter(|l| l.state.serves_reads() && !self.missed_own_write(state, l));
        readers
            .clone()
            .find(|l| !self.avoided(state, l.node_index))
            .or_else(|| readers.next())
    }

    /// Remembers that a request to the node at `node_index` failed: reads
    /// of replicated ranges prefer other replicas for `RETRY_INTERVAL`.
    pub(super) fn avoid(&self, state: &MapState, node_index: usize) {
        if let Some(node) = state.nodes.get(node_index) {
            let until = self.clock_ms() + RETRY_INTERVAL.as_millis() as u64;
            node.avoid_until_ms.store(until, Ordering::Relaxed);
        }
    }

    pub(super) fn avoided(&self, state: &MapState, node_index: usize) -> bool {
        state
            .nodes
            .get(node_index)
            .is_some_and(|n| n.avoid_until_ms.load(Ordering::Relaxed) > self.clock_ms())
    }

    /// Milliseconds since the manager started (never 0 after the first).
    pub(super) fn clock_ms(&self) -> u64 {
        self.clock.elapsed().as_millis() as u64 + 1
    }

    /// How long a read of a replicated range waits for its replica before
    /// it goes to another: `read_hedge_delay_us` when set, else
    /// `HEDGE_P99_FACTOR` times the recent p99 of such reads, at least
    /// `MIN_HEDGE_DELAY`; never more than half the request timeout.
    pub(super) fn hedge_delay(&self) -> Duration {
        let ceiling = self.config.request_timeout() / 2;
        if self.config.read_hedge_delay_us > 0 {
            return Duration::from_micros(self.config.read_hedge_delay_us).min(ceiling);
        }
        let auto = self.latency.p99().map_or(MIN_HEDGE_DELAY, |p99| {
            (p99 * HEDGE_P99_FACTOR).max(MIN_HEDGE_DELAY)
        });
        auto.min(ceiling)
    }

    /// After a write round in which some targets failed: each page whose
    /// write a live replica took has its other replicas that missed it
    /// marked stale (at the coordinator, then in the map in use) before
    /// the write counts as done. A page no live replica took failed.
    /// `started`: when the round was sent.
    pub(super) fn settle_failed_writes(
        &self,
        state: &MapState,
        targets: &[Target],
        outcome: Outcome,
        started: Instant,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        let failed = |k: usize| outcome.failed & (1 << k) != 0;
        // The first page no live replica took.
        let mut untaken = None;
        let mut stale = [(0u64, 0usize); crate::tcp::MAX_CHUNK];
        let mut stale_count = 0;
        let mut k = 0;
        while k < targets.len() {
            // A page's targets are adjacent (see `resolve`).
            let (gpa, page) = (targets[k].gpa, targets[k].page);
            let mut end = k;
            while end < targets.len() && targets[end].gpa == gpa && targets[end].page == page {
                end += 1;
            }
            let page_failed = (k..end).any(failed);
            let live_took_it =
                (k..end).any(|j| !failed(j) && targets[j].loc.state == ReplicaState::Live);
            if page_failed && !live_took_it {
                untaken.get_or_insert(k);
            } else if page_failed {
                for j in (k..end).filter(|&j| failed(j)) {
                    let key = (targets[j].loc.range_start, targets[j].loc.node_index);
                    if !stale[..stale_count].contains(&key) {
                        stale[stale_count] = key;
                        stale_count += 1;
                    }
                }
            }
            k = end;
        }
        let mut first_error = None;
        for &(range_start, node_index) in &stale[..stale_count] {
            if let Err(e) = self.mark_stale(state, range_start, node_index, started, deadline) {
                self.owed_stale
                    .owe(range_start, self.node_name(state, node_index));
                first_error.get_or_insert(e);
            }
        }
        // A page no live replica took fails with the round's first error.
        if let Some(k) = untaken {
            return Err(outcome.error.unwrap_or_else(|| TransportError::NodeDown {
                node: self.node_name(state, targets[k].loc.node_index),
                reason: format!("no live replica took the write of {:#x}", targets[k].gpa),
            }));
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Before a write to `targets` (resolved on `state`): marks stale every
    /// replica of their ranges that is owed it ([`OwedStale`]). Returns
    /// whether one was (the map in use changed: resolve again), or the
    /// error of one the coordinator still did not take: the write must not
    /// count as done, and is not sent.
    pub(super) fn settle_owed_stale(
        &self,
        state: &MapState,
        targets: &[Target],
        deadline: Instant,
    ) -> Result<bool, TransportError> {
        let mut changed = false;
        let mut done: smallvec::SmallVec<[u64; 4]> = smallvec::SmallVec::new();
        for t in targets {
            let range_start = t.loc.range_start;
            if done.contains(&range_start) {
                continue;
            }
            done.push(range_start);
            changed |= self.settle_owed_of_range(state, range_start, deadline)?;
        }
        Ok(changed)
    }

    /// Marks stale now every replica this manager owes a mark, whatever
    /// range it is of (`TransportManager::settle_owed_stale_marks`); the
    /// first error of a range the coordinator did not take (its replicas
    /// stay owed; the other ranges are still settled).
    pub(super) fn settle_every_owed_stale(&self, deadline: Instant) -> Result<(), TransportError> {
        let state = self.state.load_full();
        let mut first_error = None;
        for range_start in self.owed_stale.ranges() {
            if let Err(e) = self.settle_owed_of_range(&state, range_start, deadline) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Marks stale every replica of the range at `range_start` that is
    /// owed it; whether one was.
    fn settle_owed_of_range(
        &self,
        state: &MapState,
        range_start: u64,
        deadline: Instant,
    ) -> Result<bool, TransportError> {
        let mut changed = false;
        for node in self.owed_stale.of_range(range_start) {
            // Marked again even when this map shows it stale or
            // recovering: that may predate the write it missed. Gone
            // from the range, it holds nothing of it any more.
            let replica = state
                .nodes
                .iter()
                .position(|n| n.id == node)
                .filter(|&i| state.map.replicas(range_start).any(|l| l.node_index == i));
            if let Some(i) = replica {
                match self.try_mark_stale(state, range_start, i, Instant::now(), deadline)? {
                    Marked::Stale => changed = true,
                    // No other replica is live: none has pages it
                    // lacks (they recover from it). Nothing is owed.
                    Marked::LastLive(_) => tracing::info!(
                        range_start,
                        %node,
                        "a replica that missed a write is its range's only live one now: \
                         not marked stale"
                    ),
                }
            }
            self.owed_stale.settled(range_start, &node);
        }
        Ok(changed)
    }

    /// Marks `node_index`'s replica of the range at `range_start` stale at
    /// the coordinator, then in the map in use, so that no read goes to it,
    /// for a write sent at `started` that the replica missed.
    fn mark_stale(
        &self,
        state: &MapState,
        range_start: u64,
        node_index: usize,
        started: Instant,
        deadline: Instant,
    ) -> Result<(), TransportError> {
        match self.try_mark_stale(state, range_start, node_index, started, deadline)? {
            Marked::Stale => Ok(()),
            Marked::LastLive(e) => Err(e),
        }
    }

    /// As [`Inner::mark_stale`], telling the coordinator's refusal to mark
    /// the range's last live replica apart from other failures.
    fn try_mark_stale(
        &self,
        state: &MapState,
        range_start: u64,
        node_index: usize,
        started: Instant,
        deadline: Instant,
    ) -> Result<Marked, TransportError> {
        let node = self.node_name(state, node_index);
        let missed = |reason: String| TransportError::ReplicaMissedWrite {
            gpa: range_start,
            node: node.clone(),
            reason,
        };
        let Some(client) = &self.coordinator else {
            return Err(missed("no coordinator to mark it stale".into()));
        };
        // The write that missed the replica may have spent its whole
        // deadline waiting for it: the mark still gets a quarter of the
        // request timeout (the live replica took the write; failing it
        // for want of a few more milliseconds makes the caller write
        // again).
        let floor = (self.config.request_timeout() / 4).max(STALE_MARK_FLOOR);
        let until = deadline.max(Instant::now() + floor);
        // One mark at a time: writes that missed the replica together
        // (a batch's, or every write in flight when a node stopped) make
        // one call. A mark sent after this write was sent stands for it:
        // the replica was stale at the coordinator after that, so it
        // recovers before it serves again, and its recovery copies the
        // range only a grace period after it began, longer than a request
        // timeout (`--recovery-grace-ms`), by when this write had reached
        // the live replica. (The map in use cannot tell: a Stale in it may
        // predate a recovery the manager has not heard of.)
        let Some(mut sent_marks) = self.stale_marking.try_lock_until(until) else {
            return Err(missed(
                "another stale mark held the coordinator past the deadline".into(),
            ));
        };
        if sent_marks.since(range_start, &node, started) {
            tracing::debug!(range_start, %node, "a replica missed a write: marked stale by a mark sent since");
            return Ok(Marked::Stale);
        }
        tracing::warn!(range_start, %node, "a replica missed a write: marking it stale");
        let sent = Instant::now();
        let remaining = until
            .saturating_duration_since(sent)
            .max(Duration::from_millis(1));
        let change = match client.mark_replica_stale(range_start, &node, remaining) {
            Ok(change) => {
                sent_marks.record(range_start, &node, sent);
                change
            }
            // The only conflict this call is answered (docs/coordinator.md).
            Err(e) if e.is_conflict() => return Ok(Marked::LastLive(missed(e.to_string()))),
            Err(e) => return Err(missed(e.to_string())),
        };
        // The coordinator's map at `change.version` has it stale: until a
        // refresh brings that (or newer), the map in use says so too. A map
        // in use of another generation (the coordinator lost its state
        // since) is not comparable: it gets the state, keeping its version,
        // so that any map of the coordinator's generation replaces it.
        loop {
            let old = self.state.load_full();
            let same_generation = !other_generation(old.map.generation(), change.generation);
            if same_generation && old.map.version() >= change.version {
                break;
            }
            let version = if same_generation {
                change.version
            } else {
                old.map.version()
            };
            let map = old
                .map
                .with_replica_state(range_start, &node, ReplicaState::Stale, version);
            let new = std::sync::Arc::new(MapState {
                map,
                nodes: old.nodes.clone(),
            });
            let prev = self.state.compare_and_swap(&old, new);
            if std::sync::Arc::ptr_eq(&prev, &old) {
                drop(prev);
                self.publish_view();
                break;
            }
        }
        Ok(Marked::Stale)
    }
}
