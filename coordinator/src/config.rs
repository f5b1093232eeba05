//! Settings of one coordinator instance.

use std::net::SocketAddr;
use std::path::PathBuf;

use rdma_transport::auth::ClusterKey;

/// How to run a coordinator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// Address to listen on; port 0 picks a free port.
    pub listen: SocketAddr,
    /// SQLite database file; created when missing. Unused with
    /// [`StoreConfig::Etcd`].
    pub db_path: PathBuf,
    /// Where the state lives: the SQLite file (default) or etcd.
    pub store: StoreConfig,
    /// When set, every route but `GET /v1/health` needs a credential
    /// derived from this key (node, client or admin; see
    /// `docs/coordinator.md`). `None`: insecure, reads are open and writes
    /// need `token` when one is set (logged at WARN at start).
    pub cluster_key: Option<ClusterKey>,
    /// An extra admin credential: `Authorization: Bearer <token>`. Without
    /// a cluster key it guards writes only. Must not be empty.
    pub token: Option<String>,
    /// A node is alive while its last heartbeat is younger than this.
    pub lease_ms: u64,
    /// Bounds on what one caller can take from the others.
    pub limits: Limits,
}

/// Which backend keeps the coordinator's state.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum StoreConfig {
    /// The SQLite file at [`CoordinatorConfig::db_path`] (one coordinator).
    #[default]
    Sqlite,
    /// An etcd cluster: coordinators are stateless, run several. Needs the
    /// `etcd` cargo feature; without it [`crate::Server::bind`] refuses it.
    Etcd(EtcdConfig),
}

/// How to reach the etcd cluster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdConfig {
    /// Client URLs of the members, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// Every key the coordinator writes starts with this (e.g.
    /// `/rdma-transport/`): several clusters can share one etcd.
    pub prefix: String,
    /// An etcd request that has not answered within this long fails (the
    /// HTTP request then answers 503).
    pub request_timeout_ms: u64,
}

impl EtcdConfig {
    /// Key prefix used when none is given.
    pub const DEFAULT_PREFIX: &'static str = "/rdma-transport/";
    /// Request timeout used when none is given: above an etcd election
    /// (about 1 s), well below the default lease (3 s), so a heartbeat
    /// stuck on a member that died fails over before its lease lapses.
    pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 1500;

    /// `endpoints` with the default prefix and timeout.
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            prefix: Self::DEFAULT_PREFIX.to_owned(),
            request_timeout_ms: Self::DEFAULT_REQUEST_TIMEOUT_MS,
        }
    }
}

/// Resource bounds of a coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Registered nodes at most; registering one more answers 429.
    pub max_nodes: usize,
    /// Map entries at most; claiming one more answers 429.
    pub max_ranges: usize,
    /// Replicas one node may hold at most (a range it alone holds counts
    /// one); claiming one more answers 429.
    pub max_ranges_per_node: usize,
    /// Replicas of one range at most (its holders); one more answers 429.
    pub max_replicas: usize,
    /// Connections served at once; more wait in the listen backlog.
    pub max_connections: usize,
    /// A connection that has not sent a whole request head this long after
    /// connecting (or after its previous answer) is closed.
    pub header_timeout_ms: u64,
    /// A request whose body has not fully arrived this long after its head
    /// answers 408.
    pub body_timeout_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_nodes: 4096,
            max_ranges: 65536,
            max_ranges_per_node: 4096,
            max_replicas: 3,
            max_connections: 256,
            header_timeout_ms: 10_000,
            body_timeout_ms: 10_000,
        }
    }
}

impl CoordinatorConfig {
    /// Lease used when none is given.
    pub const DEFAULT_LEASE_MS: u64 = 3000;

    /// An insecure configuration (no key, no token) with
    /// [`Self::DEFAULT_LEASE_MS`] and default [`Limits`].
    pub fn new(listen: SocketAddr, db_path: impl Into<PathBuf>) -> Self {
        Self {
            listen,
            db_path: db_path.into(),
            store: StoreConfig::Sqlite,
            cluster_key: None,
            token: None,
            lease_ms: Self::DEFAULT_LEASE_MS,
            limits: Limits::default(),
        }
    }
}
