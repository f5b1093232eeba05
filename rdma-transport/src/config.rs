//! Configuration of a [`crate::TransportManager`].

use std::time::Duration;

use crate::auth::ClusterKey;

/// Which data path to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TransportKind {
    /// RDMA where both ends have a usable device, TCP otherwise.
    #[default]
    Auto,
    /// TCP only.
    Tcp,
    /// RDMA only; refuses to start without a usable device.
    Rdma,
}

impl std::str::FromStr for TransportKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "tcp" => Ok(Self::Tcp),
            "rdma" => Ok(Self::Rdma),
            other => Err(format!(
                "unknown transport {other:?} (expected auto, tcp or rdma)"
            )),
        }
    }
}

/// The data path a node's connection really uses (see
/// [`crate::TransportManager::node_transports`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataPath {
    /// Pages move over the TCP connection.
    Tcp,
    /// Pages move by RDMA READ/WRITE over an RC queue pair.
    Rdma,
}

impl DataPath {
    /// `"tcp"` or `"rdma"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Rdma => "rdma",
        }
    }
}

impl std::fmt::Display for DataPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How poller threads (and, in busy mode, callers) wait for answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PollMode {
    /// Pollers spin on the connections while traffic flows and block in
    /// `poll(2)` only after `poll_idle_spin_us` without an answer; callers
    /// spin for `wait_spin_us` before they block. Lowest latency; costs a
    /// core while busy. Opt-in: pair it with `poller_cpus`.
    Busy,
    /// Nobody spins: a caller blocks on its sockets (TCP) or parks (RDMA)
    /// at once, pollers always block until a connection is readable. The
    /// default: the embedding program (the VMM) decides where CPU time goes.
    #[default]
    Event,
}

/// Settings of a [`crate::TransportManager`]. `Default` leaves thread
/// placement to the embedding program: one poller thread, not pinned, and
/// no busy polling (`PollMode::Event`). Pinning (`poller_cpus`) and busy
/// polling (`PollMode::Busy`, `wait_spin_us`) are opt-in; the bench turns
/// them on explicitly and prints the placement it used.
#[derive(Debug, Clone)]
pub struct ManagerConfig {
    /// Base URL of the coordinator, e.g. `http://127.0.0.1:7070`; several,
    /// comma-separated, for coordinators sharing one etcd store (see
    /// [`CoordinatorClient`](crate::coordinator::CoordinatorClient)).
    pub coordinator_url: String,
    /// Bearer token sent to a coordinator without a cluster key (its
    /// `--token`); unused when `cluster_key` is set.
    pub coordinator_token: Option<String>,
    /// The cluster key every page-server proves and this client proves to
    /// them in each connection's handshake; the map is read from the
    /// coordinator with the read-only client credential derived from it.
    /// `None`: insecure, only servers without a key are used (logged at
    /// WARN once).
    pub cluster_key: Option<ClusterKey>,
    /// Data path choice.
    pub transport: TransportKind,
    /// Size of the page pool in bytes (a multiple of 4096). The pool is
    /// mapped on 2 MiB huge pages while the host has free reserved ones
    /// (`/proc/sys/vm/nr_hugepages`), on normal pages otherwise: a VMM
    /// that needs reserved huge pages for guest memory reserves enough for
    /// the pools of every manager on the host too.
    pub pool_size_bytes: usize,
    /// Number of poller threads.
    pub poller_threads: usize,
    /// CPUs to pin pollers to (poller i on `cpus[i % len]`).
    /// `Some(vec![])` (default): no pinning, the scheduler (or whoever sets
    /// the process's affinity) decides. `None`: the last CPUs of the host,
    /// one per poller.
    pub poller_cpus: Option<Vec<usize>>,
    /// How pollers and callers wait. Default `Event` (nobody spins).
    pub poll_mode: PollMode,
    /// Busy mode: how long a poller keeps spinning after the last answer.
    pub poll_idle_spin_us: u64,
    /// Busy mode: how long a caller spins for its answer (reading it
    /// itself) before it blocks. In event mode a caller blocks at once.
    pub wait_spin_us: u64,
    /// Deadline of every request, from submission to answer. A write to a
    /// replicated range that a live replica took and another missed (that
    /// one timed out, say) may take up to a quarter of this longer (at
    /// least 100 ms): the time to mark the other stale at the coordinator,
    /// without which the write would fail.
    pub request_timeout_ms: u64,
    /// Deadline of a connection attempt plus handshake. Default 3500: Linux
    /// retransmits a lost SYN after 1 s and again 2 s later, so a 1 s
    /// deadline failed a connect on one dropped SYN (e.g. a full listen
    /// backlog); 3.5 s survives two. A request's own deadline still bounds
    /// the dial it waits for.
    pub connect_timeout_ms: u64,
    /// Period of the background map refresh; 0 turns it off (the map is
    /// still refreshed on a miss or a lost node).
    pub map_refresh_ms: u64,
    /// RDMA device to use (e.g. `mlx5_0`, `rxe0`); the first one when `None`.
    pub rdma_device: Option<String>,
    /// Port of the RDMA device (from 1).
    pub rdma_port: u8,
    /// GID index to use; `None`: the IPv4-mapped RoCE v2 GID on Ethernet
    /// ports, 0 on InfiniBand.
    pub rdma_gid_index: Option<u8>,
    /// Local ACK timeout code of the QPs (4.096 us * 2^code; 1..=31).
    /// Default 14 (~67 ms): see `rdma::QP_TIMEOUT`.
    pub rdma_ack_timeout: u8,
    /// Transport retries before an RDMA request fails (0..=7). Default 3.
    pub rdma_retry_count: u8,
    /// Ask every page-server for end-to-end page checksums (CRC-32C in the
    /// header of each page payload, checked before the page is used; see
    /// docs/wire-protocol.md). TCP data path only: pages moved by RDMA are
    /// not checksummed. A corrupted page is [`crate::TransportError::Checksum`],
    /// never data. Default on: one page in flight pays nothing measurable,
    /// 32 in flight about 7 % of throughput (docs/benchmarking.md). On,
    /// each WRITE's sum and each coherence frame's also cover its offset
    /// (and a coherence frame's body), where the page-server agrees.
    pub page_checksums: bool,
    /// Replicated ranges: how long a read waits for a replica before it
    /// goes to the next live one (the slow request is abandoned). 0
    /// (default): four times the recent p99 of such reads, at least 1 ms.
    /// Never more than half of `request_timeout_ms`.
    pub read_hedge_delay_us: u64,
    /// This client's identity on every connection (HELLO's client id).
    /// `None` (default): a random one per manager. A page-server ends a
    /// client's older data connections when it opens a new one, so that a
    /// write the client gave up on cannot land after a newer one
    /// (docs/wire-protocol.md). Give a value that stays the same across
    /// restarts of the VMM process (e.g. derived from the VM's UUID) and
    /// the same holds across a restart: the new process's connections end
    /// the dead one's, and what it sent and was not yet applied is
    /// refused. Two managers alive at once must never share one (each
    /// would end the other's connections): a live migration's destination
    /// created while the source's manager lives takes another id
    /// (docs/embedding.md, "A VMM that restarts").
    pub client_id: Option<u64>,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            coordinator_url: "http://127.0.0.1:7070".into(),
            coordinator_token: None,
            cluster_key: None,
            transport: TransportKind::Auto,
            pool_size_bytes: 16 << 20,
            poller_threads: 1,
            poller_cpus: Some(Vec::new()),
            poll_mode: PollMode::Event,
            poll_idle_spin_us: 1000,
            wait_spin_us: 1000,
            request_timeout_ms: 1000,
            connect_timeout_ms: 3500,
            map_refresh_ms: 1000,
            rdma_device: None,
            rdma_port: 1,
            rdma_gid_index: None,
            rdma_ack_timeout: crate::rdma::QP_TIMEOUT,
            rdma_retry_count: crate::rdma::QP_RETRY_CNT,
            page_checksums: true,
            read_hedge_delay_us: 0,
            client_id: None,
        }
    }
}

impl ManagerConfig {
    pub(crate) fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    pub(crate) fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// How long a waiting caller (or fault handler) polls for its answer
    /// before it blocks: `wait_spin_us` in busy mode, nothing in event mode.
    pub(crate) fn caller_spin(&self) -> Duration {
        match self.poll_mode {
            PollMode::Busy => Duration::from_micros(self.wait_spin_us),
            PollMode::Event => Duration::ZERO,
        }
    }

    /// The CPUs the pollers are pinned to (empty: not pinned): `poller_cpus`,
    /// or when it is `None` the last CPUs of the host, one per poller. An
    /// embedder placing its own threads away from them can ask.
    pub fn resolved_poller_cpus(&self) -> Vec<usize> {
        if let Some(cpus) = &self.poller_cpus {
            return cpus.clone();
        }
        let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
        (0..self.poller_threads.max(1))
            .map(|i| ncpu - 1 - (i % ncpu))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_neither_pin_nor_busy_poll() {
        let d = ManagerConfig::default();
        assert_eq!(d.poll_mode, PollMode::Event);
        assert_eq!(d.resolved_poller_cpus(), Vec::<usize>::new());
        let pinned = ManagerConfig {
            poller_cpus: None,
            poller_threads: 1,
            ..d
        };
        let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert_eq!(pinned.resolved_poller_cpus(), vec![ncpu - 1]);
    }
}
