//! The listener, the connection threads, and the handle to stop them.

use std::io;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

use rdma_transport::coordinator::api::{RangeContents, RdmaRegion};
use rdma_transport::region::{MapOptions, MappedRegion};

use crate::admission::Admission;
use crate::client_keys::ClientKeyKind;
use crate::coherence_home::{CoherenceHome, CoherenceStats};
use crate::config::ServerConfig;
use crate::connection::Exported;
use crate::handshake::ServerAuth;
use crate::held_ranges::{HeldRange, HeldRanges};
use crate::layout::Layout;
use crate::limits::Timeouts;
use crate::metrics::PageMetrics;
use crate::metrics_http::MetricsEndpoint;
use crate::page_sums::PageSums;
use crate::range_contents::RangesSeen;
use crate::rdma::RdmaExport;
use crate::recovery::Recovery;
use crate::recovery_guard::RecoveryGuard;
use crate::registration::{OtherProcesses, Registration};
use crate::self_fence::SelfFence;
use crate::stats::{RecoveryCounters, ServerStats};

/// Why a page-server could not start or register.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// Bad settings.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The exported memory could not be mapped.
    #[error("cannot map {memory_bytes} bytes of exported memory: {source}")]
    Memory {
        /// Requested size.
        memory_bytes: usize,
        /// The OS error.
        source: io::Error,
    },
    /// The listener could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// Requested address.
        addr: SocketAddr,
        /// The OS error.
        source: io::Error,
    },
    /// The coordinator refused the registration (e.g. the range overlaps
    /// another node's: 409).
    #[error("coordinator refused registration: {0}")]
    Registration(String),
    /// The state directory cannot be used (`ServerConfig::state_dir`).
    #[error("state directory: {0}")]
    StateDir(#[from] crate::held_ranges::StateDirError),
    /// Registration did not finish in time.
    #[error("not registered with the coordinator after {0:?}")]
    RegistrationTimeout(Duration),
    /// The RDMA device named in the configuration cannot serve the region.
    #[error("RDMA device {device}: {reason}")]
    Rdma {
        /// The device asked for.
        device: String,
        /// What failed.
        reason: String,
    },
    /// A thread the server needs could not be started.
    #[error("cannot start the {name} thread: {source}")]
    Thread {
        /// Which thread.
        name: &'static str,
        /// The OS error.
        source: io::Error,
    },
}

/// A running page-server. Dropping it shuts it down.
#[derive(Debug)]
pub struct RunningServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    metrics: Option<MetricsEndpoint>,
    acceptor: Option<JoinHandle<()>>,
    registration: Option<Registration>,
    recovery: Option<Recovery>,
}

/// What the acceptor and the connection threads share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) exported: Exported,
    pub(crate) stop: AtomicBool,
    pub(crate) admission: Arc<Admission>,
    pub(crate) spin_before_block: crate::spin::SpinSetting,
    /// Each accepted connection's `dead_peer::watch` bound.
    pub(crate) dead_peer_timeout: Duration,
    /// Replica recovery counters (the recovery thread counts).
    pub(crate) recovery: RecoveryCounters,
    /// Each range's replica state in the last map read (the recovery
    /// thread notes it, each registration claims by it).
    pub(crate) seen: Arc<RangesSeen>,
}

/// Maps the exported memory, binds the listener, starts serving, and starts
/// registering with the coordinator in the background (see
/// [`RunningServer::wait_registered`]).
///
/// # Errors
/// [`ServerError::Config`], [`ServerError::StateDir`],
/// [`ServerError::Memory`], [`ServerError::Listen`].
pub fn spawn(config: ServerConfig) -> Result<RunningServer, ServerError> {
    if config.cluster_key.is_none() {
        tracing::warn!(node = %config.node_id, "no cluster key: insecure mode, any client that connects can read and write the exported memory");
    }
    let layout = config
        .layout()
        .map_err(|err| ServerError::Config(err.to_string()))?;
    let memory_bytes = layout.total_bytes();
    if !rdma_transport::coordinator::api::is_valid_node_id(&config.node_id) {
        return Err(ServerError::Config(format!(
            "invalid node id {:?}",
            config.node_id
        )));
    }
    check_limits(&config)?;
    let held = config
        .state_dir
        .as_deref()
        .map(|dir| HeldRanges::open(dir, &config.node_id))
        .transpose()?;
    let seen = RangesSeen::new(
        layout
            .ranges()
            .iter()
            .map(|r| HeldRange {
                gpa_start: r.gpa_start,
                length_bytes: r.length_bytes,
            })
            .collect(),
        held,
    );
    let region = MappedRegion::new(
        memory_bytes,
        MapOptions {
            try_huge_pages: config.huge_pages,
            populate: false,
        },
    )
    .map_err(|source| ServerError::Memory {
        memory_bytes,
        source,
    })?;
    let rdma = open_rdma(&config, &region)?;
    let listener = crate::listener::bind(config.listen).map_err(|source| ServerError::Listen {
        addr: config.listen,
        source,
    })?;
    let addr = listener
        .local_addr()
        .map_err(|source| ServerError::Listen {
            addr: config.listen,
            source,
        })?;
    let rdma_enabled = rdma.is_some();
    let shared = Arc::new(Shared {
        exported: Exported {
            rdma,
            region,
            // Odd, so never 0 (0 means "no epoch seen yet" to clients).
            epoch: rdma_transport::ids::random_u64() | 1,
            auth: ServerAuth::new(config.node_id.clone(), config.cluster_key.clone()),
            page_checksums: config.page_checksums,
            guard: RecoveryGuard::new(memory_bytes),
            // RDMA writes the region without this side seeing it: no sums;
            // nor any on a server that offers no checksums.
            sums: PageSums::new(memory_bytes, !rdma_enabled && config.page_checksums),
            coherence: CoherenceHome::new(config.node_dead_home_timeout),
            metrics: PageMetrics::new(),
            damage_log: rdma_transport::log_limit::LogLimit::new(
                rdma_transport::log_limit::WARN_INTERVAL,
            ),
            self_fence: SelfFence::new(config.stall_fence, config.lease_fence),
        },
        stop: AtomicBool::new(false),
        admission: Arc::new(Admission::new(
            Timeouts {
                handshake: config.handshake_timeout,
                idle: (!config.idle_timeout.is_zero()).then_some(config.idle_timeout),
            },
            config.max_connections,
            config.max_pending_handshakes,
        )),
        spin_before_block: crate::spin::SpinSetting::new(config.spin_before_block),
        dead_peer_timeout: config.dead_peer_timeout,
        recovery: RecoveryCounters::default(),
        seen: Arc::new(seen),
    });
    shared
        .exported
        .self_fence
        .on_fence(cut_rdma_when_fenced(Arc::downgrade(&shared)));
    shared
        .exported
        .self_fence
        .start_ticker()
        .map_err(|source| ServerError::Thread {
            name: "self fence",
            source,
        })?;
    let accept_shared = Arc::clone(&shared);
    let acceptor = std::thread::Builder::new()
        .name("page-server-accept".into())
        .spawn(move || crate::acceptor::accept_loop(&listener, &accept_shared))
        .map_err(|source| ServerError::Listen { addr, source })?;
    tracing::info!(
        node = %config.node_id,
        %addr,
        memory_bytes,
        ranges = %layout_summary(&layout),
        backing = ?shared.exported.region.backing(),
        "page-server listening"
    );
    // Before anything was seen in a map, a range claimed missed is one an
    // earlier process held (the state directory says so).
    if shared
        .seen
        .each()
        .any(|(_, contents)| contents == RangeContents::Missed)
    {
        shared
            .exported
            .coherence
            .restart_grace()
            .had_predecessor("the state directory says an earlier process held a range");
    }
    let published = shared.exported.rdma.as_ref().map(|r| r.endpoint());
    let registration = config.coordinator_url.is_some().then(|| {
        Registration::start(
            &config,
            &layout,
            addr,
            published,
            shared.exported.epoch,
            Arc::clone(&shared.seen),
            OtherProcesses {
                restart_grace: shared.exported.coherence.restart_grace(),
                on_superseded: stop_serving_when_superseded(Arc::clone(&shared)),
                self_fence: Arc::clone(&shared.exported.self_fence),
            },
        )
    });
    // Starts copying only once registered (it watches the registration).
    let recovery = registration
        .as_ref()
        .map(|r| Recovery::start(&config, &layout, Arc::clone(&shared), r.watch()));
    let metrics = match config.metrics_listen {
        None => None,
        Some(listen) => Some(
            MetricsEndpoint::start(
                listen,
                Arc::clone(&shared),
                registration.as_ref().map(Registration::watch),
            )
            .map_err(|source| ServerError::Listen {
                addr: listen,
                source,
            })?,
        ),
    };
    Ok(RunningServer {
        addr,
        shared,
        metrics,
        acceptor: Some(acceptor),
        registration,
        recovery,
    })
}

/// `GPA_START:LENGTH@OFFSET` of every range, for the start-up log.
fn layout_summary(layout: &Layout) -> String {
    let ranges: Vec<String> = layout
        .ranges()
        .iter()
        .map(|r| {
            format!(
                "{:#x}:{:#x}@{:#x}",
                r.gpa_start, r.length_bytes, r.remote_offset
            )
        })
        .collect();
    ranges.join(",")
}

/// The shortest stall threshold accepted (`ServerConfig::stall_fence`).
const MIN_STALL_FENCE: Duration = Duration::from_millis(100);

/// The connection limits must let something in.
fn check_limits(config: &ServerConfig) -> Result<(), ServerError> {
    if config.handshake_timeout.is_zero() {
        return Err(ServerError::Config(
            "the handshake timeout must be positive".into(),
        ));
    }
    if config.node_dead_home_timeout < Duration::from_millis(1) {
        return Err(ServerError::Config(
            "the nodes' bound on this server's silence (node_dead_home_timeout) must be at \
             least 1 ms: a node without one keeps its copies of pages the home gives to others"
                .into(),
        ));
    }
    if !config.stall_fence.is_zero() && config.stall_fence < MIN_STALL_FENCE {
        return Err(ServerError::Config(format!(
            "the stall fence ({:?}) must be 0 (off) or at least {MIN_STALL_FENCE:?}: a busy \
             host's scheduling delays would fence the server again and again",
            config.stall_fence
        )));
    }
    if !config.lease_fence.is_zero() && config.lease_fence < config.heartbeat_interval * 2 {
        return Err(ServerError::Config(format!(
            "the lease fence ({:?}) must be at least twice the heartbeat interval ({:?}): \
             otherwise one late heartbeat stops the server",
            config.lease_fence, config.heartbeat_interval
        )));
    }
    if config.max_connections == 0 || config.max_pending_handshakes == 0 {
        return Err(ServerError::Config(format!(
            "max_connections ({}) and max_pending_handshakes ({}) must be positive",
            config.max_connections, config.max_pending_handshakes
        )));
    }
    Ok(())
}

/// Opens the RDMA side unless disabled. Without an explicitly named device,
/// a host with no usable device serves TCP only.
fn open_rdma(
    config: &ServerConfig,
    region: &MappedRegion,
) -> Result<Option<RdmaExport>, ServerError> {
    if !config.rdma.enabled {
        tracing::info!(node = %config.node_id, "RDMA disabled; serving TCP only");
        return Ok(None);
    }
    // SAFETY: the export is stored next to the region in `Exported`, whose
    // field order drops it first; the region is never unmapped before.
    match unsafe { RdmaExport::open(&config.rdma, region) } {
        Ok(export) => {
            let (endpoint, region) = (export.endpoint(), export.region());
            tracing::info!(
                node = %config.node_id,
                device = %endpoint.device,
                port = endpoint.port,
                gid = %endpoint.gid,
                gid_index = endpoint.gid_index,
                region_addr = format_args!("{:#x}", region.addr),
                client_keys = %export.client_keys(),
                "RDMA enabled: exported region registered; each client connection gets its own key"
            );
            Ok(Some(export))
        }
        Err(err) => match &config.rdma.device {
            Some(device) => Err(ServerError::Rdma {
                device: device.clone(),
                reason: err.to_string(),
            }),
            None => {
                tracing::info!(node = %config.node_id, reason = %err, "no usable RDMA device; serving TCP only");
                Ok(None)
            }
        },
    }
}

impl RunningServer {
    /// The bound listener address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Test hook: while `held`, coherence messages over RDMA are not taken
    /// (they wait in their channels), TCP ones are served as usual.
    #[doc(hidden)]
    #[cfg(feature = "test-hooks")]
    pub fn hold_coherence_channels_for_test(&self, held: bool) {
        self.shared.exported.coherence.hold_channels(held);
    }

    /// Test hook: the coherence home closes every node's connection from
    /// the calling thread, as it does when a send to a node stalls on
    /// another connection's thread. Returns how many.
    #[doc(hidden)]
    #[cfg(feature = "test-hooks")]
    pub fn close_coherence_nodes_for_test(&self) -> usize {
        self.shared.exported.coherence.close_nodes()
    }

    /// Test hook: every client's QP goes to the error state while the
    /// control connections stay open, as if the QPs died silently. Returns
    /// the number of QPs broken.
    #[doc(hidden)]
    #[cfg(feature = "test-hooks")]
    pub fn break_rdma_qps_for_test(&self) -> usize {
        self.shared
            .exported
            .rdma
            .as_ref()
            .map_or(0, RdmaExport::break_qps)
    }

    /// How client connections get their rkeys, when RDMA is served.
    pub fn rdma_client_keys(&self) -> Option<ClientKeyKind> {
        self.shared
            .exported
            .rdma
            .as_ref()
            .map(RdmaExport::client_keys)
    }

    /// Test hook: the key of every live client connection.
    #[doc(hidden)]
    #[cfg(feature = "test-hooks")]
    pub fn rdma_client_keys_for_test(&self) -> Vec<crate::ClientKeyInfo> {
        self.shared
            .exported
            .rdma
            .as_ref()
            .map_or_else(Vec::new, RdmaExport::client_keys_for_test)
    }

    /// The exported region's RDMA address and its MR's rkey (as published
    /// to the coordinator), when RDMA is served. That rkey grants no remote
    /// access: each client connection gets its own in HELLO_ACK.
    pub fn rdma_region(&self) -> Option<RdmaRegion> {
        self.shared.exported.rdma.as_ref().map(|r| r.region())
    }

    /// Handshakes refused because the client could not prove the cluster key.
    pub fn auth_failures(&self) -> u64 {
        self.shared.exported.auth.failures()
    }

    /// The coherence home's counters.
    pub fn coherence_stats(&self) -> CoherenceStats {
        self.shared.exported.coherence.snapshot()
    }

    /// Changes how long every connection thread polls its socket before it
    /// blocks (`ServerConfig::spin_before_block`), for the connections open
    /// now and later. An open one takes the new value when its next
    /// request has been answered. Zero blocks at once.
    pub fn set_spin_before_block(&self, spin: Duration) {
        self.shared.spin_before_block.set(spin);
    }

    /// Connections being served now (handshaken or not, and evicted ones
    /// whose threads are still ending).
    pub fn active_connections(&self) -> usize {
        self.shared.admission.conns.len()
    }

    /// Connections open now, and those refused or closed by the limits
    /// since the server started, by reason; and the replica recoveries
    /// (running now, done, failed, pages copied).
    pub fn stats(&self) -> ServerStats {
        let mut stats = self.shared.admission.stats();
        if let Some(registration) = &self.registration {
            registration.watch().fill(&mut stats);
        }
        self.shared.recovery.fill(&mut stats);
        self.shared.fill_fence(&mut stats);
        stats.reads_with_kept_sums = self.shared.exported.metrics.kept_sums();
        stats.checksum_failures = self.shared.exported.metrics.checksum_failures();
        stats
    }

    /// What a claim of each exported range (in layout order) says this
    /// process's memory holds, from the replica's state in the last map the
    /// node read: what a registration with a coordinator that lost its
    /// state goes by (docs/operations.md, "Coordinator state lost").
    pub fn range_contents(&self) -> Vec<RangeContents> {
        (0..self.shared.seen.len())
            .map(|i| self.shared.seen.contents(i))
            .collect()
    }

    /// Blocks until the node and its range are registered with the
    /// coordinator, or `timeout` passes.
    ///
    /// # Errors
    /// [`ServerError::Registration`] when the coordinator refused it,
    /// [`ServerError::RegistrationTimeout`] when time ran out;
    /// `Ok` at once when no coordinator is configured.
    pub fn wait_registered(&self, timeout: Duration) -> Result<(), ServerError> {
        match &self.registration {
            Some(r) => r.wait(timeout),
            None => Ok(()),
        }
    }

    /// Where `GET /metrics` is served (`ServerConfig::metrics_listen`).
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(MetricsEndpoint::addr)
    }

    /// Stops accepting, closes every connection and joins every thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    /// Stops like a killed process, for failure tests: every connection's
    /// socket is shut down at once without goodbye (linger 0, so its last
    /// close resets it), the listener is closed (connecting then fails),
    /// heartbeats stop, and nothing is deregistered: the coordinator learns
    /// of the failure only from the clients or the lease running out.
    /// Unlike [`RunningServer::shutdown`], the sockets close before the
    /// registration thread is stopped, so the failure instant does not wait
    /// on a heartbeat in flight.
    pub fn abort(mut self) {
        if self.shared.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        // The crash itself first: every connection reset at once (joining
        // the recovery thread may wait for a coordinator request).
        let threads = self.shared.admission.conns.abort_all();
        // Wake the blocking accept; the acceptor then ends and drops the
        // listener.
        let _ = TcpStream::connect_timeout(&wake_addr(self.addr), Duration::from_millis(200));
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
        if let Some(r) = self.registration.take() {
            r.stop();
        }
        // Like a killed process, no thread of this server acts once this
        // returns: its recovery would otherwise go on talking to the
        // coordinator in the name of this node.
        if let Some(r) = self.recovery.take() {
            r.stop();
        }
        self.shared.exported.self_fence.end();
        for thread in threads {
            let _ = thread.join();
        }
        if let Some(mut metrics) = self.metrics.take() {
            metrics.stop();
        }
        tracing::info!(addr = %self.addr, "page-server aborted");
    }

    fn stop(&mut self) {
        if self.shared.stop.swap(true, Ordering::SeqCst) {
            return;
        }
        if let Some(r) = self.recovery.take() {
            r.stop();
        }
        if let Some(r) = self.registration.take() {
            r.stop();
        }
        // Wake the blocking accept with a connection of our own.
        let _ = TcpStream::connect_timeout(&wake_addr(self.addr), Duration::from_millis(200));
        if let Some(h) = self.acceptor.take() {
            let _ = h.join();
        }
        self.shared.exported.coherence.stop_waiting();
        self.shared.exported.self_fence.end();
        for thread in self.shared.admission.conns.close_all() {
            let _ = thread.join();
        }
        if let Some(mut metrics) = self.metrics.take() {
            metrics.stop();
        }
        tracing::info!(addr = %self.addr, "page-server stopped");
    }
}

fn wake_addr(addr: SocketAddr) -> SocketAddr {
    if addr.ip().is_unspecified() {
        SocketAddr::from(([127, 0, 0, 1], addr.port()))
    } else {
        addr
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    /// Sets what the self fence counted in `stats`.
    pub(crate) fn fill_fence(&self, stats: &mut ServerStats) {
        let counts = self.exported.self_fence.counts();
        stats.stalls = counts.stalls;
        stats.lease_lapses = counts.lease_lapses;
        stats.requests_held_by_fence = counts.held;
        stats.fenced = counts.fenced;
    }
}

/// What this process does each time it fences itself (`self_fence.rs`):
/// its connections' threads serve nothing more until the coordinator's
/// word, but RDMA READs and WRITEs are one-sided, served by the device
/// without them. So every data session's QP is moved to the error state
/// (nothing lands after this) and its connection closed: its client
/// reconnects, and its handshake waits for the coordinator's word like
/// any request. Coherence nodes' channels stay: their requests are
/// answered `Retry` meanwhile.
fn cut_rdma_when_fenced(shared: Weak<Shared>) -> crate::self_fence::OnFence {
    Box::new(move || {
        let Some(shared) = shared.upgrade() else {
            return;
        };
        let Some(rdma) = &shared.exported.rdma else {
            return;
        };
        let broken = rdma.break_data_qps();
        let closed = shared.admission.conns.shut_down_rdma_sessions();
        if broken + closed > 0 {
            tracing::warn!(
                qps = broken,
                connections = closed,
                "fenced: every RDMA data session cut off until the coordinator's word"
            );
        }
    })
}

/// What this process does once another registered as its node: it is no
/// longer the node (the coordinator sends the node's clients to the
/// other), so it closes every connection and takes no more. Its coherence
/// nodes drop their copies as the connection ends; its data clients find
/// the other process in the map (docs/operations.md, "One process per
/// node id").
fn stop_serving_when_superseded(shared: Arc<Shared>) -> crate::registration::OnSuperseded {
    Box::new(move || {
        let closed = shared.admission.conns.close_all().len();
        tracing::error!(
            connections = closed,
            "closed every connection and takes no more: another process is this node now"
        );
    })
}
