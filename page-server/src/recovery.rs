//! Replica recovery: a page-server whose replica of one of its ranges is
//! `stale` (new, restarted, or marked stale by a client after a failed
//! write) copies the range from a live replica, by itself.
//!
//! Once registered, the thread reads the map, then follows it with long
//! polls of one heartbeat period each (a change, such as a client marking
//! this replica stale, arrives at once; a quiet map is read again every
//! period), and notes each range's replica state in it (what the node's
//! next registration claims its memory holds, `range_contents.rs`). For each
//! exported range in turn (one recovery at a time), when this node's
//! replica of it is stale and another replica is live, it: reads one page
//! from a live replica (none answering, it disturbs nobody and tries again
//! next period); closes every connection opened before (but coherence
//! nodes'), so that no write a client gave up on can still arrive
//! (`conns.rs`, `Connections::fence`);
//! turns the write guard on (`recovery_guard.rs`); asks the coordinator to
//! mark the replica `recovering` (clients then send it every write, and it
//! serves no reads); waits the grace period, so that every client has seen
//! the change and writes here too; copies the range from the first live
//! replica, 64 pages at a time at a bounded rate, each page applied only if
//! no client wrote it meanwhile; and asks the coordinator to mark it `live`
//! under the recovery's number.
//! A refusal (the replica went stale again meanwhile) or any failure turns
//! the guard off and the next period tries again.
//!
//! The guard covers the whole exported memory (every range) while any one
//! range recovers: client writes to the other ranges are marked too, which
//! is harmless (the copy only touches the recovering range's pages, at its
//! offset), and a new recovery starts with a fresh bitmap.

use std::cell::Cell;
use std::io;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use rdma_transport::auth::ClusterKey;
use rdma_transport::coordinator::api::{
    MapEntry, MapResponse, NodeInfo, RangeState, Replica, ReplicaState,
};
use rdma_transport::coordinator::{CoordinatorClient, CoordinatorError};
use rdma_transport::{
    ManagerConfig, Page, PollMode, TransportError, TransportKind, TransportManager, PAGE_SIZE,
};

use crate::config::ServerConfig;
use crate::layout::{Layout, PlacedRange};
use crate::other_processes;
use crate::registration::{node_credential, RegisteredWatch};
use crate::server::Shared as ServerShared;

/// Pages read from the source per request batch.
const BATCH_PAGES: usize = 64;
/// Deadline of each batch read from the source.
const SOURCE_REQUEST_TIMEOUT_MS: u64 = 5000;
/// Deadline of the one-page read that checks, before a recovery disturbs
/// this node's clients, that a live replica answers.
const SOURCE_PROBE_TIMEOUT_MS: u64 = 1000;
/// How long the connections shut down at the start of a recovery may take
/// to end.
const FENCE_TIMEOUT: Duration = Duration::from_secs(2);
/// Deadline of each coordinator request.
const COORDINATOR_TIMEOUT: Duration = Duration::from_secs(2);

/// Why one recovery attempt ended without the replica turning live.
#[derive(Debug, thiserror::Error)]
enum RecoveryError {
    #[error("coordinator: {0}")]
    Coordinator(#[from] CoordinatorError),
    #[error("the replica is no longer recovering under recovery {seq} (it went stale again, or this node restarted)")]
    Overtaken { seq: u64 },
    #[error("the coordinator's answer names no replica of this node")]
    NotAReplica,
    #[error("no live replica to copy from")]
    NoSource,
    #[error("no live replica answered ({tried} tried; node {node}: {source}); nothing was fenced")]
    NoSourceAnswers {
        tried: usize,
        node: String,
        source: TransportError,
    },
    #[error("copy from node {node}: {source}")]
    Copy {
        node: String,
        source: TransportError,
    },
    #[error("the range does not fit this node's exported memory at offset {offset}")]
    OutsideRegion { offset: u64 },
    #[error("the map has this node's replica at offset {map_offset:#x}, but the range is at {layout_offset:#x} here (registration not refreshed yet?)")]
    Misplaced { map_offset: u64, layout_offset: u64 },
    #[error("writing the copy into the exported memory: {0}")]
    Region(#[from] io::Error),
    #[error("page-server stopping")]
    Stopped,
    #[error("{connections} connection(s) still open {FENCE_TIMEOUT:?} after they were shut down")]
    ConnectionsLinger { connections: usize },
}

/// What the recovery works on, from the server's configuration.
#[derive(Debug)]
struct Plan {
    node_id: String,
    /// Every exported range, with its offset in the exported memory.
    ranges: Vec<PlacedRange>,
    period: Duration,
    retry: Duration,
    grace: Duration,
    rate_mib_s: u64,
    cluster_key: Option<ClusterKey>,
    page_checksums: bool,
}

/// An interruptible sleep, woken by [`Recovery::stop`].
#[derive(Debug, Default)]
struct Stop {
    state: Mutex<StopState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct StopState {
    stopped: bool,
    /// The thread waits for a long poll of the map, which nothing can
    /// interrupt: it does nothing more once that answers, if stopped.
    polling: bool,
}

impl Stop {
    /// Sleeps for `d` unless stopped first; true when stopped.
    fn sleep(&self, d: Duration) -> bool {
        let mut state = self.state.lock();
        if !state.stopped {
            let _ = self.cv.wait_for(&mut state, d);
        }
        state.stopped
    }

    fn is_stopped(&self) -> bool {
        self.state.lock().stopped
    }

    /// Runs `poll` unless stopped, marked as polling; `None` when stopped
    /// before or during it.
    fn polling<T>(&self, poll: impl FnOnce() -> T) -> Option<T> {
        {
            let mut state = self.state.lock();
            if state.stopped {
                return None;
            }
            state.polling = true;
        }
        let answer = poll();
        let mut state = self.state.lock();
        state.polling = false;
        (!state.stopped).then_some(answer)
    }
}

/// The background recovery thread.
#[derive(Debug)]
pub(crate) struct Recovery {
    stop: Arc<Stop>,
    handle: Option<JoinHandle<()>>,
}

impl Recovery {
    /// Starts the thread; it does nothing until `registered` holds.
    pub(crate) fn start(
        config: &ServerConfig,
        layout: &Layout,
        server: Arc<ServerShared>,
        registered: RegisteredWatch,
    ) -> Self {
        let plan = Plan {
            node_id: config.node_id.clone(),
            ranges: layout.ranges().to_vec(),
            period: config.heartbeat_interval,
            retry: config.register_retry,
            grace: config.recovery_grace,
            rate_mib_s: config.recovery_rate_mib_s,
            cluster_key: config.cluster_key.clone(),
            page_checksums: config.page_checksums,
        };
        let url = config.coordinator_url.clone().unwrap_or_default();
        let credential = node_credential(config);
        let stop = Arc::new(Stop::default());
        let thread_stop = Arc::clone(&stop);
        let handle = std::thread::Builder::new()
            .name("page-server-recovery".into())
            .spawn(move || {
                let client = match CoordinatorClient::with_credential(
                    &url,
                    &credential,
                    COORDINATOR_TIMEOUT,
                ) {
                    Ok(c) => c,
                    Err(err) => {
                        tracing::error!(%err, "replica recovery off: bad coordinator URL or node id");
                        return;
                    }
                };
                let follower = Follower {
                    plan,
                    server: Arc::downgrade(&server),
                    stop: thread_stop,
                    client,
                };
                // Only rounds hold the server: a long poll in progress
                // when it stops keeps nothing of it alive.
                drop(server);
                follower.run(&registered);
            })
            .map_err(|err| tracing::error!(%err, "cannot start the replica recovery thread"))
            .ok();
        Self { stop, handle }
    }

    /// Stops the thread (a copy in progress ends at its next batch) and
    /// joins it, unless it waits for a long poll of the map: it then ends
    /// when that answers, doing nothing more (`Stop::polling`).
    pub(crate) fn stop(mut self) {
        let in_poll = {
            let mut state = self.stop.state.lock();
            state.stopped = true;
            state.polling
        };
        self.stop.cv.notify_all();
        if let Some(h) = self.handle.take() {
            if !in_poll {
                let _ = h.join();
            }
        }
    }
}

/// What follows a round: the next map to look at.
enum Next {
    Map(MapResponse),
    /// The long poll failed: a period, then a plain read.
    Failed,
    Stopped,
}

/// The thread: rounds of recovery, each on the map that the last one's
/// long poll brought.
struct Follower {
    plan: Plan,
    server: Weak<ServerShared>,
    stop: Arc<Stop>,
    client: CoordinatorClient,
}

impl Follower {
    fn run(&self, registered: &RegisteredWatch) {
        while !registered.is_registered() {
            if self.stop.sleep(self.plan.retry) {
                return;
            }
        }
        let mut map = None;
        loop {
            let Some(server) = self.server.upgrade() else {
                return;
            };
            let worker = Worker {
                plan: &self.plan,
                server,
                stop: &self.stop,
                client: &self.client,
                round_failed: Cell::new(false),
            };
            let last_version = worker.round(map.take());
            let failed = worker.round_failed.get();
            drop(worker);
            map = match last_version {
                Some(version) if !failed => match self.next_map(version) {
                    Next::Map(next) => Some(next),
                    Next::Failed => None,
                    Next::Stopped => return,
                },
                _ => None,
            };
            if map.is_none() && self.stop.sleep(self.plan.period) {
                return;
            }
        }
    }

    /// The map once its version passes `version`, or after a period if it
    /// does not (a long poll): a client's stale mark of this replica is
    /// acted on at once, not up to a period later.
    fn next_map(&self, version: u64) -> Next {
        let period = self.plan.period;
        let sent = Instant::now();
        let Some(answer) = self.stop.polling(|| {
            self.client
                .map_after(version, period, period + COORDINATOR_TIMEOUT)
        }) else {
            return Next::Stopped;
        };
        match answer {
            Ok(map) => {
                // Answered at once with nothing new (a coordinator without
                // long polls): the rest of the period first.
                let rest = period.saturating_sub(sent.elapsed());
                if map.version <= version && !rest.is_zero() && self.stop.sleep(rest) {
                    return Next::Stopped;
                }
                Next::Map(map)
            }
            Err(err) => {
                tracing::debug!(%err, "replica recovery: cannot follow the map");
                Next::Failed
            }
        }
    }
}

/// One round of recovery, holding the server.
struct Worker<'f> {
    plan: &'f Plan,
    server: Arc<ServerShared>,
    stop: &'f Stop,
    client: &'f CoordinatorClient,
    /// A recovery of this round failed: the next round waits a period,
    /// whatever the map does (a failed attempt changes it).
    round_failed: Cell<bool>,
}

impl Worker<'_> {
    /// One look at the map (`first`, or read now), and a recovery of each
    /// range whose replica here is stale, one after the other. Returns the
    /// version of the last map it looked at (`None`: it could not read
    /// one, or stopped).
    fn round(&self, first: Option<MapResponse>) -> Option<u64> {
        let mut map = first;
        let mut last_version = None;
        for (index, range) in self.plan.ranges.iter().enumerate() {
            if self.stop.is_stopped() {
                return None;
            }
            let current = match map.take() {
                Some(map) => map,
                None => match self.client.map() {
                    Ok(map) => map,
                    Err(err) => {
                        tracing::debug!(%err, "replica recovery: cannot read the map");
                        return None;
                    }
                },
            };
            last_version = Some(current.version);
            if other_processes::replaced_in(
                &current,
                &self.plan.node_id,
                self.server.exported.epoch,
            ) {
                // The node's replicas are another process's now: copying
                // into this one's memory would make them live with the
                // other's memory empty.
                tracing::debug!("replica recovery: another process is this node now");
                return None;
            }
            if let Some(mine) = own_entry(&current, range).and_then(|e| self.own_replica(e)) {
                self.server.seen.note(index, mine.state);
            }
            if !self.range_round(index, range, &current) {
                // No recovery ran: the map is still current for the next range.
                map = Some(current);
            }
        }
        last_version
    }

    /// A recovery of `range` when this node's replica of it is stale in
    /// `map` and another replica is live. Returns whether one ran.
    fn range_round(&self, index: usize, range: &PlacedRange, map: &MapResponse) -> bool {
        let Some(entry) = own_entry(map, range) else {
            return false;
        };
        let Some(mine) = self.own_replica(entry) else {
            return false;
        };
        // `Recovering` here is an attempt of this node that ended without
        // an answer to its `live` request (or an earlier process's, which
        // the coordinator reports as stale anyway): start a new one.
        if !matches!(mine.state, ReplicaState::Stale | ReplicaState::Recovering) {
            return false;
        }
        if live_sources(map, entry, &self.plan.node_id).is_empty() {
            tracing::debug!(
                gpa_start = format_args!("{:#x}", range.gpa_start),
                length_bytes = range.length_bytes,
                "replica stale and no other replica live: nothing to recover from"
            );
            return false;
        }
        let counters = &self.server.recovery;
        if let Err(err) = self.probe_sources(range, map) {
            self.failed(range, &err, "not started");
            return false;
        }
        counters.set_running(Some(range.gpa_start));
        let started = Instant::now();
        let result = self.recover(range);
        self.server.exported.guard.end();
        let reconnect = self.server.admission.conns.resume_rdma();
        if reconnect > 0 {
            tracing::info!(
                connections = reconnect,
                "RDMA offered again: closed the connections answered without it"
            );
        }
        counters.set_running(None);
        match result {
            Ok((seq, pages)) => {
                counters.recovered();
                self.server.seen.note(index, ReplicaState::Live);
                tracing::info!(
                    node = %self.plan.node_id,
                    gpa_start = format_args!("{:#x}", range.gpa_start),
                    length_bytes = range.length_bytes,
                    remote_offset = format_args!("{:#x}", range.remote_offset),
                    recovery_seq = seq,
                    copied_pages = pages,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "replica recovered: live again"
                );
            }
            Err(RecoveryError::Stopped) => {}
            Err(err) => self.failed(range, &err, "failed"),
        }
        true
    }

    /// Counts a recovery of `range` that did not turn it live (`outcome`:
    /// how far it got) and logs why.
    fn failed(&self, range: &PlacedRange, err: &RecoveryError, outcome: &str) {
        self.round_failed.set(true);
        self.server.recovery.failed();
        tracing::warn!(
            node = %self.plan.node_id,
            gpa_start = format_args!("{:#x}", range.gpa_start),
            length_bytes = range.length_bytes,
            %err,
            retry_in_ms = self.plan.period.as_millis() as u64,
            "replica recovery {outcome}; trying again next period"
        );
    }

    /// Reads the range's first page from each live replica in `map` until
    /// one answers. A recovery starts by fencing this node's clients (every
    /// connection closed, RDMA paused until it ends); one whose sources are
    /// all out of reach from here would do that for nothing, and again
    /// every period for as long as they stay so.
    fn probe_sources(&self, range: &PlacedRange, map: &MapResponse) -> Result<(), RecoveryError> {
        let entry = own_entry(map, range).ok_or(RecoveryError::NotAReplica)?;
        let sources = live_sources(map, entry, &self.plan.node_id);
        let mut last = None;
        for &(source, node) in &sources {
            let config = ManagerConfig {
                request_timeout_ms: SOURCE_PROBE_TIMEOUT_MS,
                connect_timeout_ms: SOURCE_PROBE_TIMEOUT_MS,
                ..self.manager_config()
            };
            let mut page: Page = [0u8; PAGE_SIZE];
            let answered = TransportManager::from_map(config, source_map(entry, source, node))
                .and_then(|m| m.read_pages(&[entry.gpa_start], std::slice::from_mut(&mut page)));
            match answered {
                Ok(()) => return Ok(()),
                Err(err) => {
                    tracing::debug!(source = %node.id, %err, "replica recovery: a live replica did not answer");
                    last = Some((node.id.clone(), err));
                }
            }
        }
        match last {
            Some((node, source)) => Err(RecoveryError::NoSourceAnswers {
                tried: sources.len(),
                node,
                source,
            }),
            None => Err(RecoveryError::NoSource),
        }
    }

    /// Marks the replica recovering, waits the grace period, copies the
    /// range and marks it live. Returns the recovery's number and the pages
    /// copied in.
    fn recover(&self, range: &PlacedRange) -> Result<(u64, u64), RecoveryError> {
        let (gpa_start, me) = (range.gpa_start, self.plan.node_id.as_str());
        // Fence first: a write a client gave up on while this replica was
        // cut off from it (the reason it is stale) may still be in its
        // TCP's send queue, and land when the link comes back, older than
        // what the live replicas hold. Landed before the guard, the copy
        // overwrites it; after, the guard would keep it for good. So every
        // connection opened before now is closed (and its thread gone)
        // before the guard begins.
        self.fence_connections()?;
        // Then the guard: clients may write here as soon as the coordinator
        // says `recovering`, before its answer reaches this thread. The
        // caller turns it off whatever the outcome.
        self.server.exported.guard.begin();
        // Named by this process's epoch: the coordinator refuses a recovery
        // by any other process of this node (an earlier one still running
        // would otherwise copy into memory that nobody serves and turn the
        // current process's empty replica live).
        let epoch = self.server.exported.epoch;
        let change = self.client.begin_recovery(gpa_start, me, epoch)?;
        let seq = self
            .own_replica(&change.entry)
            .map(|r| r.recovery_seq)
            .ok_or(RecoveryError::NotAReplica)?;
        tracing::info!(
            node = %me,
            gpa_start = format_args!("{gpa_start:#x}"),
            length_bytes = range.length_bytes,
            recovery_seq = seq,
            grace_ms = self.plan.grace.as_millis() as u64,
            "replica recovery started; waiting the grace period so that every client writes here too"
        );
        // A protocol wait, not a synchronisation shortcut: clients learn
        // that this replica takes writes from their next map refresh, and a
        // write sent before that may still be in flight for a request
        // timeout. The copy must not start before both have passed.
        if self.stop.sleep(self.plan.grace) {
            return Err(RecoveryError::Stopped);
        }
        let map = self.client.map()?;
        let entry = own_entry(&map, range).ok_or(RecoveryError::Overtaken { seq })?;
        let mine = self
            .own_replica(entry)
            .filter(|r| r.state == ReplicaState::Recovering && r.recovery_seq == seq)
            .ok_or(RecoveryError::Overtaken { seq })?;
        // Clients address this replica at the map's offset; the copy must
        // land at the same place, which must be this range's own slot.
        if mine.remote_offset != range.remote_offset {
            return Err(RecoveryError::Misplaced {
                map_offset: mine.remote_offset,
                layout_offset: range.remote_offset,
            });
        }
        let dest_offset = range.remote_offset;
        let sources = live_sources(&map, entry, me);
        if sources.is_empty() {
            return Err(RecoveryError::NoSource);
        }
        let mut last_err = RecoveryError::NoSource;
        for (source, node) in sources {
            match self.copy_from(entry, source, node, dest_offset) {
                Ok(pages) => {
                    return match self.client.finish_recovery(gpa_start, me, seq, epoch) {
                        Ok(_) => Ok((seq, pages)),
                        Err(err) if err.is_conflict() => Err(RecoveryError::Overtaken { seq }),
                        Err(err) => Err(err.into()),
                    };
                }
                Err(err @ (RecoveryError::Stopped | RecoveryError::OutsideRegion { .. })) => {
                    return Err(err)
                }
                Err(err) => {
                    tracing::warn!(
                        gpa_start = format_args!("{gpa_start:#x}"),
                        source = %node.id,
                        %err,
                        "replica recovery: copy failed; trying the next live replica"
                    );
                    last_err = err;
                }
            }
        }
        Err(last_err)
    }

    /// Closes the connections opened before the recovery and pauses RDMA
    /// (`Connections::fence`), and waits until their threads, and so their
    /// QPs, are gone. Their clients reconnect; until the recovery ends they
    /// get TCP only: an RDMA WRITE lands in memory without this process
    /// seeing it, so the write guard could not keep it from being
    /// overwritten by an older copied page.
    fn fence_connections(&self) -> Result<(), RecoveryError> {
        let conns = &self.server.admission.conns;
        let closed = conns.fence();
        if closed > 0 {
            tracing::info!(
                connections = closed,
                "replica recovery: closed the connections opened before it; clients reconnect, over TCP until it ends"
            );
        }
        let deadline = Instant::now() + FENCE_TIMEOUT;
        while conns.fenced_open() > 0 {
            if Instant::now() >= deadline {
                return Err(RecoveryError::ConnectionsLinger {
                    connections: conns.fenced_open(),
                });
            }
            if self.stop.sleep(Duration::from_millis(1)) {
                return Err(RecoveryError::Stopped);
            }
        }
        Ok(())
    }

    /// Copies the range from `source` (reached at `node`) into the exported
    /// memory at `dest_offset`, through the write guard. Returns the pages
    /// applied (those a client wrote meanwhile are kept, not counted).
    fn copy_from(
        &self,
        entry: &MapEntry,
        source: &Replica,
        node: &NodeInfo,
        dest_offset: u64,
    ) -> Result<u64, RecoveryError> {
        let region = &self.server.exported.region;
        let dest = usize::try_from(dest_offset)
            .ok()
            .filter(|d| {
                usize::try_from(entry.length_bytes)
                    .ok()
                    .and_then(|len| d.checked_add(len))
                    .is_some_and(|end| end <= region.len_bytes())
            })
            .ok_or(RecoveryError::OutsideRegion {
                offset: dest_offset,
            })?;
        let copy_err = |source| RecoveryError::Copy {
            node: node.id.clone(),
            source,
        };
        let manager =
            TransportManager::from_map(self.manager_config(), source_map(entry, source, node))
                .map_err(copy_err)?;
        let pages = entry.length_bytes / PAGE_SIZE as u64;
        let mut buf: Vec<Page> = vec![[0u8; PAGE_SIZE]; BATCH_PAGES];
        let mut gpas = Vec::with_capacity(BATCH_PAGES);
        let (started, mut applied) = (Instant::now(), 0u64);
        let mut first = 0u64;
        while first < pages {
            if self.stop.is_stopped() {
                return Err(RecoveryError::Stopped);
            }
            let count = (pages - first).min(BATCH_PAGES as u64) as usize;
            gpas.clear();
            gpas.extend(
                (0..count as u64).map(|i| entry.gpa_start + (first + i) * PAGE_SIZE as u64),
            );
            manager
                .read_pages(&gpas, &mut buf[..count])
                .map_err(copy_err)?;
            let mut batch_applied = 0u64;
            for (i, page) in buf[..count].iter().enumerate() {
                let off = dest + (first as usize + i) * PAGE_SIZE;
                if self.server.exported.guard.apply_copy(
                    region,
                    &self.server.exported.sums,
                    off,
                    page,
                )? {
                    batch_applied += 1;
                }
            }
            self.server.recovery.pages_copied(batch_applied);
            applied += batch_applied;
            first += count as u64;
            self.pace(started, first * PAGE_SIZE as u64)?;
        }
        Ok(applied)
    }

    /// Sleeps as long as needed to keep the copy under the rate bound.
    fn pace(&self, started: Instant, copied_bytes: u64) -> Result<(), RecoveryError> {
        if self.plan.rate_mib_s == 0 {
            return Ok(());
        }
        let due = Duration::from_secs_f64(
            copied_bytes as f64 / (self.plan.rate_mib_s as f64 * f64::from(1u32 << 20)),
        );
        let ahead = due.saturating_sub(started.elapsed());
        if !ahead.is_zero() && self.stop.sleep(ahead) {
            return Err(RecoveryError::Stopped);
        }
        Ok(())
    }

    /// A manager of its own for the copy: TCP (the copy goes through this
    /// CPU anyway), one unpinned event-driven poller, no coordinator.
    fn manager_config(&self) -> ManagerConfig {
        ManagerConfig {
            cluster_key: self.plan.cluster_key.clone(),
            transport: TransportKind::Tcp,
            pool_size_bytes: BATCH_PAGES * PAGE_SIZE,
            poller_threads: 1,
            poller_cpus: Some(Vec::new()),
            poll_mode: PollMode::Event,
            request_timeout_ms: SOURCE_REQUEST_TIMEOUT_MS,
            map_refresh_ms: 0,
            page_checksums: self.plan.page_checksums,
            ..ManagerConfig::default()
        }
    }

    /// This node's replica of `entry`.
    fn own_replica<'e>(&self, entry: &'e MapEntry) -> Option<&'e Replica> {
        entry
            .replicas
            .iter()
            .find(|r| r.node_id == self.plan.node_id)
    }
}

/// `range`'s entry in `map` (same start and length).
fn own_entry<'m>(map: &'m MapResponse, range: &PlacedRange) -> Option<&'m MapEntry> {
    map.entries
        .iter()
        .find(|e| e.gpa_start == range.gpa_start && e.length_bytes == range.length_bytes)
}

/// The live replicas of `entry` other than `me`'s whose node is alive, in
/// the map's order, with their nodes.
fn live_sources<'m>(
    map: &'m MapResponse,
    entry: &'m MapEntry,
    me: &str,
) -> Vec<(&'m Replica, &'m NodeInfo)> {
    entry
        .replicas
        .iter()
        .filter(|r| r.state == ReplicaState::Live && r.node_id != me)
        .filter_map(|r| {
            map.nodes
                .iter()
                .find(|n| n.id == r.node_id && n.alive)
                .map(|n| (r, n))
        })
        .collect()
}

/// A map whose only entry puts the range on `source`, valid in its epoch:
/// the manager's epoch fence then refuses any other process at that address.
fn source_map(entry: &MapEntry, source: &Replica, node: &NodeInfo) -> MapResponse {
    MapResponse {
        version: 1,
        generation: 0,
        entries: vec![MapEntry {
            gpa_start: entry.gpa_start,
            length_bytes: entry.length_bytes,
            node_id: source.node_id.clone(),
            remote_offset: source.remote_offset,
            rdma: None,
            valid_epoch: source.valid_epoch,
            state: RangeState::Live,
            replicas: Vec::new(),
        }],
        nodes: vec![node.clone()],
    }
}
