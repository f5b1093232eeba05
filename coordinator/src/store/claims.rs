//! What a claim of a range becomes when the coordinator has no replica row
//! for the claiming node: the range is new to it, or the node joins it.
//! Both backends apply these rules.
//!
//! Usually that is a new range (its first holder is `live`: zeros are its
//! contents) or a new replica (`stale`: it copies the range from a live
//! one). But a coordinator that lost its state (it started on an empty
//! database, or a new etcd-backed one replaced it) sees the running
//! page-servers claim their ranges again, in whatever order their
//! heartbeats come, beside page-servers that just started. Taken the usual
//! way, whichever claims a range first would be its live replica: a
//! page-server that just started (zeros) or one that had missed writes, and
//! the one that held the contents would copy those over its own.
//!
//! So each claim says what the claimer's memory holds of the range
//! ([`RangeContents`], from the last map it read), and:
//! - a range new to the coordinator is `live` for a claimer that holds it,
//!   `live` but unconfirmed for [`UNCONFIRMED_FOR_MS`] for a claimer that
//!   does not say (a new range, as far as anybody knows), and `stale` (the
//!   range `lost`: it serves nothing) for a claimer that missed writes;
//! - a claimer that holds the contents, joining a range whose live
//!   replicas are all still unconfirmed, becomes its live replica, and
//!   those replicas, and any recovering one (it copies from them), turn
//!   `stale`: they recover from it. Joining a range with no live replica
//!   at all (`lost`), it is live too.
//! - otherwise a joining claimer is `stale`, as before.
//!
//! Writes made to an unconfirmed replica before a holder's claim displaced
//! it are lost with it; the window is the time the running page-servers
//! take to claim again (about one heartbeat period after the coordinator is
//! back).

use rdma_transport::coordinator::api::RangeContents;

use super::effective::{StoredRange, StoredState};

/// How long a replica made live by a claim that did not say what it holds
/// gives way to a claimer that holds the range's contents. Page-servers
/// claim their ranges again about one heartbeat period (1 s by default,
/// below the lease) after a coordinator that forgot them is back.
pub(crate) const UNCONFIRMED_FOR_MS: u64 = 30_000;

/// The first replica of a range new to the coordinator, claimed at
/// `now_unix_ms`: its stored state, and until when it is unconfirmed (0:
/// confirmed).
pub(crate) fn first_replica(contents: RangeContents, now_unix_ms: u64) -> (StoredState, u64) {
    match contents {
        RangeContents::Held => (StoredState::Live, 0),
        RangeContents::Unknown => (
            StoredState::Live,
            now_unix_ms.saturating_add(UNCONFIRMED_FOR_MS),
        ),
        RangeContents::Missed => (StoredState::Stale, 0),
    }
}

/// What a claimer with no replica of `existing` joins it as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Joining {
    /// A stale replica: it copies the range from a live one.
    Stale,
    /// The live replica; the replicas named turn stale.
    Live { displaced: Vec<String> },
}

/// The rule above for a claim of `existing` at `now_unix_ms`.
pub(crate) fn joining(
    existing: &StoredRange,
    contents: RangeContents,
    now_unix_ms: u64,
) -> Joining {
    if contents != RangeContents::Held {
        return Joining::Stale;
    }
    let mut live = existing.replicas.iter().filter(|r| r.is_live());
    if !live.all(|r| r.unconfirmed_until_ms > now_unix_ms) {
        return Joining::Stale;
    }
    let displaced = existing
        .replicas
        .iter()
        .filter(|r| r.is_live() || r.is_recovering())
        .map(|r| r.node_id.clone())
        .collect();
    Joining::Live { displaced }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::effective::{RangeRow, StoredReplica};

    fn replica(node_id: &str, state: StoredState, unconfirmed_until_ms: u64) -> StoredReplica {
        StoredReplica {
            node_id: node_id.to_owned(),
            rank: 0,
            remote_offset: 0,
            valid_epoch: 7,
            state,
            recovery_seq: 0,
            node_epoch: 7,
            unconfirmed_until_ms,
        }
    }

    fn range(replicas: Vec<StoredReplica>) -> StoredRange {
        StoredRange {
            row: RangeRow {
                gpa_start: 0,
                length_bytes: 4096,
                rdma: None,
            },
            replicas,
        }
    }

    #[test]
    fn a_new_range_is_live_unless_its_claimer_missed_writes() {
        assert_eq!(
            first_replica(RangeContents::Held, 1000),
            (StoredState::Live, 0)
        );
        assert_eq!(
            first_replica(RangeContents::Unknown, 1000),
            (StoredState::Live, 1000 + UNCONFIRMED_FOR_MS)
        );
        assert_eq!(
            first_replica(RangeContents::Missed, 1000),
            (StoredState::Stale, 0)
        );
    }

    #[test]
    fn a_holder_displaces_unconfirmed_and_recovering_replicas_only_while_unconfirmed() {
        let fresh = range(vec![
            replica("b", StoredState::Live, 5000),
            replica("c", StoredState::Recovering, 0),
            replica("d", StoredState::Stale, 0),
        ]);
        assert_eq!(
            joining(&fresh, RangeContents::Held, 4999),
            Joining::Live {
                displaced: vec!["b".to_owned(), "c".to_owned()]
            }
        );
        assert_eq!(joining(&fresh, RangeContents::Held, 5000), Joining::Stale);
        for contents in [RangeContents::Unknown, RangeContents::Missed] {
            assert_eq!(joining(&fresh, contents, 0), Joining::Stale);
        }
    }

    #[test]
    fn a_holder_joins_a_confirmed_range_as_stale_and_a_lost_one_as_live() {
        let confirmed = range(vec![
            replica("b", StoredState::Live, 5000),
            replica("c", StoredState::Live, 0),
        ]);
        assert_eq!(joining(&confirmed, RangeContents::Held, 0), Joining::Stale);
        let lost = range(vec![replica("b", StoredState::Stale, 0)]);
        assert_eq!(
            joining(&lost, RangeContents::Held, 0),
            Joining::Live { displaced: vec![] }
        );
    }
}
