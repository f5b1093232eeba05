//! The locally cached GPA map: which node owns which guest-physical range.
//!
//! Built from the coordinator's `GET /v1/map` answer once, then looked up in
//! O(log n) by binary search on every page, with no HTTP call and no lock.

use crate::coordinator::api::{MapEntry, MapResponse, NodeInfo, RdmaRegion, ReplicaState};
use crate::page::is_page_aligned;

/// Where one GPA lives: one holder (replica) of its range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Index of the holder in [`GpaMap::nodes`].
    pub node_index: usize,
    /// Byte offset inside the holder's exported region.
    pub remote_offset: u64,
    /// RDMA access to the holder's region, when published.
    pub rdma: Option<RdmaRegion>,
    /// The holder epoch that holds the range's valid contents (0: not
    /// checked); see [`MapEntry::valid_epoch`].
    pub valid_epoch: u64,
    /// First address of the range (names it in replica state changes).
    pub range_start: u64,
    /// Index of this holder among the range's replicas.
    pub replica: usize,
    /// The replica's state.
    pub state: ReplicaState,
    /// The range has more than one holder.
    pub replicated: bool,
}

#[derive(Debug, Clone)]
struct Holder {
    node_index: usize,
    remote_offset: u64,
    valid_epoch: u64,
    state: ReplicaState,
}

#[derive(Debug, Clone)]
struct Range {
    gpa_start: u64,
    gpa_end: u64,
    rdma: Option<RdmaRegion>,
    /// Every replica, in the coordinator's order (the primary is the first
    /// that serves reads). Never empty.
    holders: Vec<Holder>,
}

impl Range {
    fn location(&self, gpa: u64, replica: usize) -> Option<Location> {
        let h = self.holders.get(replica)?;
        // `from_response` keeps only ranges whose remote end fits in a u64,
        // so this cannot overflow; checked anyway rather than trusted.
        let remote_offset = h.remote_offset.checked_add(gpa - self.gpa_start)?;
        Some(Location {
            node_index: h.node_index,
            remote_offset,
            rdma: self.rdma,
            valid_epoch: h.valid_epoch,
            range_start: self.gpa_start,
            replica,
            state: h.state,
            replicated: self.holders.len() > 1,
        })
    }
}

/// An immutable snapshot of the map at one version.
#[derive(Debug, Clone, Default)]
pub struct GpaMap {
    version: u64,
    /// The coordinator state `version` counts in (0: not said).
    generation: u64,
    ranges: Vec<Range>,
    nodes: Vec<NodeInfo>,
}

impl GpaMap {
    /// Builds a snapshot from the coordinator's answer. Entries that name an
    /// unknown node, overflow, or overlap an earlier entry are dropped with a
    /// warning rather than trusted.
    pub fn from_response(resp: MapResponse) -> Self {
        let MapResponse {
            version,
            generation,
            mut entries,
            nodes,
        } = resp;
        entries.sort_by_key(|e| e.gpa_start);
        let mut ranges: Vec<Range> = Vec::with_capacity(entries.len());
        for MapEntry {
            gpa_start,
            length_bytes,
            node_id,
            remote_offset,
            rdma,
            valid_epoch,
            state: _,
            replicas,
        } in entries
        {
            // An older coordinator names one holder, at the top level; its
            // state is left to the epoch check.
            let replicas = if replicas.is_empty() {
                vec![crate::coordinator::api::Replica {
                    node_id,
                    remote_offset,
                    valid_epoch,
                    state: ReplicaState::Live,
                    recovery_seq: 0,
                }]
            } else {
                replicas
            };
            let Some(gpa_end) = gpa_start
                .checked_add(length_bytes)
                .filter(|_| length_bytes > 0)
            else {
                tracing::warn!(
                    gpa_start,
                    length_bytes,
                    "map entry has a bad length; ignored"
                );
                continue;
            };
            if !is_page_aligned(gpa_start) || !is_page_aligned(length_bytes) {
                tracing::warn!(
                    gpa_start,
                    length_bytes,
                    "map entry is not 4 KiB aligned; ignored"
                );
                continue;
            }
            if ranges.last().is_some_and(|prev| prev.gpa_end > gpa_start) {
                tracing::warn!(gpa_start, "map entry overlaps the previous one; ignored");
                continue;
            }
            let mut holders = Vec::with_capacity(replicas.len());
            for replica in replicas {
                let Some(node_index) = nodes.iter().position(|n| n.id == replica.node_id) else {
                    tracing::warn!(gpa_start, node_id = %replica.node_id, "map entry names an unknown node; replica ignored");
                    continue;
                };
                // Every page of the range must have a representable remote
                // offset: `lookup` then adds without overflow.
                if replica.remote_offset.checked_add(length_bytes).is_none()
                    || !is_page_aligned(replica.remote_offset)
                {
                    tracing::warn!(
                        gpa_start,
                        remote_offset = replica.remote_offset,
                        length_bytes,
                        "replica's remote offset is unaligned or overflows; replica ignored"
                    );
                    continue;
                }
                if holders.iter().any(|h: &Holder| h.node_index == node_index) {
                    tracing::warn!(gpa_start, node_id = %replica.node_id, "node named twice in one range; ignored");
                    continue;
                }
                holders.push(Holder {
                    node_index,
                    remote_offset: replica.remote_offset,
                    valid_epoch: replica.valid_epoch,
                    state: replica.state,
                });
            }
            if holders.is_empty() {
                tracing::warn!(gpa_start, "map entry has no usable holder; ignored");
                continue;
            }
            ranges.push(Range {
                gpa_start,
                gpa_end,
                rdma,
                holders,
            });
        }
        Self {
            version,
            generation,
            ranges,
            nodes,
        }
    }

    /// The coordinator's version of this snapshot.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The coordinator state [`GpaMap::version`] counts in
    /// (`MapResponse::generation`; 0: not said).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether this map replaces one at `generation` and `version`: it is
    /// newer, or of another generation (a coordinator that lost its state
    /// counts versions from 0 again; its maps are the current ones). A
    /// generation of 0 (not said: an older coordinator, a map made by hand)
    /// is compared by version only.
    pub fn supersedes(&self, generation: u64, version: u64) -> bool {
        other_generation(self.generation, generation) || self.version > version
    }

    /// Every node the map knows, indexed by [`Location::node_index`].
    pub fn nodes(&self) -> &[NodeInfo] {
        &self.nodes
    }

    /// Number of mapped ranges.
    pub fn len(&self) -> usize {
        self.ranges.len()
    }

    /// True when nothing is mapped.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Total mapped bytes.
    pub fn mapped_bytes(&self) -> u64 {
        self.ranges.iter().map(|r| r.gpa_end - r.gpa_start).sum()
    }

    /// Mapped ranges as `(gpa_start, length_bytes, primary node_id)`, sorted.
    pub fn ranges(&self) -> impl Iterator<Item = (u64, u64, &str)> + '_ {
        self.ranges.iter().map(|r| {
            let primary = r.primary().unwrap_or(0);
            (
                r.gpa_start,
                r.gpa_end - r.gpa_start,
                self.nodes[r.holders[primary].node_index].id.as_str(),
            )
        })
    }

    fn range_of(&self, gpa: u64) -> Option<&Range> {
        let idx = self.ranges.partition_point(|r| r.gpa_end <= gpa);
        self.ranges.get(idx).filter(|r| r.gpa_start <= gpa)
    }

    /// Where to read `gpa` from, in O(log n): the range's primary (its first
    /// replica that serves reads), or, when none does, its first replica
    /// (whose state then says why it cannot serve).
    pub fn lookup(&self, gpa: u64) -> Option<Location> {
        let r = self.range_of(gpa)?;
        r.location(gpa, r.primary().unwrap_or(0))
    }

    /// The `replica`-th holder of `gpa`'s range (0 to [`replica_count`](Self::replica_count) - 1).
    pub fn replica(&self, gpa: u64, replica: usize) -> Option<Location> {
        self.range_of(gpa)?.location(gpa, replica)
    }

    /// Every holder of `gpa`'s range, in rank order (none: unmapped), with
    /// one lookup of the range.
    pub fn replicas(&self, gpa: u64) -> impl Iterator<Item = Location> + Clone + '_ {
        let range = self.range_of(gpa);
        let count = range.map_or(0, |r| r.holders.len());
        (0..count).filter_map(move |i| range.and_then(|r| r.location(gpa, i)))
    }

    /// How many holders `gpa`'s range has (0: unmapped).
    pub fn replica_count(&self, gpa: u64) -> usize {
        self.range_of(gpa).map_or(0, |r| r.holders.len())
    }

    /// The holder of `gpa`'s range on the node named `node_id`.
    pub fn replica_on(&self, gpa: u64, node_id: &str) -> Option<Location> {
        let r = self.range_of(gpa)?;
        let i = r.holders.iter().position(|h| {
            self.nodes
                .get(h.node_index)
                .is_some_and(|n| n.id == node_id)
        })?;
        r.location(gpa, i)
    }

    /// A copy of this map at `version` in which `node_id`'s replica of the
    /// range starting at `range_start` is in `state` (a change the
    /// coordinator confirmed at `version`, applied before the next refresh).
    pub fn with_replica_state(
        &self,
        range_start: u64,
        node_id: &str,
        state: ReplicaState,
        version: u64,
    ) -> Self {
        let mut map = self.clone();
        map.version = map.version.max(version);
        let node_index = map.nodes.iter().position(|n| n.id == node_id);
        if let Some(r) = map.ranges.iter_mut().find(|r| r.gpa_start == range_start) {
            for h in &mut r.holders {
                if Some(h.node_index) == node_index {
                    h.state = state;
                }
            }
        }
        map
    }
}

/// Whether versions of generations `a` and `b` are not comparable: both
/// are said (not 0) and they differ (`MapResponse::generation`).
pub(crate) fn other_generation(a: u64, b: u64) -> bool {
    a != 0 && b != 0 && a != b
}

impl Range {
    /// Index of the first holder that serves reads.
    fn primary(&self) -> Option<usize> {
        self.holders.iter().position(|h| h.state.serves_reads())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str) -> NodeInfo {
        NodeInfo {
            id: id.into(),
            tcp_addr: "127.0.0.1:1".into(),
            rdma: None,
            alive: true,
            last_seen_ms_ago: 0,
            epoch: 0,
        }
    }

    fn entry(start: u64, len: u64, node: &str, off: u64) -> MapEntry {
        MapEntry {
            gpa_start: start,
            length_bytes: len,
            node_id: node.into(),
            remote_offset: off,
            rdma: None,
            valid_epoch: 0,
            replicas: Vec::new(),
            state: crate::coordinator::api::RangeState::Live,
        }
    }

    fn map() -> GpaMap {
        GpaMap::from_response(MapResponse {
            version: 3,
            generation: 0,
            entries: vec![
                entry(0x10_0000, 0x1000 * 4, "b", 0x8000),
                entry(0, 0x1000 * 16, "a", 0),
            ],
            nodes: vec![node("a"), node("b")],
        })
    }

    #[test]
    fn lookup_finds_owner_and_offset() {
        let m = map();
        assert_eq!(m.version(), 3);
        assert_eq!(
            m.lookup(0).map(|l| (l.node_index, l.remote_offset)),
            Some((0, 0))
        );
        assert_eq!(
            m.lookup(0xffff).map(|l| (l.node_index, l.remote_offset)),
            Some((0, 0xffff))
        );
        assert_eq!(
            m.lookup(0x10_0000).map(|l| (l.node_index, l.remote_offset)),
            Some((1, 0x8000))
        );
        assert_eq!(
            m.lookup(0x10_3fff).map(|l| (l.node_index, l.remote_offset)),
            Some((1, 0xbfff))
        );
        assert_eq!(m.mapped_bytes(), 20 * 0x1000);
    }

    #[test]
    fn lookup_carries_the_valid_epoch() {
        let mut entry = entry(0, 0x2000, "a", 0);
        entry.valid_epoch = 0x77;
        let m = GpaMap::from_response(MapResponse {
            version: 1,
            generation: 0,
            entries: vec![entry],
            nodes: vec![node("a")],
        });
        assert_eq!(m.lookup(0x1000).map(|l| l.valid_epoch), Some(0x77));
    }

    #[test]
    fn reads_go_to_the_first_live_replica_writes_to_live_and_recovering() {
        use crate::coordinator::api::Replica;
        let replica = |node: &str, off: u64, state| Replica {
            node_id: node.into(),
            remote_offset: off,
            valid_epoch: 1,
            state,
            recovery_seq: 0,
        };
        let mut e = entry(0, 0x4000, "a", 0);
        e.replicas = vec![
            replica("a", 0, ReplicaState::Stale),
            replica("b", 0x10_000, ReplicaState::Live),
            replica("c", 0x20_000, ReplicaState::Recovering),
        ];
        let m = GpaMap::from_response(MapResponse {
            version: 5,
            generation: 0,
            entries: vec![e],
            nodes: vec![node("a"), node("b"), node("c")],
        });
        let primary = m.lookup(0x1000).unwrap();
        assert_eq!((primary.node_index, primary.remote_offset), (1, 0x11_000));
        assert!(primary.replicated && primary.state.serves_reads());
        assert_eq!(m.replica_count(0x1000), 3);
        let takers: Vec<usize> = (0..3)
            .filter_map(|r| m.replica(0x1000, r))
            .filter(|l| l.state.takes_writes())
            .map(|l| l.node_index)
            .collect();
        assert_eq!(takers, vec![1, 2]);
        assert_eq!(
            m.replica_on(0x2000, "c").map(|l| l.remote_offset),
            Some(0x22_000)
        );
        assert_eq!(m.ranges().next().map(|r| r.2), Some("b"));
        // b marked stale: no replica serves reads; the first is reported.
        let m = m.with_replica_state(0, "b", ReplicaState::Stale, 9);
        assert_eq!(m.version(), 9);
        let first = m.lookup(0).unwrap();
        assert_eq!(first.node_index, 0);
        assert!(!first.state.serves_reads());
    }

    #[test]
    fn holes_and_ends_miss() {
        let m = map();
        for gpa in [0x1_0000, 0x5_0000, 0xf_ffff, 0x10_4000, u64::MAX] {
            assert_eq!(m.lookup(gpa), None, "{gpa:#x}");
        }
        assert_eq!(GpaMap::default().lookup(0), None);
    }

    #[test]
    fn bad_entries_are_dropped() {
        let m = GpaMap::from_response(MapResponse {
            version: 1,
            generation: 0,
            entries: vec![
                entry(0, 0x2000, "a", 0),
                entry(0x1000, 0x2000, "a", 0),        // overlaps
                entry(0x9000, 0x1000, "ghost", 0),    // unknown node
                entry(u64::MAX - 10, 0x1000, "a", 0), // overflows
                entry(0x5000, 0, "a", 0),             // empty
                entry(0x10_0000, 0x2000, "a", u64::MAX - 0xfff), // remote end overflows
                entry(0x20_0000, 0x2000, "a", 0x10),  // unaligned offset
                entry(0x30_0800, 0x1000, "a", 0),     // unaligned start
                entry(0x40_0000, 0x1800, "a", 0),     // unaligned length
            ],
            nodes: vec![node("a")],
        });
        assert_eq!(m.len(), 1);
        assert!(m.lookup(0x2000).is_none());
        for gpa in [0x10_0000, 0x10_1000, 0x20_0000, 0x30_0000, 0x40_0000] {
            assert_eq!(m.lookup(gpa), None, "{gpa:#x}");
        }
    }

    #[test]
    fn many_ranges_lookup_matches_linear_scan() {
        let entries: Vec<_> = (0..1000u64)
            .map(|i| entry(i * 0x3000, 0x2000, "a", i * 0x2000))
            .collect();
        let m = GpaMap::from_response(MapResponse {
            version: 1,
            generation: 0,
            entries,
            nodes: vec![node("a")],
        });
        for gpa in (0..3000u64 * 0x1000).step_by(0x800) {
            let linear = (gpa % 0x3000 < 0x2000).then(|| (gpa / 0x3000) * 0x2000 + gpa % 0x3000);
            assert_eq!(m.lookup(gpa).map(|l| l.remote_offset), linear, "{gpa:#x}");
        }
    }
}
