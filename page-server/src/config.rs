//! Settings of a page-server.

use std::net::SocketAddr;
use std::time::Duration;

use rdma_transport::auth::ClusterKey;

use crate::client_keys::ClientKeys;
use crate::layout::{ExportedRange, Layout, LayoutError};
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
    /// Where to serve Prometheus metrics (`GET /metrics`); none when `None`.
    pub metrics_listen: Option<SocketAddr>,
    /// Bytes of memory to export (a multiple of 4096). With one range (what
    /// [`ServerConfig::new`] sets up), that range's length; with several
    /// ([`ServerConfig::set_ranges`]), their total.
    pub memory_bytes: usize,
    /// First GPA of the range this node owns; with several ranges, of the
    /// first one.
    pub gpa_base: u64,
    /// Several ranges, when set by [`ServerConfig::set_ranges`]; `None`:
    /// the one range `memory_bytes` at `gpa_base`.
    ranges: Option<Vec<ExportedRange>>,
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
    /// Wait between registration attempts while the coordinator is not up,
    /// and before the next heartbeat after one failed (the lease is at
    /// risk; doubled for each further failure in a row, up to
    /// `heartbeat_interval`).
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
    /// is closed; zero (the default): never. `TransportManager` runs a
    /// request whose connection the server closed once more on a new
    /// connection, so its clients do not notice; clients that went away
    /// are closed by `dead_peer_timeout` without it (docs/operations.md,
    /// "Connection limits").
    pub idle_timeout: Duration,
    /// A client connection whose peer shows no sign of life for this long
    /// is closed by the kernel (`rdma_transport::dead_peer`: keepalive probes, and
    /// `TCP_USER_TIMEOUT` on unacknowledged answers), freeing its place
    /// under `max_connections`: a client host that crashed or was cut off
    /// answers nothing, not even a reset. A live client's kernel answers
    /// the probes however long it stays idle. Default 30 s; zero: the
    /// kernel's defaults (an idle dead peer is kept forever).
    pub dead_peer_timeout: Duration,
    /// The longest a coherence node cut off from this home may keep its
    /// copies of the home's pages. Each node declares its own bound when it
    /// connects (`CoherenceConfig::dead_home_timeout_ms`, 10 s by default,
    /// as here); one that declares none, or a longer one, is not made a
    /// node (its coherence messages are refused with `Status::NodeBound`).
    /// A node lost to silence (`dead_peer_timeout`, or the kernel's own
    /// timeouts) is declared lost, and its pages given to others,
    /// `dead_peer::left_for_sure_within` its bound later: whichever way
    /// the network was cut, the node has dropped its copies by then. A
    /// node this server closes itself (a refused write-back, a stalled
    /// send) is declared lost once it closed its side, or at most that
    /// long after. At least 1 ms (`spawn` refuses less).
    pub node_dead_home_timeout: Duration,
    /// How long a connection thread keeps polling its socket (yielding the
    /// CPU) after a request before it blocks. A streaming client then never
    /// waits for an idle CPU to wake up; 0 blocks at once (for hosts where
    /// the server shares a CPU with latency-critical threads).
    pub spin_before_block: Duration,
    /// A process that did not run for this long (stopped, paused) serves
    /// nothing more until the coordinator answers a heartbeat sent after
    /// it with this process's epoch: it may have been replaced meanwhile
    /// (`self_fence.rs`; docs/operations.md, "One process per node id").
    /// Must stay below the coordinator's lease minus the heartbeat period.
    /// Zero: off; otherwise at least 100 ms (`spawn` refuses less).
    pub stall_fence: Duration,
    /// A process whose heartbeats the coordinator has not answered for
    /// this long (from the send of the last answered one) serves nothing
    /// until one is: below the coordinator's lease, a process cut off from
    /// the coordinator stops serving before another process of its node
    /// can register (`self_fence.rs`). Zero (the default): a process cut
    /// off from the coordinator keeps serving its clients. At least twice
    /// `heartbeat_interval` when set (`spawn` refuses less).
    pub lease_fence: Duration,
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
    /// A directory kept across restarts (`held_ranges.rs`): it records each
    /// range this node's memory has held, so that a later process, whose
    /// memory is empty, claims those ranges as missed and a coordinator
    /// that lost its state too makes them `lost`, not `live` with zeros.
    /// `None` (the default): nothing is kept, and a range whose holders
    /// all restarted while the coordinator had no state comes back zeros.
    pub state_dir: Option<std::path::PathBuf>,
}

impl ServerConfig {
    /// A config with sensible defaults for `node_id` exporting `memory_bytes`.
    pub fn new(node_id: impl Into<String>, memory_bytes: usize) -> Self {
        Self {
            node_id: node_id.into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            advertise: None,
            metrics_listen: None,
            memory_bytes,
            gpa_base: 0,
            ranges: None,
            coordinator_url: None,
            coordinator_token: None,
            cluster_key: None,
            heartbeat_interval: Duration::from_millis(1000),
            register_retry: Duration::from_millis(200),
            max_connections: 256,
            max_pending_handshakes: 64,
            handshake_timeout: Duration::from_secs(2),
            idle_timeout: Duration::ZERO,
            dead_peer_timeout: Duration::from_secs(30),
            node_dead_home_timeout: Duration::from_millis(
                rdma_transport::coherent::DEFAULT_DEAD_HOME_TIMEOUT_MS,
            ),
            spin_before_block: Duration::from_micros(50),
            stall_fence: Duration::from_millis(500),
            lease_fence: Duration::ZERO,
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
            state_dir: None,
        }
    }
}

impl ServerConfig {
    /// Exports `ranges` instead of the one range `memory_bytes` at
    /// `gpa_base`: laid out one after the other in the exported memory, in
    /// this order (range k at the sum of the lengths before it). Sets
    /// `memory_bytes` to their total and `gpa_base` to the first one's
    /// start; changing either afterwards is refused by
    /// [`ServerConfig::layout`]. Checked by `layout` (and so by `spawn`).
    pub fn set_ranges(&mut self, ranges: Vec<ExportedRange>) {
        let total = ranges
            .iter()
            .fold(0u64, |sum, r| sum.saturating_add(r.length_bytes));
        self.memory_bytes = usize::try_from(total).unwrap_or(usize::MAX);
        self.gpa_base = ranges.first().map_or(0, |r| r.gpa_start);
        self.ranges = Some(ranges);
    }

    /// The ranges to export, in layout order, unchecked.
    pub fn ranges(&self) -> Vec<ExportedRange> {
        match &self.ranges {
            Some(ranges) => ranges.clone(),
            None => vec![ExportedRange::new(self.gpa_base, self.memory_bytes as u64)],
        }
    }

    /// The checked layout of the exported memory.
    ///
    /// # Errors
    /// A [`LayoutError`] from [`Layout::new`], or
    /// [`LayoutError::Inconsistent`] when `memory_bytes` or `gpa_base` was
    /// changed after [`ServerConfig::set_ranges`].
    pub fn layout(&self) -> Result<Layout, LayoutError> {
        let layout = Layout::new(&self.ranges())?;
        if self.ranges.is_some() {
            let first = layout.ranges().first().map_or(0, |r| r.gpa_start);
            if layout.total_bytes() != self.memory_bytes || first != self.gpa_base {
                return Err(LayoutError::Inconsistent {
                    memory_bytes: self.memory_bytes,
                    gpa_base: self.gpa_base,
                });
            }
        }
        Ok(layout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn new_exports_one_range_at_gpa_base() {
        let mut cfg = ServerConfig::new("n", MIB as usize);
        cfg.gpa_base = 4 * MIB;
        assert_eq!(cfg.ranges(), [ExportedRange::new(4 * MIB, MIB)]);
        let layout = cfg.layout().unwrap();
        assert_eq!(layout.total_bytes(), MIB as usize);
        assert_eq!(layout.ranges()[0].remote_offset, 0);
    }

    #[test]
    fn set_ranges_sizes_the_memory_and_keeps_the_order() {
        let mut cfg = ServerConfig::new("n", 4096);
        cfg.set_ranges(vec![
            ExportedRange::new(2 * MIB, MIB),
            ExportedRange::new(0, 2 * MIB),
        ]);
        assert_eq!(cfg.memory_bytes, (3 * MIB) as usize);
        assert_eq!(cfg.gpa_base, 2 * MIB);
        let offsets: Vec<u64> = cfg
            .layout()
            .unwrap()
            .ranges()
            .iter()
            .map(|r| r.remote_offset)
            .collect();
        assert_eq!(offsets, [0, MIB]);
    }

    #[test]
    fn changing_the_single_range_fields_after_set_ranges_is_refused() {
        let mut cfg = ServerConfig::new("n", 4096);
        cfg.set_ranges(vec![ExportedRange::new(0, MIB)]);
        cfg.memory_bytes = 2 * MIB as usize;
        assert!(matches!(
            cfg.layout(),
            Err(LayoutError::Inconsistent { .. })
        ));
        cfg.memory_bytes = MIB as usize;
        cfg.gpa_base = MIB;
        assert!(matches!(
            cfg.layout(),
            Err(LayoutError::Inconsistent { .. })
        ));
    }

    #[test]
    fn bad_single_range_and_bad_ranges_are_refused() {
        assert_eq!(
            ServerConfig::new("n", 100).layout(),
            Err(LayoutError::NotAligned {
                range: ExportedRange::new(0, 100)
            })
        );
        assert!(matches!(
            ServerConfig::new("n", 0).layout(),
            Err(LayoutError::ZeroLength(_))
        ));
        let mut cfg = ServerConfig::new("n", 4096);
        cfg.set_ranges(Vec::new());
        assert_eq!(cfg.layout(), Err(LayoutError::Empty));
        cfg.set_ranges(vec![
            ExportedRange::new(0, 2 * MIB),
            ExportedRange::new(MIB, MIB),
        ]);
        assert!(matches!(cfg.layout(), Err(LayoutError::Overlap { .. })));
    }
}
