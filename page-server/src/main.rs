//! `page-server`: exports this node's memory to the other nodes.
#![allow(clippy::print_stderr)]

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use page_server::ServerConfig;

/// Exports a region of this node's memory over the page wire protocol and
/// registers it with the coordinator. A flag given twice takes its last
/// value (a wrapper script's defaults, overridden after them).
#[derive(Debug, Parser)]
#[command(version, args_override_self = true)]
struct Args {
    /// This node's id (letters, digits, `_`, `-`, `.`).
    #[arg(long)]
    node_id: String,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:7100")]
    listen: SocketAddr,
    /// Address other nodes reach this one at (default: the bound address).
    #[arg(long)]
    advertise: Option<String>,
    /// Serve Prometheus metrics (`GET /metrics`) on this address, e.g.
    /// 127.0.0.1:9100 (default: none).
    #[arg(long)]
    metrics_listen: Option<SocketAddr>,
    /// Memory to export as one GPA range starting at --gpa-base, e.g. 1GiB,
    /// 512MiB, 4096 [default: 256MiB]. Not with --range.
    #[arg(long, value_parser = rdma_transport::size::parse_size_bytes)]
    memory: Option<usize>,
    /// First guest-physical address of the one exported range (decimal or
    /// 0x hex) [default: 0]. Not with --range.
    #[arg(long, value_parser = parse_u64)]
    gpa_base: Option<u64>,
    /// A GPA range to export, GPA_START:LENGTH (start in decimal or 0x hex;
    /// length in decimal, 0x hex, or with a unit: 64KiB, 512MiB, 1GiB).
    /// Repeat it to export several ranges: they are laid out one after the
    /// other in the exported memory, in the order given, and registered
    /// (and recovered, when replicated) each on its own. Page aligned, not
    /// overlapping. Instead of --memory and --gpa-base.
    #[arg(long = "range", value_name = "GPA_START:LENGTH", conflicts_with_all = ["memory", "gpa_base"])]
    ranges: Vec<page_server::ExportedRange>,
    /// Coordinator base URL; several, comma-separated, for coordinators
    /// sharing one etcd store (one that cannot be reached, or answers 503,
    /// is skipped for the next).
    #[arg(long, default_value = "http://127.0.0.1:7070")]
    coordinator: String,
    /// Bearer token for the coordinator (or env COORDINATOR_TOKEN).
    #[arg(long, env = "COORDINATOR_TOKEN")]
    token: Option<String>,
    /// File holding the cluster key (hex, at least 32 bytes, not readable by
    /// other users): clients must prove it before any page moves.
    #[arg(long, env = "RT_CLUSTER_KEY_FILE")]
    cluster_key_file: Option<std::path::PathBuf>,
    /// Run without a cluster key: any client on the network can read and
    /// write the exported memory.
    #[arg(long)]
    insecure: bool,
    /// Heartbeat period in milliseconds (also how often a quiet map is
    /// looked at again for replicas to recover; a change is followed at
    /// once).
    #[arg(long, default_value_t = 1000)]
    heartbeat_ms: u64,
    /// Microseconds a connection thread keeps polling its socket after a
    /// request before it blocks (0: block at once).
    #[arg(long, default_value_t = 50)]
    spin_us: u64,
    /// Milliseconds this process may go without running (stopped, paused
    /// VM) before it serves nothing more until the coordinator confirms,
    /// by a heartbeat sent after the stall, that no other process replaced
    /// it meanwhile (0: off; else at least 100). Keep it below the
    /// coordinator's lease minus the heartbeat period.
    #[arg(long, default_value_t = 500)]
    stall_fence_ms: u64,
    /// Milliseconds without a heartbeat answered by the coordinator (from
    /// the send of the last answered one) after which this process serves
    /// nothing until one is (0: never, the default: a process cut off from
    /// the coordinator keeps serving). Set it below the coordinator's
    /// --lease-ms so that a process cut off from the coordinator stops
    /// serving before another process of its node can register; at least
    /// twice --heartbeat-ms.
    #[arg(long, default_value_t = 0)]
    lease_fence_ms: u64,
    /// Milliseconds from accept to the end of a connection's HELLO
    /// handshake; slower connections are closed.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    handshake_timeout_ms: u64,
    /// Milliseconds a handshaken connection may go without a complete
    /// request before it is closed (0: never; clients run a request whose
    /// connection was closed once more on a new one).
    #[arg(long, default_value_t = 0)]
    idle_timeout_ms: u64,
    /// Milliseconds a client's host may show no sign of life (keepalive
    /// probes and answers unacknowledged) before its connection is closed
    /// and its place freed (0: the kernel's defaults, an idle dead client
    /// is kept forever). Live idle clients are never closed by it.
    #[arg(long, default_value_t = 30_000)]
    dead_peer_timeout_ms: u64,
    /// The longest a coherence node cut off from this page-server may keep
    /// copies of its pages, in milliseconds: nodes declare theirs (their
    /// dead_home_timeout_ms) and a longer one is refused. A node lost to
    /// silence is declared lost, and its pages given to other nodes, its
    /// own bound plus a probe interval and 2 s later; one this server
    /// closes itself, once it closed its side or after that wait.
    #[arg(long, default_value_t = rdma_transport::coherent::DEFAULT_DEAD_HOME_TIMEOUT_MS, value_parser = clap::value_parser!(u64).range(1..))]
    node_dead_home_timeout_ms: u64,
    /// Handshaken connections served at once.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    max_connections: u64,
    /// Connections still in their handshake at once; beyond it the oldest
    /// of them is closed.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    max_pending_handshakes: u64,
    /// Write the bound address to this file once listening and registered
    /// with the coordinator, its ranges in the map (for scripts). Written
    /// whole (a temporary file, renamed).
    #[arg(long)]
    ready_file: Option<std::path::PathBuf>,
    /// RDMA device to serve the region on (default: the first device, if
    /// any; without one the server serves TCP only).
    #[arg(long, conflicts_with = "no_rdma")]
    rdma_device: Option<String>,
    /// Port of the RDMA device.
    #[arg(long, default_value_t = 1)]
    rdma_port: u8,
    /// GID index (default: the IPv4-mapped RoCE v2 GID; 0 on InfiniBand).
    #[arg(long)]
    rdma_gid_index: Option<u8>,
    /// How each client connection gets its own rkey: `mw` (type-2 memory
    /// windows bound to the client's QP), `mr` (a memory region per
    /// connection), or `auto` (windows where the device has them).
    #[arg(long, default_value = "auto")]
    rdma_client_keys: page_server::ClientKeys,
    /// Serve TCP only, even where an RDMA device exists.
    #[arg(long)]
    no_rdma: bool,
    /// Back the exported memory with 2 MiB huge pages when reserved
    /// (`/proc/sys/vm/nr_hugepages`); normal pages otherwise.
    #[arg(long)]
    huge_pages: bool,
    /// Replica recovery (a replicated range whose replica here is stale is
    /// copied from a live replica): milliseconds between the coordinator
    /// marking it `recovering` and the start of the copy. Must exceed the
    /// clients' map refresh period plus their request timeout (1000 + 1000
    /// ms by default), so that every client writes here before the copy
    /// starts. See docs/operations.md, "Replica recovery".
    #[arg(long, default_value_t = 2500)]
    recovery_grace_ms: u64,
    /// Replica recovery: most MiB per second copied from the source
    /// replica (0: unbounded).
    #[arg(long, default_value_t = 512)]
    recovery_rate_mib_s: u64,
    /// A directory kept across restarts (e.g. /var/lib/page-server/NODE):
    /// it records each range this node has held, so that after a restart
    /// those ranges are claimed as missed and, should the coordinator have
    /// lost its state too, come back `lost` instead of `live` with zeros.
    /// See docs/operations.md, "Coordinator state lost".
    #[arg(long)]
    state_dir: Option<std::path::PathBuf>,
}

/// `--memory` when neither it nor `--range` is given.
const DEFAULT_MEMORY_BYTES: usize = 256 << 20;

fn parse_u64(s: &str) -> Result<u64, String> {
    let r = match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    r.map_err(|e| format!("{s:?}: {e}"))
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let cluster_key =
        rdma_transport::auth::key_from_flags(args.cluster_key_file.as_deref(), args.insecure)
            .map_err(anyhow::Error::msg)?;
    let mut config = ServerConfig::new(args.node_id, args.memory.unwrap_or(DEFAULT_MEMORY_BYTES));
    config.gpa_base = args.gpa_base.unwrap_or(0);
    if !args.ranges.is_empty() {
        config.set_ranges(args.ranges);
    }
    // Checked here too (spawn does) for a message that names the flags.
    config
        .layout()
        .context("bad exported ranges (--range, or --memory and --gpa-base)")?;
    config.cluster_key = cluster_key;
    config.listen = args.listen;
    config.advertise = args.advertise;
    config.metrics_listen = args.metrics_listen;
    config.coordinator_url = Some(args.coordinator);
    config.coordinator_token = args.token;
    config.heartbeat_interval = Duration::from_millis(args.heartbeat_ms.max(1));
    config.spin_before_block = Duration::from_micros(args.spin_us);
    config.stall_fence = Duration::from_millis(args.stall_fence_ms);
    config.lease_fence = Duration::from_millis(args.lease_fence_ms);
    config.huge_pages = args.huge_pages;
    config.recovery_grace = Duration::from_millis(args.recovery_grace_ms);
    config.recovery_rate_mib_s = args.recovery_rate_mib_s;
    config.state_dir = args.state_dir;
    config.handshake_timeout = Duration::from_millis(args.handshake_timeout_ms);
    config.idle_timeout = Duration::from_millis(args.idle_timeout_ms);
    config.dead_peer_timeout = Duration::from_millis(args.dead_peer_timeout_ms);
    config.node_dead_home_timeout = Duration::from_millis(args.node_dead_home_timeout_ms);
    config.max_connections = usize::try_from(args.max_connections).context("--max-connections")?;
    config.max_pending_handshakes =
        usize::try_from(args.max_pending_handshakes).context("--max-pending-handshakes")?;
    config.rdma = page_server::RdmaOptions {
        enabled: !args.no_rdma,
        device: args.rdma_device,
        port: args.rdma_port,
        gid_index: args.rdma_gid_index,
        client_keys: args.rdma_client_keys,
    };
    let term = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM] {
        signal_hook::flag::register(sig, Arc::clone(&term)).context("installing signal handler")?;
    }
    let server = page_server::spawn(config).context("starting page-server")?;
    if let Some(path) = &args.ready_file {
        // A script that reads the map next must find the ranges there.
        // The registration is retried meanwhile (and a refusal logged).
        while !term.load(Ordering::Relaxed) {
            match server.wait_registered(Duration::from_millis(100)) {
                Ok(()) => {
                    write_ready_file(path, server.addr()).context("writing ready file")?;
                    break;
                }
                Err(page_server::ServerError::RegistrationTimeout(_)) => {}
                Err(_) => std::thread::park_timeout(Duration::from_millis(100)),
            }
        }
    }
    while !term.load(Ordering::Relaxed) {
        std::thread::park_timeout(Duration::from_millis(100));
    }
    tracing::info!("signal received; shutting down");
    server.shutdown();
    Ok(())
}

/// Writes `addr` to `path` whole: a reader never sees part of it.
fn write_ready_file(path: &std::path::Path, addr: SocketAddr) -> std::io::Result<()> {
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    std::fs::write(&temporary, addr.to_string())?;
    std::fs::rename(&temporary, path)
}
