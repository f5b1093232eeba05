//! `TransportManager`: the API a hypervisor embeds.
//!
//! It owns the page pool, the poller threads and one connection per remote
//! node, and resolves every GPA through a locally cached copy of the
//! coordinator's map (see `gpa_map.rs`). The hot path takes no lock and
//! makes no allocation: one lock-free map load, a binary search, one
//! `writev` by the calling thread, and a wait for the poller's completion.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use parking_lot::{Condvar, Mutex};

use crate::config::{DataPath, ManagerConfig};
use crate::coordinator::api::MapResponse;
use crate::coordinator::{CoordinatorClient, Credential};
use crate::error::TransportError;
use crate::gpa_map::GpaMap;
use crate::page::Page;
use crate::pool::{PageFrame, PagePool};
use crate::tcp::Pollers;
use crate::wire::Opcode;

mod async_op;
#[cfg(test)]
mod checksum_tests;
mod coherent;
mod completion;
mod epoch;
mod fast_view;
mod latency;
mod link;
mod map_state;
mod rdma_batch;
mod rdma_single;
mod registered;
mod replicas;
mod request;
mod round;
mod stats;
mod tcp_chunk;
mod tcp_single;
#[cfg(test)]
mod tests;
#[cfg(any(test, feature = "test-hooks"))]
mod unwind_hook;

pub use completion::{Completion, CompletionCallback, CompletionQueue, Reap};
use link::{Link, RdmaSide};
use map_state::{Install, MapState, Node};
pub use registered::ZeroCopyStats;
pub use stats::ManagerStats;

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
    rdma: Option<RdmaSide>,
    state: ArcSwap<MapState>,
    /// The one-page paths' snapshot of `state`, its links and the
    /// registered regions (`fast_view.rs`), and what serialises its
    /// publications.
    view: ArcSwap<fast_view::FastView>,
    view_lock: Mutex<()>,
    last_refresh: Mutex<Option<Instant>>,
    /// When the last map fetch that succeeded was sent (ms of `clock`; 0:
    /// never): the map in use is at least that fresh.
    map_confirmed_ms: std::sync::atomic::AtomicU64,
    client_id: u64,
    /// When the manager started (the time base of `Node::avoid_until_ms`).
    clock: Instant,
    /// Round trips of replicated reads (the automatic hedging delay).
    latency: latency::RecentLatency,
    /// Page-I/O counters (`stats.rs`).
    counters: stats::Counters,
    /// Pages TCP answers put straight into their destination, on every
    /// connection (`ZeroCopyStats::tcp_direct_pages`).
    tcp_landed_pages: Arc<std::sync::atomic::AtomicU64>,
    /// Replicas to mark stale before the next write to their range counts.
    owed_stale: replicas::OwedStale,
    /// Held while a replica is being marked stale, with when each mark the
    /// coordinator took was sent: requests that missed a replica together
    /// make one call (`replicas.rs`).
    stale_marking: Mutex<replicas::SentMarks>,
    /// The coherent nodes made from this manager, told of each map
    /// installed (`coherent.rs`: a home another process replaced).
    coherent_nodes: Mutex<Vec<std::sync::Weak<crate::coherent::Shared>>>,
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
        // With a cluster key the manager reads the map as a client (read-only
        // credential); without one, the coordinator token, if any.
        let credential = match (&config.cluster_key, &config.coordinator_token) {
            (Some(key), _) => Credential::Client { key: key.clone() },
            (None, Some(token)) => Credential::Token(token.clone()),
            (None, None) => Credential::None,
        };
        let client = CoordinatorClient::with_credential(
            &config.coordinator_url,
            &credential,
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
        if config.request_timeout_ms == 0 || config.poller_threads == 0 {
            return Err(TransportError::Config(
                "request_timeout_ms and poller_threads must be > 0".into(),
            ));
        }
        if config.cluster_key.is_none() {
            tracing::warn!("no cluster key: insecure mode, only page-servers without a key are used and nothing proves who they are");
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
        let rdma = RdmaSide::open(&config, &pool, &cpus)?;
        let client_id = config.client_id.unwrap_or_else(crate::ids::random_u64);
        let inner = Arc::new(Inner {
            state: ArcSwap::from_pointee(MapState::default()),
            view: ArcSwap::default(),
            view_lock: Mutex::new(()),
            config,
            coordinator,
            pool,
            pollers,
            rdma,
            last_refresh: Mutex::new(None),
            map_confirmed_ms: std::sync::atomic::AtomicU64::new(0),
            client_id,
            clock: Instant::now(),
            latency: latency::RecentLatency::default(),
            counters: stats::Counters::default(),
            tcp_landed_pages: Arc::default(),
            owed_stale: replicas::OwedStale::default(),
            stale_marking: Mutex::new(replicas::SentMarks::default()),
            coherent_nodes: Mutex::new(Vec::new()),
        });
        if let Some(rdma) = &inner.rdma {
            let weak = Arc::downgrade(&inner);
            rdma.device.registry.on_change(Box::new(move || {
                if let Some(inner) = weak.upgrade() {
                    inner.publish_view();
                }
            }));
        }
        inner.install_map(map, Install::Always);
        // Every node at once: one that is down costs one connect timeout in
        // all, not one each.
        let deadline = Instant::now() + inner.config.connect_timeout();
        let state = inner.state.load_full();
        std::thread::scope(|s| {
            for node in &state.nodes {
                let inner = &inner;
                s.spawn(move || {
                    if let Err(err) = inner.connection(node, deadline, false) {
                        tracing::warn!(node = %node.id, %err, "node not reachable at start; will retry on use");
                    }
                });
            }
        });
        let follower = inner
            .coordinator
            .clone()
            .filter(|_| inner.config.map_refresh_ms > 0);
        let refresher = follower.map(|client| {
            let stop = Arc::new(RefreshStop::default());
            let (thread_inner, thread_stop) = (Arc::downgrade(&inner), Arc::clone(&stop));
            let handle = std::thread::Builder::new()
                .name("gpa-map-refresh".into())
                .spawn(move || refresh_loop(&thread_inner, &client, &thread_stop));
            handle.map(|h| (stop, h))
        });
        let refresher = refresher
            .transpose()
            .map_err(|e| TransportError::Config(format!("cannot start map refresher: {e}")))?;
        Ok(Self { inner, refresher })
    }

    /// Reads the page at `gpa` into `page`. A page that fails its checksum
    /// is read once more before the error is returned (see
    /// [`TransportError::Checksum`]).
    ///
    /// # Errors
    /// [`TransportError::Unaligned`], [`TransportError::UnknownGpa`],
    /// [`TransportError::NodeDown`], [`TransportError::Timeout`],
    /// [`TransportError::Refused`], [`TransportError::Protocol`],
    /// [`TransportError::Checksum`].
    #[inline]
    pub fn read_page(&self, gpa: u64, page: &mut Page) -> Result<(), TransportError> {
        read_once_more(|| {
            self.inner
                .run_one_counted(Opcode::Read, gpa, page.as_mut_ptr())
        })
    }

    /// Writes `page` to the page at `gpa`; returns once the owner acknowledged it.
    ///
    /// # Errors
    /// As [`TransportManager::read_page`].
    #[inline]
    pub fn write_page(&self, gpa: u64, page: &Page) -> Result<(), TransportError> {
        self.inner
            .run_one_counted(Opcode::Write, gpa, page.as_ptr().cast_mut())
    }

    /// Reads `pages[i]` from `gpas[i]` for every i, with all requests in
    /// flight at once (up to 64 per connection per round). On error, returns
    /// the first one; the other pages may or may not have been read. A batch
    /// in which a page failed its checksum is read once more, as
    /// [`TransportManager::read_page`] does.
    ///
    /// # Errors
    /// As [`TransportManager::read_page`], and [`TransportError::Config`] when
    /// the slices' lengths differ.
    pub fn read_pages(&self, gpas: &[u64], pages: &mut [Page]) -> Result<(), TransportError> {
        check_lengths(gpas.len(), pages.len())?;
        if let ([gpa], [page]) = (gpas, &mut *pages) {
            return self.read_page(*gpa, page);
        }
        read_once_more(|| self.run_batch(Opcode::Read, gpas, pages.as_mut_ptr().cast()))
    }

    /// Writes `pages[i]` to `gpas[i]` for every i, all in flight at once.
    ///
    /// # Errors
    /// As [`TransportManager::read_pages`].
    pub fn write_pages(&self, gpas: &[u64], pages: &[Page]) -> Result<(), TransportError> {
        check_lengths(gpas.len(), pages.len())?;
        if let ([gpa], [page]) = (gpas, pages) {
            return self.write_page(*gpa, page);
        }
        self.run_batch(Opcode::Write, gpas, pages.as_ptr().cast::<u8>().cast_mut())
    }

    /// A blocking batch: one round when it fits in one (`MAX_CHUNK`
    /// requests), else an asynchronous submission on a private queue that
    /// this thread reaps (windows slide: a slow node or window holds back
    /// only its own).
    fn run_batch(
        &self,
        opcode: Opcode,
        gpas: &[u64],
        pages: *mut u8,
    ) -> Result<(), TransportError> {
        if gpas.len() <= crate::tcp::MAX_CHUNK {
            return self
                .inner
                .run_counted(opcode, gpas, pages, gpas.len(), None);
        }
        let queue = self.inner.completion_queue(Reap::Poll)?;
        // The caller's slice holds `gpas.len()` pages and stays borrowed
        // until this function returns, which is after the completion was
        // reaped (or the queue, dropped on every path, cancelled what was
        // left).
        if opcode == Opcode::Write {
            // SAFETY: see above.
            unsafe { queue.submit_write_raw(gpas, pages.cast_const().cast(), 0)? };
        } else {
            // SAFETY: see above.
            unsafe { queue.submit_read_raw(gpas, pages.cast(), 0)? };
        }
        let mut done = Vec::with_capacity(1);
        while done.is_empty() {
            queue.wait(&mut done, 1, self.inner.config.request_timeout());
        }
        done.pop().map_or(Ok(()), |c| c.result)
    }

    /// Reads the page at `gpa` into a frame of the page pool. Over RDMA the
    /// page is read straight into the frame (no copy).
    ///
    /// # Errors
    /// [`TransportError::PoolExhausted`] when no frame is free, else as
    /// [`TransportManager::read_page`].
    pub fn read_frame(&self, gpa: u64) -> Result<PageFrame, TransportError> {
        let frame = self
            .inner
            .pool
            .alloc()
            .ok_or(TransportError::PoolExhausted {
                capacity: self.inner.pool.capacity(),
            })?;
        let ptr = frame.as_ptr();
        let mut slot = Some(frame);
        self.inner
            .run_counted(Opcode::Read, &[gpa], ptr, 1, Some(&mut slot))?;
        slot.ok_or_else(|| TransportError::Protocol {
            node: String::new(),
            detail: "read_frame lost its frame".into(),
        })
    }

    /// A new queue for asynchronous reads and writes: submit pages and get
    /// each submission's [`Completion`] back by polling, through an eventfd,
    /// or by a callback (see [`Reap`]). Many queues may share a manager.
    ///
    /// # Errors
    /// [`TransportError::Config`] when its eventfd or thread cannot be made.
    pub fn completion_queue(&self, reap: Reap) -> Result<CompletionQueue, TransportError> {
        self.inner.completion_queue(reap)
    }

    /// How long a waiting caller polls before it blocks (see
    /// [`ManagerConfig::wait_spin_us`]): the fault handlers spin as long.
    pub(crate) fn caller_spin(&self) -> std::time::Duration {
        self.inner.config.caller_spin()
    }

    /// A fault handler's one-page read straight into `page`, waiting at
    /// most `wait` (see `Inner::read_direct_within`): `None` when the
    /// one-page TCP path does not apply.
    ///
    /// # Safety
    /// `page` must be valid for writes of `PAGE_SIZE` bytes, and nobody
    /// else may read or write them until this returns.
    pub(crate) unsafe fn read_direct_within(
        &self,
        gpa: u64,
        page: *mut u8,
        wait: std::time::Duration,
    ) -> Option<Result<(), TransportError>> {
        self.inner.read_direct_within(gpa, page, wait)
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
        self.inner.refresh(None)
    }

    /// Installs `map` if its version is newer than the map in use, or it is
    /// of another generation (`MapResponse::generation`) (for a
    /// hypervisor that distributes the map itself, or a coordinator push).
    /// Connections of nodes that left the map or changed address are closed
    /// once the requests still using them are done. Returns whether `map`
    /// was installed.
    pub fn update_map(&self, map: MapResponse) -> bool {
        self.inner.install_map(map, Install::IfNewer)
    }

    /// How long a read of a replicated range waits now for its replica
    /// before the same read goes to another one (see
    /// [`ManagerConfig::read_hedge_delay_us`]; it follows the recent p99
    /// unless configured).
    pub fn read_hedge_delay(&self) -> std::time::Duration {
        self.inner.hedge_delay()
    }

    /// Marks stale at the coordinator, now, every replica this manager
    /// owes a stale mark (`ManagerStats::owed_stale_marks`): a replica
    /// that missed one of its writes (which failed with
    /// [`TransportError::ReplicaMissedWrite`]) while the coordinator could
    /// not be told. Such a replica is still live for everybody else and
    /// lacks the write; this manager's own writes and reads settle the
    /// debt or avoid it, but another manager knows nothing of it. So
    /// before another manager takes the VM over (a migration's
    /// destination, a restarted VMM), call this until it returns Ok. (The
    /// manager's drop tries once too, within the request timeout.)
    ///
    /// # Errors
    /// The first replica the coordinator could not mark
    /// ([`TransportError::ReplicaMissedWrite`], naming the coordinator's
    /// error); it stays owed.
    pub fn settle_owed_stale_marks(&self) -> Result<(), TransportError> {
        self.inner.settle_every_owed_stale(
            std::time::Instant::now() + self.inner.config.request_timeout(),
        )
    }

    /// A snapshot of the manager's state (map, nodes, pool, hedging delay)
    /// and its page-I/O counters.
    pub fn stats(&self) -> ManagerStats {
        self.inner.stats()
    }

    /// Every node of the map with the data path its connection uses now
    /// (`None`: not connected at the moment).
    pub fn node_transports(&self) -> Vec<(String, Option<DataPath>)> {
        self.inner
            .state
            .load()
            .nodes
            .iter()
            .map(|n| {
                let path = n
                    .conn
                    .load()
                    .as_ref()
                    .filter(|l| !l.is_broken())
                    .map(|l| l.path());
                (n.id.clone(), path)
            })
            .collect()
    }

    /// Test hook: makes the next RDMA requests to `node` use a wrong rkey,
    /// so they fail with a remote access error and the QP is rebuilt. False
    /// when the node has no live RDMA connection.
    #[doc(hidden)]
    #[cfg(feature = "test-hooks")]
    pub fn corrupt_rkey_for_test(&self, node: &str) -> bool {
        match self.inner.live_link(node) {
            Some(Link::Rdma(conn)) => {
                conn.corrupt_rkey();
                true
            }
            _ => false,
        }
    }

    /// Test hook: the rkey the node's live RDMA connection uses (the one
    /// its HELLO_ACK carried, unless changed by a test hook).
    #[doc(hidden)]
    #[cfg(feature = "test-hooks")]
    pub fn rdma_rkey_for_test(&self, node: &str) -> Option<u32> {
        match self.inner.live_link(node) {
            Some(Link::Rdma(conn)) => Some(conn.rkey()),
            _ => None,
        }
    }

    /// Test hook: makes the next RDMA requests to `node` use `rkey` (e.g.
    /// another connection's). False when the node has no live RDMA
    /// connection.
    #[doc(hidden)]
    #[cfg(feature = "test-hooks")]
    pub fn set_rdma_rkey_for_test(&self, node: &str, rkey: u32) -> bool {
        match self.inner.live_link(node) {
            Some(Link::Rdma(conn)) => {
                conn.set_rkey(rkey);
                true
            }
            _ => false,
        }
    }

    /// Test hook: CQ events the RDMA pollers took from their completion
    /// channels (event mode, or busy mode after an idle spell).
    #[doc(hidden)]
    #[cfg(feature = "test-hooks")]
    pub fn rdma_cq_events_for_test(&self) -> u64 {
        self.inner.rdma.as_ref().map_or(0, |r| r.pollers.events())
    }

    /// Test hook: the calling thread's next request panics right after it
    /// is submitted (before its completion), to test that an unwinding
    /// caller leaves nothing pointing at its stack, buffers or frames.
    #[cfg(feature = "test-hooks")]
    #[doc(hidden)]
    pub fn panic_after_next_submit_for_test(&self) {
        unwind_hook::arm();
    }

    /// Test hook: the local QP number of the node's live RDMA connection.
    #[doc(hidden)]
    #[cfg(feature = "test-hooks")]
    pub fn rdma_qpn_for_test(&self, node: &str) -> Option<u32> {
        match self.inner.live_link(node) {
            Some(Link::Rdma(conn)) => Some(conn.qpn()),
            _ => None,
        }
    }

    /// Test hook: READ batches abandoned at the hedging delay on the node's
    /// live RDMA connection, with its QP kept, whose completions were not
    /// polled yet (their frames are out of the pool until then).
    #[doc(hidden)]
    #[cfg(feature = "test-hooks")]
    pub fn rdma_abandoned_reads_for_test(&self, node: &str) -> Option<usize> {
        match self.inner.live_link(node) {
            Some(Link::Rdma(conn)) => Some(conn.abandoned_batches()),
            _ => None,
        }
    }
}

impl Drop for TransportManager {
    fn drop(&mut self) {
        if self.inner.owed_stale.any() {
            // Nobody else knows of these replicas' missed writes.
            if let Err(err) = self.settle_owed_stale_marks() {
                tracing::error!(
                    %err,
                    owed = self.inner.owed_stale.count(),
                    "dropped owing stale marks: replicas that missed a write of this manager's \
                     stay live at the coordinator, and may serve older pages at a failover"
                );
            }
        }
        if let Some((stop, handle)) = self.refresher.take() {
            *stop.stop.lock() = true;
            stop.cv.notify_all();
            // Not joined: it may be in a long poll of the map (at most one
            // refresh period plus a request timeout). It holds no strong
            // reference to the manager's state, so nothing waits for it; it
            // exits when its poll answers.
            drop(handle);
        }
        for node in &self.inner.state.load().nodes {
            if let Some(link) = node.conn.swap(None) {
                link.mark_broken();
            }
        }
        self.inner.clear_view();
    }
}

/// Runs a blocking read, and once more if a page failed its checksum: a
/// page corrupted on the way, or (more likely) one a WRITE from another
/// client changed while the page-server was sending it out of its memory
/// with the checksum it kept (docs/wire-protocol.md, "Page checksums"). A
/// second failure is returned. The asynchronous API reports the first.
fn read_once_more(
    mut read: impl FnMut() -> Result<(), TransportError>,
) -> Result<(), TransportError> {
    match read() {
        Err(TransportError::Checksum { node, gpa, .. }) => {
            tracing::debug!(%node, gpa, "a page failed its checksum: reading once more");
            read()
        }
        other => other,
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

/// The longest wait a coordinator grants a long poll of the map.
const MAX_LONG_POLL_MS: u64 = 60_000;

/// Follows the coordinator's map with long polls of one refresh period each
/// (`GET /v1/map?after=V`): a change arrives as soon as it is made, a quiet
/// map costs one request per period. After a failure, or an answer at once
/// with nothing new (a coordinator without long polls), it waits a period
/// before the next poll, as the periodic refresh did. Holds the manager's
/// state only between polls; ends when the manager is gone or stopped.
fn refresh_loop(inner: &std::sync::Weak<Inner>, client: &CoordinatorClient, stop: &RefreshStop) {
    loop {
        if *stop.stop.lock() {
            return;
        }
        let Some((after, sent_ms, period, timeout)) = inner.upgrade().map(|inner| {
            let (after, sent_ms) = inner.long_poll_start();
            let timeout = Duration::from_millis(inner.config.request_timeout_ms.max(2000));
            // The coordinator waits at most a minute per poll: ask no more,
            // so that a quiet answer is recognised as one.
            let wait_ms = inner.config.map_refresh_ms.min(MAX_LONG_POLL_MS);
            (after, sent_ms, wait_ms, timeout)
        }) else {
            return;
        };
        let followed = match client.map_after(after, Duration::from_millis(period), timeout) {
            Ok(resp) => {
                let Some(inner) = inner.upgrade() else {
                    return;
                };
                inner.finish_long_poll(resp, after, sent_ms, period)
            }
            Err(err) => {
                tracing::debug!(%err, "background map refresh failed");
                false
            }
        };
        if !followed {
            let mut stopped = stop.stop.lock();
            if !*stopped {
                stop.cv
                    .wait_for(&mut stopped, Duration::from_millis(period));
            }
        }
    }
}

impl Inner {
    /// Drops a dead connection so the next request reconnects.
    fn forget(&self, node: &Node, link: &Link) {
        let current = node.conn.load();
        if current.as_ref().is_some_and(|c| c.same(link)) {
            node.conn.store(None);
            drop(current);
            self.publish_view();
        }
    }

    /// The live connection of the node named `id`, if any.
    #[cfg(feature = "test-hooks")]
    fn live_link(&self, id: &str) -> Option<Link> {
        let state = self.state.load();
        let node = state.nodes.iter().find(|n| n.id == id)?;
        let link = node.conn.load_full()?;
        (!link.is_broken()).then(|| Link::clone(&link))
    }
}
