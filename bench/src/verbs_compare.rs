//! Ours against the bare RDMA loop (`--verbs-baseline`), in alternating
//! blocks of one process.
//!
//! The SoftRoCE VM runs at one of two speeds and switches every few
//! seconds, so a ratio of two runs taken a minute apart (ours against
//! perftest's) moves by ±15% from one pair to the next. Here the two loops
//! take turns every `block` operations, each pair of blocks in the other
//! order than the last, over the same number of pages in the same pattern;
//! both therefore meet the same speeds. Printed: the ratio of the whole
//! runs (p50, mean) and the median of the per-pair ratios; with many pages
//! in flight (`--depth N`, the bare loop as `ib_read_bw -t N`), pages/s.

use std::time::Duration;

use anyhow::bail;

use indicatif::ProgressBar;
use rand::{Rng, SeedableRng};
use rdma_transport::TransportManager;

use crate::baseline::verbs::BareVerbs;
use crate::report::{fmt_ratio, fmt_us, median, Record};
use crate::workload::{self, AccessPattern, Api, Op, Outcome, Spec, WorkingSet};

/// Pins the calling thread, and so the threads it starts (ours runs in
/// one per block), to the first CPU this process may use that is not in
/// `avoid` (the pollers'), so both loops run where the other's did. `None`
/// when every CPU is in `avoid`: then neither is pinned.
pub fn pin_loops(avoid: &[usize]) -> anyhow::Result<Option<usize>> {
    crate::baseline::pin_first_free(avoid)
}

/// Both loops' outcomes and each pair of blocks' ratios.
pub struct Alternated {
    pub ours: Outcome,
    pub bare: Outcome,
    /// Ours / bare, p50 of each pair of blocks.
    pub pair_p50: Vec<f64>,
    /// Ours / bare, mean of each pair of blocks.
    pub pair_mean: Vec<f64>,
    /// Ours / bare, pages/s of each pair of blocks.
    pub pair_rate: Vec<f64>,
}

/// Runs `spec` (random pages, one thread, `spec.depth` pages in flight, as
/// `bare` was connected for) through `api` and through `bare`, `block`
/// operations at a time, until each has done `spec.ops`.
/// Writes are checked by reading back afterwards, as in the plain run.
pub fn alternate(
    mgr: &TransportManager,
    set: &WorkingSet,
    spec: Spec,
    seed: u64,
    api: Api,
    bare: &mut BareVerbs,
    block: u64,
) -> anyhow::Result<Alternated> {
    if spec.pattern != AccessPattern::Random {
        bail!("--verbs-baseline compares random pages only");
    }
    let hidden = ProgressBar::hidden();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ 0xba5e);
    let pages = set.len();
    let mut next_page = || rng.gen_range(0..pages);
    let mut ours = Outcome::empty(Duration::ZERO);
    let mut bare_total = Outcome::empty(Duration::ZERO);
    let (mut pair_p50, mut pair_mean, mut pair_rate) = (Vec::new(), Vec::new(), Vec::new());
    let mut done = 0;
    let mut pair = 0u64;
    while done < spec.ops {
        let n = block.min(spec.ops - done);
        let block_spec = Spec { ops: n, ..spec };
        // A seed per block: the workload picks its pages (and a write its
        // pattern) from it, and the same seed would replay the first
        // block's pages every time, hot against the bare loop's new ones.
        let block_seed = seed ^ (pair << 32);
        let (o, b) = if pair % 2 == 0 {
            let b = bare.run(spec.op, n, &mut next_page)?;
            (
                workload::run_api(mgr, set, block_spec, block_seed, &hidden, api),
                b,
            )
        } else {
            let o = workload::run_api(mgr, set, block_spec, block_seed, &hidden, api);
            (o, bare.run(spec.op, n, &mut next_page)?)
        };
        pair_p50.push(p50_ns(&o) / p50_ns(&b).max(1.0));
        pair_mean.push(o.latency_ns.mean() / b.latency_ns.mean().max(1.0));
        pair_rate.push(pages_per_s(&o) / pages_per_s(&b).max(1e-9));
        merge(&mut ours, o);
        merge(&mut bare_total, b);
        if ours.errors > 0 {
            break;
        }
        done += n;
        pair += 1;
    }
    if spec.op == Op::Write {
        ours.bad_pages += set.verify_all(mgr)?;
        ours.pages_checked = ours.ops_done;
        bare_total.bad_pages += bare.check_region();
        bare_total.pages_checked = bare_total.ops_done;
    }
    Ok(Alternated {
        ours,
        bare: bare_total,
        pair_p50,
        pair_mean,
        pair_rate,
    })
}

/// The line that compares the two records of an alternated run: latency
/// with one page in flight, pages/s with more.
pub fn ratio_line(
    ours: &Record,
    bare: &Record,
    alt: &Alternated,
    block: u64,
    cpu: Option<usize>,
) -> String {
    let callers = cpu.map_or_else(|| "any CPU".to_owned(), |c| format!("CPU {c}"));
    if ours.depth > 1 {
        return format!(
            "throughput vs bare verbs ({:?} {:?}, depth {}, alternated in blocks of {block}, {} pairs, callers on {callers}): x{} ({:.0} vs {:.0} pages/s); per pair: median x{}",
            ours.op,
            ours.pattern,
            ours.depth,
            alt.pair_rate.len(),
            fmt_ratio(ours.throughput.pages_per_s / bare.throughput.pages_per_s.max(1e-9)),
            ours.throughput.pages_per_s,
            bare.throughput.pages_per_s,
            fmt_ratio(median(&alt.pair_rate)),
        );
    }
    format!(
        "overhead vs bare verbs ({:?} {:?}, alternated in blocks of {block}, {} pairs, callers on {}): p50 x{} ({} vs {} us), mean x{} ({} vs {} us); per pair: p50 median x{}, mean median x{}",
        ours.op,
        ours.pattern,
        alt.pair_p50.len(),
        callers,
        fmt_ratio(ours.latency_us.p50 / bare.latency_us.p50.max(1e-9)),
        fmt_us(ours.latency_us.p50),
        fmt_us(bare.latency_us.p50),
        fmt_ratio(ours.latency_us.mean / bare.latency_us.mean.max(1e-9)),
        fmt_us(ours.latency_us.mean),
        fmt_us(bare.latency_us.mean),
        fmt_ratio(median(&alt.pair_p50)),
        fmt_ratio(median(&alt.pair_mean)),
    )
}

fn pages_per_s(o: &Outcome) -> f64 {
    o.ops_done as f64 / o.elapsed.as_secs_f64().max(1e-9)
}

fn p50_ns(o: &Outcome) -> f64 {
    o.latency_ns.value_at_quantile(0.5) as f64
}

/// Adds one block's outcome to its loop's total (blocks run one after the
/// other: their times add up).
fn merge(total: &mut Outcome, part: Outcome) {
    total.elapsed += part.elapsed;
    total.absorb(part);
}
