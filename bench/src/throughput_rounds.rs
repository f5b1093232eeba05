//! `--op read|write --depth N>1 --baseline --throughput-rounds R`: many
//! pages in flight from one thread against the bare pipelined client in R
//! rounds, one after the other in this process.
//!
//! Each round runs our loop and the bare pipelined client in its best
//! layout (`baseline::run_pipelined`), starting each round with the other
//! one. Our GB/s at depth 32 moved between 1.8 and 2.6 in consecutive runs
//! of one binary (2026-12-06), and the bare's as much: one pair of runs a
//! minute apart says little, the median of the rounds' ratios, each from
//! runs seconds apart, says more (as `--latency-rounds` for one page in
//! flight).

use crate::baseline::{self, Layout};
use crate::report::{fmt_ratio, fmt_ratios, median, Record};
use crate::rounds::{check, Job};
use crate::workload::Op;
use rdma_transport::PAGE_SIZE;

/// One round's GB/s, and the layout the bare won with.
#[derive(Clone)]
struct Round {
    ours_gb_per_s: f64,
    bare_gb_per_s: f64,
    bare_layout: String,
    /// The bare in `cross-cpu-spinning`, the layout of the bench's default
    /// placement of ours (caller and page-server on different CPUs, both
    /// spinning); `None` when not run (one CPU).
    bare_spinning_gb_per_s: Option<f64>,
}

/// Runs `rounds` rounds of `job` (one thread, `job.spec.depth` > 1) and
/// returns the summary lines.
pub fn run(job: &Job<'_>, rounds: u64) -> anyhow::Result<Vec<String>> {
    let spec = job.spec;
    if spec.depth < 2 || spec.threads != 1 || !matches!(spec.op, Op::Read | Op::Write) {
        anyhow::bail!(
            "--throughput-rounds is for reads or writes from one thread, depth 2 or more"
        );
    }
    let mut all = Vec::new();
    for r in 0..rounds {
        let mut round = Round {
            ours_gb_per_s: 0.0,
            bare_gb_per_s: 0.0,
            bare_layout: String::new(),
            bare_spinning_gb_per_s: None,
        };
        for k in 0..2 {
            if (r + k) % 2 == 0 {
                let outcome = job.run_ours()?;
                round.ours_gb_per_s = Record::new("ours", spec, 1, &outcome).throughput.gb_per_s;
            } else {
                let best = baseline::run_pipelined(spec, job.set.len(), job.seed, spec.depth)?;
                check("bare pipelined TCP", best.all_verified)?;
                let record = Record::pipelined(spec, &best);
                round.bare_gb_per_s = record.throughput.gb_per_s;
                round.bare_layout = best.layout.name().to_string();
                round.bare_spinning_gb_per_s = best
                    .tried_in(Layout::CrossCpuSpinning)
                    .map(|t| t.pages_per_s * PAGE_SIZE as f64 / 1e9);
            }
        }
        all.push(round);
    }
    Ok(summary(spec.op, spec.depth, spec.ops, &all))
}

fn summary(op: Op, depth: usize, ops: u64, rounds: &[Round]) -> Vec<String> {
    let ratios: Vec<f64> = rounds
        .iter()
        .map(|r| r.ours_gb_per_s / r.bare_gb_per_s.max(1e-12))
        .collect();
    let gbs = |f: fn(&Round) -> f64| {
        rounds
            .iter()
            .map(|r| format!("{:.2}", f(r)))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let layouts = rounds
        .iter()
        .map(|r| r.bare_layout.as_str())
        .collect::<Vec<_>>()
        .join(" ");
    let mut lines = vec![format!(
        "{op:?}, depth {depth}, {} rounds of {ops}: ours / bare pipelined TCP GB/s per round {}; median x{}",
        rounds.len(),
        fmt_ratios(&ratios),
        fmt_ratio(median(&ratios)),
    )];
    let spinning: Vec<f64> = rounds
        .iter()
        .filter_map(|r| Some(r.ours_gb_per_s / r.bare_spinning_gb_per_s?.max(1e-12)))
        .collect();
    if !rounds.is_empty() && spinning.len() == rounds.len() {
        lines.push(format!(
            "{op:?}, depth {depth}, the same rounds: ours / bare pipelined TCP in cross-cpu-spinning (the layout of the bench's default placement of ours) GB/s per round {}; median x{} (bare {})",
            fmt_ratios(&spinning),
            fmt_ratio(median(&spinning)),
            gbs(|r| r.bare_spinning_gb_per_s.unwrap_or_default()),
        ));
    }
    lines.push(format!(
        "{op:?}, depth {depth} rounds, GB/s: ours {}; bare pipelined TCP {} ({layouts})",
        gbs(|r| r.ours_gb_per_s),
        gbs(|r| r.bare_gb_per_s),
    ));
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_divides_each_round_by_its_own_bare_run() {
        let round = |ours: f64, bare: f64| Round {
            ours_gb_per_s: ours,
            bare_gb_per_s: bare,
            bare_layout: "same-cpu-blocking".into(),
            bare_spinning_gb_per_s: None,
        };
        let rounds = [round(2.0, 2.5), round(2.4, 2.4), round(1.0, 2.5)];
        let lines = summary(Op::Read, 32, 1000, &rounds);
        assert_eq!(lines.len(), 2, "no spinning layout run: no line for it");
        assert!(
            lines[0].ends_with("GB/s per round 0.80 1.00 0.40; median x0.80"),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].ends_with(
                "ours 2.00 2.40 1.00; bare pipelined TCP 2.50 2.40 2.50 (same-cpu-blocking same-cpu-blocking same-cpu-blocking)"
            ),
            "{}",
            lines[1]
        );
    }

    #[test]
    fn ours_is_also_divided_by_the_bare_in_the_layout_of_its_placement() {
        let round = |ours: f64, spinning: f64| Round {
            ours_gb_per_s: ours,
            bare_gb_per_s: 5.0,
            bare_layout: "same-cpu-blocking".into(),
            bare_spinning_gb_per_s: Some(spinning),
        };
        let rounds = [round(4.0, 5.0), round(3.0, 4.0), round(4.5, 5.0)];
        let lines = summary(Op::Read, 32, 1000, &rounds);
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(
            lines[1].ends_with("GB/s per round 0.80 0.75 0.90; median x0.80 (bare 5.00 4.00 5.00)"),
            "{}",
            lines[1]
        );
    }
}
