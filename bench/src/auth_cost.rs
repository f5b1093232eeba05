//! `--compare-insecure`: the same read and write runs, in the same process,
//! against a second local cluster whose members hold no cluster key, so the
//! cost of authentication shows as a ratio. It should be one round trip per
//! connection (the handshake) and nothing per page.

use std::sync::Arc;

use anyhow::Context;
use indicatif::ProgressBar;
use rdma_transport::{ManagerConfig, TransportManager, PAGE_SIZE};

use crate::cluster::LocalCluster;
use crate::report::{fmt_ratio, Record};
use crate::workload::{self, Op, Spec, WorkingSet};

/// The keyed runs to repeat: each spec with its seed and its keyed record.
pub struct Keyed<'a> {
    pub spec: Spec,
    pub seed: u64,
    pub record: &'a Record,
}

/// Starts an insecure local cluster shaped like the keyed one (`nodes`,
/// `memory_bytes`), connects with `config` less its key, fills it, and runs
/// every keyed spec again. Returns the insecure records (transport
/// `<path>-insecure`, every page checked) and one ratio line per spec.
pub fn run(
    config: &ManagerConfig,
    nodes: usize,
    memory_bytes: usize,
    server_spin: std::time::Duration,
    keyed: &[Keyed<'_>],
) -> anyhow::Result<(Vec<Record>, Vec<String>)> {
    let cluster = LocalCluster::start(nodes, memory_bytes, server_spin, None)?;
    let mgr = Arc::new(
        TransportManager::connect(ManagerConfig {
            coordinator_url: cluster.url().to_owned(),
            cluster_key: None,
            ..config.clone()
        })
        .context("connecting to the insecure comparison cluster")?,
    );
    let map = mgr.map();
    let gpas: Vec<u64> = map
        .ranges()
        .flat_map(|(start, len, _)| {
            (0..len / PAGE_SIZE as u64).map(move |i| start + i * PAGE_SIZE as u64)
        })
        .take(memory_bytes / PAGE_SIZE)
        .collect();
    let set = WorkingSet::new(gpas);
    set.fill(&mgr, 1)
        .context("filling the insecure comparison cluster")?;
    let path = format!("{}-insecure", crate::data_path_name(&mgr));
    let mut records = Vec::new();
    let mut lines = Vec::new();
    for k in keyed {
        let mut outcome = workload::run(&mgr, &set, k.spec, k.seed, &ProgressBar::hidden());
        if k.spec.op == Op::Write {
            outcome.bad_pages += set.verify_all(&mgr).context("reading back written pages")?;
            outcome.pages_checked = outcome.ops_done;
        }
        let insecure = Record::new(&path, k.spec, map.nodes().len(), &outcome);
        lines.push(format!(
            "authentication cost ({:?} {:?}, depth {}): keyed vs insecure p50 x{}, p99 x{}, throughput x{}",
            k.spec.op,
            k.spec.pattern,
            k.spec.depth,
            fmt_ratio(k.record.latency_us.p50 / insecure.latency_us.p50.max(1e-9)),
            fmt_ratio(k.record.latency_us.p99 / insecure.latency_us.p99.max(1e-9)),
            fmt_ratio(
                k.record.throughput.pages_per_s / insecure.throughput.pages_per_s.max(1e-9)
            ),
        ));
        records.push(insecure);
    }
    drop(mgr);
    drop(cluster);
    Ok((records, lines))
}
