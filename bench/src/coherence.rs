//! `--op coherence`: what the coherence protocol costs a fault, with `--hv
//! K` hypervisor node processes (`bench hv-node serve`, see
//! `hv_node/serve.rs`) mapping the same guest RAM over the cluster. The
//! bench commands them on their stdin; each access is timed inside the
//! node that makes it, faults included. Each sample uses a page nobody
//! touched before. Cases (the `transport` field of the records):
//!
//! - `remote-fault`: a fault of guest memory that is not coherent
//!   (`GuestMemory`, read-ahead off) in the bench process, on the upper
//!   half of the RAM: the reference of issue 11's target;
//! - `plain-fault`: node 0 reads a page nobody holds: one request, the
//!   page with the grant (the reference; it must hold what the bench filled
//!   the remote memory with);
//! - `read-modified`: node 1 writes the page, node 0 reads it: the home
//!   first has node 1 write it back and keep a read-only copy;
//! - `upgrade-1`, `upgrade-3`: 1 (3) other nodes and node 0 hold the page
//!   read-only, node 0 writes it: the home invalidates the others first
//!   (`upgrade-3` needs `--hv 4`);
//! - `pingpong`: nodes 0 and 1 increment one counter in turn; pages/s is
//!   round trips per second (each a transfer of the page both ways).
//!
//! The first four cases take turns sample by sample, so that they share
//! whatever the host does meanwhile; their pages/s is one over the mean
//! latency.
//!
//! Every sample's value is checked: node 0 reads what node 1 wrote, and
//! after an upgrade the last other holder reads node 0's value; the
//! ping-pong counter ends at twice the turns. `verified` says they all held.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rdma_transport::auth::ClusterKey;
use rdma_transport::guest_memory::{GuestMemory, GuestMemoryConfig};
use rdma_transport::PAGE_SIZE;

use crate::report::{self, Record};
use crate::workload::{AccessPattern, Op, Outcome, Spec};

/// Samples per case at most (each takes several commands).
const MAX_SAMPLES: u64 = 2000;
/// Turns of each node in the ping-pong.
const PINGPONG_TURNS: u64 = 2000;
/// The first page the samples use.
const FIRST_PAGE: u64 = 0;

/// What `--op coherence` needs.
pub struct Params<'a> {
    /// The bench's manager (for the reference fault).
    pub mgr: &'a Arc<rdma_transport::TransportManager>,
    pub url: &'a str,
    pub key: Option<&'a ClusterKey>,
    pub hv: usize,
    pub ops: u64,
    pub memory_bytes: usize,
    pub hold_us: u64,
    pub nodes: usize,
    /// The seed the remote memory was filled with (`pattern.rs`).
    pub fill_seed: u64,
}

/// One `bench hv-node serve` process.
struct Node {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    index: usize,
}

impl Node {
    fn start(
        index: usize,
        params: &Params<'_>,
        key_file: Option<&std::path::Path>,
    ) -> anyhow::Result<Self> {
        let exe = std::env::current_exe().context("finding the bench binary")?;
        let mut cmd = Command::new(exe);
        cmd.args(["hv-node", "serve", "--coordinator", params.url])
            .args(["--memory", &params.memory_bytes.to_string()])
            .args([
                "--node",
                &index.to_string(),
                "--nodes",
                &params.hv.to_string(),
            ])
            .args(["--hold-us", &params.hold_us.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(path) = key_file {
            cmd.arg("--cluster-key-file").arg(path);
        }
        let mut child = cmd.spawn().context("starting a node process")?;
        let stdin = child.stdin.take().context("node stdin")?;
        let stdout = BufReader::new(child.stdout.take().context("node stdout")?);
        let mut node = Self {
            child,
            stdin,
            stdout,
            index,
        };
        let ready = node.line()?;
        if ready != "ready" {
            bail!("node {index} did not start: {ready}");
        }
        Ok(node)
    }

    fn line(&mut self) -> anyhow::Result<String> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("node {} exited ({:?})", self.index, self.child.try_wait());
        }
        Ok(line.trim().to_owned())
    }

    fn send(&mut self, command: &str) -> anyhow::Result<()> {
        writeln!(self.stdin, "{command}")
            .and_then(|()| self.stdin.flush())
            .with_context(|| format!("node {} is gone", self.index))
    }

    /// The answer to the command sent last: (ns, value).
    fn answer(&mut self) -> anyhow::Result<(u64, u64)> {
        let line = self.line()?;
        let mut words = line.split_whitespace();
        if words.next() != Some("ok") {
            bail!("node {}: {line}", self.index);
        }
        let mut num = || -> anyhow::Result<u64> {
            words
                .next()
                .and_then(|w| w.parse().ok())
                .with_context(|| format!("node {}: a bad answer {line:?}", self.index))
        };
        Ok((num()?, num()?))
    }

    fn call(&mut self, command: &str) -> anyhow::Result<(u64, u64)> {
        self.send(command)?;
        self.answer()
    }

    fn read(&mut self, gpa: u64) -> anyhow::Result<(u64, u64)> {
        self.call(&format!("r {gpa}"))
    }

    fn write(&mut self, gpa: u64, value: u64) -> anyhow::Result<u64> {
        Ok(self.call(&format!("w {gpa} {value}"))?.0)
    }
}

/// How long a node may take to hand its pages back and exit.
const EXIT_LIMIT: Duration = Duration::from_secs(30);

impl Drop for Node {
    /// Asks the node to hand its pages back and exit; kills it if it has
    /// not within `EXIT_LIMIT`.
    fn drop(&mut self) {
        let _ = self.send("q");
        let asked = Instant::now();
        while asked.elapsed() < EXIT_LIMIT {
            match self.child.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                Err(_) => break,
            }
        }
        eprintln!("coherence: node {} did not exit; killing it", self.index);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A case's samples.
struct Case {
    name: &'static str,
    outcome: Outcome,
    started: Instant,
}

impl Case {
    fn new(name: &'static str) -> Self {
        Self {
            name,
            outcome: Outcome::empty(Duration::ZERO),
            started: Instant::now(),
        }
    }

    fn sample(&mut self, ns: u64, right: bool, what: impl FnOnce() -> String) {
        let _ = self.outcome.latency_ns.record(ns.max(1));
        self.outcome.ops_done += 1;
        self.outcome.pages_checked += 1;
        if !right {
            self.outcome.bad_pages += 1;
            self.outcome.first_error.get_or_insert_with(what);
        }
    }

    fn record(mut self, nodes: usize) -> Record {
        self.outcome.elapsed = self.started.elapsed();
        let spec = Spec {
            op: Op::Coherence,
            ops: self.outcome.ops_done,
            threads: 1,
            depth: 1,
            pattern: AccessPattern::Seq,
        };
        let mut record = Record::new(self.name, spec, nodes, &self.outcome);
        // The cases take turns: pages/s is one over the mean latency, not
        // over the run's wall clock (which all of them share).
        let mean_s = record.latency_us.mean / 1e6;
        record.throughput.pages_per_s = 1.0 / mean_s.max(1e-9);
        record.throughput.gb_per_s = record.throughput.pages_per_s * PAGE_SIZE as f64 / 1e9;
        record
    }
}

/// Runs every case; returns the records and the summary lines.
pub fn run(params: &Params<'_>) -> anyhow::Result<(Vec<Record>, Vec<String>)> {
    if params.hv < 2 {
        bail!("--op coherence needs --hv 2 or more");
    }
    let samples = params.ops.min(MAX_SAMPLES);
    // The cases' pages in the lower half, the reference's in the upper one.
    let pages_needed = 2 * (FIRST_PAGE + 4 * samples + 1);
    if (params.memory_bytes / PAGE_SIZE) < pages_needed as usize {
        bail!(
            "--op coherence with {samples} samples needs --memory of at least {} MiB",
            (pages_needed as usize * PAGE_SIZE).div_ceil(1 << 20)
        );
    }
    let key_file = match params.key {
        Some(key) => Some(write_key(key)?),
        None => None,
    };
    eprintln!("coherence: starting {} node processes...", params.hv);
    let mut nodes: Vec<Node> = (0..params.hv)
        .map(|i| Node::start(i, params, key_file.as_ref().map(|f| f.path())))
        .collect::<anyhow::Result<_>>()?;
    let reference = Reference::map(params)?;
    let gpa = |case: u64, i: u64| (FIRST_PAGE + case * samples + i) * PAGE_SIZE as u64;
    let value = |case: u64, i: u64| (case << 32) | (i + 1);
    let mut records = Vec::new();

    // The cases take turns, sample by sample: they share whatever the
    // (noisy) host does meanwhile, so their ratios hold.
    let mut remote = Case::new("remote-fault");
    let mut plain = Case::new("plain-fault");
    let mut modified = Case::new("read-modified");
    let mut upgrades = [
        (2u64, 1usize, Case::new("upgrade-1")),
        (3, 3, Case::new("upgrade-3")),
    ];
    for (_, others, case) in &upgrades {
        if params.hv <= *others {
            eprintln!(
                "coherence: {} needs --hv {} (skipped)",
                case.name,
                others + 1
            );
        }
    }
    let seeded = |p: u64| crate::pattern::first_word(p, params.fill_seed);
    for i in 0..samples {
        // A fault of guest memory that is not coherent, in this process,
        // on the upper half of the RAM (the cases use the lower one).
        let p = reference.gpa_base() + i * PAGE_SIZE as u64;
        let (ns, v) = reference.touch(p);
        remote.sample(ns, v == seeded(p), || {
            format!("sample {i} read {v:#x}, not the fill's {:#x}", seeded(p))
        });

        let p = gpa(0, i);
        let (ns, v) = nodes[0].read(p)?;
        plain.sample(ns, v == seeded(p), || {
            format!("sample {i} read {v:#x}, not the fill's {:#x}", seeded(p))
        });

        let (p, want) = (gpa(1, i), value(1, i));
        nodes[1].write(p, want)?;
        let (ns, v) = nodes[0].read(p)?;
        modified.sample(ns, v == want, || {
            format!("sample {i}: node 0 read {v}, node 1 wrote {want}")
        });

        for (case, others, upgrade) in &mut upgrades {
            let (case, others) = (*case, *others);
            if params.hv <= others {
                continue;
            }
            let p = gpa(case, i);
            let (before, after) = (value(case, i), value(case, i) + (1 << 31));
            nodes[1].write(p, before)?;
            for node in nodes.iter_mut().take(others + 1).skip(2) {
                node.read(p)?;
            }
            nodes[0].read(p)?;
            let ns = nodes[0].write(p, after)?;
            let (_, seen) = nodes[others].read(p)?;
            upgrade.sample(ns, seen == after, || {
                format!("sample {i}: node {others} read {seen} after node 0 wrote {after}")
            });
        }
    }
    records.push(remote.record(params.nodes));
    records.push(plain.record(params.nodes));
    records.push(modified.record(params.nodes));
    for (_, others, upgrade) in upgrades {
        if params.hv > others {
            records.push(upgrade.record(params.nodes));
        }
    }

    let mut pingpong = Case::new("pingpong");
    let counter = gpa(4, 0);
    nodes[0].write(counter, 0)?;
    nodes[0].send(&format!("pp {counter} {PINGPONG_TURNS} 0"))?;
    nodes[1].send(&format!("pp {counter} {PINGPONG_TURNS} 1"))?;
    let (ns0, _) = nodes[0].answer()?;
    let (ns1, last) = nodes[1].answer()?;
    let (_, end) = nodes[0].read(counter)?;
    let round_trip_ns = ns0.max(ns1) / PINGPONG_TURNS;
    for _ in 0..PINGPONG_TURNS {
        pingpong.sample(round_trip_ns, true, String::new);
    }
    if end != 2 * PINGPONG_TURNS || last != end {
        pingpong.outcome.bad_pages += 1;
        pingpong.outcome.first_error = Some(format!(
            "the counter ended at {end} (node 1 saw {last}), not {}",
            2 * PINGPONG_TURNS
        ));
    }
    let mut rec = pingpong.record(params.nodes);
    // Round trips per second over the whole exchange (not the bench's
    // wall clock, which includes starting it).
    let secs = ns0.max(ns1) as f64 / 1e9;
    rec.throughput.pages_per_s = PINGPONG_TURNS as f64 / secs.max(1e-9);
    rec.throughput.gb_per_s = rec.throughput.pages_per_s * PAGE_SIZE as f64 / 1e9;
    records.push(rec);
    let (rdma, tcp) = nodes[0].call("t")?;
    eprintln!(
        "coherence: node 0 reaches its homes over {}",
        match (rdma, tcp) {
            (0, _) => format!("TCP ({tcp} connection(s))"),
            (_, 0) => format!("RDMA message channels ({rdma})"),
            _ => format!("RDMA ({rdma}) and TCP ({tcp})"),
        }
    );
    drop(nodes);

    let p50 = |name: &str| {
        records
            .iter()
            .find(|r| r.transport == name)
            .map(|r| r.latency_us.p50)
    };
    let mut lines = Vec::new();
    if let (Some(plain), Some(remote)) = (p50("plain-fault"), p50("remote-fault")) {
        for name in ["plain-fault", "read-modified", "upgrade-1", "upgrade-3"] {
            let Some(p) = p50(name) else { continue };
            let target = if name == "upgrade-1" {
                " (target: within 2x)"
            } else {
                ""
            };
            lines.push(format!(
                "coherence: {name} p50 {} = {} the coherent plain fault's {}, {} the non-coherent remote fault's {}{target}",
                report::fmt_us(p),
                report::fmt_ratio(p / plain),
                report::fmt_us(plain),
                report::fmt_ratio(p / remote),
                report::fmt_us(remote),
            ));
        }
    }
    Ok((records, lines))
}

/// Guest memory that is not coherent, over the upper half of the RAM: the
/// reference fault (read-ahead off, so each touch is one remote fault).
struct Reference {
    memory: GuestMemory,
}

impl Reference {
    fn map(params: &Params<'_>) -> anyhow::Result<Self> {
        let half = params.memory_bytes / 2 / PAGE_SIZE * PAGE_SIZE;
        let memory = GuestMemory::new(
            Arc::clone(params.mgr),
            GuestMemoryConfig {
                prefetch_max_pages: 0,
                handler_cpus: Some(vec![]),
                fault_timeout_ms: 10_000,
                ..GuestMemoryConfig::new(half as u64, half)
            },
        )
        .context("mapping the reference guest memory")?;
        Ok(Self { memory })
    }

    fn gpa_base(&self) -> u64 {
        self.memory.gpa_base()
    }

    /// Reads the u64 at `gpa` (its first touch: a fault); (ns, value).
    fn touch(&self, gpa: u64) -> (u64, u64) {
        let ptr = self
            .memory
            .host_addr(gpa)
            .unwrap_or_else(|| unreachable!("the samples fit the region (checked)"));
        let started = Instant::now();
        // SAFETY: an aligned u64 inside the live region, read once; the
        // fault brings the page in first.
        let value = unsafe { std::ptr::read_volatile(ptr.cast::<u64>()) };
        (started.elapsed().as_nanos() as u64, value)
    }
}

/// The cluster key in a file only this user can read, for the node
/// processes.
fn write_key(key: &ClusterKey) -> anyhow::Result<tempfile::NamedTempFile> {
    use std::os::unix::fs::PermissionsExt;
    let mut file = tempfile::NamedTempFile::new().context("a file for the cluster key")?;
    file.as_file()
        .set_permissions(std::fs::Permissions::from_mode(0o600))?;
    file.write_all(key.to_hex().as_bytes())?;
    file.flush()?;
    Ok(file)
}
