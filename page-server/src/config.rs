//! Settings of a page-server.

use std::net::SocketAddr;
use std::time::Duration;

use rdma_transport::auth::ClusterKey;

use crate::client_keys::ClientKeys;
use crate::rdma::RdmaOptions;

/// What to export and where to announce it.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// This node's id in the coordinator.
    pub node_id: String,
    /// TCP address to listen on (port 0: an ephemeral port).
    pub listen: SocketAddr,
    /// Address other nodes use to reach this one; the bound address when `None`.
    pub advertise: Option<String>,
    /// Bytes of memory to export (a multiple of 4096).
    pub memory_bytes: usize,
    /// First GPA of the range this node owns.
    pub gpa_base: u64,
    /// Coordinator base URL; `None` runs without registering.
    pub coordinator_url: Option<String>,
    /// Bearer token for a coordinator without a cluster key (its `--token`);
    /// unused when `cluster_key` is set.
    pub coordinator_token: Option<String>,
    /// The cluster key clients must prove (and this server proves to them)
    /// before any page moves; the node also registers with the coordinator
    /// with the node credential derived from it. `None`: insecure, any
    /// client is served and clients that hold a key refuse this server.
    pub cluster_key: Option<ClusterKey>,
    /// Period of the heartbeat that keeps this node's lease alive, and of
    /// the replica recovery's look at the map.
    pub heartbeat_interval: Duration,
    /// Wait between registration attempts while the coordinator is not up.
    pub register_retry: Duration,
    /// Handshaken connections served at once; a connection that finishes
    /// its HELLO beyond this is closed without a HELLO_ACK. Connections
    /// still in their handshake do not count (see `max_pending_handshakes`).
    pub max_connections: usize,
    /// Connections that have not finished their HELLO handshake, at once; a
    /// new one beyond this closes the oldest of them, so they can never
    /// keep a good client out.
    pub max_pending_handshakes: usize,
    /// Time from accept to the end of the HELLO handshake; a connection
    /// that takes longer (however its bytes trickle in) is closed.
    pub handshake_timeout: Duration,
    /// A handshaken connection that sends no complete request for this long
    /// is closed; zero (the default): never. Off by default because
    /// `TransportManager` does not yet retry a request whose connection the
    /// server closed while idle: its first request after such a close fails
    /// with `NodeDown` (see `tests/flood.rs`, the ignored test).
    pub idle_timeout: Duration,
    /// How long a connection thread keeps polling its socket (yielding the
    /// CPU) after a request before it blocks. A streaming client then never
    /// waits for an idle CPU to wake up; 0 blocks at once (for hosts where
    /// the server shares a CPU with latency-critical threads).
    pub spin_before_block: Duration,
    /// The RDMA side (on by default: the first device, if there is one).
    pub rdma: RdmaOptions,
    /// Back the exported memory with 2 MiB huge pages when the host has
    /// them reserved (registering it for RDMA is then much faster).
    pub huge_pages: bool,
    /// Agree to page checksums when a client asks for them (default on:
    /// CRC-32C of a page costs well under a microsecond; see
    /// docs/wire-protocol.md). Off: clients that ask get pages without.
    pub page_checksums: bool,
    /// Replica recovery: how long after the coordinator marks this node's
    /// replica `recovering` the copy from a live replica starts. A protocol
    /// wait: it must exceed the clients' map refresh period plus their
    /// request timeout, so that every client sends its writes here too
    /// before the copy starts (a page written here during the copy is never
    /// overwritten by it). Default 2500 ms (clients: 1000 + 1000 ms).
    pub recovery_grace: Duration,
    /// Replica recovery: most MiB per second copied from the source
    /// replica (the copy sleeps between batches to stay under it); 0:
    /// unbounded. Default 512.
    pub recovery_rate_mib_s: u64,
}

impl ServerConfig {
    /// A config with sensible defaults for `node_id` exporting `memory_bytes`.
    pub fn new(node_id: impl Into<String>, memory_bytes: usize) -> Self {
        Self {
            node_id: node_id.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            memory_bytes,
            gpa_base: 0,
            coordinator_url: None,
            coordinator_token: None,
            cluster_key: None,
            heartbeat_interval: Duration::from_millis(1000),
            register_retry: Duration::from_millis(200),
            max_connections: 256,
            max_pending_handshakes: 64,
            handshake_timeout: Duration::from_secs(2),
            idle_timeout: Duration::ZERO,
            spin_before_block: Duration::from_micros(50),
            rdma: RdmaOptions {
                enabled: true,
                device: None,
                port: 1,
                gid_index: None,
                client_keys: ClientKeys::Auto,
            },
            huge_pages: false,
            page_checksums: true,
            recovery_grace: Duration::from_millis(2500),
            recovery_rate_mib_s: 512,
        }
    }
}
