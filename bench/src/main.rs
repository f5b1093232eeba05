//! `bench`: latency and throughput of the paging transport.
//!
//! With no flags: starts a local cluster on loopback (coordinator on a
//! temporary database, two page-servers on ephemeral ports), fills the
//! remote memory, runs a write and a read benchmark with every page's content
//! checked, prints a table, and tears the cluster down.
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod async_loop;
mod baseline;
mod cluster;
mod coherence;
mod compare;
mod failure;
mod fault;
mod flush;
mod guest;
mod hv_node;
mod latency_rounds;
mod matrix;
mod pattern;
mod replicas;
mod report;
mod rounds;
mod throughput_rounds;
mod verbs_compare;
mod workload;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use rdma_transport::{ManagerConfig, PollMode, TransportKind, TransportManager, PAGE_SIZE};

use crate::cluster::LocalCluster;
use crate::matrix::{BackingChoice, PatternChoice, PrefetchChoice};
use crate::report::Record;
use crate::workload::{Op, Spec, WorkingSet};

/// The local page-servers' spin before they block, in µs, for reads and
/// writes. They stand in for remote nodes with CPUs of their own; with two
/// of them taking every other random request, the page-server's default 50
/// µs often ran out between two requests, and waking a blocked server cost
/// p99 x2.7-x4.1 of the bare ping-pong against x1.2-x2.0 with 200 µs
/// (docs/benchmarking.md, "Bench placement, 2026-11-26").
const LOCAL_SERVER_SPIN_US: u64 = 200;

/// Latency and throughput benchmark of the remote-memory paging transport.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Data path: auto (RDMA where possible), tcp, or rdma (fails without a device).
    #[arg(long, default_value = "auto")]
    transport: TransportKind,
    /// Operation to measure; both (write, then read) when not given.
    #[arg(long, value_enum)]
    op: Option<Op>,
    /// Page operations per run.
    #[arg(long, default_value_t = 50_000)]
    ops: u64,
    /// Remote memory under test, e.g. 64MiB (the local cluster exports this much).
    #[arg(long, default_value = "64MiB", value_parser = rdma_transport::size::parse_size_bytes)]
    memory: usize,
    /// Benchmark threads.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Requests in flight per thread.
    #[arg(long, default_value_t = 1)]
    depth: usize,
    /// Address order: random, seq, or all (one run of each) [default:
    /// random for read and write, all for fault].
    #[arg(long, value_enum)]
    pattern: Option<PatternChoice>,
    /// --op fault only: guest-memory read-ahead on, off, or both (one run of
    /// each) [default: both].
    #[arg(long, value_enum)]
    prefetch: Option<PrefetchChoice>,
    /// --op fault only: what guest memory is made of: anon (private
    /// anonymous memory), memfd (shared memory, faults resolved with
    /// UFFDIO_CONTINUE), hugetlbfs (a MFD_HUGETLB memfd: 2 MiB per fault;
    /// needs reserved huge pages), or all (anon and memfd) [default: anon].
    #[arg(long, value_enum)]
    backing: Option<BackingChoice>,
    /// Page-servers in the local cluster.
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// --op coherence: hypervisor node processes sharing the guest RAM
    /// (upgrade-3 needs 4).
    #[arg(long, default_value_t = 2)]
    hv: usize,
    /// --op coherence: the nodes' minimum hold time of an exclusive grant
    /// (µs, see docs/coherence.md).
    #[arg(long, default_value_t = 50)]
    hold_us: u64,
    /// Holders of each range in the local cluster (1 to 3, at most --nodes):
    /// when it divides --nodes, the page-servers form groups of this many
    /// that hold one range each; otherwise every page-server holds this many
    /// ranges in rotation (3 nodes, 2 replicas: ranges A, B, C on nodes
    /// 0+1, 1+2, 2+0). Runs start once every replica is live.
    #[arg(long, default_value_t = 1, conflicts_with = "coordinator")]
    replicas: usize,
    /// This many ms into each read and write run, stop the primary of the
    /// first range abruptly (sockets closed without goodbye, heartbeats
    /// stopped), and report errors, verified pages and the latency of the
    /// requests around it. The node is started again, and recovered, before
    /// the next run. Needs --replicas 2 or more, or --accept-errors.
    #[arg(long, value_name = "T")]
    fail_node_after_ms: Option<u64>,
    /// With --fail-node-after-ms: failed operations are counted, not a
    /// failed run (wrong pages and lost acknowledged writes still are).
    #[arg(long, requires = "fail_node_after_ms")]
    accept_errors: bool,
    /// Use an existing cluster at this coordinator URL instead of starting one.
    #[arg(long)]
    coordinator: Option<String>,
    /// With --coordinator: the cluster's key file (hex, not readable by other
    /// users). The local cluster makes a throw-away key of its own.
    #[arg(long, env = "RT_CLUSTER_KEY_FILE")]
    cluster_key_file: Option<PathBuf>,
    /// Run without a cluster key (the local cluster too): anyone on the
    /// network could read and write the pages.
    #[arg(long)]
    insecure: bool,
    /// Also run every read/write again, in this process, against a second
    /// local cluster without a key, and print the cost of authentication
    /// as keyed/insecure ratios.
    #[arg(long, conflicts_with_all = ["insecure", "coordinator"])]
    compare_insecure: bool,
    /// Also run every read/write again, in this process, against a second
    /// local cluster that holds each range once (--nodes / --replicas
    /// page-servers, same memory), and print the cost of replication as
    /// R/1 ratios, next to a bare program's fan-out to R servers against
    /// one. Needs --replicas 2 or more.
    #[arg(long, conflicts_with_all = ["coordinator", "compare_insecure", "fail_node_after_ms"])]
    compare_replicas: bool,
    /// Rounds of a comparison (--compare-insecure, --compare-replicas): the
    /// two clusters take turns this many times per run; each side's
    /// figures are its medians.
    #[arg(long, default_value_t = 3)]
    compare_rounds: usize,
    /// Write the results as a JSON array to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also run a bare TCP ping-pong of the same sizes in each thread layout
    /// (same CPU blocking, two CPUs spinning, two CPUs blocking) and print our
    /// overhead against the layout with the lowest p50.
    #[arg(long)]
    baseline: bool,
    /// RDMA: also run a bare verbs loop in this process (two RC QPs on the
    /// same device, one READ or WRITE posted and its completion spun on, as
    /// perftest's ib_read_lat does; with --depth N, N outstanding and one
    /// posted as each completes, as `ib_read_bw -t N`), alternating blocks
    /// of `--verbs-block` operations with ours, and print our overhead
    /// against it (p50 and mean at depth 1, pages/s deeper). One thread.
    #[arg(long)]
    verbs_baseline: bool,
    /// `--op fault --baseline`: also run N rounds of our one-thread fault
    /// (no read-ahead) and the baselines one after the other, and print
    /// the median of the rounds' ratios (bench/src/fault/alternate.rs).
    #[arg(long, default_value_t = 0, value_name = "N")]
    fault_rounds: u64,
    /// `--baseline --depth 1` reads or writes from one thread: also run N
    /// rounds of ours, the bare ping-pong and (with more than one node) the
    /// bare ping-pong over as many servers, one after the other, and print
    /// the median of the rounds' ratios (bench/src/latency_rounds.rs).
    #[arg(long, default_value_t = 0, value_name = "N")]
    latency_rounds: u64,
    /// `--baseline --depth N` (N > 1) reads or writes from one thread: also
    /// run R rounds of ours and the bare pipelined client, one after the
    /// other, and print the median of the rounds' GB/s ratios
    /// (bench/src/throughput_rounds.rs).
    #[arg(long, default_value_t = 0, value_name = "R")]
    throughput_rounds: u64,
    /// Operations per block of `--verbs-baseline`.
    #[arg(long, default_value_t = 250, value_name = "OPS")]
    verbs_block: u64,
    /// Poller mode: busy (pollers and callers spin before they block) or
    /// event (nobody spins). The bench's default is busy; the library's is
    /// event.
    #[arg(long, default_value = "busy", value_parser = parse_poll_mode)]
    poll_mode: PollMode,
    /// CPUs to pin the pollers to: `last` (the last CPUs, one per poller),
    /// `none` (not pinned: the library's default), or a list like `1,3`.
    #[arg(long, default_value = "last", value_parser = parse_poller_cpus)]
    poller_cpus: CpuChoice,
    /// CPUs to pin the guest-memory fault handlers to (`--op fault` and its
    /// flush runs): `first` (the first CPUs, one per handler, away from the
    /// pollers), `none` (not pinned: the library's default), or a list like
    /// `0,2`.
    #[arg(long, default_value = "first", value_parser = parse_handler_cpus)]
    handler_cpus: CpuChoice,
    /// `--op fault`: fault handler threads of the measured regions
    /// (`GuestMemoryConfig::handler_threads`; the flush runs keep one). With
    /// `--handler-cpus first`, handler i is pinned to CPU i.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=256))]
    handler_threads: u16,
    /// `--op fault`: CPUs of the faulting threads: `auto` (with one
    /// handler thread pinned, all on its CPU, where the local page-servers
    /// then go too; else `spread`), `spread` (thread t on CPU t, mod the
    /// CPU count), `none` (not pinned) or a list like `0` (thread t on the
    /// list's entry t, mod its length). See docs/benchmarking.md, "Four
    /// faulting threads on the handler's CPU".
    #[arg(long, default_value = "auto", value_parser = parse_toucher_cpus)]
    toucher_cpus: CpuChoice,
    /// Scheduler slice (µs) the fault handlers ask for, Linux 6.12+
    /// (`GuestMemoryConfig::handler_slice_us`; 0: the kernel's). Longer
    /// than the faulting threads' (the kernel's default, at most 3 ms), a
    /// faulting thread woken by its page preempts the handler on a shared
    /// CPU (docs/benchmarking.md, "Handlers that let the vCPU run first")
    #[arg(long, default_value_t = 4000)]
    handler_slice_us: u64,
    /// The library call: copy (`read_pages`/`write_pages` with the bench's
    /// buffers, one batch of --depth at a time), frame (reads with
    /// `read_frame`, each page checked in its pool frame; one page per
    /// call, so --depth 1; writes copy) or async (a completion queue per
    /// thread keeping --depth one-page submissions in flight).
    #[arg(long, value_enum, default_value = "copy")]
    api: workload::Api,
    /// Poller threads.
    #[arg(long, default_value_t = 1)]
    pollers: usize,
    /// How long a caller spins for its answer before parking, in microseconds
    /// (default: the library's).
    #[arg(long)]
    wait_spin_us: Option<u64>,
    /// How long the local page-servers' connection threads spin for the
    /// next request before they block, in microseconds (the page-server's
    /// `--spin-us`; its default is 50). Default here: 200, or 0 for `--op
    /// fault` (see docs/benchmarking.md, "Bench placement, 2026-11-26").
    #[arg(long, value_name = "US")]
    page_server_spin_us: Option<u64>,
    /// CPUs of the local page-servers' connection threads: `auto` (the
    /// bench's choice: with one thread the pollers' CPU for reads and
    /// writes and CPU 0 for `--op fault`, else not pinned), `none` (not
    /// pinned) or a list like `1`.
    #[arg(long, default_value = "auto", value_parser = parse_server_cpus)]
    page_server_cpus: CpuChoice,
    /// RDMA: local ACK timeout code of the QPs (4.096 us * 2^CODE; default:
    /// the library's 14, ~67 ms). SoftRoCE retransmits spuriously now and
    /// then, and each retransmission waits this long.
    #[arg(long, value_name = "CODE")]
    rdma_ack_timeout: Option<u8>,
    /// End-to-end page checksums (CRC-32C, TCP data path): on or off
    /// (default: the library's, `ManagerConfig::page_checksums`). The
    /// page-servers always offer them; this decides whether the client asks.
    #[arg(long, value_name = "on|off", value_parser = parse_on_off)]
    checksums: Option<bool>,
    /// Register each worker thread's page buffers with the transport
    /// (`TransportManager::register_memory`): over RDMA, reads land in them
    /// and writes go out of them directly, with no pool frame and no copy.
    /// Prints the zero-copy page counts at the end.
    #[arg(long)]
    register_buffers: bool,
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("expected on or off, got {other:?}")),
    }
}

/// A `--*-cpus` flag: `None` for its keyword (`last`, `first`, `auto`: the
/// automatic choice), else the list (empty for `none`: not pinned). Its
/// value is the library's `Option<Vec<usize>>` as it is.
#[derive(Debug, Clone)]
struct CpuChoice(Option<Vec<usize>>);

fn parse_poller_cpus(s: &str) -> Result<CpuChoice, String> {
    parse_cpu_choice(s, "last")
}

fn parse_handler_cpus(s: &str) -> Result<CpuChoice, String> {
    parse_cpu_choice(s, "first")
}

fn parse_toucher_cpus(s: &str) -> Result<CpuChoice, String> {
    if s == "spread" {
        let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
        return Ok(CpuChoice(Some((0..ncpu).collect())));
    }
    parse_cpu_choice(s, "auto")
}

/// The fault op's faulting-thread CPUs (`None`: not a fault run): thread t
/// runs on entry t (mod the length); empty: not pinned. `--toucher-cpus`,
/// or with `auto` the CPU of the one pinned handler thread, else thread t
/// on CPU t of `ncpu`.
fn fault_toucher_cpus(args: &Args, ncpu: usize) -> Option<Vec<usize>> {
    let handlers = fault_handler_cpus(args, ncpu)?;
    Some(match (&args.toucher_cpus.0, handlers.as_slice()) {
        (Some(cpus), _) => cpus.clone(),
        (None, &[handler]) => vec![handler],
        (None, _) => (0..ncpu.max(1)).collect(),
    })
}

fn parse_server_cpus(s: &str) -> Result<CpuChoice, String> {
    parse_cpu_choice(s, "auto")
}

/// The CPUs of the local page-servers' connection threads for the read and
/// write runs: `--page-server-cpus`, or with `auto` and one caller thread,
/// the pollers' CPUs. The caller then has its CPU to itself and the
/// servers spin on the other one, as in the bare ping-pong's best layout
/// (`cross-cpu-spinning`); left to the scheduler, the two servers of the
/// default cluster shared the caller's CPU half the time (depth-1 read p50
/// median x1.39 of the bare ping-pong against x1.22 pinned, 8 alternated
/// runs each, docs/benchmarking.md). Several caller threads need both CPUs:
/// not pinned. Nor are they when a run restarts a server or compares with
/// a second cluster, whose servers (or a restarted one's threads) would not
/// be placed alike. The fault op places them per run (fault.rs).
fn local_server_cpus(args: &Args, poller_cpus: &[usize]) -> Option<Vec<usize>> {
    let plain_local_run = args.coordinator.is_none()
        && args.threads == 1
        && args.fail_node_after_ms.is_none()
        && !args.compare_insecure
        && !args.compare_replicas;
    match (&args.page_server_cpus.0, args.op) {
        (Some(cpus), _) => Some(cpus.clone()),
        (None, None | Some(Op::Read | Op::Write)) if plain_local_run => Some(poller_cpus.to_vec()),
        _ => None,
    }
}

/// The fault op's handler CPUs, as the placement line shows them (`None`:
/// not a fault run): `--handler-cpus`, or with `first` handler i on CPU i
/// of `ncpu` (the library's choice for `handler_cpus: None`).
fn fault_handler_cpus(args: &Args, ncpu: usize) -> Option<Vec<usize>> {
    (args.op == Some(Op::Fault)).then(|| {
        args.handler_cpus.0.clone().unwrap_or_else(|| {
            (0..usize::from(args.handler_threads))
                .map(|i| i % ncpu.max(1))
                .collect()
        })
    })
}

fn parse_cpu_choice(s: &str, keyword: &str) -> Result<CpuChoice, String> {
    if s == keyword {
        return Ok(CpuChoice(None));
    }
    parse_cpu_list(s, keyword).map(|cpus| CpuChoice(Some(cpus)))
}

/// `none` (an empty list: not pinned) or CPU ids like `1,3`; `keyword` is
/// the flag's other value, for the error message.
fn parse_cpu_list(s: &str, keyword: &str) -> Result<Vec<usize>, String> {
    if s == "none" {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(|c| {
            c.trim()
                .parse::<usize>()
                .map_err(|_| format!("expected {keyword}, none or CPU ids like 1,3; got {s:?}"))
        })
        .collect()
}

fn parse_poll_mode(s: &str) -> Result<PollMode, String> {
    match s {
        "busy" => Ok(PollMode::Busy),
        "event" => Ok(PollMode::Event),
        other => Err(format!("unknown poll mode {other:?} (busy or event)")),
    }
}

fn main() -> std::process::ExitCode {
    // The CPUs the baseline's layouts may use, taken before anything pins
    // this thread (see `baseline::allowed_cpus`).
    baseline::allowed_cpus();
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            // The chain of causes, without a backtrace: what a user can act on.
            eprintln!("bench: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if std::env::args_os().nth(1).is_some_and(|a| a == "hv-node") {
        // A node process of `--op coherence` (or of the coherence tests).
        hv_node::main(std::env::args_os().skip(1));
    }
    let args = Args::parse();
    workload::set_register_buffers(args.register_buffers);
    if args.threads == 0 || args.depth == 0 || args.nodes == 0 || args.ops == 0 {
        bail!("--threads, --depth, --nodes and --ops must be at least 1");
    }
    if args.api == workload::Api::Frame && args.depth > 1 {
        bail!("--api frame reads one page per call: use --depth 1");
    }
    if args.api != workload::Api::Copy && args.op == Some(Op::Fault) {
        bail!("--api applies to --op read and write");
    }
    if args.api == workload::Api::Async && args.fail_node_after_ms.is_some() {
        bail!("--fail-node-after-ms measures the blocking API: use --api copy");
    }
    if args.memory < PAGE_SIZE * args.nodes {
        bail!("--memory must hold at least one page per node");
    }
    let placements =
        replicas::layout(args.nodes, args.replicas, args.memory).map_err(anyhow::Error::msg)?;
    replicas::check_failure_flags(
        args.fail_node_after_ms,
        args.replicas,
        args.accept_errors,
        args.coordinator.is_none(),
        args.op == Some(Op::Fault),
    )
    .map_err(anyhow::Error::msg)?;
    if args.compare_insecure && (args.replicas > 1 || args.fail_node_after_ms.is_some()) {
        bail!("--compare-insecure runs without replicas or failures");
    }
    let cluster_key = match (&args.coordinator, args.insecure) {
        (None, false) => Some(
            rdma_transport::auth::ClusterKey::generate()
                .context("a throw-away key for the local cluster")?,
        ),
        _ => rdma_transport::auth::key_from_flags(args.cluster_key_file.as_deref(), args.insecure)
            .map_err(anyhow::Error::msg)?,
    };
    if (args.compare_insecure || args.compare_replicas) && args.op == Some(Op::Fault) {
        bail!("--compare-insecure and --compare-replicas apply to --op read and write");
    }
    if args.compare_replicas && args.replicas < 2 {
        bail!("--compare-replicas compares --replicas 2 or more with one holder per range");
    }
    if args.verbs_baseline
        && (args.transport != TransportKind::Rdma
            || args.threads != 1
            || args.depth > baseline::verbs::MAX_DEPTH
            || args.verbs_block == 0
            || matches!(args.op, Some(Op::Fault | Op::Coherence))
            || args.fail_node_after_ms.is_some()
            || args.baseline
            || matches!(args.pattern, Some(PatternChoice::Seq | PatternChoice::All)))
    {
        bail!("--verbs-baseline needs --transport rdma, --op read or write, random pages, one thread, --depth 1 to 1024, --verbs-block 1 or more, no failure and no --baseline");
    }
    if args.fault_rounds > 0 && (args.op != Some(Op::Fault) || !args.baseline) {
        bail!("--fault-rounds needs --op fault and --baseline");
    }
    if args.latency_rounds > 0
        && (!args.baseline
            || args.depth != 1
            || args.threads != 1
            || matches!(args.op, Some(Op::Fault | Op::Coherence))
            || args.replicas > 1
            || args.fail_node_after_ms.is_some())
    {
        bail!("--latency-rounds needs --baseline, reads or writes, --depth 1, one thread, one replica and no failure");
    }
    if args.throughput_rounds > 0
        && (!args.baseline
            || args.depth < 2
            || args.threads != 1
            || matches!(args.op, Some(Op::Fault | Op::Coherence))
            || args.replicas > 1
            || args.fail_node_after_ms.is_some())
    {
        bail!("--throughput-rounds needs --baseline, reads or writes, --depth 2 or more, one thread, one replica and no failure");
    }
    if args.compare_rounds == 0 {
        bail!("--compare-rounds must be at least 1");
    }
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The fault op places the local page-servers, and sets their spin, per
    // run (fault.rs); they start as its measured runs want them.
    let fault_cpus = fault_toucher_cpus(&args, ncpu).map(|touchers| fault::FaultCpus {
        touchers,
        handlers: fault_handler_cpus(&args, ncpu).unwrap_or_default(),
        server_cpus: args.page_server_cpus.0.clone(),
        server_spin: args.page_server_spin_us.map(Duration::from_micros),
        ncpu,
    });
    let fault_servers = fault_cpus
        .as_ref()
        .filter(|_| args.coordinator.is_none())
        .map(|cpus| cpus.fault_servers(args.threads));
    let server_spin = match (&fault_servers, args.page_server_spin_us) {
        (Some(placement), _) => placement.spin,
        (None, us) => Duration::from_micros(us.unwrap_or(LOCAL_SERVER_SPIN_US)),
    };
    let mut cluster = match &args.coordinator {
        Some(_) => None,
        None => Some(cluster::LocalCluster::start_placed(
            &placements,
            server_spin,
            cluster_key.clone(),
        )?),
    };
    let ranges = replicas::range_count(&placements);
    if let Some(c) = &cluster {
        if args.replicas > 1 {
            eprintln!("waiting for every replica to be live...");
        }
        replicas::wait_all_live(
            &c.coordinator_client()?,
            ranges,
            args.replicas,
            replicas::LIVE_TIMEOUT,
        )?;
    }
    let url = match (&cluster, &args.coordinator) {
        (Some(c), _) => c.url().to_owned(),
        (None, Some(u)) => u.clone(),
        (None, None) => unreachable!("one of the two is set above"),
    };
    let config = ManagerConfig {
        coordinator_url: url.clone(),
        cluster_key,
        transport: args.transport,
        poll_mode: args.poll_mode,
        poller_threads: args.pollers,
        poller_cpus: args.poller_cpus.0.clone(),
        wait_spin_us: args.wait_spin_us.unwrap_or(match args.op {
            Some(Op::Fault) => fault::WAIT_SPIN_US,
            _ => ManagerConfig::default().wait_spin_us,
        }),
        rdma_ack_timeout: args
            .rdma_ack_timeout
            .unwrap_or(ManagerConfig::default().rdma_ack_timeout),
        page_checksums: args
            .checksums
            .unwrap_or(ManagerConfig::default().page_checksums),
        ..ManagerConfig::default()
    };
    let poller_cpus = config.resolved_poller_cpus();
    let mut placement = report::Placement {
        poll_mode: match config.poll_mode {
            PollMode::Busy => "busy".into(),
            PollMode::Event => "event".into(),
        },
        poller_cpus: poller_cpus.clone(),
        wait_spin_us: config.wait_spin_us,
        page_server_spin_us: args
            .coordinator
            .is_none()
            .then_some(server_spin.as_micros() as u64),
        handler_cpus: fault_cpus.as_ref().map(|c| c.handlers.clone()),
        handler_slice_us: (args.op == Some(Op::Fault)).then_some(args.handler_slice_us),
        toucher_cpus: fault_cpus.as_ref().map(|c| c.touchers.clone()),
        // The fault op's measured runs' (the flush runs print theirs).
        page_server_cpus: match &fault_servers {
            Some(placement) => Some(placement.cpus.clone()),
            None => local_server_cpus(&args, &poller_cpus),
        },
        caller_cpu: None,
    };
    let mgr = std::sync::Arc::new(
        TransportManager::connect(config.clone())
            .with_context(|| format!("connecting to the cluster at {url}"))?,
    );
    // The fault op places them per run (fault.rs).
    if let (Some(cpus), false, true) = (
        &placement.page_server_cpus,
        args.op == Some(Op::Fault),
        args.coordinator.is_none(),
    ) {
        cluster::pin_local_servers(cpus);
    }
    // One caller thread of a read or write run, with its page-servers
    // pinned: the caller (this thread, and so the threads it starts) goes
    // on a CPU none of them is on, where the bare client runs. Left to the
    // scheduler, it started now and then on the servers' CPU (depth-1 read
    // p50 18.3 us instead of 12.0, docs/benchmarking.md). `--verbs-baseline`
    // pins it itself.
    if let (Some(servers), 1, false, None | Some(Op::Read | Op::Write)) = (
        placement.page_server_cpus.as_deref(),
        args.threads,
        args.verbs_baseline,
        args.op,
    ) {
        if !servers.is_empty() {
            let avoid: Vec<usize> = poller_cpus.iter().chain(servers).copied().collect();
            placement.caller_cpu = baseline::pin_first_free(&avoid)?;
        }
    }
    let placement = placement;
    let map = mgr.map();
    let nodes = map.nodes().len();
    let limit_pages = args.memory / PAGE_SIZE;
    let gpas: Vec<u64> = map
        .ranges()
        .flat_map(|(start, len, _)| {
            (0..len / PAGE_SIZE as u64).map(move |i| start + i * PAGE_SIZE as u64)
        })
        .take(limit_pages)
        .collect();
    if gpas.is_empty() {
        bail!("the cluster at {url} maps no memory");
    }
    let set = WorkingSet::new(gpas);
    // Which node serves each page (`--baseline` spreads the bare
    // ping-pong's pages the same way).
    let owners = set.owners(&map);
    eprintln!(
        "cluster: {url}, {} nodes, {} replica(s) per range, {} MiB under test ({} pages); filling it...",
        nodes,
        args.replicas,
        (set.len() * PAGE_SIZE) >> 20,
        set.len()
    );
    set.fill(&mgr, 1).context("filling remote memory")?;
    let mut bare_verbs = if args.verbs_baseline {
        Some(baseline::verbs::BareVerbs::connect(
            &config,
            set.len(),
            1,
            args.depth,
        )?)
    } else {
        None
    };
    let verbs_cpu = if args.verbs_baseline {
        verbs_compare::pin_loops(&poller_cpus)?
    } else {
        None
    };

    let ops: Vec<Op> = match args.op {
        Some(op) => vec![op],
        None => vec![Op::Write, Op::Read],
    };
    let prefetch = matrix::prefetch(&ops, args.prefetch)?;
    let backings = matrix::backings(&ops, args.backing)?;
    let mut records = Vec::new();
    let mut lines = Vec::new();
    let mut keyed_runs = Vec::new();
    let mut seed = 100;
    let mut failed_before = false;
    for &op in &ops {
        let patterns = matrix::patterns(op, args.pattern);
        if op == Op::Coherence {
            let (recs, summary) = coherence::run(&coherence::Params {
                mgr: &mgr,
                url: &url,
                key: config.cluster_key.as_ref(),
                hv: args.hv,
                ops: args.ops,
                memory_bytes: args.memory,
                hold_us: args.hold_us,
                nodes,
                fill_seed: 1,
            })?;
            records.extend(recs);
            lines.extend(summary);
            continue;
        }
        if op == Op::Fault {
            let params = fault::Params {
                ops: args.ops,
                threads: args.threads,
                baseline: args.baseline,
                nodes,
                data_path: data_path_name(&mgr),
                patterns: patterns.clone(),
                prefetch: prefetch.clone(),
                backings: backings.clone(),
                handler_cpus: args.handler_cpus.0.clone(),
                handler_threads: usize::from(args.handler_threads),
                handler_slice_us: args.handler_slice_us,
                cpus: fault_cpus
                    .clone()
                    .context("the fault op resolves its CPUs")?,
                cluster: cluster.as_ref(),
                fault_rounds: args.fault_rounds,
            };
            let (recs, summary) = fault::run(&mgr, &set, &params)?;
            records.extend(recs);
            lines.extend(summary);
            let flush_servers = params.cpus.flush_servers();
            params.place(&flush_servers);
            if params.cluster.is_some() {
                lines.push(format!("flush runs: {}", flush_servers.describe()));
            }
            let (recs, summary) = flush::run(
                &mgr,
                &set,
                args.ops,
                &backings,
                &patterns,
                args.handler_cpus.0.clone(),
                args.handler_slice_us,
            )?;
            records.extend(recs);
            lines.extend(summary);
            continue;
        }
        for pattern in patterns {
            let spec = Spec {
                op,
                ops: args.ops,
                threads: args.threads,
                depth: args.depth,
                pattern,
            };
            seed += 1;
            if let Some(bare) = bare_verbs.as_mut() {
                let alt = verbs_compare::alternate(
                    &mgr,
                    &set,
                    spec,
                    seed,
                    args.api,
                    bare,
                    args.verbs_block,
                )?;
                let mut ours = Record::new(&data_path_name(&mgr), spec, nodes, &alt.ours);
                ours.api = Some(args.api.name().into());
                ours.placement = Some(placement.clone());
                let base = Record::new("bare-verbs", spec, 1, &alt.bare);
                lines.push(verbs_compare::ratio_line(
                    &ours,
                    &base,
                    &alt,
                    args.verbs_block,
                    verbs_cpu,
                ));
                keyed_runs.push((spec, seed));
                records.push(ours);
                records.push(base);
                continue;
            }
            let progress = progress_bar(args.ops, &format!("{op:?}"));
            let ours = match (args.fail_node_after_ms, cluster.as_mut()) {
                (Some(after_ms), Some(c)) => {
                    let failed = FailedRun {
                        cluster: c,
                        mgr: &mgr,
                        set: &set,
                        after_ms,
                        replicas: args.replicas,
                        ranges,
                        accept_errors: args.accept_errors,
                        restart_first: failed_before,
                        api: args.api,
                        request_timeout: Duration::from_millis(config.request_timeout_ms),
                    };
                    failed_before = true;
                    failed.run(spec, seed, nodes, &progress)?
                }
                _ => {
                    let landed_before = mgr.zero_copy_stats().tcp_direct_pages;
                    let kept_before = cluster.as_ref().map(LocalCluster::reads_with_kept_sums);
                    let mut outcome =
                        workload::run_api(&mgr, &set, spec, seed, &progress, args.api);
                    let landed = mgr.zero_copy_stats().tcp_direct_pages - landed_before;
                    let kept = cluster
                        .as_ref()
                        .zip(kept_before)
                        .map(|(c, before)| c.reads_with_kept_sums() - before);
                    if op == Op::Write {
                        outcome.bad_pages +=
                            set.verify_all(&mgr).context("reading back written pages")?;
                        outcome.pages_checked = outcome.ops_done;
                    }
                    let mut r = Record::new(&data_path_name(&mgr), spec, nodes, &outcome);
                    r.replicas = args.replicas;
                    if r.transport == "tcp" {
                        r.tcp_direct_pages = Some(landed);
                        if op == Op::Read && config.page_checksums {
                            r.server_kept_sum_reads = kept;
                            if let Some(kept) = kept {
                                lines.push(format!(
                                    "page-servers: {kept} of {} READ answers sent out of their region with the sum kept since the page's write (no copy)",
                                    outcome.ops_done
                                ));
                            }
                        }
                    }
                    r
                }
            };
            progress.finish_and_clear();
            let mut ours = ours;
            ours.api = Some(args.api.name().into());
            ours.placement = Some(placement.clone());
            let pipelined = if args.baseline && spec.depth > 1 {
                // The bare program with the same number in flight, kept
                // full all the time (ours drains between batches).
                let best = baseline::run_pipelined(spec, set.len(), seed, spec.depth)?;
                Some(Record::pipelined(Spec { threads: 1, ..spec }, &best))
            } else {
                None
            };
            if let Some(p) = &pipelined {
                lines.push(report::pipelined_line(&ours, p));
            }
            let base = if args.baseline {
                // One client thread, in the best layout this machine offers.
                let base_spec = Spec { threads: 1, ..spec };
                let best = baseline::run(base_spec, set.len(), seed)?;
                Some(Record::baseline(base_spec, &best))
            } else {
                None
            };
            if let Some(base) = &base {
                lines.push(report::ratio_line(&ours, base));
                lines.push(report::layouts_line(base));
            }
            let servers = owners.iter().max().map_or(0, |&m| m + 1);
            let spread = if args.baseline && spec.depth == 1 && servers > 1 && args.replicas == 1 {
                // The same job for the bare program: its pages on as many
                // servers as ours, sharing the CPUs ours share.
                let base_spec = Spec { threads: 1, ..spec };
                let best = baseline::run_spread(base_spec, &owners, seed)?;
                let mut spread = Record::baseline(base_spec, &best);
                spread.transport = format!("bare-spread{servers}");
                lines.push(report::spread_ratio_line(&ours, &spread, servers));
                lines.push(report::spread_layouts_line(&spread, servers));
                Some(spread)
            } else {
                None
            };
            let job = rounds::Job {
                mgr: &mgr,
                set: &set,
                owners: &owners,
                spec,
                seed,
                api: args.api,
                same_cpu: rounds::SameCpu::new(
                    cluster.as_ref(),
                    placement.caller_cpu,
                    placement.page_server_cpus.as_deref().unwrap_or_default(),
                    server_spin,
                ),
            };
            if args.latency_rounds > 0 {
                lines.extend(latency_rounds::run(&job, args.latency_rounds)?);
            }
            if args.throughput_rounds > 0 {
                lines.extend(throughput_rounds::run(&job, args.throughput_rounds)?);
            }
            keyed_runs.push((spec, seed));
            records.push(ours);
            records.extend(base);
            records.extend(spread);
            records.extend(pipelined);
        }
    }
    if args.register_buffers {
        let zc = mgr.zero_copy_stats();
        eprintln!(
            "zero-copy: {} pages moved by RDMA straight from/into registered buffers, {} through a pool frame",
            zc.direct_pages, zc.framed_pages
        );
    }
    if args.replicas > 1 {
        let s = mgr.stats();
        eprintln!(
            "hedging: {} pages read from another replica after the hedging delay (now {} us)",
            s.reads_hedged, s.read_hedge_delay_us
        );
    }
    let runs = keyed_runs;
    let path = data_path_name(&mgr);
    if args.compare_insecure {
        let other =
            compare::OtherCluster::start(&config, &placements, args.memory, server_spin, None)?;
        let ours = compare::Side {
            label: "keyed".into(),
            path: format!("{path}-keyed"),
            replicas: args.replicas,
            mgr: &mgr,
            set: &set,
        };
        let (recs, cost) = compare::alternate(
            "authentication cost",
            &ours,
            &other.side("insecure", "insecure", args.replicas),
            &runs,
            args.compare_rounds,
            None,
        )?;
        records.extend(recs);
        lines.extend(cost);
    }
    if args.compare_replicas {
        // As many page-servers as ranges, each holding one.
        let single = replicas::layout(ranges, 1, args.memory).map_err(anyhow::Error::msg)?;
        let other = compare::OtherCluster::start(
            &config,
            &single,
            args.memory,
            server_spin,
            config.cluster_key.clone(),
        )?;
        let ours = compare::Side {
            label: format!("R={}", args.replicas),
            path: format!("{path}-r{}", args.replicas),
            replicas: args.replicas,
            mgr: &mgr,
            set: &set,
        };
        let (recs, cost) = compare::alternate(
            "replication cost",
            &ours,
            &other.side("R=1", "r1", 1),
            &runs,
            args.compare_rounds,
            Some(args.replicas),
        )?;
        records.extend(recs);
        lines.extend(cost);
    }
    if args.coordinator.is_none() {
        println!(
            "local cluster: {} page-servers, {} replica(s) per range{}",
            args.nodes,
            args.replicas,
            args.fail_node_after_ms
                .map(|t| format!(", primary of the first range stopped {t} ms into each run"))
                .unwrap_or_default()
        );
    }
    println!("{}", placement.describe());
    println!("{}", report::header());
    for r in &records {
        println!("{}", report::line(r));
    }
    lines.extend(records.iter().filter_map(report::failure_line));
    for l in &lines {
        println!("{l}");
    }
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&records)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    drop(mgr);
    drop(cluster);
    let failed: Vec<_> = records.iter().filter(|r| !r.verified).collect();
    if !failed.is_empty() {
        for r in &failed {
            eprintln!(
                "run {:?}/{} not verified: {} errors{}",
                r.op,
                r.transport,
                r.errors,
                r.first_error
                    .as_deref()
                    .map(|e| format!(", first: {e}"))
                    .unwrap_or_default()
            );
        }
        bail!("{} run(s) failed verification", failed.len());
    }
    Ok(())
}

/// One read or write run with a page-server stopped `after_ms` into it.
struct FailedRun<'a> {
    cluster: &'a mut cluster::LocalCluster,
    mgr: &'a TransportManager,
    set: &'a WorkingSet,
    after_ms: u64,
    replicas: usize,
    ranges: usize,
    accept_errors: bool,
    /// A node stopped in an earlier run: start it again first.
    restart_first: bool,
    /// The manager's request deadline.
    request_timeout: Duration,
    /// The library call of reads.
    api: workload::Api,
}

impl FailedRun<'_> {
    /// Restores the cluster if need be, waits until every replica is live,
    /// stops the first range's primary `after_ms` into the run, and, for a
    /// write run, reads every page back. Operations that fail are counted,
    /// never a reason to stop.
    fn run(
        self,
        spec: Spec,
        seed: u64,
        nodes: usize,
        progress: &ProgressBar,
    ) -> anyhow::Result<Record> {
        let client = self.cluster.coordinator_client()?;
        let mut refill = false;
        if self.restart_first && self.cluster.restart_stopped()? > 0 {
            if self.replicas == 1 {
                // Its range had no other holder: lost; start it afresh.
                let lost = self.cluster.reinitialise_lost()?;
                eprintln!("restarted the stopped page-server; re-initialised {lost} lost range(s)");
                refill = true;
            } else {
                eprintln!("restarted the stopped page-server; waiting for it to recover...");
            }
        }
        let map =
            replicas::wait_all_live(&client, self.ranges, self.replicas, replicas::LIVE_TIMEOUT)
                .context("before a run with a failure")?;
        if refill {
            // The manager may still try the stopped server's old address
            // until its map is refreshed: a few tries.
            let mut tries = 0;
            while let Err(err) = self.set.fill(self.mgr, 1) {
                tries += 1;
                if tries >= 10 {
                    return Err(err).context("filling remote memory again after a lost range");
                }
                std::thread::sleep(Duration::from_millis(500));
            }
        }
        let victim = replicas::first_primary(&map).context("the map is empty")?;
        let server = self
            .cluster
            .take_server(&victim)
            .with_context(|| format!("{victim} is not a page-server of the local cluster"))?;
        let hedge = self.mgr.read_hedge_delay();
        let start = Instant::now();
        let fail_at = start + Duration::from_millis(self.after_ms);
        let injector = failure::Injector::schedule(fail_at, move || server.abort())?;
        let (mut outcome, disruption) = workload::run_observed(
            self.mgr,
            self.set,
            spec,
            seed,
            progress,
            Some(failure::Window::around(fail_at)),
            self.api,
        );
        let stopped_at = injector.join()?;
        let readback = (spec.op == Op::Write).then(|| self.set.readback(self.mgr, seed));
        let verified_pages = match &readback {
            Some(rb) => {
                // Every acknowledged page must hold its write.
                outcome.bad_pages += rb.wrong + rb.lost_acked;
                outcome.pages_checked = outcome.ops_done - outcome.errors;
                rb.pages_checked - rb.wrong
            }
            None => outcome.pages_checked - outcome.bad_pages,
        };
        let mut r = Record::new(&data_path_name(self.mgr), spec, nodes, &outcome);
        r.replicas = self.replicas;
        if self.accept_errors {
            r.verified = outcome.verified_despite_errors();
        }
        let spanned = failure::Spanned::of(&disruption);
        r.failure = Some(failure::FailureReport {
            node: victim,
            after_ms: self.after_ms,
            at_ms: stopped_at.duration_since(start).as_secs_f64() * 1000.0,
            during_run: stopped_at.duration_since(start) < outcome.elapsed,
            errors_by_kind: disruption
                .errors_by_kind
                .iter()
                .map(|(k, n)| ((*k).to_owned(), *n))
                .collect(),
            verified_pages,
            bound: (spec.op == Op::Read && spanned.pages > 0).then(|| {
                failure::SpannedBound::of(&spanned, hedge, r.latency_us.p50, self.request_timeout)
            }),
            spanned,
            readback,
        });
        Ok(r)
    }
}

/// The data path the run really used: `tcp`, `rdma`, or `mixed` when
/// nodes differ (`none` when no node is connected).
pub(crate) fn data_path_name(mgr: &TransportManager) -> String {
    let mut paths: Vec<&str> = mgr
        .node_transports()
        .iter()
        .filter_map(|(_, path)| path.map(|p| p.as_str()))
        .collect();
    paths.sort_unstable();
    paths.dedup();
    match paths.as_slice() {
        [] => "none".into(),
        [one] => (*one).into(),
        _ => "mixed".into(),
    }
}

fn progress_bar(total: u64, label: &str) -> ProgressBar {
    let bar = ProgressBar::new(total);
    if let Ok(style) =
        ProgressStyle::with_template("{msg:>6} [{bar:40}] {pos}/{len} {per_sec} eta {eta}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(label.to_owned());
    // Drawn only when stderr is a terminal; a short run never shows it.
    bar.enable_steady_tick(Duration::from_millis(500));
    bar
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bench's flags `argv` (after the program name), parsed.
    fn parse(argv: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("bench").chain(argv.iter().copied()))
            .expect("valid flags")
    }

    /// The local page-servers' CPUs for `argv` when the pollers are on CPU 1.
    fn servers(argv: &[&str]) -> Option<Vec<usize>> {
        local_server_cpus(&parse(argv), &[1])
    }

    #[test]
    fn fault_handlers_are_placed_one_per_cpu_unless_listed() {
        let cpus = |argv: &[&str]| fault_handler_cpus(&parse(argv), 2);
        assert_eq!(cpus(&["--op", "fault"]), Some(vec![0]));
        assert_eq!(
            cpus(&["--op", "fault", "--handler-threads", "3"]),
            Some(vec![0, 1, 0])
        );
        assert_eq!(
            cpus(&[
                "--op",
                "fault",
                "--handler-threads",
                "2",
                "--handler-cpus",
                "none"
            ]),
            Some(vec![])
        );
        assert_eq!(cpus(&["--op", "read", "--handler-threads", "2"]), None);
        assert!(
            Args::try_parse_from(["bench", "--op", "fault", "--handler-threads", "0"]).is_err(),
            "a region needs a handler"
        );
    }

    #[test]
    fn faulting_threads_join_a_lone_pinned_handler_unless_listed() {
        let cpus = |argv: &[&str]| fault_toucher_cpus(&parse(argv), 2);
        assert_eq!(cpus(&["--op", "fault", "--threads", "4"]), Some(vec![0]));
        assert_eq!(
            cpus(&["--op", "fault", "--handler-cpus", "1"]),
            Some(vec![1])
        );
        assert_eq!(
            cpus(&["--op", "fault", "--handler-threads", "2"]),
            Some(vec![0, 1]),
            "two handlers: spread"
        );
        assert_eq!(
            cpus(&["--op", "fault", "--handler-cpus", "none"]),
            Some(vec![0, 1]),
            "an unpinned handler: spread"
        );
        assert_eq!(
            cpus(&["--op", "fault", "--toucher-cpus", "none"]),
            Some(vec![])
        );
        assert_eq!(
            cpus(&["--op", "fault", "--toucher-cpus", "1,0"]),
            Some(vec![1, 0])
        );
        assert_eq!(cpus(&["--op", "read"]), None);
    }

    #[test]
    fn local_servers_join_the_pollers_only_on_a_plain_run_with_one_caller() {
        assert_eq!(
            servers(&[]),
            Some(vec![1]),
            "the default write and read runs"
        );
        assert_eq!(servers(&["--op", "read", "--depth", "32"]), Some(vec![1]));
        assert_eq!(servers(&["--op", "read", "--threads", "4"]), None);
        assert_eq!(
            servers(&["--op", "fault"]),
            None,
            "placed per run by fault.rs"
        );
        assert_eq!(servers(&["--coordinator", "http://127.0.0.1:1"]), None);
        assert_eq!(servers(&["--compare-insecure"]), None);
        assert_eq!(servers(&["--compare-replicas", "--replicas", "2"]), None);
        assert_eq!(servers(&["--fail-node-after-ms", "100"]), None);
        assert_eq!(servers(&["--page-server-cpus", "none"]), Some(vec![]));
        assert_eq!(
            servers(&["--page-server-cpus", "0", "--threads", "4"]),
            Some(vec![0]),
            "an explicit list always holds"
        );
    }
}
