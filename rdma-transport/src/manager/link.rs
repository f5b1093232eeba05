//! A node's live connection, over TCP or RDMA, and how the manager makes
//! one: RDMA when both ends have a usable device, TCP otherwise (or only,
//! for `TransportKind::Tcp`).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::map_state::Refusal;
use super::{Inner, Node, RETRY_INTERVAL};
use crate::config::{DataPath, ManagerConfig, TransportKind};
use crate::error::TransportError;
use crate::pool::PagePool;
use crate::rdma::{dial_rdma, ClientDevice, Dialed, RdmaConnection, RdmaPollers};
use crate::tcp::{ClientAuth, ConnectError, TcpConnection, Waiter, CODE_CONN_LOST};

/// The connection a node's requests go over.
#[derive(Debug, Clone)]
pub(super) enum Link {
    Tcp(Arc<TcpConnection>),
    Rdma(Arc<RdmaConnection>),
}

impl Link {
    pub(super) fn is_broken(&self) -> bool {
        match self {
            Self::Tcp(c) => c.is_broken(),
            Self::Rdma(c) => c.is_broken(),
        }
    }

    pub(super) fn mark_broken(&self) {
        match self {
            Self::Tcp(c) => c.mark_broken(CODE_CONN_LOST),
            Self::Rdma(c) => c.mark_broken(CODE_CONN_LOST),
        }
    }

    pub(super) fn path(&self) -> DataPath {
        match self {
            Self::Tcp(_) => DataPath::Tcp,
            Self::Rdma(_) => DataPath::Rdma,
        }
    }

    /// The server's epoch (its HELLO_ACK's).
    pub(super) fn epoch(&self) -> u64 {
        match self {
            Self::Tcp(c) => c.ack.epoch,
            Self::Rdma(c) => c.ack.epoch,
        }
    }

    /// Whether both are the same connection.
    pub(super) fn same(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Tcp(a), Self::Tcp(b)) => Arc::ptr_eq(a, b),
            (Self::Rdma(a), Self::Rdma(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }
}

/// The manager's RDMA side: the device with the registered pool, and the
/// pollers whose channels the CQs use.
///
/// Field order is drop order: the pollers stop (and drop their connections)
/// before the device closes.
#[derive(Debug)]
pub(super) struct RdmaSide {
    pub(super) pollers: RdmaPollers,
    pub(super) device: Arc<ClientDevice>,
}

impl RdmaSide {
    /// Opens the device for `config` unless the transport is TCP only.
    /// `Ok(None)`: TCP for every node (no device, and `Auto`).
    ///
    /// # Errors
    /// [`TransportError::RdmaUnavailable`] with the reason, for
    /// `TransportKind::Rdma` on a host without a usable device.
    pub(super) fn open(
        config: &ManagerConfig,
        pool: &PagePool,
        cpus: &[usize],
    ) -> Result<Option<Self>, TransportError> {
        if config.transport == TransportKind::Tcp {
            return Ok(None);
        }
        let opened = ClientDevice::open(config, pool).and_then(|device| {
            let pollers =
                RdmaPollers::start(&device, config.poller_threads, cpus, config.poll_mode)?;
            Ok(Self { pollers, device })
        });
        match (opened, config.transport) {
            (Ok(side), _) => Ok(Some(side)),
            (Err(reason), TransportKind::Rdma) => Err(TransportError::RdmaUnavailable(reason)),
            (Err(reason), _) => {
                tracing::info!(%reason, "no usable RDMA device on this host; transport auto uses TCP for every node");
                Ok(None)
            }
        }
    }
}

impl Inner {
    /// The node's live connection, connecting (at most once per
    /// `RETRY_INTERVAL` after a failure) when there is none. Returns by
    /// `deadline`: one caller dials (bounded by its deadline), others of the
    /// same node wait for that dial each until its own deadline, and no lock
    /// is held across the dial. `hedging`: `deadline` is a hedged read's
    /// delay, and a dial that runs it out is not the node's failure.
    pub(super) fn connection(
        &self,
        node: &Node,
        deadline: Instant,
        hedging: bool,
    ) -> Result<Link, TransportError> {
        // A guard, then one clone of the link (one increment), not a
        // clone of the `Arc<Link>` and another of the link inside it.
        let live = || {
            node.conn
                .load()
                .as_deref()
                .filter(|c| !c.is_broken())
                .cloned()
        };
        if let Some(link) = live() {
            return Ok(link);
        }
        let mut dial = node.dial.lock();
        loop {
            if let Some(link) = live() {
                return Ok(link);
            }
            if !dial.dialing {
                break;
            }
            if node.dial_done.wait_until(&mut dial, deadline).timed_out() && dial.dialing {
                return Err(self.timeout(node));
            }
        }
        if dial
            .last_failure
            .is_some_and(|t| t.elapsed() < RETRY_INTERVAL)
        {
            if let Some(refusal) = node.refusal.lock().as_ref() {
                return Err(refusal.to_error(&node.id));
            }
            return Err(TransportError::NodeDown {
                node: node.id.clone(),
                reason: "unreachable (retrying)".into(),
            });
        }
        let timeout = self
            .config
            .connect_timeout()
            .min(deadline.saturating_duration_since(Instant::now()));
        if timeout.is_zero() {
            return Err(self.timeout(node));
        }
        // A hedged read's delay, not the connect timeout, bounds this dial.
        let cut_short = hedging && timeout < self.config.connect_timeout();
        dial.dialing = true;
        drop(dial);
        let dialing = DialingGuard(node);
        let started = Instant::now();
        let result = self.dial(node, timeout);
        let mut dial = node.dial.lock();
        match result {
            Err(err) if cut_short && started.elapsed() >= timeout => {
                // It ran out a hedging delay, which says nothing of the
                // node: not its failure, so its next request (a write that
                // must reach it) dials again at once instead of failing
                // for `RETRY_INTERVAL`, and marking the replica stale. (A
                // dial that runs out a whole request deadline is the
                // node's failure: its requests fail fast for a while.)
                drop(dial);
                drop(dialing);
                tracing::debug!(node = %node.id, %err, "dial cut short by the caller's deadline");
                Err(self.timeout(node))
            }
            Ok(link) => {
                let epoch = link.epoch();
                let old_epoch = node.epoch.swap(epoch, Ordering::Relaxed);
                if old_epoch != 0 && old_epoch != epoch {
                    tracing::info!(node = %node.id, "page-server restarted (new epoch); reconnected");
                }
                let path = link.path();
                let mut logged = node.logged_path.lock();
                if *logged != Some(path) {
                    *logged = Some(path);
                    tracing::info!(node = %node.id, addr = %node.addr, %path, "data path for node");
                }
                drop(logged);
                node.conn.store(Some(Arc::new(link.clone())));
                dial.last_failure = None;
                *node.refusal.lock() = None;
                drop(dial);
                drop(dialing);
                self.publish_view();
                Ok(link)
            }
            Err(err) => {
                dial.last_failure = Some(Instant::now());
                *node.refusal.lock() = Refusal::of(&err);
                drop(dial);
                drop(dialing);
                if matches!(
                    err,
                    TransportError::NodeDown { .. } | TransportError::AuthFailed { .. }
                ) {
                    self.refresh_on_miss(deadline);
                }
                Err(err)
            }
        }
    }

    fn timeout(&self, node: &Node) -> TransportError {
        TransportError::Timeout {
            node: node.id.clone(),
            timeout_ms: self.config.request_timeout_ms,
        }
    }

    /// Makes a new connection to `node` over the data path this manager and
    /// the page-server can both use.
    fn dial(&self, node: &Node, timeout: Duration) -> Result<Link, TransportError> {
        let Some(rdma) = &self.rdma else {
            return self.dial_tcp(node, timeout);
        };
        let poller = rdma.pollers.pick();
        let dialed = dial_rdma(
            &node.addr,
            &self.client_auth(node),
            timeout,
            &rdma.device,
            &poller.channel,
        );
        let require = self.config.transport == TransportKind::Rdma;
        match dialed {
            Ok(Dialed::Rdma(conn)) => {
                RdmaPollers::add(&poller, &conn);
                Ok(Link::Rdma(conn))
            }
            Ok(Dialed::TcpOnly(_)) if require => Err(TransportError::RdmaUnavailable(format!(
                "node {}'s page-server at {} does not offer RDMA",
                node.id, node.addr
            ))),
            Ok(Dialed::TcpOnly(conn)) => {
                self.pollers.add(&conn);
                Ok(Link::Tcp(conn))
            }
            Err(crate::rdma::DialError::Tcp(err)) => Err(connect_error(node, err)),
            Err(err) if require => Err(TransportError::RdmaUnavailable(format!(
                "node {}: {err}",
                node.id
            ))),
            Err(err) => {
                tracing::warn!(node = %node.id, %err, "RDMA set-up failed; using TCP for this node");
                self.dial_tcp(node, timeout)
            }
        }
    }

    fn dial_tcp(&self, node: &Node, timeout: Duration) -> Result<Link, TransportError> {
        let conn = TcpConnection::connect(&node.addr, &self.client_auth(node), timeout)
            .map_err(|err| connect_error(node, err))?;
        let conn = Arc::new(conn);
        self.pollers.add(&conn);
        Ok(Link::Tcp(conn))
    }
}

impl Inner {
    fn client_auth<'a>(&'a self, node: &'a Node) -> ClientAuth<'a> {
        ClientAuth {
            client_id: self.client_id,
            node_id: &node.id,
            key: self.config.cluster_key.as_ref(),
            checksums: self.config.page_checksums,
            coherence: false,
            node_bound_ms: None,
            landed_pages: Some(&self.tcp_landed_pages),
        }
    }
}

/// What a failed dial means to the caller: a peer that fails the cluster
/// key check is `AuthFailed` (and said so in the log), anything else
/// `NodeDown`.
fn connect_error(node: &Node, err: ConnectError) -> TransportError {
    match err {
        ConnectError::AuthFailed { addr, detail } => {
            tracing::warn!(node = %node.id, %addr, %detail, "refusing a peer that failed authentication");
            TransportError::AuthFailed {
                node: node.id.clone(),
                detail: format!("{addr}: {detail}"),
            }
        }
        other => TransportError::NodeDown {
            node: node.id.clone(),
            reason: other.to_string(),
        },
    }
}

/// Ends a node's dial, even one that unwinds: clears `dialing` and wakes
/// the callers waiting for it.
struct DialingGuard<'a>(&'a Node);

impl Drop for DialingGuard<'_> {
    fn drop(&mut self) {
        self.0.dial.lock().dialing = false;
        self.0.dial_done.notify_all();
    }
}

/// Waits for a chunk that went to TCP and RDMA nodes at once: parks and lets
/// both kinds of pollers complete it (a rare case: mixed clusters only).
pub(super) fn wait_mixed(
    waiter: &Waiter,
    tcp: &[Option<Arc<TcpConnection>>],
    rdma: &[Option<Arc<RdmaConnection>>],
    deadline: Instant,
) -> bool {
    for c in rdma.iter().flatten() {
        c.progress();
    }
    if waiter.is_done() {
        return true;
    }
    for c in tcp.iter().flatten() {
        c.parking.enter();
    }
    for c in rdma.iter().flatten() {
        c.parking.enter();
    }
    let done = waiter.wait(Duration::ZERO, deadline);
    for c in tcp.iter().flatten() {
        c.parking.leave();
    }
    for c in rdma.iter().flatten() {
        c.parking.leave();
    }
    done
}
