//! `--replicas R`: how the local cluster's page-servers hold the ranges,
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

/// One page-server of the local cluster: its id and the ranges it holds
/// (`(gpa_base, length_bytes)`, in the order it lays them out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub node_id: String,
    pub ranges: Vec<(u64, usize)>,
}

impl Placement {
    /// The bytes this page-server exports.
    pub fn memory_bytes(&self) -> usize {
        self.ranges.iter().map(|&(_, len)| len).sum()
    }
}

/// How many distinct ranges `placements` map.
pub fn range_count(placements: &[Placement]) -> usize {
    let mut bases: Vec<u64> = placements
        .iter()
        .flat_map(|p| p.ranges.iter().map(|&(base, _)| base))
        .collect();
    bases.sort_unstable();
    bases.dedup();
    bases.len()
}

/// Places `nodes` page-servers so that each range is held by `replicas`
/// of them; the ranges split `memory_bytes` evenly from GPA 0, each
/// rounded up to whole pages.
///
/// - When `replicas` divides `nodes`: groups of `replicas` consecutive
///   nodes, each group holding one range. Node `g * replicas` registers
///   first in its group, so it is the group's primary.
/// - Otherwise (e.g. 3 nodes, 2 replicas): as many ranges as nodes, range
///   `i` on nodes `i, i+1, ..., i+replicas-1` (mod `nodes`), so every node
///   holds `replicas` ranges and losing any one node leaves every range a
///   replica. Nodes register in order, so node `i` is the primary of range
///   `i`, and node 0 also of the last ranges that wrap around.
///
/// # Errors
/// When `replicas` is not in `1..=MAX_REPLICAS`, `nodes` is smaller than
/// `replicas`, or the memory holds less than a page per range.
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
    if nodes < replicas {
        return Err(format!(
            "--nodes ({nodes}) must be at least --replicas ({replicas}): each range is held by \
             {replicas} page-servers"
        ));
    }
    let grouped = nodes % replicas == 0;
    let ranges = if grouped { nodes / replicas } else { nodes };
    let per_range = (memory_bytes / ranges).div_ceil(PAGE_SIZE) * PAGE_SIZE;
    if per_range == 0 {
        return Err("--memory must hold at least one page per range".into());
    }
    let base = |range: usize| (range * per_range) as u64;
    Ok((0..nodes)
        .map(|i| Placement {
            node_id: format!("node-{i}"),
            ranges: if grouped {
                vec![(base(i / replicas), per_range)]
            } else {
                // The ranges whose rotation includes node i: i, i-1, ...
                (0..replicas)
                    .map(|k| (base((i + nodes - k) % nodes), per_range))
                    .collect()
            },
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
        let half = (4 * PAGE_SIZE) as u64;
        let ranges: Vec<_> = l.iter().map(|p| p.ranges.clone()).collect();
        let r = |base| vec![(base, 4 * PAGE_SIZE)];
        assert_eq!(ranges, vec![r(0), r(0), r(half), r(half)]);
        assert_eq!(l[3].node_id, "node-3");
        assert_eq!(range_count(&l), 2);
        let one = layout(2, 1, 8 * PAGE_SIZE).unwrap();
        assert_eq!(one[1].ranges, r(half), "R=1 is the old contiguous split");
        let three = layout(3, 3, 5 * PAGE_SIZE + 1).unwrap();
        assert!(three.iter().all(|p| p.ranges == vec![(0, 6 * PAGE_SIZE)]));
    }

    #[test]
    fn otherwise_each_range_rotates_over_r_nodes() {
        let l = layout(3, 2, 6 * PAGE_SIZE).unwrap();
        let len = 2 * PAGE_SIZE;
        let (a, b, c) = (0u64, len as u64, 2 * len as u64);
        // Range i on nodes i and i+1 (mod 3).
        assert_eq!(l[0].ranges, vec![(a, len), (c, len)]);
        assert_eq!(l[1].ranges, vec![(b, len), (a, len)]);
        assert_eq!(l[2].ranges, vec![(c, len), (b, len)]);
        assert_eq!(range_count(&l), 3);
        assert!(l.iter().all(|p| p.memory_bytes() == 2 * len));
        for range in [a, b, c] {
            let holders = l
                .iter()
                .filter(|p| p.ranges.iter().any(|&(g, _)| g == range))
                .count();
            assert_eq!(holders, 2, "range {range:#x}");
        }
    }

    #[test]
    fn bad_layouts_are_refused_with_a_reason() {
        let err = layout(1, 2, 1 << 20).unwrap_err();
        assert!(err.contains("at least --replicas"), "{err}");
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
            generation: 0,
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
