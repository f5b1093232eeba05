//! The baseline: the best a bare program does on this machine, in this run.
//!
//! The bare TCP ping-pong ([`pingpong`]) runs once per [`Layout`] the
//! machine offers (same CPU blocking, different CPUs both spinning,
//! different CPUs blocking), one after the other, and the layout with the
//! lowest p50 is the baseline. Why the best and not one fixed layout: the
//! library gets to place its own threads (a busy poller on the last CPU,
//! callers that spin before they park, and in the fault bench everything
//! pinned to CPU 0), so the bare program must get its best placement too; a
//! ratio against a slow layout (blocking across CPUs: ~80 us on an idle VM,
//! against 6-13 us for the others) only measures that layout's wake-ups.
//! Why p50: it is the ratios' headline figure and the most stable one. The
//! baseline's record (table line) holds the chosen layout's figures; the
//! printed p99 and throughput ratios are against the best layout for each
//! (named in the line), since the lowest-p50 layout may have the worst tail
//! on a busy host (a spinning thread preempted for a whole time slice).

mod conn;
mod layout;
mod page_order;
mod pingpong;
mod pipelined;
mod remote_fault;
mod spread;
pub mod uffd_fault;
pub mod verbs;

use anyhow::bail;

use crate::report::LayoutResult;
use crate::workload::{Outcome, Spec};

pub use layout::{allowed_cpus, pin_current, pin_first_free, Layout};

/// The baseline of one spec: the chosen layout's run and every layout's.
pub struct Best {
    /// The layout with the lowest p50.
    pub layout: Layout,
    pub outcome: Outcome,
    /// Every layout tried, in the order run (the chosen one included).
    pub tried: Vec<LayoutResult>,
    /// True when every layout's pages were all checked and right.
    pub all_verified: bool,
}

impl Best {
    /// The run in `layout`, if it was tried.
    pub fn tried_in(&self, layout: Layout) -> Option<&LayoutResult> {
        self.tried.iter().find(|t| t.layout == layout.name())
    }
}

/// Runs the ping-pong with `spec` (threads ignored: one client) in every
/// layout this process can have, over `pages` pages of `seed`'s pattern,
/// and keeps the one with the lowest p50 (the first on a tie).
pub fn run(spec: Spec, pages: usize, seed: u64) -> anyhow::Result<Best> {
    run_fanout(spec, pages, seed, 1)
}

/// As [`run`], each write sent to `servers` bare servers at once (see
/// [`pingpong`]): what a replicated write costs a bare program here.
pub fn run_fanout(spec: Spec, pages: usize, seed: u64, servers: usize) -> anyhow::Result<Best> {
    lowest_p50(servers, |layout, placement, server_cpus| {
        pingpong::run(spec, pages, seed, layout, placement.0, server_cpus)
    })
}

/// The bare ping-pong with its pages spread over servers as `owners`
/// says (page `i` on server `owners[i]`), one page in flight ([`spread`]),
/// in every layout this process can have, the servers all on the layout's
/// server CPU; the one with the lowest p50. Ours with `--nodes N` does the
/// same job on the same CPUs.
pub fn run_spread(spec: Spec, owners: &[usize], seed: u64) -> anyhow::Result<Best> {
    lowest_p50(1, |layout, placement, _| {
        spread::run(spec, owners, seed, layout, placement)
    })
}

/// The bare remote fault ([`remote_fault`]): `spec.ops` userfaultfd faults
/// over `pages` pages of `seed`'s pattern, each page fetched from the bare
/// ping-pong server, in every layout this process can have (toucher and
/// handler on the first CPU, like ours); the one with the lowest p50.
pub fn run_remote_fault(spec: Spec, pages: usize, seed: u64) -> anyhow::Result<Best> {
    lowest_p50(1, |layout, placement, _| {
        remote_fault::run(spec, pages, seed, layout, placement)
    })
}

/// Runs `run(layout, (client CPU, server CPU), server CPUs)` with
/// `servers` server threads in every layout this process can have, and
/// keeps the one with the lowest p50 (the first on a tie).
fn lowest_p50(
    servers: usize,
    mut run: impl FnMut(Layout, (usize, usize), &[usize]) -> anyhow::Result<Outcome>,
) -> anyhow::Result<Best> {
    let cpus = layout::allowed_cpus();
    let mut best: Option<(Layout, Outcome)> = None;
    let mut tried = Vec::new();
    let mut all_verified = true;
    for layout in Layout::ALL {
        let Some(placement) = layout.cpus(&cpus) else {
            tracing::info!(layout = layout.name(), "skipped: needs two CPUs");
            continue;
        };
        let Some(server_cpus) = layout.server_cpus(&cpus, placement, servers) else {
            tracing::info!(
                layout = layout.name(),
                servers,
                "skipped: spinning needs a CPU per thread"
            );
            continue;
        };
        let outcome = run(layout, placement, &server_cpus)?;
        let result = LayoutResult::new(layout.name(), placement, &outcome);
        all_verified &= result.verified;
        let better = match &best {
            None => true,
            Some((_, b)) => result.p50_us < p50_us(b),
        };
        tried.push(result);
        if better {
            best = Some((layout, outcome));
        }
    }
    let Some((layout, outcome)) = best else {
        bail!("no baseline layout fits the CPUs this process may use ({cpus:?})");
    };
    Ok(Best {
        layout,
        outcome,
        tried,
        all_verified,
    })
}

/// The bare pipelined client ([`pipelined`]): one thread, one connection,
/// `depth` requests in flight at all times, `spec`'s op, ops and pattern
/// over `pages` pages of `seed`'s pattern, every page checked. It runs in
/// every layout this process can have (one server thread) and keeps the one
/// with the highest throughput (the first on a tie): the figure a
/// many-in-flight run is compared with.
pub fn run_pipelined(spec: Spec, pages: usize, seed: u64, depth: usize) -> anyhow::Result<Best> {
    let cpus = layout::allowed_cpus();
    let mut best: Option<(Layout, Outcome, f64)> = None;
    let mut tried = Vec::new();
    let mut all_verified = true;
    let spec = Spec {
        threads: 1,
        depth,
        ..spec
    };
    for layout in Layout::ALL {
        let Some(placement) = layout.cpus(&cpus) else {
            tracing::info!(layout = layout.name(), "skipped: needs two CPUs");
            continue;
        };
        let outcome = pipelined::run(spec, pages, seed, depth, layout, placement)?;
        let result = LayoutResult::new(layout.name(), placement, &outcome);
        all_verified &= result.verified;
        let rate = result.pages_per_s;
        tried.push(result);
        if best.as_ref().map_or(true, |(_, _, r)| rate > *r) {
            best = Some((layout, outcome, rate));
        }
    }
    let Some((layout, outcome, _)) = best else {
        bail!("no baseline layout fits the CPUs this process may use ({cpus:?})");
    };
    Ok(Best {
        layout,
        outcome,
        tried,
        all_verified,
    })
}

fn p50_us(o: &Outcome) -> f64 {
    o.latency_ns.value_at_quantile(0.5) as f64 / 1000.0
}
