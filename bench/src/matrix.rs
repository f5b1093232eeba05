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

/// `--backing` (fault op only): what guest memory is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum BackingChoice {
    /// Private anonymous memory (the library's default): `UFFDIO_COPY`.
    Anon,
    /// A memfd (shared memory): pages received straight into the region's
    /// alias, mapped with `UFFDIO_CONTINUE`.
    Memfd,
    /// An `MFD_HUGETLB` memfd (hugetlbfs): a fault brings a whole 2 MiB
    /// huge page, mapped with `UFFDIO_CONTINUE`. Needs reserved huge pages
    /// (`/proc/sys/vm/nr_hugepages`).
    Hugetlbfs,
    /// Anon, then memfd (one run each, same cluster, same run; not
    /// hugetlbfs, which needs reserved huge pages).
    All,
}

/// What one fault or flush run's guest memory is made of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backing {
    Anon,
    Memfd,
    Hugetlbfs,
}

impl Backing {
    /// The name in the table and the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Backing::Anon => "anon",
            Backing::Memfd => "memfd",
            Backing::Hugetlbfs => "hugetlbfs",
        }
    }

    /// 4 KiB pages in the unit of dirty tracking and write-back.
    pub fn unit_pages(self) -> usize {
        match self {
            Backing::Anon | Backing::Memfd => 1,
            Backing::Hugetlbfs => 512,
        }
    }
}

/// The backings to run, in order: `--backing` if given, else anonymous
/// memory. Refuses `--backing` for the other ops, which map no guest memory.
pub fn backings(ops: &[Op], choice: Option<BackingChoice>) -> anyhow::Result<Vec<Backing>> {
    if choice.is_some() && ops.iter().any(|&op| op != Op::Fault) {
        bail!("--backing applies to --op fault only");
    }
    Ok(match choice.unwrap_or(BackingChoice::Anon) {
        BackingChoice::Anon => vec![Backing::Anon],
        BackingChoice::Memfd => vec![Backing::Memfd],
        BackingChoice::Hugetlbfs => vec![Backing::Hugetlbfs],
        BackingChoice::All => vec![Backing::Anon, Backing::Memfd],
    })
}

/// The address orders to run for `op`: `--pattern` if given; otherwise
/// random for reads and writes, and both for faults (random against
/// sequential is what prefetch is about).
pub fn patterns(op: Op, choice: Option<PatternChoice>) -> Vec<AccessPattern> {
    let choice = choice.unwrap_or(match op {
        Op::Fault => PatternChoice::All,
        Op::Read | Op::Write => PatternChoice::Random,
        // Its own cases, one order (coherence.rs).
        Op::Coherence => PatternChoice::Seq,
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
    fn backing_defaults_to_anon_and_only_for_faults() -> anyhow::Result<()> {
        assert_eq!(backings(&[Op::Fault], None)?, vec![Backing::Anon]);
        assert_eq!(
            backings(&[Op::Fault], Some(BackingChoice::All))?,
            vec![Backing::Anon, Backing::Memfd]
        );
        assert!(backings(&[Op::Read], Some(BackingChoice::Memfd)).is_err());
        Ok(())
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
