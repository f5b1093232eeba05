//! `--replicas R`: how the local cluster's page-servers form replica groups,
//! the checks on the failure flags, and the wait until every replica of
//! every range is live.

use std::time::{Duration, Instant};

use anyhow::bail;
use rdma_transport::coordinator::api::{MapResponse, ReplicaState};
use rdma_transport::coordinator::CoordinatorClient;
use rdma_transport::PAGE_SIZE;

/// The coordinator's limit on holders of one range.
pub const MAX_REPLICAS: usize = 3;

/// How long [`wait_all_live`] waits by default: a joining replica waits a
/// grace period (2.5 s by default) and then copies its range.
pub const LIVE_TIMEOUT: Duration = Duration::from_secs(60);

/// One page-server of the local cluster: its id and the range it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub node_id: String,
    pub gpa_base: u64,
    pub length_bytes: usize,
}

/// Places `nodes` page-servers in groups of `replicas` consecutive nodes;
/// each group holds one range (the same `gpa_base` and length on each of
/// its members), and the groups' ranges split `memory_bytes` evenly from
/// GPA 0, each rounded up to whole pages. Node `g * replicas` registers
/// first in its group, so it is the group's primary.
///
/// # Errors
/// When `replicas` is not in `1..=MAX_REPLICAS` or does not divide `nodes`.
pub fn layout(
    nodes: usize,
    replicas: usize,
    memory_bytes: usize,
) -> Result<Vec<Placement>, String> {
    if !(1..=MAX_REPLICAS).contains(&replicas) {
        return Err(format!(
            "--replicas must be 1 to {MAX_REPLICAS} (the coordinator's limit), got {replicas}"
        ));
    }
    if nodes == 0 || nodes % replicas != 0 {
        return Err(format!(
            "--nodes ({nodes}) must be a positive multiple of --replicas ({replicas}): \
             each group of {replicas} page-servers holds one range"
        ));
    }
    let groups = nodes / replicas;
    let per_group = (memory_bytes / groups).div_ceil(PAGE_SIZE) * PAGE_SIZE;
    if per_group == 0 {
        return Err("--memory must hold at least one page per replica group".into());
    }
    Ok((0..nodes)
        .map(|i| Placement {
            node_id: format!("node-{i}"),
            gpa_base: ((i / replicas) * per_group) as u64,
            length_bytes: per_group,
        })
        .collect())
}

/// Checks the failure flags against the rest: a failure needs the local
/// cluster (the bench stops one of its page-servers), read or write runs,
/// and a second replica unless errors are accepted.
///
/// # Errors
/// A message a user can act on.
pub fn check_failure_flags(
    fail_after_ms: Option<u64>,
    replicas: usize,
    accept_errors: bool,
    local_cluster: bool,
    fault_op: bool,
) -> Result<(), String> {
    let Some(after_ms) = fail_after_ms else {
        return Ok(());
    };
    if !local_cluster {
        return Err(
            "--fail-node-after-ms needs the local cluster (it stops one of its page-servers)"
                .into(),
        );
    }
    if fault_op {
        return Err("--fail-node-after-ms applies to --op read and write".into());
    }
    if after_ms == 0 {
        return Err("--fail-node-after-ms must be at least 1".into());
    }
    if replicas < 2 && !accept_errors {
        return Err(
            "--fail-node-after-ms with --replicas 1 loses the failed node's range: \
             use --replicas 2 or more, or add --accept-errors to count the failures"
                .into(),
        );
    }
    Ok(())
}

/// Every replica of `map` that is not live, as `gpa:node=state`, and every
/// range with fewer than `replicas` holders. Empty when all is live.
pub fn not_live(map: &MapResponse, replicas: usize) -> Vec<String> {
    let mut pending = Vec::new();
    for e in &map.entries {
        // Older coordinators list no replicas: the one holder is named by
        // the entry (and serves while the range is live).
        if e.replicas.is_empty() {
            if replicas > 1 {
                pending.push(format!(
                    "{:#x}: 1 of {replicas} replicas (the coordinator lists none)",
                    e.gpa_start
                ));
            }
            continue;
        }
        if e.replicas.len() < replicas {
            pending.push(format!(
                "{:#x}: {} of {replicas} replicas registered",
                e.gpa_start,
                e.replicas.len()
            ));
        }
        for r in &e.replicas {
            if r.state != ReplicaState::Live {
                pending.push(format!("{:#x}:{}={:?}", e.gpa_start, r.node_id, r.state));
            }
        }
    }
    pending
}

/// The first live replica of the first range (the primary every read goes
/// to first), or the entry's owner when the coordinator lists no replicas.
pub fn first_primary(map: &MapResponse) -> Option<String> {
    let first = map.entries.first()?;
    first
        .replicas
        .iter()
        .find(|r| r.state == ReplicaState::Live)
        .map(|r| r.node_id.clone())
        .or_else(|| Some(first.node_id.clone()))
}

/// Polls the coordinator's map until every range has `replicas` holders,
/// all live, and `ranges` ranges are mapped; returns that map.
///
/// # Errors
/// When `timeout` runs out (naming what is not live yet), or the map
/// cannot be read at the deadline.
pub fn wait_all_live(
    client: &CoordinatorClient,
    ranges: usize,
    replicas: usize,
    timeout: Duration,
) -> anyhow::Result<MapResponse> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = match client.map() {
            Ok(map) => {
                let mut pending = not_live(&map, replicas);
                if map.entries.len() < ranges {
                    pending.push(format!("{} of {ranges} ranges mapped", map.entries.len()));
                }
                if pending.is_empty() {
                    return Ok(map);
                }
                pending.join(", ")
            }
            Err(err) => format!("reading the map: {err}"),
        };
        if Instant::now() >= deadline {
            bail!(
                "not every replica is live after {} s (is the coordinator's and the \
                 page-servers' replica support in this build?): {last}",
                timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_transport::coordinator::api::{MapEntry, RangeState, Replica};

    #[test]
    fn nodes_form_groups_of_r_that_share_one_range() {
        let l = layout(4, 2, 8 * PAGE_SIZE).unwrap();
        let bases: Vec<u64> = l.iter().map(|p| p.gpa_base).collect();
        let half = (4 * PAGE_SIZE) as u64;
        assert_eq!(bases, vec![0, 0, half, half]);
        assert!(l.iter().all(|p| p.length_bytes == 4 * PAGE_SIZE));
        assert_eq!(l[3].node_id, "node-3");
        let one = layout(2, 1, 8 * PAGE_SIZE).unwrap();
        assert_eq!(one[1].gpa_base, half, "R=1 is the old contiguous split");
        let three = layout(3, 3, 5 * PAGE_SIZE + 1).unwrap();
        assert!(three
            .iter()
            .all(|p| p.gpa_base == 0 && p.length_bytes == 6 * PAGE_SIZE));
    }

    #[test]
    fn bad_groupings_are_refused_with_a_reason() {
        let err = layout(3, 2, 1 << 20).unwrap_err();
        assert!(err.contains("multiple of --replicas"), "{err}");
        assert!(layout(4, 4, 1 << 20).unwrap_err().contains("1 to 3"));
        assert!(layout(2, 0, 1 << 20).is_err());
        assert!(layout(2, 2, 0).is_err());
    }

    #[test]
    fn failure_flags_need_a_second_replica_or_accepted_errors() {
        assert!(check_failure_flags(None, 1, false, false, true).is_ok());
        assert!(check_failure_flags(Some(100), 2, false, true, false).is_ok());
        let err = check_failure_flags(Some(100), 1, false, true, false).unwrap_err();
        assert!(err.contains("--accept-errors"), "{err}");
        assert!(check_failure_flags(Some(100), 1, true, true, false).is_ok());
        assert!(check_failure_flags(Some(100), 2, false, false, false).is_err());
        assert!(check_failure_flags(Some(100), 2, false, true, true).is_err());
        assert!(check_failure_flags(Some(0), 2, false, true, false).is_err());
    }

    fn replica(node: &str, state: ReplicaState) -> Replica {
        Replica {
            node_id: node.into(),
            remote_offset: 0,
            valid_epoch: 1,
            state,
            recovery_seq: 0,
        }
    }

    fn map(replicas: Vec<Replica>) -> MapResponse {
        MapResponse {
            version: 1,
            entries: vec![MapEntry {
                gpa_start: 0,
                length_bytes: PAGE_SIZE as u64,
                node_id: replicas
                    .first()
                    .map_or("node-0".into(), |r| r.node_id.clone()),
                remote_offset: 0,
                rdma: None,
                valid_epoch: 1,
                state: RangeState::Live,
                replicas,
            }],
            nodes: Vec::new(),
        }
    }

    #[test]
    fn only_a_map_with_every_replica_live_is_ready() {
        let ready = map(vec![
            replica("node-0", ReplicaState::Live),
            replica("node-1", ReplicaState::Live),
        ]);
        assert!(not_live(&ready, 2).is_empty());
        assert_eq!(first_primary(&ready).as_deref(), Some("node-0"));
        let joining = map(vec![
            replica("node-0", ReplicaState::Live),
            replica("node-1", ReplicaState::Stale),
        ]);
        assert_eq!(not_live(&joining, 2), vec!["0x0:node-1=Stale".to_owned()]);
        let short = map(vec![replica("node-0", ReplicaState::Live)]);
        assert_eq!(not_live(&short, 2).len(), 1);
        assert!(
            not_live(&map(Vec::new()), 1).is_empty(),
            "older coordinator, R=1"
        );
        assert_eq!(not_live(&map(Vec::new()), 2).len(), 1);
        let failed_over = map(vec![
            replica("node-0", ReplicaState::Stale),
            replica("node-1", ReplicaState::Live),
        ]);
        assert_eq!(first_primary(&failed_over).as_deref(), Some("node-1"));
    }
}
