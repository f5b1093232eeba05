//! `--op read|write --depth 1 --baseline --latency-rounds N`: one page in
//! flight against its baselines in N rounds, one after the other in this
//! process.
//!
//! Each round runs our loop, the bare ping-pong in its best layout and,
//! with more than one node, the bare ping-pong with its pages spread over
//! as many servers (`baseline::run_spread`), starting each round with the
//! next of them. The host's speed drifts within a process (a bare layout
//! measured at 9.5 µs and 15 µs a minute apart), so one ratio of runs a
//! minute apart says little; the median of the rounds' ratios, each from
//! runs seconds apart, says more (as `--fault-rounds` for faults).

use crate::baseline;
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
}

/// Runs `rounds` rounds of `job` and returns the summary lines.
pub fn run(job: &Job<'_>, rounds: u64) -> anyhow::Result<Vec<String>> {
    let spec = job.spec;
    if spec.depth != 1 || spec.threads != 1 || !matches!(spec.op, Op::Read | Op::Write) {
        anyhow::bail!("--latency-rounds is for one read or write in flight from one thread");
    }
    let servers = job.owners.iter().max().map_or(0, |&m| m + 1);
    let kinds = if servers > 1 { 3 } else { 2 };
    let p = |r: &Record| (r.latency_us.p50, r.latency_us.p99);
    let mut all = Vec::new();
    for r in 0..rounds {
        let mut round = Round::default();
        for k in 0..kinds {
            match (r + k) % kinds {
                0 => round.ours = p(&Record::new("ours", spec, servers, &job.run_ours()?)),
                1 => {
                    let best = baseline::run(spec, job.set.len(), job.seed)?;
                    check("bare TCP ping-pong", best.all_verified)?;
                    round.bare = p(&Record::baseline(spec, &best));
                }
                _ => {
                    let best = baseline::run_spread(spec, job.owners, job.seed)?;
                    check("bare TCP ping-pong over spread pages", best.all_verified)?;
                    round.spread = p(&Record::baseline(spec, &best));
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
}
