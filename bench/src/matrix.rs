//! Which runs the command line selects: address orders (`--pattern`) and,
//! for the fault op, prefetch on or off (`--prefetch`).

use anyhow::bail;

use crate::workload::{AccessPattern, Op};

/// `--pattern`: one address order, or each in turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PatternChoice {
    /// Uniformly random pages.
    Random,
    /// Consecutive pages, each thread from its own start.
    Seq,
    /// Random, then sequential (one run each).
    All,
}

/// `--prefetch` (fault op only): guest-memory read-ahead on, off, or both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefetchChoice {
    /// Read-ahead on (the library's default window).
    On,
    /// Read-ahead off: every touch is a fault.
    Off,
    /// On, then off (one run each).
    Both,
}

/// The address orders to run for `op`: `--pattern` if given; otherwise
/// random for reads and writes, and both for faults (random against
/// sequential is what prefetch is about).
pub fn patterns(op: Op, choice: Option<PatternChoice>) -> Vec<AccessPattern> {
    let choice = choice.unwrap_or(match op {
        Op::Fault => PatternChoice::All,
        Op::Read | Op::Write => PatternChoice::Random,
    });
    match choice {
        PatternChoice::Random => vec![AccessPattern::Random],
        PatternChoice::Seq => vec![AccessPattern::Seq],
        PatternChoice::All => vec![AccessPattern::Random, AccessPattern::Seq],
    }
}

/// Whether each fault run has read-ahead, prefetch first; both when
/// `--prefetch` is not given. Refuses `--prefetch` for the other ops, which
/// have no read-ahead.
pub fn prefetch(ops: &[Op], choice: Option<PrefetchChoice>) -> anyhow::Result<Vec<bool>> {
    if choice.is_some() && ops.iter().any(|&op| op != Op::Fault) {
        bail!("--prefetch applies to --op fault only");
    }
    Ok(match choice.unwrap_or(PrefetchChoice::Both) {
        PrefetchChoice::On => vec![true],
        PrefetchChoice::Off => vec![false],
        PrefetchChoice::Both => vec![true, false],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_defaults_per_op() {
        assert_eq!(patterns(Op::Read, None), vec![AccessPattern::Random]);
        assert_eq!(
            patterns(Op::Fault, None),
            vec![AccessPattern::Random, AccessPattern::Seq]
        );
        assert_eq!(
            patterns(Op::Fault, Some(PatternChoice::Seq)),
            vec![AccessPattern::Seq]
        );
        assert_eq!(patterns(Op::Write, Some(PatternChoice::All)).len(), 2);
    }

    #[test]
    fn prefetch_only_for_faults() -> anyhow::Result<()> {
        assert_eq!(prefetch(&[Op::Fault], None)?, vec![true, false]);
        assert_eq!(
            prefetch(&[Op::Fault], Some(PrefetchChoice::Off))?,
            vec![false]
        );
        assert!(prefetch(&[Op::Write, Op::Read], None).is_ok());
        assert!(prefetch(&[Op::Read], Some(PrefetchChoice::On)).is_err());
        Ok(())
    }
}
