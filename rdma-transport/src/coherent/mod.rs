//! Coherent pages, node side (docs/coherence.md, "Integration"): this
//! process is one node of a coherent VM; each page's home is the
//! page-server that owns its range.
//!
//! [`CoherentNode::acquire`] gets a shared copy or exclusive ownership of a
//! page, running the `coherence` crate's [`NodePage`](coherence::NodePage)
//! per page. The local copy is the embedder's (later `GuestMemory`): it
//! implements [`CoherenceHandler`], whose `install` puts a granted page in
//! place and whose `recall` drops it or makes it read-only when the home
//! calls it back, returning its contents when they must be written back.
//! The handler runs with the page's state locked: every event of a page is
//! handled (and its messages sent) before the next one (`pages.rs`).
//!
//! Transport: one dedicated TCP connection per home (`link.rs`), with the
//! usual handshake (the cluster key proves both sides), and a reader thread
//! that always reads it: the home's callbacks come unasked, at any time. The
//! data connections' receive path is only read while a caller waits for an
//! answer, which a callback cannot wait for. Over TCP pages travel with the
//! messages (a grant carries the home's page, a write-back the node's).
//! When the manager uses RDMA and the home serves it, the handshake sets up
//! an RDMA message channel (`crate::rdma::MessageChannel`): frames go by
//! RDMA WRITE WITH IMMEDIATE into the home's ring (write-backs with their
//! page), and a grant's page is read from the home's region by RDMA READ.
//!
//! A node whose connection to a home breaks is lost for that home (it
//! forgets every copy it held there: `recall(Invalidate { write_back:
//! false })`, the home marks pages it owned lost); the next `acquire`
//! connects again as a new node.

mod link;
mod pages;

use std::collections::HashMap;
use std::net::TcpStream;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use coherence::{Access, Mode, NodeStats};
use parking_lot::Mutex;

use crate::error::TransportError;
use crate::page::{is_page_aligned, Page};
use link::Link;

/// What the home asks of a page the node holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recall {
    /// Drop the local copy (the next access must `acquire` again). With
    /// `write_back`, the copy is modified and owned by this node: return its
    /// contents first.
    Invalidate {
        /// Return the contents ([`RecallAnswer::WriteBack`]).
        write_back: bool,
    },
    /// Return the contents of the (modified, owned) copy and keep it
    /// read-only.
    Downgrade,
}

impl Recall {
    /// Whether the answer must carry the page's contents.
    pub fn needs_data(self) -> bool {
        matches!(
            self,
            Recall::Invalidate { write_back: true } | Recall::Downgrade
        )
    }
}

/// The embedder's answer to a [`Recall`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecallAnswer {
    /// Done; no contents (for a recall that needs none).
    Done,
    /// The page's current contents, to write back to the home.
    WriteBack(Box<Page>),
}

/// The embedder's side of the local copies. Called with the page's state
/// locked: do not call [`CoherentNode`] methods for the same page from it.
pub trait CoherenceHandler: Send + Sync {
    /// A grant: make `data` the local copy of `gpa` (when `Some`; `None`:
    /// keep the copy already held, an upgrade) and allow `mode`'s accesses
    /// (`Shared`: reads; `Exclusive`: reads and writes).
    fn install(&self, gpa: u64, mode: Mode, data: Option<&Page>);

    /// The home (or an eviction) recalls the page. An answer without
    /// contents to a recall that [needs them](Recall::needs_data) makes this
    /// node lost for the page's home (its pages there are marked lost):
    /// never done on purpose.
    fn recall(&self, gpa: u64, recall: Recall) -> RecallAnswer;
}

/// Settings of a [`CoherentNode`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoherenceConfig {
    /// An owner keeps a page at least this long after its grant before it
    /// answers a callback (docs/coherence.md, "False sharing").
    pub min_hold_us: u64,
    /// How long an `acquire` waits for the home.
    pub timeout_ms: u64,
    /// A home that shows no sign of life for this long (its host crashed,
    /// or the network to it was cut: keepalive probes and sent frames
    /// unanswered) is left: every copy of its pages is dropped, as when its
    /// connection closes. Must be positive: a node without a bound would
    /// keep its copies for as long as a home stayed silent, and no home
    /// accepts one (its first access to a home's page fails with
    /// [`TransportError::Config`]).
    ///
    /// The node declares it to each home when it connects, and a home that
    /// lost this node to silence gives its pages to other nodes
    /// [`crate::dead_peer::left_for_sure_within`] that bound later (this
    /// node's copies are gone by then). A home accepts no bound longer
    /// than its `--node-dead-home-timeout-ms` (10 s by default): with a
    /// longer one, the first access to that home's pages fails with
    /// [`TransportError::Config`], naming both (docs/coherence.md,
    /// "Failures").
    pub dead_home_timeout_ms: u64,
}

impl CoherenceConfig {
    /// `dead_home_timeout_ms` as declared to homes; why not, when it is 0
    /// or does not fit the wire's 32 bits.
    pub(crate) fn declared_bound_ms(&self) -> Result<NonZeroU32, String> {
        let ms = self.dead_home_timeout_ms;
        u32::try_from(ms)
            .ok()
            .and_then(NonZeroU32::new)
            .ok_or_else(|| {
                format!(
                "a coherent node needs a dead_home_timeout_ms from 1 to {} ms, not {ms}: without \
                 a bound it would keep its copies of a silent home's pages for as long as the \
                 home stays silent, while the home gives them to other nodes",
                u32::MAX
            )
            })
    }
}

/// [`CoherenceConfig::dead_home_timeout_ms`]'s default, and what a
/// page-server expects of its nodes by default.
pub const DEFAULT_DEAD_HOME_TIMEOUT_MS: u64 = 10_000;

impl Default for CoherenceConfig {
    fn default() -> Self {
        Self {
            min_hold_us: 50,
            timeout_ms: 5_000,
            dead_home_timeout_ms: DEFAULT_DEAD_HOME_TIMEOUT_MS,
        }
    }
}

/// Where a page lives, as the node's map says.
#[derive(Debug, Clone)]
pub(crate) struct HomeRef {
    pub(crate) node: String,
    pub(crate) addr: String,
    pub(crate) offset: u64,
    /// The home's epoch whose memory holds the page's range (0: not
    /// checked; see `manager/epoch.rs`).
    pub(crate) valid_epoch: u64,
}

/// What a [`CoherentNode`] needs from its [`crate::TransportManager`].
pub(crate) trait Resolve: Send + Sync + std::fmt::Debug {
    /// The home of the page at `gpa`.
    fn home_of(&self, gpa: u64) -> Result<HomeRef, TransportError>;
    /// A handshaken, blocking connection to `home`, declaring this node's
    /// bound on the home's silence (`CoherenceConfig::dead_home_timeout_ms`).
    fn dial(&self, home: &HomeRef, node_bound_ms: NonZeroU32) -> Result<Dialed, TransportError>;
    /// Whether the home's process in `server_epoch` (its connection's)
    /// holds the range of `gpa`: by `home.valid_epoch`, else by the map
    /// refreshed once. A home restarted since the range was last written
    /// has an empty memory, not the guest's pages.
    ///
    /// # Errors
    /// [`TransportError::DataLost`] when it does not.
    fn confirm_epoch(
        &self,
        gpa: u64,
        home: &HomeRef,
        server_epoch: u64,
    ) -> Result<(), TransportError>;
}

/// A connection to a home: the socket, and the RDMA message channel set
/// up in its handshake (when both sides have RDMA; the socket then only
/// tells that the home is gone).
#[derive(Debug)]
pub(crate) struct Dialed {
    pub(crate) stream: TcpStream,
    pub(crate) channel: Option<Arc<crate::rdma::MessageChannel>>,
    /// The home agreed to offset-bound sums: every frame's checksum covers
    /// its offset, body and page (`wire::coherence_checksum`).
    pub(crate) bound_sums: bool,
    /// The longest bound on its silence the home accepts from a node (its
    /// `--node-dead-home-timeout-ms`); `None` from a home that does not say.
    pub(crate) node_bound_limit_ms: Option<NonZeroU32>,
    /// The home process's epoch (its HELLO_ACK's).
    pub(crate) epoch: u64,
}

/// This process as a node of a coherent VM. Made by
/// [`crate::TransportManager::coherent_node`]. Dropping it closes its
/// connections to the homes: to them, it is a node that died (pages it
/// owned and had not written back are lost).
#[derive(Debug)]
pub struct CoherentNode {
    shared: Arc<Shared>,
}

pub(crate) struct Shared {
    handler: Arc<dyn CoherenceHandler>,
    config: CoherenceConfig,
    resolve: Arc<dyn Resolve>,
    links: Mutex<HashMap<String, Arc<Link>>>,
    /// Set by [`CoherentNode::close`]: no new connection is made.
    closed: std::sync::atomic::AtomicBool,
    clock: Instant,
    stats: Mutex<NodeStats>,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("config", &self.config)
            .field("homes", &self.links.lock().len())
            .finish_non_exhaustive()
    }
}

impl Shared {
    pub(crate) fn now_us(&self) -> u64 {
        u64::try_from(self.clock.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// Leaves (drops every copy of, then closes) each home whose process
    /// is not the node's by `epoch_of` (a node id's epoch in the map;
    /// `None` or 0: not known, kept): another process registered as that
    /// node.
    pub(crate) fn leave_replaced_homes(&self, epoch_of: impl Fn(&str) -> Option<u64>) {
        let replaced: Vec<(Arc<Link>, u64)> = self
            .links
            .lock()
            .values()
            .filter(|link| link.epoch != 0 && !link.is_dead())
            .filter_map(|link| {
                let now = epoch_of(&link.node).filter(|&e| e != 0 && e != link.epoch)?;
                Some((Arc::clone(link), now))
            })
            .collect();
        for (link, now) in replaced {
            tracing::warn!(
                node = %link.node,
                connected_epoch = format_args!("{:#x}", link.epoch),
                map_epoch = format_args!("{now:#x}"),
                "another process is this home now: leaving the one connected to and dropping \
                 the copies of its pages"
            );
            link.shut();
        }
    }
}

impl CoherentNode {
    pub(crate) fn new(
        resolve: Arc<dyn Resolve>,
        handler: Arc<dyn CoherenceHandler>,
        config: CoherenceConfig,
    ) -> Self {
        Self {
            shared: Arc::new(Shared {
                handler,
                config,
                resolve,
                links: Mutex::new(HashMap::new()),
                closed: std::sync::atomic::AtomicBool::new(false),
                clock: Instant::now(),
                stats: Mutex::new(NodeStats::default()),
            }),
        }
    }

    /// Makes the local copy of `gpa` allow `access`: returns at once when it
    /// does (a hit), else asks the page's home and returns once the grant
    /// was installed (`CoherenceHandler::install`). Concurrent calls for the
    /// same page share one request. The page may be recalled again right
    /// after (after `min_hold_us` for an exclusive grant): an embedder
    /// checks its copy's mode under its own lock, and calls again if it
    /// lost it (as a faulting vCPU would fault again).
    ///
    /// # Errors
    /// [`TransportError::CoherentDataLost`] when the page's latest writes
    /// were lost with a node that owned it; [`TransportError::DataLost`]
    /// when its home restarted since the range was last written (its
    /// memory is empty) and no operator has re-initialised the range;
    /// [`TransportError::Unaligned`],
    /// [`TransportError::UnknownGpa`], [`TransportError::NodeDown`] (the
    /// home cannot be reached, or the connection broke meanwhile),
    /// [`TransportError::Timeout`], [`TransportError::Refused`],
    /// [`TransportError::Protocol`].
    pub fn acquire(&self, gpa: u64, access: Access) -> Result<(), TransportError> {
        let (link, offset) = self.link_for(gpa)?;
        let deadline = Instant::now() + Duration::from_millis(self.shared.config.timeout_ms);
        pages::acquire(&self.shared, &link, gpa, offset, access, deadline)
    }

    /// Drops the local copy of `gpa`: a shared one silently, a modified one
    /// after writing it back (`CoherenceHandler::recall` gives its
    /// contents). Nothing to do when the node holds no copy.
    ///
    /// # Errors
    /// As [`CoherentNode::acquire`].
    pub fn evict(&self, gpa: u64) -> Result<(), TransportError> {
        let (link, offset) = self.link_for(gpa)?;
        pages::evict(&self.shared, &link, gpa, offset)
    }

    /// What the manager tells of each map it installs.
    pub(crate) fn watch(&self) -> std::sync::Weak<Shared> {
        Arc::downgrade(&self.shared)
    }

    /// The node's protocol counters, summed over its pages.
    pub fn stats(&self) -> NodeStats {
        *self.shared.stats.lock()
    }

    /// The homes this node is connected to, each with its RDMA message
    /// channel's counters (`None`: the connection is TCP).
    pub fn connections(&self) -> Vec<(String, Option<crate::rdma::ChannelStats>)> {
        let mut homes: Vec<_> = self
            .shared
            .links
            .lock()
            .iter()
            .map(|(node, link)| (node.clone(), link.channel_stats()))
            .collect();
        homes.sort_by(|a, b| a.0.cmp(&b.0));
        homes
    }

    fn link_for(&self, gpa: u64) -> Result<(Arc<Link>, u64), TransportError> {
        if !is_page_aligned(gpa) {
            return Err(TransportError::Unaligned { gpa });
        }
        let home = self.shared.resolve.home_of(gpa)?;
        let mut links = self.shared.links.lock();
        if self
            .shared
            .closed
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Err(TransportError::NodeDown {
                node: home.node,
                reason: "this coherent node was closed".into(),
            });
        }
        if let Some(link) = links.get(&home.node).filter(|l| !l.is_dead()) {
            let link = Arc::clone(link);
            drop(links);
            self.shared.resolve.confirm_epoch(gpa, &home, link.epoch)?;
            return Ok((link, home.offset));
        }
        let node_bound_ms = self
            .shared
            .config
            .declared_bound_ms()
            .map_err(TransportError::Config)?;
        // Dialled under the lock: one connection per home, and a home that
        // is down costs the callers of this node one timeout each at most.
        let dialed = self.shared.resolve.dial(&home, node_bound_ms)?;
        check_node_bound(&home.node, node_bound_ms, dialed.node_bound_limit_ms)?;
        let link = Link::start(&self.shared, &home.node, dialed)?;
        links.insert(home.node.clone(), Arc::clone(&link));
        drop(links);
        self.shared.resolve.confirm_epoch(gpa, &home, link.epoch)?;
        Ok((link, home.offset))
    }
}

/// Whether a home that accepts bounds up to `limit_ms` (`None`: it does
/// not say) waits long enough for this node, whose bound is `node_bound_ms`,
/// to drop its copies when the home goes silent.
fn check_node_bound(
    home: &str,
    node_bound_ms: NonZeroU32,
    limit_ms: Option<NonZeroU32>,
) -> Result<(), TransportError> {
    match limit_ms {
        Some(limit) if node_bound_ms <= limit => Ok(()),
        Some(limit) => Err(TransportError::Config(format!(
            "home {home} waits for a silent node as if it dropped its copies within {limit} ms \
             (its --node-dead-home-timeout-ms), but this node's dead_home_timeout_ms is \
             {node_bound_ms}: its vCPUs could read pages the home had given to others. Use a \
             bound of at most {limit} ms, or raise the home's"
        ))),
        None => Err(TransportError::Config(format!(
            "home {home} does not say how long it waits for a silent node (a page-server from \
             before nodes declared their bound): it cannot be a coherence home for this node"
        ))),
    }
}

impl CoherentNode {
    /// Closes every connection to the homes, as dropping the node does: to
    /// them, this node died (pages it owned and had not written back are
    /// lost). Waiting `acquire`s fail with `NodeDown`, and so does every
    /// later call.
    pub fn close(&self) {
        let links: Vec<Arc<Link>> = {
            let mut links = self.shared.links.lock();
            self.shared
                .closed
                .store(true, std::sync::atomic::Ordering::Release);
            links.drain().map(|(_, l)| l).collect()
        };
        for link in links {
            link.close_and_join();
        }
    }
}

impl Drop for CoherentNode {
    fn drop(&mut self) {
        self.close();
    }
}
