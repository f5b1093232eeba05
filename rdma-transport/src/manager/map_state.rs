//! The map the manager routes by, and the nodes it names: installing a
//! newer map (never an older one), refreshing it from the coordinator within
//! a caller's deadline, and closing the connections of nodes that left.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use parking_lot::{Condvar, Mutex};

use super::link::Link;
use super::{Inner, RETRY_INTERVAL};
use crate::config::DataPath;
use crate::coordinator::api::{MapResponse, NodeInfo};
use crate::error::TransportError;
use crate::gpa_map::{other_generation, GpaMap};

/// One installed map and the nodes it names, in the map's node order.
#[derive(Debug, Default)]
pub(super) struct MapState {
    pub(super) map: GpaMap,
    pub(super) nodes: Vec<Arc<Node>>,
}

/// A node of the map at one address. A node that changes address is a new
/// `Node`; the old one (and its connection) goes when the last request that
/// still uses it is done.
#[derive(Debug)]
pub(super) struct Node {
    pub(super) id: String,
    pub(super) addr: String,
    pub(super) conn: ArcSwapOption<Link>,
    /// Who is dialling, and when the last attempt failed.
    pub(super) dial: Mutex<DialState>,
    /// Signalled when a dial ends (callers of the same node wait on it,
    /// each until its own deadline).
    pub(super) dial_done: Condvar,
    pub(super) epoch: AtomicU64,
    /// Until when (ms of `Inner::clock`) reads of replicated ranges prefer
    /// other replicas: a request to this node failed.
    pub(super) avoid_until_ms: AtomicU64,
    /// The data path last logged for this node (logged once per change).
    pub(super) logged_path: Mutex<Option<DataPath>>,
    /// Why the last attempt was refused, when that is more than "down"
    /// (repeated to callers until the next attempt).
    pub(super) refusal: Mutex<Option<Refusal>>,
}

/// A refusal a node's callers keep getting until the next attempt.
#[derive(Debug, Clone)]
pub(super) enum Refusal {
    /// RDMA is required and the node cannot do it.
    Rdma(String),
    /// The peer at the node's address failed authentication.
    Auth(String),
}

impl Refusal {
    pub(super) fn of(err: &TransportError) -> Option<Self> {
        match err {
            TransportError::RdmaUnavailable(reason) => Some(Self::Rdma(reason.clone())),
            TransportError::AuthFailed { detail, .. } => Some(Self::Auth(detail.clone())),
            _ => None,
        }
    }

    pub(super) fn to_error(&self, node: &str) -> TransportError {
        match self {
            Self::Rdma(reason) => TransportError::RdmaUnavailable(reason.clone()),
            Self::Auth(detail) => TransportError::AuthFailed {
                node: node.to_owned(),
                detail: detail.clone(),
            },
        }
    }
}

/// A node's connection attempts.
#[derive(Debug, Default)]
pub(super) struct DialState {
    /// A caller is dialling now (outside the lock).
    pub(super) dialing: bool,
    pub(super) last_failure: Option<Instant>,
}

impl Node {
    fn new(info: &NodeInfo) -> Self {
        Self {
            id: info.id.clone(),
            addr: info.tcp_addr.clone(),
            conn: ArcSwapOption::empty(),
            dial: Mutex::new(DialState::default()),
            dial_done: Condvar::new(),
            epoch: AtomicU64::new(0),
            avoid_until_ms: AtomicU64::new(0),
            logged_path: Mutex::new(None),
            refusal: Mutex::new(None),
        }
    }
}

impl Drop for Node {
    /// The node left the map or moved: close its connection (socket, receive
    /// buffer, QP), failing anything still in flight on it. The poller that
    /// served it drops it at its next turn.
    fn drop(&mut self) {
        if let Some(link) = self.conn.swap(None) {
            tracing::debug!(node = %self.id, addr = %self.addr, "closing the connection of a node no longer in the map");
            link.mark_broken();
        }
    }
}

/// Whether a map may replace the one in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Install {
    /// Only if its version is newer (every refresh and update).
    IfNewer,
    /// Whatever its version (the first map).
    Always,
}

impl Inner {
    /// Refreshes the map unless that happened less than `RETRY_INTERVAL`
    /// ago, giving the coordinator no longer than `deadline`.
    pub(super) fn refresh_on_miss(&self, deadline: Instant) {
        if self.coordinator.is_none() {
            return;
        }
        {
            let mut last = self.last_refresh.lock();
            if last.is_some_and(|t| t.elapsed() < RETRY_INTERVAL) {
                return;
            }
            *last = Some(Instant::now());
        }
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return;
        }
        if let Err(err) = self.refresh(Some(remaining)) {
            tracing::warn!(%err, "map refresh failed");
        }
    }

    /// Fetches the map (within `timeout` when given, else the client's own)
    /// and installs it if it is newer. Returns the coordinator's version.
    pub(super) fn refresh(&self, timeout: Option<Duration>) -> Result<u64, TransportError> {
        let client = self.coordinator.as_ref().ok_or_else(|| {
            TransportError::Config("manager has a fixed map and no coordinator".into())
        })?;
        let sent_ms = self.clock_ms();
        let resp = match timeout {
            Some(t) => client.map_within(t)?,
            None => client.map()?,
        };
        let version = resp.version;
        self.install_map(resp, Install::IfNewer);
        self.map_confirmed_ms.fetch_max(sent_ms, Ordering::Relaxed);
        Ok(version)
    }

    /// Before a long poll of the map: the version in use and the time the
    /// poll is sent (ms of `clock`).
    pub(super) fn long_poll_start(&self) -> (u64, u64) {
        (self.state.load().map.version(), self.clock_ms())
    }

    /// Installs the answer to a long poll sent at `sent_ms` for a version
    /// past `after`, waiting at most `wait_ms`. An answer still at `after`
    /// that took the whole wait was read by the coordinator at or after
    /// `sent_ms + wait_ms` (it reads the map again at its deadline), so the
    /// map in use is confirmed as of then; any other answer only as of
    /// `sent_ms`. Returns false for an answer that neither changed the
    /// version nor took the wait (a coordinator without long polls): the
    /// caller then waits before it polls again.
    pub(super) fn finish_long_poll(
        &self,
        resp: MapResponse,
        after: u64,
        sent_ms: u64,
        wait_ms: u64,
    ) -> bool {
        let changed = resp.version > after
            || other_generation(resp.generation, self.state.load().map.generation());
        let waited = self.clock_ms().saturating_sub(sent_ms) >= wait_ms;
        self.install_map(resp, Install::IfNewer);
        let confirmed_ms = if !changed && waited {
            sent_ms + wait_ms
        } else {
            sent_ms
        };
        self.map_confirmed_ms
            .fetch_max(confirmed_ms, Ordering::Relaxed);
        changed || waited
    }

    /// Whether writes to a range with a replica that takes none must first
    /// refresh the map: it is older than one refresh period. Such a
    /// replica may have begun recovering since (it then takes every write,
    /// and the page-server's grace period assumes each client learns that
    /// within a refresh period plus a request timeout, see
    /// docs/operations.md); a write that skipped it would be missing from
    /// its copy. Never for a manager without a coordinator or periodic
    /// refresh (its embedder distributes the map).
    pub(super) fn map_too_old_for_writes(&self) -> bool {
        if self.coordinator.is_none() || self.config.map_refresh_ms == 0 {
            return false;
        }
        let confirmed = self.map_confirmed_ms.load(Ordering::Relaxed);
        self.clock_ms().saturating_sub(confirmed) > self.config.map_refresh_ms
    }

    /// Swaps in `resp`'s map, keeping the nodes (and connections) whose
    /// address did not change. With `Install::IfNewer`, a map whose version
    /// is not newer than the one in use is dropped: refreshes race (the
    /// background loop, misses, lost nodes), and an answer that was slower
    /// to arrive must not undo a newer one. A map of another generation
    /// (`GpaMap::supersedes`: the coordinator lost its state and counts
    /// from 0 again) is always installed. Returns whether it was installed.
    pub(super) fn install_map(&self, resp: MapResponse, rule: Install) -> bool {
        let map = GpaMap::from_response(resp);
        loop {
            let old = self.state.load_full();
            if rule == Install::IfNewer && !map.supersedes(old.map.generation(), old.map.version())
            {
                return false;
            }
            if other_generation(map.generation(), old.map.generation()) {
                tracing::warn!(
                    old_generation = old.map.generation(),
                    old_version = old.map.version(),
                    generation = map.generation(),
                    version = map.version(),
                    "the coordinator's map is of another generation (it lost its state): installed whatever its version"
                );
            }
            let nodes = map
                .nodes()
                .iter()
                .map(|info| {
                    old.nodes
                        .iter()
                        .find(|n| n.id == info.id && n.addr == info.tcp_addr)
                        .cloned()
                        .unwrap_or_else(|| Arc::new(Node::new(info)))
                })
                .collect();
            let new = Arc::new(MapState {
                map: map.clone(),
                nodes,
            });
            let prev = self.state.compare_and_swap(&old, new);
            if Arc::ptr_eq(&prev, &old) {
                drop(prev);
                self.publish_view();
                self.leave_replaced_homes(&map);
                tracing::debug!(
                    version = map.version(),
                    ranges = map.len(),
                    "GPA map installed"
                );
                return true;
            }
            // Another thread installed a map meanwhile: decide again
            // against that one.
        }
    }
}
