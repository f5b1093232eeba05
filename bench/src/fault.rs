//! `--op fault`: guest memory over the cluster, faulted in by touching it.
//!
//! Maps the working set as one [`GuestMemory`] region, fills the remote
//! pages with a known pattern, and has T threads touch every page once per
//! round, timing each first touch from the faulting thread's side and
//! checking every page's content. Between rounds the region is evicted (not
//! timed), so every round faults again. Runs each selected address order
//! (`--pattern`: random, seq, or all, the default) with each selected
//! prefetch setting (`--prefetch`: on, off, or both, the default), prefetch
//! first, with each selected backing (`--backing`: anon, the default,
//! memfd, hugetlbfs, or all = anon and memfd; labels `uffd`, `uffd-nopf`,
//! with `+memfd` for a memfd, `+huge` for hugetlbfs, where read-ahead is
//! always off and a fault brings a whole 2 MiB page).
//! Then flush.rs measures write-back of dirty pages with each backing.
//!
//! With `--baseline`, in the same run, for each address order: a
//! userfaultfd fault resolved by `UFFDIO_COPY` from a local buffer (same
//! handler-thread pinning as ours) and the bare TCP ping-pong (32 B request,
//! 32 B + 4 KiB reply) in its best layout (bench/src/baseline/mod.rs); the
//! report compares each of our runs' p50 with the sum of their p50s. Then
//! the two as one bare program (`bare-fault`: a userfaultfd handler that
//! fetches each page from the bare ping-pong server, in each layout), to
//! which each run's p50 is compared too, with how far that bare program is
//! from the sum.

mod alternate;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rdma_transport::guest_memory::{GuestMemory, GuestMemoryConfig};

use crate::cluster::LocalCluster;
use crate::matrix::Backing;
use rdma_transport::{Page, TransportManager, PAGE_SIZE};

use crate::pattern;
use crate::report::{self, fmt_ratio, fmt_us, Record};
use crate::workload::{new_histogram, AccessPattern, Op, Outcome, Spec, WorkingSet};

const SEED: u64 = 0xfa17;

/// The caller spin of the fault op's manager (`--wait-spin-us` overrides):
/// on a 2-CPU host the handler must park soon, or it starves the
/// page-server thread it waits for; with several faulting threads it must
/// not park too soon, or each answer costs a wake-up (see
/// docs/benchmarking.md, "Handler spin and four faulting threads": 10 and
/// 30 µs give the same one-thread faults, 30 gives four threads more).
pub const WAIT_SPIN_US: u64 = 30;

/// How long the local page-servers spin before they block in the fault
/// runs that give them CPUs of their own (as the read runs' servers do,
/// main.rs).
pub const SERVER_SPIN_US: u64 = 200;

/// Where the local cluster's page-server connection threads (in this
/// process) run for one run, and how long they poll their sockets before
/// they block. They stand in for remote nodes, which have CPUs of their
/// own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerPlacement {
    /// Empty: not pinned.
    pub cpus: Vec<usize>,
    pub spin: Duration,
}

impl ServerPlacement {
    /// For the summary lines.
    pub fn describe(&self) -> String {
        let cpus = match self.cpus.as_slice() {
            [] => "not pinned".to_owned(),
            cpus => format!("on CPU {cpus:?}"),
        };
        format!(
            "local page-servers {cpus}, spinning {} us",
            self.spin.as_micros()
        )
    }
}

/// The page-servers' placement for a fault run with `threads` faulting
/// threads, thread t on `touchers[t % len]`, and fault handlers on
/// `handlers` (either empty: not pinned), on a host of `ncpu` CPUs.
/// `--page-server-cpus` and `--page-server-spin-us` (`explicit_*`) win;
/// otherwise the bench's choice:
///
/// The faulting threads and the handler all on one CPU (one thread, or
/// `--toucher-cpus auto` with one handler), and the host has more: the
/// servers on the other CPUs, spinning, as the bare remote fault's best
/// layout (`cross-cpu-spinning`). Nothing of a fault then waits for a
/// halted vCPU to wake, and the servers' work leaves the faulting CPU:
/// 2026-12-05, `--prefetch off --pattern random --threads 4`, three
/// alternated pairs, one thread 42-47k faults/s against 35-37k with the
/// servers blocking on the faulting CPU (the default until then), four
/// threads 73-76k against 51-54k (x1.59-1.75 of one thread, against
/// x1.44-1.48); one random fault 21-22 µs p50 against 26
/// (docs/benchmarking.md, "Fault runs with the page-servers spinning on
/// the other CPU").
///
/// Everything on one CPU (a one-CPU host): there, not spinning: waking a
/// thread on another, idle, CPU costs tens of µs per fault in this VM
/// (random p50 90 µs against 30 µs pinned, 2026-11-26), and a spinner
/// would take the faulting threads' CPU.
///
/// Several faulting threads spread over the CPUs: not pinned, not
/// spinning. Both CPUs are busy then, and the servers' work (one loopback
/// answer per fault) is half of what the faults cost (4 threads: 28-34k
/// faults/s pinned to CPU 0, 41-45k unpinned, same host and hour).
///
/// The baselines run after the fault runs, with the last run's placement
/// (each of their layouts pins its own threads; idle servers block after
/// their spin).
pub fn fault_servers(
    threads: usize,
    explicit_cpus: Option<&[usize]>,
    explicit_spin: Option<Duration>,
    touchers: &[usize],
    handlers: &[usize],
    ncpu: usize,
) -> ServerPlacement {
    let mut used: Vec<usize> = if touchers.is_empty() || handlers.is_empty() {
        Vec::new()
    } else {
        (0..threads.max(1))
            .map(|t| touchers[t % touchers.len()])
            .chain(handlers.iter().copied())
            .collect()
    };
    used.sort_unstable();
    used.dedup();
    let chosen = match *used.as_slice() {
        [cpu] if ncpu > 1 => (0..ncpu).filter(|&c| c != cpu).collect(),
        [cpu] => vec![cpu],
        _ => Vec::new(),
    };
    let cpus = explicit_cpus.map_or(chosen, <[usize]>::to_vec);
    let apart = !cpus.is_empty() && !used.is_empty() && cpus.iter().all(|c| !used.contains(c));
    let spin = explicit_spin.unwrap_or(if apart {
        Duration::from_micros(SERVER_SPIN_US)
    } else {
        Duration::ZERO
    });
    ServerPlacement { cpus, spin }
}

/// The page-servers' placement for the flush runs, whose writer is the
/// bench's thread and whose write-protect calls run on `handler_cpu`:
/// there, blocking (unless `--page-server-*` say otherwise). The servers
/// run in this process: while one of its threads runs on another CPU,
/// each write-protect call interrupts that CPU to flush its TLB, and a
/// spinning server always runs. Flushing 8192 random dirty pages took
/// 73-77 ms with the servers spinning on CPU 1 against 25-28 ms with them
/// blocking on CPU 0 or on CPU 1 (2026-12-05). Remote page-servers are
/// other processes on other hosts.
pub fn flush_servers(
    explicit_cpus: Option<&[usize]>,
    explicit_spin: Option<Duration>,
    handler_cpu: usize,
) -> ServerPlacement {
    ServerPlacement {
        cpus: explicit_cpus.map_or_else(|| vec![handler_cpu], <[usize]>::to_vec),
        spin: explicit_spin.unwrap_or(Duration::ZERO),
    }
}

/// Pins toucher (faulting thread) t to `cpus[t % len]` (empty: not
/// pinned). The bench's default (`--toucher-cpus auto`, main.rs) puts them
/// all on the CPU of the one fault handler: a faulting thread sleeps in its
/// fault while the handler works, and waking a thread on the other CPU
/// costs tens of µs in this VM. (`spread`, thread t on CPU t, was the
/// default until 2026-11-30.)
pub(crate) fn pin_toucher(t: usize, cpus: &[usize]) {
    if cpus.is_empty() {
        return;
    }
    let id = cpus[t % cpus.len()];
    let _ = core_affinity::set_for_current(core_affinity::CoreId { id });
}

/// Where the fault op's threads run, and what the command line says of the
/// local page-servers: the inputs of [`fault_servers`] and
/// [`flush_servers`], resolved once.
#[derive(Debug, Clone)]
pub struct FaultCpus {
    /// The faulting threads' CPUs (`--toucher-cpus`, resolved): thread t
    /// on entry t, mod the length; empty: not pinned.
    pub touchers: Vec<usize>,
    /// Where the handlers run: `--handler-cpus`, or handler i on CPU i
    /// (the library's choice); empty: not pinned.
    pub handlers: Vec<usize>,
    /// `--page-server-cpus` (`None`: the bench's choice per run).
    pub server_cpus: Option<Vec<usize>>,
    /// `--page-server-spin-us` (`None`: the bench's choice per run).
    pub server_spin: Option<Duration>,
    /// CPUs of this host.
    pub ncpu: usize,
}

impl FaultCpus {
    /// The local page-servers' placement for a run with `threads` faulting
    /// threads.
    pub fn fault_servers(&self, threads: usize) -> ServerPlacement {
        fault_servers(
            threads,
            self.server_cpus.as_deref(),
            self.server_spin,
            &self.touchers,
            &self.handlers,
            self.ncpu,
        )
    }

    /// The page-servers on the first handler's CPU, blocking: the bare
    /// programs' `same-cpu-blocking` layout, which `--fault-rounds` also
    /// runs ours in (fault/alternate.rs). `None` when the command line
    /// placed the servers or the handlers are not pinned.
    pub fn same_cpu_servers(&self) -> Option<ServerPlacement> {
        let placed = self.server_cpus.is_some() || self.server_spin.is_some();
        // The flush runs' placement, when the bench chooses it.
        (!placed && !self.handlers.is_empty()).then(|| self.flush_servers())
    }

    /// The flush runs' (see [`flush_servers`]).
    pub fn flush_servers(&self) -> ServerPlacement {
        let handler_cpu = self.handlers.first().copied().unwrap_or(0);
        flush_servers(self.server_cpus.as_deref(), self.server_spin, handler_cpu)
    }
}

/// What the fault runs need from the command line.
pub struct Params<'a> {
    pub ops: u64,
    pub threads: usize,
    pub baseline: bool,
    pub nodes: usize,
    pub data_path: String,
    /// Address orders to run, in order.
    pub patterns: Vec<AccessPattern>,
    /// Read-ahead on or off, per run, in order (each with every pattern).
    pub prefetch: Vec<bool>,
    /// What guest memory is made of, per run, in order (each with every
    /// prefetch setting and pattern).
    pub backings: Vec<Backing>,
    /// `GuestMemoryConfig::handler_cpus` (`--handler-cpus`).
    pub handler_cpus: Option<Vec<usize>>,
    /// `GuestMemoryConfig::handler_threads` (`--handler-threads`).
    pub handler_threads: usize,
    /// `GuestMemoryConfig::handler_slice_us` (`--handler-slice-us`).
    pub handler_slice_us: u64,
    /// Where the faulting threads, handlers and local page-servers run.
    pub cpus: FaultCpus,
    /// The local cluster, whose servers' spin each run sets (`None` with
    /// `--coordinator`: nothing to place).
    pub cluster: Option<&'a LocalCluster>,
    /// With `baseline`: rounds of ours and the baselines one after the
    /// other (`--fault-rounds`, 0: none; see fault/alternate.rs).
    pub fault_rounds: u64,
}

impl Params<'_> {
    /// Places the local page-servers for a run with `threads` faulting
    /// threads.
    fn place_servers(&self, threads: usize) {
        self.place(&self.cpus.fault_servers(threads));
    }

    /// Pins the local page-servers' threads and sets their spin.
    pub fn place(&self, placement: &ServerPlacement) {
        let Some(cluster) = self.cluster else {
            return;
        };
        crate::cluster::pin_local_servers(&placement.cpus);
        cluster.set_server_spin(placement.spin);
    }
}

/// Runs the fault benchmark; returns the table's records and the summary lines.
pub fn run(
    mgr: &Arc<TransportManager>,
    set: &WorkingSet,
    params: &Params,
) -> anyhow::Result<(Vec<Record>, Vec<String>)> {
    let gpa_base = set.gpas[0];
    let pages = set.len();
    if set
        .gpas
        .iter()
        .enumerate()
        .any(|(i, &g)| g != gpa_base + (i * PAGE_SIZE) as u64)
    {
        bail!("--op fault needs one contiguous GPA range");
    }
    set.fill(mgr, SEED).context("filling remote memory")?;
    params.place_servers(params.threads);
    let mut records = Vec::new();
    let mut lines = Vec::new();
    // Warm-up, not measured: the first run after start-up is slower
    // whatever it is (scheduler and cache state), which would skew the
    // comparison of the runs below.
    {
        let ram = GuestMemory::new(
            Arc::clone(mgr),
            GuestMemoryConfig {
                handler_cpus: params.handler_cpus.clone(),
                handler_threads: params.handler_threads,
                handler_slice_us: params.handler_slice_us,
                ..GuestMemoryConfig::new(gpa_base, pages * PAGE_SIZE)
            },
        )
        .context("mapping guest memory")?;
        let warm = Spec {
            op: Op::Fault,
            ops: params.ops,
            threads: params.threads,
            depth: 1,
            pattern: AccessPattern::Random,
        };
        touch_rounds(&ram, warm, &params.cpus.touchers, |_| true)?;
    }
    let default_window = GuestMemoryConfig::new(gpa_base, pages * PAGE_SIZE).prefetch_max_pages;
    // (pattern, prefetch on, p50 us, faults/s) of each anonymous run, for
    // the summaries.
    let mut ran: Vec<(AccessPattern, bool, f64, f64)> = Vec::new();
    for &backing in &params.backings {
        for &prefetch in &params.prefetch {
            for &pattern in &params.patterns {
                let (label, window) = match (prefetch, backing) {
                    (true, Backing::Anon) => ("uffd", default_window),
                    (false, Backing::Anon) => ("uffd-nopf", 0),
                    (true, Backing::Memfd) => ("uffd+memfd", default_window),
                    (false, Backing::Memfd) => ("uffd-nopf+memfd", 0),
                    // No read-ahead on huge pages: a fault brings 2 MiB.
                    (true, Backing::Hugetlbfs) => ("uffd+huge", 0),
                    (false, Backing::Hugetlbfs) => ("uffd-nopf+huge", 0),
                };
                let run = Run {
                    label,
                    backing,
                    window,
                    pattern,
                };
                // With several vCPU threads, one thread first, in the same
                // process, for the ratio of their rates.
                let one = if params.threads > 1 {
                    params.place_servers(1);
                    let (record, line) = run.measure(mgr, set, params, 1)?;
                    lines.push(line);
                    let rate = record.throughput.pages_per_s;
                    records.push(record);
                    Some(rate)
                } else {
                    None
                };
                params.place_servers(params.threads);
                let (record, line) = run.measure(mgr, set, params, params.threads)?;
                lines.push(line);
                if let Some(one) = one {
                    lines.push(format!(
                        "{label}, {pattern:?}: {} faulting threads {:.0} faults/s vs one {one:.0}: x{:.2}",
                        params.threads,
                        record.throughput.pages_per_s,
                        record.throughput.pages_per_s / one.max(1e-9)
                    ));
                }
                if backing == Backing::Anon {
                    ran.push((
                        pattern,
                        prefetch,
                        record.latency_us.p50,
                        record.throughput.pages_per_s,
                    ));
                }
                records.push(record);
            }
        }
    }
    let rate = |pattern, prefetch| {
        ran.iter()
            .find(|r| r.0 == pattern && r.1 == prefetch)
            .map(|r| r.3)
    };
    if let (Some(random), Some(seq)) = (
        rate(AccessPattern::Random, true),
        rate(AccessPattern::Seq, true),
    ) {
        lines.push(format!(
            "sequential faults with prefetch vs random: x{:.2} faults/s",
            seq / random.max(1e-9)
        ));
    }
    if params.baseline {
        for &pattern in &params.patterns {
            let spec = one_vcpu(params.ops, pattern);
            let local = local_uffd_baseline(pages.min(16384), spec)?;
            let local = Record::new("uffd-local", spec, 0, &local);
            let tcp_spec = Spec {
                op: Op::Read,
                ..spec
            };
            // Every layout pins its own threads (CPU 0, where our toucher,
            // handler and page-server threads are, and the last CPU, where
            // our poller is): the same choice of CPUs we had.
            let best = crate::baseline::run(tcp_spec, pages, SEED)?;
            let tcp = Record::baseline(tcp_spec, &best);
            let sum = local.latency_us.p50 + tcp.latency_us.p50;
            for &(_, prefetch, p50, _) in ran.iter().filter(|r| r.0 == pattern) {
                lines.push(format!(
                    "{pattern:?} fault p50 {} us (prefetch {}) vs local uffd fault {} us + bare TCP 4 KiB read {} us ({}) = {} us: x{}",
                    fmt_us(p50),
                    if prefetch { "on" } else { "off" },
                    fmt_us(local.latency_us.p50),
                    fmt_us(tcp.latency_us.p50),
                    best.layout.name(),
                    fmt_us(sum),
                    fmt_ratio(p50 / sum.max(1e-9))
                ));
            }
            lines.push(report::layouts_line(&tcp));
            // The same with the bare pages spread over as many servers as
            // ours are over our nodes, on the same CPUs.
            let owners = set.owners(&mgr.map());
            let servers = owners.iter().max().map_or(0, |&m| m + 1);
            if servers > 1 {
                let best = crate::baseline::run_spread(tcp_spec, &owners, SEED)?;
                let mut spread = Record::baseline(tcp_spec, &best);
                spread.transport = format!("bare-spread{servers}");
                let sum = local.latency_us.p50 + spread.latency_us.p50;
                for &(_, prefetch, p50, _) in ran.iter().filter(|r| r.0 == pattern) {
                    lines.push(format!(
                        "{pattern:?} fault p50 {} us (prefetch {}) vs local uffd fault {} us + bare TCP 4 KiB read over {servers} servers, pages spread as over our nodes, {} us ({}) = {} us: x{}",
                        fmt_us(p50),
                        if prefetch { "on" } else { "off" },
                        fmt_us(local.latency_us.p50),
                        fmt_us(spread.latency_us.p50),
                        best.layout.name(),
                        fmt_us(sum),
                        fmt_ratio(p50 / sum.max(1e-9))
                    ));
                }
                lines.push(report::spread_layouts_line(&spread, servers));
                records.push(spread);
            }
            // The whole remote fault as one bare program: whether the sum
            // above can be had at all on this machine.
            let bare = crate::baseline::run_remote_fault(spec, pages.min(16384), SEED)?;
            let mut remote = Record::baseline(spec, &bare);
            remote.transport = "bare-fault".into();
            for &(_, prefetch, p50, _) in ran.iter().filter(|r| r.0 == pattern) {
                lines.push(format!(
                    "{pattern:?} fault p50 {} us (prefetch {}) vs the bare remote fault {} us ({}, x{} of the sum above): x{}",
                    fmt_us(p50),
                    if prefetch { "on" } else { "off" },
                    fmt_us(remote.latency_us.p50),
                    bare.layout.name(),
                    fmt_ratio(remote.latency_us.p50 / sum.max(1e-9)),
                    fmt_ratio(p50 / remote.latency_us.p50.max(1e-9))
                ));
            }
            lines.push(report::layouts_line(&remote));
            records.push(local);
            records.push(tcp);
            records.push(remote);
            if params.fault_rounds > 0 {
                lines.extend(alternate::rounds(mgr, set, params, pattern)?);
            }
        }
    }
    Ok((records, lines))
}

/// One fault run's configuration (the table label says which).
struct Run {
    label: &'static str,
    backing: Backing,
    /// Read-ahead window in pages (0: off).
    window: usize,
    pattern: AccessPattern,
}

impl Run {
    /// Maps the guest memory, has `threads` threads fault every page in and
    /// checks each; returns the record and its summary line.
    fn measure(
        &self,
        mgr: &Arc<TransportManager>,
        set: &WorkingSet,
        params: &Params,
        threads: usize,
    ) -> anyhow::Result<(Record, String)> {
        let gpa_base = set.gpas[0];
        let pages = set.len();
        let ram = GuestMemory::new(
            Arc::clone(mgr),
            GuestMemoryConfig {
                prefetch_max_pages: self.window,
                handler_threads: params.handler_threads,
                ..crate::guest::config(
                    self.backing,
                    gpa_base,
                    pages * PAGE_SIZE,
                    params.handler_cpus.clone(),
                    params.handler_slice_us,
                )?
            },
        )
        .context("mapping guest memory")?;
        let spec = Spec {
            op: Op::Fault,
            ops: params.ops,
            threads,
            depth: 1,
            pattern: self.pattern,
        };
        let base = ram.as_ptr() as usize;
        let zero_copy = ram.rdma_zero_copy();
        let zc_before = mgr.zero_copy_stats();
        let outcome = touch_rounds(&ram, spec, &params.cpus.touchers, |i| {
            // SAFETY: page i was faulted in by the touch just before and
            // stays mapped until the eviction after the round.
            let page = unsafe { &*((base + i * PAGE_SIZE) as *const Page) };
            pattern::check(page, gpa_base + (i * PAGE_SIZE) as u64, SEED)
        })?;
        let stats = ram.stats();
        drop(ram);
        let zc_after = mgr.zero_copy_stats();
        let mut record = Record::new(self.label, spec, params.nodes, &outcome);
        record.backing = Some(self.backing.name().into());
        record.rdma_zero_copy = Some(zero_copy);
        let tcp_direct = zc_after.tcp_direct_pages - zc_before.tcp_direct_pages;
        if params.data_path == "tcp" {
            record.tcp_direct_pages = Some(tcp_direct);
        }
        let rdma_pages = match (
            zc_after.direct_pages - zc_before.direct_pages,
            zc_after.framed_pages - zc_before.framed_pages,
        ) {
            (0, 0) => String::new(),
            (direct, framed) => {
                format!("; RDMA: {direct} pages straight into guest RAM, {framed} through the pool")
            }
        };
        let tcp_pages = match tcp_direct {
            0 => String::new(),
            direct => format!("; TCP: {direct} read straight into guest RAM"),
        };
        // Each run places the local page-servers for its thread count.
        let servers = match params.cluster {
            None => String::new(),
            Some(_) => format!("; {}", params.cpus.fault_servers(threads).describe()),
        };
        let line = format!(
            "fault {}/{}, {:?}, {threads} thread(s): {:.0} faults/s, p50 {} us ({} fetched by faults, {} of them inline, {} by prefetch{rdma_pages}{tcp_pages}{servers})",
            self.label,
            params.data_path,
            self.pattern,
            record.throughput.pages_per_s,
            fmt_us(record.latency_us.p50),
            stats.missing_faults,
            stats.faults_fetched_inline,
            stats.prefetched_pages
        );
        Ok((record, line))
    }
}

/// `spec.threads` threads touch every page of `[0, pages)` once per round in
/// `spec.pattern` order until `spec.ops` touches; `check(i)` verifies page i
/// after its touch. The region is evicted between rounds (not timed).
/// Toucher t is pinned as [`pin_toucher`] says with `cpus`.
fn touch_rounds(
    ram: &GuestMemory,
    spec: Spec,
    cpus: &[usize],
    check: impl Fn(usize) -> bool + Sync,
) -> anyhow::Result<Outcome> {
    let pages = ram.size_bytes() / PAGE_SIZE;
    let per_round = (pages as u64).min(spec.ops);
    let rounds = spec.ops.div_ceil(per_round);
    let mut total = Outcome::empty(Duration::ZERO);
    let base = ram.as_ptr() as usize;
    for round in 0..rounds {
        let touches = per_round.min(spec.ops - round * per_round) as usize;
        let orders = orders(pages, touches, spec, round);
        let start = Barrier::new(spec.threads + 1);
        let t0 = Instant::now();
        let results: Vec<(hdrhistogram::Histogram<u64>, u64)> = std::thread::scope(|s| {
            let handles: Vec<_> = orders
                .iter()
                .enumerate()
                .map(|(t, order)| {
                    let (start, check) = (&start, &check);
                    s.spawn(move || {
                        pin_toucher(t, cpus);
                        let mut hist = new_histogram();
                        let mut bad = 0u64;
                        start.wait();
                        for &i in order {
                            let addr = (base + i * PAGE_SIZE) as *const u64;
                            let t = Instant::now();
                            // SAFETY: `addr` is the first word of page i of
                            // the live region; reading it faults the page in.
                            let word = unsafe { std::ptr::read_volatile(addr) };
                            let ns = t.elapsed().as_nanos() as u64;
                            std::hint::black_box(word);
                            let _ = hist.record(ns.max(1));
                            if !check(i) {
                                bad += 1;
                            }
                        }
                        (hist, bad)
                    })
                })
                .collect();
            start.wait();
            handles.into_iter().filter_map(|h| h.join().ok()).collect()
        });
        total.elapsed += t0.elapsed();
        for (hist, bad) in results {
            let _ = total.latency_ns.add(&hist);
            total.bad_pages += bad;
        }
        total.ops_done += touches as u64;
        total.pages_checked += touches as u64;
        ram.evict(ram.gpa_base(), ram.size_bytes() as u64)
            .context("evicting between rounds")?;
    }
    Ok(total)
}

/// The page order of each thread for one round of `touches` touches:
/// disjoint slices of the region, shuffled for the random pattern.
pub(crate) fn orders(pages: usize, touches: usize, spec: Spec, round: u64) -> Vec<Vec<usize>> {
    let threads = spec.threads.max(1);
    let per_thread = pages / threads;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(SEED ^ round);
    (0..threads)
        .map(|t| {
            let n = touches / threads + usize::from(t < touches % threads);
            let mut order: Vec<usize> = (t * per_thread..(t + 1) * per_thread).collect();
            if spec.pattern == AccessPattern::Random {
                order.shuffle(&mut rng);
            }
            order.truncate(n);
            order
        })
        .collect()
}

/// `ops` faults in `pattern` order from one faulting thread: what the
/// baselines are compared with.
fn one_vcpu(ops: u64, pattern: AccessPattern) -> Spec {
    Spec {
        op: Op::Fault,
        ops,
        threads: 1,
        depth: 1,
        pattern,
    }
}

/// A userfaultfd fault served by `UFFDIO_COPY` from a local buffer
/// filled with the page's pattern: toucher and handler on CPU 0 like ours,
/// the handler blocking in `poll` like ours.
fn local_uffd_baseline(pages: usize, spec: Spec) -> anyhow::Result<Outcome> {
    crate::baseline::uffd_fault::run(pages, spec, SEED, 0, || {
        let fill: crate::baseline::uffd_fault::Fetch = Box::new(|off, page| {
            pattern::fill(page, off, SEED);
            Ok(())
        });
        Ok(fill)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPIN: Duration = Duration::from_micros(SERVER_SPIN_US);

    fn placed(cpus: &[usize], spin: Duration) -> ServerPlacement {
        ServerPlacement {
            cpus: cpus.to_vec(),
            spin,
        }
    }

    #[test]
    fn servers_spin_on_the_cpus_the_faulting_threads_leave_free() {
        assert_eq!(
            fault_servers(1, None, None, &[0], &[0], 2),
            placed(&[1], SPIN),
            "one faulting thread"
        );
        assert_eq!(
            fault_servers(4, None, None, &[0], &[0], 2),
            placed(&[1], SPIN),
            "four on the handler's CPU"
        );
        assert_eq!(
            fault_servers(4, None, None, &[1], &[1], 4),
            placed(&[0, 2, 3], SPIN)
        );
        assert_eq!(
            fault_servers(1, None, None, &[0, 1], &[0], 2),
            placed(&[1], SPIN),
            "one thread of a spread list runs on its first CPU"
        );
        assert_eq!(
            fault_servers(1, None, None, &[0], &[0, 1], 2),
            placed(&[], Duration::ZERO),
            "a handler on each CPU: none is free"
        );
        assert_eq!(
            fault_servers(1, None, None, &[0], &[], 2),
            placed(&[], Duration::ZERO),
            "handlers not pinned"
        );
        assert_eq!(
            fault_servers(4, None, None, &[0, 1], &[0], 2),
            placed(&[], Duration::ZERO),
            "spread threads: servers not pinned, not spinning"
        );
        assert_eq!(
            fault_servers(1, None, None, &[], &[0], 2),
            placed(&[], Duration::ZERO),
            "faulting threads not pinned"
        );
        assert_eq!(
            fault_servers(1, None, None, &[0], &[0], 1),
            placed(&[0], Duration::ZERO),
            "one CPU: beside the faulting thread, blocking"
        );
    }

    #[test]
    fn page_server_flags_win_over_the_benchs_choice() {
        assert_eq!(
            fault_servers(1, Some(&[0]), None, &[0], &[0], 2),
            placed(&[0], Duration::ZERO),
            "listed on the faulting CPU: no spin"
        );
        let us_500 = Duration::from_micros(500);
        assert_eq!(
            fault_servers(1, None, Some(us_500), &[0], &[0], 2),
            placed(&[1], us_500)
        );
        assert_eq!(
            fault_servers(4, Some(&[]), Some(Duration::ZERO), &[0], &[0], 2),
            placed(&[], Duration::ZERO)
        );
        assert_eq!(flush_servers(None, None, 0), placed(&[0], Duration::ZERO));
        assert_eq!(flush_servers(None, None, 1), placed(&[1], Duration::ZERO));
        assert_eq!(
            flush_servers(Some(&[1]), Some(us_500), 0),
            placed(&[1], us_500)
        );
    }
}
