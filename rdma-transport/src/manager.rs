//! `TransportManager`: the API a hypervisor embeds.
//!
//! It owns the page pool, the poller threads and one connection per remote
//! node, and resolves every GPA through a locally cached copy of the
//! coordinator's map (see `gpa_map.rs`). The hot path takes no lock and
//! makes no allocation: one lock-free map load, a binary search, one
//! `writev` by the calling thread, and a wait for the poller's completion.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arc_swap::{ArcSwap, ArcSwapOption};
use parking_lot::{Condvar, Mutex};

use crate::config::{ManagerConfig, PollMode, TransportKind};
use crate::coordinator::api::MapResponse;
use crate::coordinator::CoordinatorClient;
use crate::error::TransportError;
use crate::gpa_map::GpaMap;
use crate::page::{is_page_aligned, Page};
use crate::pool::{PageFrame, PagePool};
use crate::tcp::{
    Pollers, Request, TcpConnection, Waiter, CODE_CONN_LOST, CODE_PROTOCOL, MAX_CHUNK,
};
use crate::wire::{Opcode, Status};

/// Shortest time between two attempts to reach the same unreachable node, or
/// two map refreshes caused by misses: a dead node fails fast instead of
/// costing a connect timeout per page.
const RETRY_INTERVAL: Duration = Duration::from_millis(100);

/// Moves 4 KiB pages between this host and the nodes that own them.
///
/// Cheap to share between threads (`&self` methods, `Send + Sync`). Dropping
/// it stops its threads and closes its connections.
#[derive(Debug)]
pub struct TransportManager {
    inner: Arc<Inner>,
    refresher: Option<(Arc<RefreshStop>, JoinHandle<()>)>,
}

#[derive(Debug)]
struct Inner {
    config: ManagerConfig,
    coordinator: Option<CoordinatorClient>,
    pool: PagePool,
    pollers: Pollers,
    state: ArcSwap<MapState>,
    last_refresh: Mutex<Option<Instant>>,
    client_id: u64,
}

#[derive(Debug, Default)]
struct MapState {
    map: GpaMap,
    nodes: Vec<Arc<Node>>,
}

#[derive(Debug)]
struct Node {
    id: String,
    addr: String,
    conn: ArcSwapOption<TcpConnection>,
    last_failure: Mutex<Option<Instant>>,
    epoch: AtomicU64,
}

#[derive(Debug, Default)]
struct RefreshStop {
    stop: Mutex<bool>,
    cv: Condvar,
}

impl TransportManager {
    /// Connects to the coordinator, fetches the GPA map and connects to every
    /// node in it (a node that is down now is retried on first use).
    ///
    /// # Errors
    /// [`TransportError::Coordinator`] when the map cannot be fetched,
    /// [`TransportError::RdmaUnavailable`] for `TransportKind::Rdma` on a host
    /// without a usable device, pool and thread set-up failures.
    pub fn connect(config: ManagerConfig) -> Result<Self, TransportError> {
        let client = CoordinatorClient::new(
            &config.coordinator_url,
            config.coordinator_token.clone(),
            Duration::from_millis(config.request_timeout_ms.max(2000)),
        )?;
        let map = client.map()?;
        Self::build(config, Some(client), map)
    }

    /// Builds a manager over a fixed map, with no coordinator (tests, or a
    /// hypervisor that distributes the map itself).
    ///
    /// # Errors
    /// As [`TransportManager::connect`], without the coordinator errors.
    pub fn from_map(config: ManagerConfig, map: MapResponse) -> Result<Self, TransportError> {
        Self::build(config, None, map)
    }

    fn build(
        config: ManagerConfig,
        coordinator: Option<CoordinatorClient>,
        map: MapResponse,
    ) -> Result<Self, TransportError> {
        match config.transport {
            TransportKind::Rdma => {
                return Err(TransportError::RdmaUnavailable(
                    "this build has no RDMA data path yet; use --transport tcp or auto".into(),
                ))
            }
            TransportKind::Auto => tracing::info!("transport auto: using TCP for every node"),
            TransportKind::Tcp => {}
        }
        if config.request_timeout_ms == 0 || config.poller_threads == 0 {
            return Err(TransportError::Config(
                "request_timeout_ms and poller_threads must be > 0".into(),
            ));
        }
        let pool = PagePool::new(config.pool_size_bytes)?;
        let cpus = config.resolved_poller_cpus();
        let pollers = Pollers::start(
            config.poller_threads,
            &cpus,
            config.poll_mode,
            Duration::from_micros(config.poll_idle_spin_us),
        )
        .map_err(|e| TransportError::Config(format!("cannot start poller threads: {e}")))?;
        let client_id = random_u64();
        let inner = Arc::new(Inner {
            state: ArcSwap::from_pointee(MapState::default()),
            config,
            coordinator,
            pool,
            pollers,
            last_refresh: Mutex::new(None),
            client_id,
        });
        inner.install_map(map);
        for node in &inner.state.load().nodes {
            if let Err(err) = inner.connection(node) {
                tracing::warn!(node = %node.id, %err, "node not reachable at start; will retry on use");
            }
        }
        let refresher =
            (inner.coordinator.is_some() && inner.config.map_refresh_ms > 0).then(|| {
                let stop = Arc::new(RefreshStop::default());
                let (thread_inner, thread_stop) = (Arc::clone(&inner), Arc::clone(&stop));
                let handle = std::thread::Builder::new()
                    .name("gpa-map-refresh".into())
                    .spawn(move || refresh_loop(&thread_inner, &thread_stop));
                handle.map(|h| (stop, h))
            });
        let refresher = refresher
            .transpose()
            .map_err(|e| TransportError::Config(format!("cannot start map refresher: {e}")))?;
        Ok(Self { inner, refresher })
    }

    /// Reads the page at `gpa` into `page`.
    ///
    /// # Errors
    /// [`TransportError::Unaligned`], [`TransportError::UnknownGpa`],
    /// [`TransportError::NodeDown`], [`TransportError::Timeout`],
    /// [`TransportError::Refused`], [`TransportError::Protocol`].
    pub fn read_page(&self, gpa: u64, page: &mut Page) -> Result<(), TransportError> {
        self.inner.run(Opcode::Read, &[gpa], page.as_mut_ptr(), 1)
    }

    /// Writes `page` to the page at `gpa`; returns once the owner acknowledged it.
    ///
    /// # Errors
    /// As [`TransportManager::read_page`].
    pub fn write_page(&self, gpa: u64, page: &Page) -> Result<(), TransportError> {
        self.inner
            .run(Opcode::Write, &[gpa], page.as_ptr().cast_mut(), 1)
    }

    /// Reads `pages[i]` from `gpas[i]` for every i, with all requests in
    /// flight at once (up to 64 per connection per round). On error, returns
    /// the first one; the other pages may or may not have been read.
    ///
    /// # Errors
    /// As [`TransportManager::read_page`], and [`TransportError::Config`] when
    /// the slices' lengths differ.
    pub fn read_pages(&self, gpas: &[u64], pages: &mut [Page]) -> Result<(), TransportError> {
        check_lengths(gpas.len(), pages.len())?;
        self.inner
            .run(Opcode::Read, gpas, pages.as_mut_ptr().cast(), gpas.len())
    }

    /// Writes `pages[i]` to `gpas[i]` for every i, all in flight at once.
    ///
    /// # Errors
    /// As [`TransportManager::read_pages`].
    pub fn write_pages(&self, gpas: &[u64], pages: &[Page]) -> Result<(), TransportError> {
        check_lengths(gpas.len(), pages.len())?;
        self.inner.run(
            Opcode::Write,
            gpas,
            pages.as_ptr().cast::<u8>().cast_mut(),
            gpas.len(),
        )
    }

    /// Reads the page at `gpa` into a frame of the page pool.
    ///
    /// # Errors
    /// [`TransportError::PoolExhausted`] when no frame is free, else as
    /// [`TransportManager::read_page`].
    pub fn read_frame(&self, gpa: u64) -> Result<PageFrame, TransportError> {
        let mut frame = self
            .inner
            .pool
            .alloc()
            .ok_or(TransportError::PoolExhausted {
                capacity: self.inner.pool.capacity(),
            })?;
        self.read_page(gpa, &mut frame)?;
        Ok(frame)
    }

    /// The page pool.
    pub fn pool(&self) -> &PagePool {
        &self.inner.pool
    }

    /// A snapshot of the GPA map in use.
    pub fn map(&self) -> GpaMap {
        self.inner.state.load().map.clone()
    }

    /// Fetches the map from the coordinator now.
    ///
    /// # Errors
    /// [`TransportError::Coordinator`]; [`TransportError::Config`] for a
    /// manager built with [`TransportManager::from_map`].
    pub fn refresh_map(&self) -> Result<u64, TransportError> {
        self.inner.refresh()
    }
}

impl Drop for TransportManager {
    fn drop(&mut self) {
        if let Some((stop, handle)) = self.refresher.take() {
            *stop.stop.lock() = true;
            stop.cv.notify_all();
            if handle.join().is_err() {
                tracing::error!("map refresher thread panicked");
            }
        }
        for node in &self.inner.state.load().nodes {
            if let Some(conn) = node.conn.swap(None) {
                conn.mark_broken(CODE_CONN_LOST);
            }
        }
    }
}

fn check_lengths(gpas: usize, pages: usize) -> Result<(), TransportError> {
    if gpas == pages {
        Ok(())
    } else {
        Err(TransportError::Config(format!(
            "{gpas} addresses for {pages} pages"
        )))
    }
}

fn refresh_loop(inner: &Inner, stop: &RefreshStop) {
    let period = Duration::from_millis(inner.config.map_refresh_ms);
    let mut stopped = stop.stop.lock();
    while !*stopped {
        if stop.cv.wait_for(&mut stopped, period).timed_out() && !*stopped {
            drop(stopped);
            if let Err(err) = inner.refresh() {
                tracing::debug!(%err, "background map refresh failed");
            }
            stopped = stop.stop.lock();
        }
    }
}

/// Where one request of a batch went.
#[derive(Clone, Copy, Default)]
struct Sent {
    group: usize,
    id: u64,
}

impl Inner {
    /// Runs `count` requests of one kind; page i is at `pages + i * 4096`.
    fn run(
        &self,
        opcode: Opcode,
        gpas: &[u64],
        pages: *mut u8,
        count: usize,
    ) -> Result<(), TransportError> {
        let mut first_error = None;
        for chunk_start in (0..count).step_by(MAX_CHUNK) {
            let chunk_end = (chunk_start + MAX_CHUNK).min(count);
            // SAFETY: `pages` covers `count` pages (checked by the callers), so
            // chunk_start is in bounds.
            let chunk_pages = unsafe { pages.add(chunk_start * crate::page::PAGE_SIZE) };
            if let Err(e) = self.run_chunk(opcode, &gpas[chunk_start..chunk_end], chunk_pages) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn run_chunk(
        &self,
        opcode: Opcode,
        gpas: &[u64],
        pages: *mut u8,
    ) -> Result<(), TransportError> {
        let n = gpas.len();
        let mut state = self.state.load();
        // Resolve every address first; refresh the map once on a miss.
        let mut loc = [(0usize, 0u64); MAX_CHUNK];
        for (i, &gpa) in gpas.iter().enumerate() {
            if !is_page_aligned(gpa) {
                return Err(TransportError::Unaligned { gpa });
            }
            let found = match state.map.lookup(gpa) {
                Some(l) => l,
                None => {
                    self.refresh_on_miss();
                    state = self.state.load();
                    state
                        .map
                        .lookup(gpa)
                        .ok_or(TransportError::UnknownGpa { gpa })?
                }
            };
            loc[i] = (found.node_index, found.remote_offset);
        }
        // Group by node, submit each group with one writev, wait for all.
        let deadline = Instant::now() + self.config.request_timeout();
        let waiter = Waiter::new();
        let mut groups: [Option<Arc<TcpConnection>>; MAX_CHUNK] = [const { None }; MAX_CHUNK];
        let mut group_nodes = [usize::MAX; MAX_CHUNK];
        let mut sent = [Sent::default(); MAX_CHUNK];
        let mut sent_count = 0;
        let mut first_error: Option<TransportError> = None;
        let mut done = [false; MAX_CHUNK];
        let mut group_count = 0;
        for i in 0..n {
            if done[i] {
                continue;
            }
            let node_index = loc[i].0;
            let node = &state.nodes[node_index];
            let mut reqs = [Request {
                offset: 0,
                page: std::ptr::null_mut(),
            }; MAX_CHUNK];
            let mut members = [0usize; MAX_CHUNK];
            let mut m = 0;
            for j in i..n {
                if !done[j] && loc[j].0 == node_index {
                    done[j] = true;
                    // SAFETY: j < n and the caller's buffer holds n pages.
                    let page = unsafe { pages.add(j * crate::page::PAGE_SIZE) };
                    reqs[m] = Request {
                        offset: loc[j].1,
                        page,
                    };
                    members[m] = j;
                    m += 1;
                }
            }
            let conn = match self.connection(node) {
                Ok(c) => c,
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            let group = group_count;
            group_count += 1;
            group_nodes[group] = node_index;
            let mut ids = [0u64; MAX_CHUNK];
            let result = conn.submit(opcode, &reqs[..m], &mut ids, &waiter, deadline);
            let armed = match &result {
                Ok(()) => m,
                Err((armed, _)) => *armed,
            };
            for &id in &ids[..armed] {
                sent[sent_count] = Sent { group, id };
                sent_count += 1;
            }
            if let Err((_, err)) = result {
                tracing::debug!(node = %node.id, %err, "submitting to node failed");
                first_error.get_or_insert(TransportError::NodeDown {
                    node: node.id.clone(),
                    reason: err.to_string(),
                });
            }
            groups[group] = Some(conn);
        }
        let spin = match self.config.poll_mode {
            PollMode::Busy => Duration::from_micros(self.config.wait_spin_us),
            PollMode::Event => Duration::ZERO,
        };
        let all_answered = sent_count > 0 && crate::tcp::wait(&waiter, &groups[..group_count], spin, deadline);
        for s in &sent[..sent_count] {
            let Some(conn) = groups[s.group].as_ref() else {
                continue;
            };
            let code = if all_answered {
                Some(conn.inflight.finish(s.id))
            } else {
                conn.inflight.cancel(s.id)
            };
            if let Some(e) = self.code_to_error(code, conn, &state.nodes[group_nodes[s.group]]) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn code_to_error(
        &self,
        code: Option<u32>,
        conn: &Arc<TcpConnection>,
        node: &Node,
    ) -> Option<TransportError> {
        let node_name = || conn.node_id.clone();
        match code {
            Some(0) => None,
            None => Some(TransportError::Timeout {
                node: node_name(),
                timeout_ms: self.config.request_timeout_ms,
            }),
            Some(CODE_CONN_LOST) => {
                self.forget(node, conn);
                Some(TransportError::NodeDown {
                    node: node_name(),
                    reason: "connection lost".into(),
                })
            }
            Some(CODE_PROTOCOL) => {
                self.forget(node, conn);
                Some(TransportError::Protocol {
                    node: node_name(),
                    detail: "malformed answer".into(),
                })
            }
            Some(other) => {
                let status = u16::try_from(other)
                    .ok()
                    .and_then(Status::from_u16)
                    .unwrap_or(Status::Internal);
                Some(TransportError::Refused {
                    node: node_name(),
                    status,
                })
            }
        }
    }

    /// Drops a dead connection so the next request reconnects.
    fn forget(&self, node: &Node, conn: &Arc<TcpConnection>) {
        let current = node.conn.load();
        if current.as_ref().is_some_and(|c| Arc::ptr_eq(c, conn)) {
            node.conn.store(None);
        }
    }

    /// The node's live connection, connecting (at most once per
    /// `RETRY_INTERVAL` after a failure) when there is none.
    fn connection(&self, node: &Node) -> Result<Arc<TcpConnection>, TransportError> {
        if let Some(conn) = node.conn.load_full().filter(|c| !c.is_broken()) {
            return Ok(conn);
        }
        let mut last_failure = node.last_failure.lock();
        if let Some(conn) = node.conn.load_full().filter(|c| !c.is_broken()) {
            return Ok(conn);
        }
        if last_failure.is_some_and(|t| t.elapsed() < RETRY_INTERVAL) {
            return Err(TransportError::NodeDown {
                node: node.id.clone(),
                reason: "unreachable (retrying)".into(),
            });
        }
        match TcpConnection::connect(
            &node.id,
            &node.addr,
            self.client_id,
            self.config.connect_timeout(),
        ) {
            Ok(conn) => {
                let conn = Arc::new(conn);
                let old_epoch = node.epoch.swap(conn.ack.epoch, Ordering::Relaxed);
                if old_epoch != 0 && old_epoch != conn.ack.epoch {
                    tracing::info!(node = %node.id, "page-server restarted (new epoch); reconnected");
                } else {
                    tracing::debug!(node = %node.id, addr = %node.addr, "connected over TCP");
                }
                self.pollers.add(&conn);
                node.conn.store(Some(Arc::clone(&conn)));
                *last_failure = None;
                Ok(conn)
            }
            Err(err) => {
                *last_failure = Some(Instant::now());
                drop(last_failure);
                self.refresh_on_miss();
                Err(TransportError::NodeDown {
                    node: node.id.clone(),
                    reason: err.to_string(),
                })
            }
        }
    }

    /// Refreshes the map unless that happened less than `RETRY_INTERVAL` ago.
    fn refresh_on_miss(&self) {
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
        if let Err(err) = self.refresh() {
            tracing::warn!(%err, "map refresh failed");
        }
    }

    fn refresh(&self) -> Result<u64, TransportError> {
        let client = self.coordinator.as_ref().ok_or_else(|| {
            TransportError::Config("manager has a fixed map and no coordinator".into())
        })?;
        let resp = client.map()?;
        let version = resp.version;
        if version != self.state.load().map.version() {
            self.install_map(resp);
        }
        Ok(version)
    }

    /// Swaps in a new map, keeping the connections of nodes whose address
    /// did not change.
    fn install_map(&self, resp: MapResponse) {
        let map = GpaMap::from_response(resp);
        let old = self.state.load();
        let nodes = map
            .nodes()
            .iter()
            .map(|info| {
                old.nodes
                    .iter()
                    .find(|n| n.id == info.id && n.addr == info.tcp_addr)
                    .cloned()
                    .unwrap_or_else(|| {
                        Arc::new(Node {
                            id: info.id.clone(),
                            addr: info.tcp_addr.clone(),
                            conn: ArcSwapOption::empty(),
                            last_failure: Mutex::new(None),
                            epoch: AtomicU64::new(0),
                        })
                    })
            })
            .collect();
        tracing::debug!(
            version = map.version(),
            ranges = map.len(),
            "GPA map installed"
        );
        self.state.store(Arc::new(MapState { map, nodes }));
    }
}

fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
