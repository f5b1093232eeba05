//! Same-run comparisons: the bench's read and write runs repeated, in this
//! process, against a second local cluster that differs in one respect,
//! the two clusters taking turns run after run so that a change of the
//! host's state (this machine flips between a fast and a slow state from
//! one run to the next) falls on both sides. Each side's figures are the
//! medians over the rounds; the ratio is ours / theirs.
//!
//! - `--compare-insecure`: the other cluster holds no cluster key, so the
//!   ratio is the cost of authentication (one round trip per connection,
//!   nothing per page).
//! - `--compare-replicas`: the other cluster holds each range once
//!   (`--nodes / --replicas` page-servers, same memory), so the ratio is the
//!   cost of replication (a write goes to every replica at once).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use indicatif::ProgressBar;
use rdma_transport::auth::ClusterKey;
use rdma_transport::{ManagerConfig, TransportManager, PAGE_SIZE};

use crate::baseline;
use crate::cluster::LocalCluster;
use crate::replicas::Placement;
use crate::report::{fmt_ratio, fmt_us, Record};
use crate::workload::{self, Op, Spec, WorkingSet};

/// A manager and the pages it runs over: one side of a comparison.
pub struct Side<'a> {
    /// How the ratio line names this side (`R=2`, `keyed`, ...).
    pub label: String,
    /// The `transport` of this side's records.
    pub path: String,
    /// Holders of each range on this side.
    pub replicas: usize,
    pub mgr: &'a TransportManager,
    pub set: &'a WorkingSet,
}

/// The second local cluster of a comparison, connected and filled.
pub struct OtherCluster {
    mgr: Arc<TransportManager>,
    set: WorkingSet,
    // Dropped after the manager (field order): the manager's connections
    // end before the servers do.
    _cluster: LocalCluster,
}

impl OtherCluster {
    /// Starts a cluster of `placements` with `key`, connects with `config`
    /// (its coordinator and key replaced) and fills `memory_bytes` of it.
    pub fn start(
        config: &ManagerConfig,
        placements: &[Placement],
        memory_bytes: usize,
        server_spin: Duration,
        key: Option<ClusterKey>,
    ) -> anyhow::Result<Self> {
        let cluster = LocalCluster::start_placed(placements, server_spin, key.clone())?;
        let mgr = Arc::new(
            TransportManager::connect(ManagerConfig {
                coordinator_url: cluster.url().to_owned(),
                cluster_key: key,
                ..config.clone()
            })
            .context("connecting to the comparison cluster")?,
        );
        let gpas: Vec<u64> = mgr
            .map()
            .ranges()
            .flat_map(|(start, len, _)| {
                (0..len / PAGE_SIZE as u64).map(move |i| start + i * PAGE_SIZE as u64)
            })
            .take(memory_bytes / PAGE_SIZE)
            .collect();
        let set = WorkingSet::new(gpas);
        set.fill(&mgr, 1)
            .context("filling the comparison cluster")?;
        Ok(Self {
            mgr,
            set,
            _cluster: cluster,
        })
    }

    /// This cluster as the other side of a comparison.
    pub fn side(&self, label: &str, path_suffix: &str, replicas: usize) -> Side<'_> {
        Side {
            label: label.to_owned(),
            path: format!("{}-{path_suffix}", crate::data_path_name(&self.mgr)),
            replicas,
            mgr: &self.mgr,
            set: &self.set,
        }
    }
}

/// One side's runs of one spec.
struct Rounds {
    records: Vec<Record>,
}

impl Rounds {
    fn median(&self, f: impl Fn(&Record) -> f64) -> f64 {
        let mut v: Vec<f64> = self.records.iter().map(f).collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    }

    /// The run whose p50 is the median, the one the table shows; verified
    /// only if every run of this side was.
    fn median_record(mut self) -> Option<Record> {
        let verified = self.records.iter().all(|r| r.verified);
        self.records
            .sort_by(|a, b| a.latency_us.p50.total_cmp(&b.latency_us.p50));
        let mid = self.records.len() / 2;
        (mid < self.records.len()).then(|| {
            let mut r = self.records.swap_remove(mid);
            r.verified &= verified;
            r
        })
    }
}

/// Runs one spec on one side, every page checked (a write run reads every
/// page back).
fn run_side(side: &Side<'_>, spec: Spec, seed: u64, nodes: usize) -> anyhow::Result<Record> {
    let mut outcome = workload::run(side.mgr, side.set, spec, seed, &ProgressBar::hidden());
    if spec.op == Op::Write {
        outcome.bad_pages += side
            .set
            .verify_all(side.mgr)
            .context("reading back written pages")?;
        outcome.pages_checked = outcome.ops_done;
    }
    let mut r = Record::new(&side.path, spec, nodes, &outcome);
    r.replicas = side.replicas;
    Ok(r)
}

/// Runs every `(spec, seed)` `rounds` times on each side, the sides taking
/// turns, and returns both sides' median records (every run's pages
/// checked: a record is unverified if any of its side's runs was) and one
/// `what` ratio line per spec.
///
/// With `fanout: Some(r)`, each round of a write spec also runs the bare
/// program's write to `r` servers and to one (best layout each, one client
/// thread), and a second line compares the two ratios: the bare fan-out's
/// is what this machine's CPUs allow a replicated write.
pub fn alternate(
    what: &str,
    ours: &Side<'_>,
    theirs: &Side<'_>,
    specs: &[(Spec, u64)],
    rounds: usize,
    fanout: Option<usize>,
) -> anyhow::Result<(Vec<Record>, Vec<String>)> {
    let rounds = rounds.max(1);
    let mut records = Vec::new();
    let mut lines = Vec::new();
    for &(spec, seed) in specs {
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let bare_servers = fanout.filter(|_| spec.op == Op::Write);
        let (mut bare_r, mut bare_1) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            a.push(run_side(ours, spec, seed, ours.mgr.map().nodes().len())?);
            b.push(run_side(
                theirs,
                spec,
                seed,
                theirs.mgr.map().nodes().len(),
            )?);
            if let Some(servers) = bare_servers {
                let one_client = Spec { threads: 1, ..spec };
                let pages = ours.set.len();
                for (n, runs) in [(servers, &mut bare_r), (1, &mut bare_1)] {
                    let best = baseline::run_fanout(one_client, pages, seed, n)?;
                    let mut r = Record::baseline(one_client, &best);
                    r.nodes = n;
                    r.transport = format!("bare-tcp-x{n}");
                    runs.push(r);
                }
            }
        }
        let (a, b) = (Rounds { records: a }, Rounds { records: b });
        let p50 = (
            a.median(|r| r.latency_us.p50),
            b.median(|r| r.latency_us.p50),
        );
        let p99 = (
            a.median(|r| r.latency_us.p99),
            b.median(|r| r.latency_us.p99),
        );
        let tput = (
            a.median(|r| r.throughput.pages_per_s),
            b.median(|r| r.throughput.pages_per_s),
        );
        lines.push(format!(
            "{what} ({:?} {:?}, depth {}, {rounds} alternating rounds, medians): {} vs {} \
             p50 {} vs {} us x{}, p99 {} vs {} us x{}, throughput x{}",
            spec.op,
            spec.pattern,
            spec.depth,
            ours.label,
            theirs.label,
            fmt_us(p50.0),
            fmt_us(p50.1),
            fmt_ratio(p50.0 / p50.1.max(1e-9)),
            fmt_us(p99.0),
            fmt_us(p99.1),
            fmt_ratio(p99.0 / p99.1.max(1e-9)),
            fmt_ratio(tput.0 / tput.1.max(1e-9)),
        ));
        if let Some(servers) = bare_servers {
            let (bare_r, bare_1) = (Rounds { records: bare_r }, Rounds { records: bare_1 });
            let bare = (
                bare_r.median(|r| r.latency_us.p50),
                bare_1.median(|r| r.latency_us.p50),
            );
            lines.push(format!(
                "bare fan-out ({:?} {:?}, depth {}, same rounds, medians): {servers} servers vs 1 \
                 p50 {} vs {} us x{}; ours {} vs bare {servers} servers p50 x{}",
                spec.op,
                spec.pattern,
                spec.depth,
                fmt_us(bare.0),
                fmt_us(bare.1),
                fmt_ratio(bare.0 / bare.1.max(1e-9)),
                ours.label,
                fmt_ratio(p50.0 / bare.0.max(1e-9)),
            ));
            records.extend(
                [bare_r, bare_1]
                    .into_iter()
                    .filter_map(Rounds::median_record),
            );
        }
        records.extend([a, b].into_iter().filter_map(Rounds::median_record));
    }
    Ok((records, lines))
}
