//! `GET /ready` on the metrics listener: whether this node serves every
//! range it exports. Ready once it is registered and its replica of each
//! range was live in the last map it read; not ready while a replica is
//! stale, recovering or lost (a restarted node before its recovery, a
//! single replica whose memory is gone). An operator restarting the
//! replicas of a range one after the other waits for the restarted one's
//! `/ready` before stopping the next: otherwise the range can lose its
//! last live replica. Without a coordinator there is nothing to wait for.

use std::fmt::Write;

use rdma_transport::coordinator::api::RangeContents;

use crate::held_ranges::HeldRange;

/// The answer: ready or not, and a line per fact behind it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Readiness {
    pub(crate) ready: bool,
    pub(crate) text: String,
}

/// Where this process stands with the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Standing {
    Registered,
    NotYet,
    /// Another process registered as this node after this one.
    Superseded,
    /// Registered, but serving nothing until the coordinator confirms this
    /// process (after a stall or a lease lapse: `self_fence.rs`).
    Fenced,
}

/// What the node knows: its `standing` (`None`: no coordinator), and each
/// exported range with what the last map said of this node's replica.
pub(crate) fn readiness(
    standing: Option<Standing>,
    ranges: impl Iterator<Item = (HeldRange, RangeContents)>,
) -> Readiness {
    let Some(standing) = standing else {
        return Readiness {
            ready: true,
            text: "ready: no coordinator\n".into(),
        };
    };
    let mut ready = standing == Standing::Registered;
    let mut lines = String::new();
    for (range, contents) in ranges {
        let state = match contents {
            RangeContents::Held => "live",
            RangeContents::Missed => "not live (stale, recovering or lost)",
            RangeContents::Unknown => "not in a map read yet",
        };
        ready &= contents == RangeContents::Held;
        let _ = writeln!(
            lines,
            "range {:#x} ({} bytes): {state}",
            range.gpa_start, range.length_bytes
        );
    }
    let verdict = if ready { "ready" } else { "not ready" };
    let registration = match standing {
        Standing::Registered => "registered with the coordinator",
        Standing::NotYet => "not registered with the coordinator yet",
        Standing::Superseded => {
            "superseded: another process registered as this node after this one; this one serves no more"
        }
        Standing::Fenced => {
            "fenced: serving nothing until the coordinator confirms this process (after a stall, or \
             no heartbeat answered within the lease fence)"
        }
    };
    let text = format!("{verdict}\n{registration}\n{lines}");
    Readiness { ready, text }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(i: u64) -> HeldRange {
        HeldRange {
            gpa_start: i << 20,
            length_bytes: 1 << 20,
        }
    }

    #[test]
    fn ready_only_when_registered_and_every_range_is_live() {
        let live = [
            (range(0), RangeContents::Held),
            (range(1), RangeContents::Held),
        ];
        let all = readiness(Some(Standing::Registered), live.into_iter());
        assert!(all.ready, "{}", all.text);
        assert_eq!(
            all.text,
            "ready\nregistered with the coordinator\n\
             range 0x0 (1048576 bytes): live\nrange 0x100000 (1048576 bytes): live\n"
        );
        for contents in [RangeContents::Missed, RangeContents::Unknown] {
            let one_not = [(range(0), RangeContents::Held), (range(1), contents)];
            let r = readiness(Some(Standing::Registered), one_not.into_iter());
            assert!(!r.ready, "{}", r.text);
            assert!(r.text.starts_with("not ready\n"), "{}", r.text);
        }
        let unregistered = readiness(Some(Standing::NotYet), live.into_iter());
        assert!(!unregistered.ready);
        assert!(unregistered.text.contains("not registered"));
        let replaced = readiness(Some(Standing::Superseded), live.into_iter());
        assert!(!replaced.ready);
        assert!(replaced.text.contains("superseded"), "{}", replaced.text);
        let fenced = readiness(Some(Standing::Fenced), live.into_iter());
        assert!(!fenced.ready);
        assert!(
            fenced.text.contains("fenced: serving nothing"),
            "{}",
            fenced.text
        );
        let alone = readiness(None, std::iter::empty());
        assert!(alone.ready, "{}", alone.text);
    }
}
