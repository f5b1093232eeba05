//! `--op fault --baseline --fault-rounds N`: the one-vCPU random fault
//! against its baselines in N rounds, one after the other in this process.
//!
//! Each round runs our fault (anonymous memory, no read-ahead, one
//! faulting thread), the local userfaultfd fault, the bare TCP ping-pong
//! in its best layout and the bare remote fault in its best layout, and,
//! with more than one node, the bare ping-pong with its pages spread over
//! as many servers as ours are over our nodes (`baseline::run_spread`),
//! starting each round with the next of them. When the bench's fault
//! placement puts the local page-servers apart from the faulting CPU,
//! each round also runs our fault with them on the handler's CPU,
//! blocking: the layout of the bare programs' `same-cpu-blocking`, which
//! is their best in the host's fast hours, so ours is also compared in
//! its better placement of the round. The host's speed drifts
//! within a process as well as between processes, so a single ours/sum
//! ratio from a run and baselines taken a minute later says little; the
//! median of the rounds' ratios, each from runs seconds apart, says more.

use std::sync::Arc;

use rdma_transport::TransportManager;

use super::{local_uffd_baseline, one_vcpu, Params, Run, SEED};
use crate::matrix::Backing;
use crate::report::{fmt_ratio, fmt_ratios, fmt_us_all, median, Record};
use crate::rounds::check;
use crate::workload::{AccessPattern, Op, Spec, WorkingSet};

/// The p50s of one round, in µs.
#[derive(Default, Clone, Copy)]
struct Round {
    ours: f64,
    local: f64,
    tcp: f64,
    bare: f64,
    /// The spread ping-pong (0 with one node: not run).
    spread: f64,
    /// Ours with the page-servers on the handler's CPU, blocking (0: not
    /// run, the fault placement already is that).
    ours_same_cpu: f64,
}

impl Round {
    /// Ours in the better of its placements this round.
    fn ours_best(&self) -> f64 {
        if self.ours_same_cpu > 0.0 {
            self.ours.min(self.ours_same_cpu)
        } else {
            self.ours
        }
    }
}

/// What a round runs, in turn.
#[derive(Clone, Copy)]
enum Kind {
    Ours,
    LocalFault,
    BareTcp,
    BareFault,
    Spread,
    OursSameCpu,
}

/// Runs `params.fault_rounds` rounds with `pattern` and returns the
/// summary lines: per round ours / (local + tcp) and ours / bare fault,
/// and their medians.
pub(super) fn rounds(
    mgr: &Arc<TransportManager>,
    set: &WorkingSet,
    params: &Params,
    pattern: AccessPattern,
) -> anyhow::Result<Vec<String>> {
    let pages = set.len();
    let run = Run {
        label: "uffd-nopf",
        backing: Backing::Anon,
        window: 0,
        pattern,
    };
    let spec = one_vcpu(params.ops, pattern);
    let tcp_spec = Spec {
        op: Op::Read,
        ..spec
    };
    let owners = set.owners(&mgr.map());
    let servers = owners.iter().max().map_or(0, |&m| m + 1);
    let fault_place = params.cpus.fault_servers(1);
    let same_cpu = params
        .cpus
        .same_cpu_servers()
        .filter(|same| *same != fault_place);
    let mut kinds = vec![Kind::Ours, Kind::LocalFault, Kind::BareTcp, Kind::BareFault];
    if servers > 1 {
        kinds.push(Kind::Spread);
    }
    if same_cpu.is_some() {
        kinds.push(Kind::OursSameCpu);
    }
    let mut rounds = Vec::new();
    for r in 0..params.fault_rounds {
        let mut round = Round::default();
        for k in 0..kinds.len() {
            match kinds[(r as usize + k) % kinds.len()] {
                Kind::Ours => {
                    params.place_servers(1);
                    let (ours, _) = run.measure(mgr, set, params, 1)?;
                    check("our fault", ours.verified)?;
                    round.ours = ours.latency_us.p50;
                }
                Kind::LocalFault => {
                    let local = local_uffd_baseline(pages.min(16384), spec)?;
                    round.local = Record::new("uffd-local", spec, 0, &local).latency_us.p50;
                    check("local userfaultfd fault", local.verified())?;
                }
                Kind::BareTcp => {
                    let best = crate::baseline::run(tcp_spec, pages, SEED)?;
                    check("bare TCP ping-pong", best.all_verified)?;
                    round.tcp = Record::baseline(tcp_spec, &best).latency_us.p50;
                }
                Kind::BareFault => {
                    let best = crate::baseline::run_remote_fault(spec, pages.min(16384), SEED)?;
                    check("bare remote fault", best.all_verified)?;
                    round.bare = Record::baseline(spec, &best).latency_us.p50;
                }
                Kind::Spread => {
                    let best = crate::baseline::run_spread(tcp_spec, &owners, SEED)?;
                    check("bare TCP ping-pong over spread pages", best.all_verified)?;
                    round.spread = Record::baseline(tcp_spec, &best).latency_us.p50;
                }
                Kind::OursSameCpu => {
                    let Some(same_cpu) = &same_cpu else { continue };
                    params.place(same_cpu);
                    let measured = run.measure(mgr, set, params, 1);
                    params.place_servers(1);
                    let (ours, _) = measured?;
                    check(
                        "our fault, the page-servers on the handler's CPU",
                        ours.verified,
                    )?;
                    round.ours_same_cpu = ours.latency_us.p50;
                }
            }
        }
        rounds.push(round);
    }
    Ok(summary(pattern, params.ops, &rounds, servers))
}

fn summary(pattern: AccessPattern, ops: u64, rounds: &[Round], servers: usize) -> Vec<String> {
    let vs_sum: Vec<f64> = rounds
        .iter()
        .map(|r| r.ours / (r.local + r.tcp).max(1e-9))
        .collect();
    let vs_bare: Vec<f64> = rounds.iter().map(|r| r.ours / r.bare.max(1e-9)).collect();
    let us = |f: fn(&Round) -> f64| fmt_us_all(rounds.iter().map(f));
    let mut lines = vec![
        format!(
            "{pattern:?} fault, {} rounds of {ops}: ours / (local uffd fault + bare TCP) per round {}; median x{}",
            rounds.len(),
            fmt_ratios(&vs_sum),
            fmt_ratio(median(&vs_sum))
        ),
        format!(
            "{pattern:?} fault, the same rounds: ours / bare remote fault per round {}; median x{}",
            fmt_ratios(&vs_bare),
            fmt_ratio(median(&vs_bare))
        ),
        format!(
            "{pattern:?} fault rounds, p50 us: ours {}; local {}; bare TCP {}; bare fault {}",
            us(|r| r.ours),
            us(|r| r.local),
            us(|r| r.tcp),
            us(|r| r.bare)
        ),
    ];
    if rounds.iter().any(|r| r.ours_same_cpu > 0.0) {
        let ratios = |ours: fn(&Round) -> f64, base: fn(&Round) -> f64| -> Vec<f64> {
            rounds.iter().map(|r| ours(r) / base(r).max(1e-9)).collect()
        };
        let sum = |r: &Round| r.local + r.tcp;
        let same_sum = ratios(|r| r.ours_same_cpu, sum);
        let same_bare = ratios(|r| r.ours_same_cpu, |r| r.bare);
        let best_sum = ratios(Round::ours_best, sum);
        let best_bare = ratios(Round::ours_best, |r| r.bare);
        lines.push(format!(
            "{pattern:?} fault, the same rounds, ours with the page-servers on the handler's CPU, blocking (the bare programs' same-cpu-blocking layout): ours / (local uffd fault + bare TCP) per round {}; median x{}; ours / bare remote fault median x{} (p50 us: {})",
            fmt_ratios(&same_sum),
            fmt_ratio(median(&same_sum)),
            fmt_ratio(median(&same_bare)),
            us(|r| r.ours_same_cpu)
        ));
        lines.push(format!(
            "{pattern:?} fault, the same rounds, ours in its better placement of the round: ours / (local uffd fault + bare TCP) per round {}; median x{}; ours / bare remote fault per round {}; median x{}",
            fmt_ratios(&best_sum),
            fmt_ratio(median(&best_sum)),
            fmt_ratios(&best_bare),
            fmt_ratio(median(&best_bare))
        ));
    }
    if servers > 1 {
        let vs_spread: Vec<f64> = rounds
            .iter()
            .map(|r| r.ours / (r.local + r.spread).max(1e-9))
            .collect();
        lines.push(format!(
            "{pattern:?} fault, the same rounds: ours / (local uffd fault + bare TCP over {servers} servers, pages spread as over our nodes) per round {}; median x{} (bare TCP over {servers} servers, p50 us: {})",
            fmt_ratios(&vs_spread),
            fmt_ratio(median(&vs_spread)),
            us(|r| r.spread)
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_divides_each_round_by_its_own_baselines() {
        let rounds = [
            Round {
                ours: 22.0,
                local: 10.0,
                tcp: 10.0,
                bare: 20.0,
                spread: 12.0,
                ours_same_cpu: 0.0,
            },
            Round {
                ours: 33.0,
                local: 15.0,
                tcp: 15.0,
                bare: 30.0,
                spread: 15.0,
                ours_same_cpu: 0.0,
            },
            Round {
                ours: 40.0,
                local: 10.0,
                tcp: 10.0,
                bare: 25.0,
                spread: 10.0,
                ours_same_cpu: 0.0,
            },
        ];
        let lines = summary(AccessPattern::Random, 100, &rounds, 2);
        assert!(
            lines[0].ends_with("per round 1.10 1.10 2.00; median x1.10"),
            "{}",
            lines[0]
        );
        assert!(
            lines[1].ends_with("per round 1.10 1.10 1.60; median x1.10"),
            "{}",
            lines[1]
        );
        assert!(
            lines[3].contains("over 2 servers, pages spread as over our nodes) per round 1.00 1.10 2.00; median x1.10"),
            "{}",
            lines[3]
        );
        assert_eq!(
            summary(AccessPattern::Random, 100, &rounds, 1).len(),
            3,
            "one node: no spread line"
        );
    }

    #[test]
    fn the_same_cpu_runs_give_their_own_line_and_the_better_placement_per_round() {
        let round = |ours, ours_same_cpu| Round {
            ours,
            local: 10.0,
            tcp: 10.0,
            bare: 20.0,
            spread: 0.0,
            ours_same_cpu,
        };
        let rounds = [round(30.0, 22.0), round(24.0, 26.0), round(32.0, 23.0)];
        let lines = summary(AccessPattern::Random, 100, &rounds, 1);
        assert_eq!(lines.len(), 5, "{lines:?}");
        assert!(
            lines[3].contains("per round 1.10 1.30 1.15; median x1.15; ours / bare remote fault median x1.15 (p50 us: 22.0 26.0 23.0)"),
            "{}",
            lines[3]
        );
        assert!(
            lines[4].ends_with("per round 1.10 1.20 1.15; median x1.15; ours / bare remote fault per round 1.10 1.20 1.15; median x1.15"),
            "{}",
            lines[4]
        );
    }
}
