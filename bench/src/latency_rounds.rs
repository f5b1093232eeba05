//! `--op read|write --depth 1 --baseline --latency-rounds N`: one page in
//! flight against its baselines in N rounds, one after the other in this
//! process.
//!
//! Each round runs our loop, the bare ping-pong in its best layout and,
//! with more than one node, the bare ping-pong with its pages spread over
//! as many servers (`baseline::run_spread`), starting each round with the
//! next of them. With a local cluster and a pinned caller it also runs
//! ours in the bare's same-CPU layout (`rounds::SameCpu`), and compares
//! each side in the same layout and each in its best: the bench's
//! placement of ours is one fixed rule, while the bare gets its best of
//! every layout. The host's speed drifts within a process (a bare layout
//! measured at 9.5 µs and 15 µs a minute apart), so one ratio of runs a
//! minute apart says little; the median of the rounds' ratios, each from
//! runs seconds apart, says more (as `--fault-rounds` for faults).

use crate::baseline::{self, Layout};
use crate::report::{fmt_ratio, fmt_ratios, fmt_us_all, median, Record};
use crate::rounds::{check, Job};
use crate::workload::{Op, Spec};

/// The p50s and p99s of one round, in µs.
#[derive(Default, Clone, Copy)]
struct Round {
    ours: (f64, f64),
    bare: (f64, f64),
    /// The spread ping-pong (zeros with one node: not run).
    spread: (f64, f64),
    /// Ours and the bare ping-pong in the bare's same-CPU layout, and the
    /// bare in the layout of the bench's default placement of ours (caller
    /// and page-servers on different CPUs, both spinning); `None` when not
    /// run.
    ours_same_cpu: Option<(f64, f64)>,
    bare_same_cpu: Option<(f64, f64)>,
    bare_spinning: Option<(f64, f64)>,
}

/// What a round runs, in turn.
#[derive(Clone, Copy)]
enum Kind {
    Ours,
    Bare,
    Spread,
    OursSameCpu,
}

/// Runs `rounds` rounds of `job` and returns the summary lines.
pub fn run(job: &Job<'_>, rounds: u64) -> anyhow::Result<Vec<String>> {
    let spec = job.spec;
    if spec.depth != 1 || spec.threads != 1 || !matches!(spec.op, Op::Read | Op::Write) {
        anyhow::bail!("--latency-rounds is for one read or write in flight from one thread");
    }
    let servers = job.owners.iter().max().map_or(0, |&m| m + 1);
    let mut kinds = vec![Kind::Ours, Kind::Bare];
    if servers > 1 {
        kinds.push(Kind::Spread);
    }
    if job.same_cpu.is_some() {
        kinds.push(Kind::OursSameCpu);
    }
    let p = |r: &Record| (r.latency_us.p50, r.latency_us.p99);
    let mut all = Vec::new();
    for r in 0..rounds as usize {
        let mut round = Round::default();
        for k in 0..kinds.len() {
            match kinds[(r + k) % kinds.len()] {
                Kind::Ours => round.ours = p(&Record::new("ours", spec, servers, &job.run_ours()?)),
                Kind::Bare => {
                    let best = baseline::run(spec, job.set.len(), job.seed)?;
                    check("bare TCP ping-pong", best.all_verified)?;
                    round.bare = p(&Record::baseline(spec, &best));
                    let layout =
                        |layout: Layout| best.tried_in(layout).map(|t| (t.p50_us, t.p99_us));
                    round.bare_same_cpu = layout(Layout::SameCpuBlocking);
                    round.bare_spinning = layout(Layout::CrossCpuSpinning);
                }
                Kind::Spread => {
                    let best = baseline::run_spread(spec, job.owners, job.seed)?;
                    check("bare TCP ping-pong over spread pages", best.all_verified)?;
                    round.spread = p(&Record::baseline(spec, &best));
                }
                Kind::OursSameCpu => {
                    round.ours_same_cpu = job
                        .run_ours_same_cpu()?
                        .map(|outcome| p(&Record::new("ours", spec, servers, &outcome)));
                }
            }
        }
        all.push(round);
    }
    Ok(summary(spec, &all, servers))
}

fn summary(spec: Spec, rounds: &[Round], servers: usize) -> Vec<String> {
    let ratios = |f: fn(&Round) -> (f64, f64)| -> (Vec<f64>, Vec<f64>) {
        rounds
            .iter()
            .map(|r| {
                let base = f(r);
                (r.ours.0 / base.0.max(1e-9), r.ours.1 / base.1.max(1e-9))
            })
            .unzip()
    };
    let us = |f: fn(&Round) -> f64| fmt_us_all(rounds.iter().map(f));
    let what = format!("{:?} {:?}, depth 1", spec.op, spec.pattern);
    let line = |label: &str, (p50, p99): (Vec<f64>, Vec<f64>)| {
        format!(
            "{what}, {} rounds of {}: ours / {label} p50 per round {}; median x{}; p99 median x{}",
            rounds.len(),
            spec.ops,
            fmt_ratios(&p50),
            fmt_ratio(median(&p50)),
            fmt_ratio(median(&p99))
        )
    };
    let mut lines = vec![line("bare TCP", ratios(|r| r.bare))];
    let mut p50s = format!(
        "{what} rounds, p50 us: ours {}; bare TCP {}",
        us(|r| r.ours.0),
        us(|r| r.bare.0)
    );
    if servers > 1 {
        lines.push(line(
            &format!("bare TCP over {servers} servers, pages spread as over our nodes,"),
            ratios(|r| r.spread),
        ));
        p50s.push_str(&format!(
            "; bare TCP over {servers} servers {}",
            us(|r| r.spread.0)
        ));
    }
    if rounds.iter().all(|r| r.bare_spinning.is_some()) {
        lines.push(line(
            "bare TCP in cross-cpu-spinning (the layout of the bench's default placement of ours)",
            ratios(|r| r.bare_spinning.unwrap_or_default()),
        ));
    }
    let pairs: Vec<((f64, f64), (f64, f64))> = rounds
        .iter()
        .filter_map(|r| r.ours_same_cpu.zip(r.bare_same_cpu))
        .collect();
    if !rounds.is_empty() && pairs.len() == rounds.len() {
        lines.push(line(
            "bare TCP, both in same-cpu-blocking (caller and page-server on one CPU, the server blocking)",
            pairs
                .iter()
                .map(|&(ours, bare)| (ours.0 / bare.0.max(1e-9), ours.1 / bare.1.max(1e-9)))
                .unzip(),
        ));
        // Each side in its best layout of the round: ours' placement or
        // the same CPU; the bare's best of every layout it ran.
        let best: Vec<f64> = rounds
            .iter()
            .zip(&pairs)
            .map(|(r, &(same, _))| r.ours.0.min(same.0) / r.bare.0.max(1e-9))
            .collect();
        lines.push(format!(
            "{what}: ours in its best layout of the round / bare TCP in its best, p50 per round {}; median x{}",
            fmt_ratios(&best),
            fmt_ratio(median(&best))
        ));
        p50s.push_str(&format!(
            "; ours in same-cpu-blocking {}",
            fmt_us_all(pairs.iter().map(|&(ours, _)| ours.0))
        ));
    }
    lines.push(p50s);
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::AccessPattern;

    #[test]
    fn summary_divides_each_round_by_its_own_baselines() {
        let spec = Spec {
            op: Op::Read,
            ops: 100,
            threads: 1,
            depth: 1,
            pattern: AccessPattern::Random,
        };
        let round = |ours: f64, bare: f64, spread: f64| Round {
            ours: (ours, 2.0 * ours),
            bare: (bare, bare),
            spread: (spread, spread),
            ..Round::default()
        };
        let rounds = [
            round(11.0, 10.0, 11.0),
            round(12.0, 10.0, 10.0),
            round(30.0, 10.0, 15.0),
        ];
        let lines = summary(spec, &rounds, 2);
        assert!(
            lines[0].ends_with("p50 per round 1.10 1.20 3.00; median x1.20; p99 median x2.40"),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].contains("over 2 servers, pages spread as over our nodes, p50 per round 1.00 1.20 2.00; median x1.20; p99 median x2.40"),
            "{}",
            lines[1]
        );
        assert!(
            lines[2].ends_with("bare TCP over 2 servers 11.0 10.0 15.0"),
            "{}",
            lines[2]
        );
        assert_eq!(
            summary(spec, &rounds, 1).len(),
            2,
            "one node: no spread line"
        );
    }

    #[test]
    fn summary_compares_each_layout_with_the_same_and_best_with_best() {
        let spec = Spec {
            op: Op::Write,
            ops: 100,
            threads: 1,
            depth: 1,
            pattern: AccessPattern::Random,
        };
        // Ours 8 in its placement and 6 on one CPU; the bare 5 on one CPU
        // (its best) and 7 spinning across CPUs.
        let round = |same: f64| Round {
            ours: (8.0, 16.0),
            bare: (5.0, 10.0),
            ours_same_cpu: Some((same, 12.0)),
            bare_same_cpu: Some((5.0, 10.0)),
            bare_spinning: Some((7.0, 14.0)),
            ..Round::default()
        };
        let lines = summary(spec, &[round(6.0), round(5.5), round(9.0)], 1);
        assert_eq!(lines.len(), 5, "{lines:#?}");
        assert!(lines[0].ends_with("p50 per round 1.60 1.60 1.60; median x1.60; p99 median x1.60"));
        assert!(
            lines[1]
                .contains("default placement of ours) p50 per round 1.14 1.14 1.14; median x1.14"),
            "{}",
            lines[1]
        );
        assert!(
            lines[2].contains("both in same-cpu-blocking")
                && lines[2]
                    .ends_with("p50 per round 1.20 1.10 1.80; median x1.20; p99 median x1.20"),
            "{}",
            lines[2]
        );
        // The third round's best layout of ours is its own placement (8).
        assert!(
            lines[3].ends_with("p50 per round 1.20 1.10 1.60; median x1.20"),
            "{}",
            lines[3]
        );
        assert!(
            lines[4].ends_with("; ours in same-cpu-blocking 6.0 5.5 9.0"),
            "{}",
            lines[4]
        );
        // A round without the same-CPU run: no same-CPU lines at all.
        let mut partial = [round(6.0), round(6.0)];
        partial[1].ours_same_cpu = None;
        assert_eq!(summary(spec, &partial, 1).len(), 3);
    }
}
