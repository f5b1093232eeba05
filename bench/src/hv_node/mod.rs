//! `bench hv-node ROLE ...`: one hypervisor node of a coherent VM, as a
//! process (the bench binary started with `hv-node` as its first argument). It maps
//! the VM's guest RAM coherently (`CoherentMemory`, pages homed at the
//! cluster's page-servers) and runs vCPU threads on it:
//!
//! - `run`: every vCPU increments shared counters with compare-and-swap and
//!   takes a spinlock in guest memory to update a multi-page structure;
//!   node pairs (0→1, 2→3, ...) pass messages through a ring. The nodes
//!   meet at barriers in guest memory (no other channel), check what they
//!   can see, hand their pages back and print one JSON line.
//! - `victim`: takes the start barrier, writes one page and hands it back,
//!   then keeps owning another page and reading the counters until it is
//!   killed.
//! - `check`: after the others, reads everything back and checks it
//!   against what the runs must have left (a dead victim's owned page must
//!   be reported lost).
//! - `touch`: reads the dead victim's owned page as a vCPU would: its
//!   fault cannot be served (the page's latest writes are lost), so the
//!   process must die of SIGBUS rather than read an older version.
//! - `serve`: timed accesses commanded on stdin (`serve.rs`), for `bench
//!   --op coherence`.
//!
//! Used by `bench/tests/coherence.rs` and `bench --op coherence`
//! (`coherence.rs`). The guest-memory layout is in `layout.rs`.

pub mod layout;
mod serve;
mod workload;

use std::time::Duration;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use rdma_transport::coherent::CoherenceConfig;
use rdma_transport::guest_memory::{CoherentMemory, GuestMemoryConfig};
use rdma_transport::{ManagerConfig, TransportManager};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Role {
    Run,
    Victim,
    Check,
    Touch,
    Serve,
}

/// One hypervisor node of a coherent VM (see the module docs).
#[derive(Debug, Parser)]
#[command(name = "bench hv-node")]
struct Args {
    #[arg(value_enum)]
    role: Role,
    /// Coordinator URL of the cluster that homes the VM's pages.
    #[arg(long)]
    coordinator: String,
    /// The cluster's key file (hex, not readable by other users); none: an
    /// insecure cluster.
    #[arg(long, env = "RT_CLUSTER_KEY_FILE")]
    cluster_key_file: Option<std::path::PathBuf>,
    /// Guest RAM of the VM (from GPA 0).
    #[arg(long, default_value = "64MiB", value_parser = rdma_transport::size::parse_size_bytes)]
    memory: usize,
    /// This node's index (0..nodes).
    #[arg(long, default_value_t = 0)]
    node: usize,
    /// Nodes that take part (victims included).
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// The victim's index, if one takes part (it does not run the vCPU
    /// workload).
    #[arg(long)]
    victim: Option<usize>,
    /// vCPU threads per node.
    #[arg(long, default_value_t = 2)]
    vcpus: usize,
    /// Counter increments per vCPU (a multiple of 16).
    #[arg(long, default_value_t = 1600)]
    iters: u64,
    /// Lock acquisitions per vCPU.
    #[arg(long, default_value_t = 100)]
    lock_iters: u64,
    /// Messages per ring.
    #[arg(long, default_value_t = 2000)]
    messages: u64,
    /// Minimum hold time of an exclusive grant (µs).
    #[arg(long, default_value_t = 50)]
    hold_us: u64,
    /// Fault handler threads.
    #[arg(long, default_value_t = 2)]
    handler_threads: usize,
    /// How long a fault may wait for its page before it fails (the vCPU
    /// then gets SIGBUS): `GuestMemoryConfig::fault_timeout_ms`.
    #[arg(long, default_value_t = GuestMemoryConfig::new(0, 0).fault_timeout_ms)]
    fault_timeout_ms: u64,
    /// Longest a wait at a barrier or in the ring may take (s) before the
    /// node gives up with an error.
    #[arg(long, default_value_t = 120)]
    wait_limit_s: u64,
}

/// Runs the node with `args` (the first one is `hv-node`) and exits: 0 when
/// its report says `verified`, 1 when not, 2 when it could not run.
pub fn main(args: impl Iterator<Item = std::ffi::OsString>) -> ! {
    let args = Args::parse_from(args);
    match run(&args) {
        Ok(report) => {
            println!("{report}");
            let verified = report
                .get("verified")
                .and_then(serde_json::Value::as_bool)
                .unwrap_or(false);
            std::process::exit(if verified { 0 } else { 1 });
        }
        Err(err) => {
            println!(
                "{}",
                serde_json::json!({ "node": args.node, "verified": false, "errors": [format!("{err:#}")] })
            );
            std::process::exit(2);
        }
    }
}

fn run(args: &Args) -> anyhow::Result<serde_json::Value> {
    anyhow::ensure!(args.node < args.nodes, "--node must be below --nodes");
    anyhow::ensure!(
        args.iters % layout::COUNTERS as u64 == 0,
        "--iters must be a multiple of {}",
        layout::COUNTERS
    );
    let cluster_key = args
        .cluster_key_file
        .as_deref()
        .map(rdma_transport::auth::ClusterKey::from_file)
        .transpose()
        .context("reading the cluster key")?;
    let manager = TransportManager::connect(ManagerConfig {
        coordinator_url: args.coordinator.clone(),
        cluster_key,
        poller_cpus: Some(vec![]),
        ..ManagerConfig::default()
    })
    .context("connecting to the cluster")?;
    let memory = CoherentMemory::new(
        &manager,
        GuestMemoryConfig {
            handler_threads: args.handler_threads,
            handler_cpus: Some(vec![]),
            fault_timeout_ms: args.fault_timeout_ms,
            ..GuestMemoryConfig::new(0, args.memory)
        },
        CoherenceConfig {
            min_hold_us: args.hold_us,
            timeout_ms: 10_000,
            ..CoherenceConfig::default()
        },
    )
    .context("mapping coherent guest memory")?;
    anyhow::ensure!(
        layout::pages_needed(args.nodes) * rdma_transport::PAGE_SIZE <= args.memory,
        "--memory is too small for the layout"
    );
    let vm = workload::Vm {
        memory: &memory,
        nodes: args.nodes,
        victim: args.victim,
        vcpus: args.vcpus,
        iters: args.iters,
        lock_iters: args.lock_iters,
        messages: args.messages,
        wait_limit: Duration::from_secs(args.wait_limit_s),
    };
    let mut report = match args.role {
        Role::Run => vm.run(args.node)?,
        Role::Victim => vm.victim(args.node)?,
        Role::Check => vm.check()?,
        Role::Touch => vm.touch_lost()?,
        Role::Serve => serve::serve(&memory, vm.wait_limit)?,
    };
    let stats = memory.stats();
    let homes = memory.connections();
    let over_rdma = homes.iter().filter(|(_, c)| c.is_some()).count();
    report["homes"] = serde_json::json!({ "rdma": over_rdma, "tcp": homes.len() - over_rdma });
    report["node"] = args.node.into();
    report["stats"] = serde_json::json!({
        "read_faults": stats.read_faults,
        "write_faults": stats.write_faults,
        "upgrade_faults": stats.upgrade_faults,
        "invalidations": stats.invalidations,
        "downgrades": stats.downgrades,
        "pages_written_back": stats.pages_written_back,
        "fault_errors": stats.fault_errors,
        "requests": stats.protocol.requests,
        "coalesced_faults": stats.protocol.coalesced_faults,
        "deferred_callbacks": stats.protocol.deferred_callbacks,
    });
    Ok(report)
}
