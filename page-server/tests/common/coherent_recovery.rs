//! A coherence node whose home runs a replica recovery of another of its
//! ranges keeps its connection, and so its copies and the pages it owns:
//! the recovery's fence closes every other connection opened before it,
//! but closing a node would declare it lost (the pages it owns and has not
//! written back become lost to every node, and it reads its copies a
//! round trip after the home gave them away). Run over TCP
//! (`tests/recovery.rs`) and over RDMA message channels in the SoftRoCE VM
//! (`tests/rdma_cluster/coherence.rs`).

use std::time::Duration;

use page_server::{ExportedRange, RunningServer, ServerConfig};
use rdma_transport::coherent::Mode;
use rdma_transport::coordinator::api::ReplicaState;
use rdma_transport::rdma::ChannelStats;
use rdma_transport::{TransportManager, PAGE_SIZE};

use super::coherent_copies::Node;
use super::{coordinator_client, page_for, page_server_with, range_states, wait_until, NODE_BYTES};

/// Where b's range of its own (the coherent pages) starts.
const OWN_GPA: u64 = 0x4000_0000;
const LIMIT: Duration = Duration::from_secs(60);

/// What the scenario saw, for the test's report.
pub struct Seen {
    /// b's recoveries of the replicated range (the first, as it joined,
    /// and the one the nodes lived through).
    pub recoveries: u64,
    /// Each node's connections to its homes right after the recovery
    /// (`CoherentNode::connections`: an RDMA channel's counters, or none).
    pub connections_after: Vec<Vec<(String, Option<ChannelStats>)>>,
    /// Coherence frames that came over RDMA channels to b in all.
    pub rdma_frames: u64,
}

/// Page-servers a and b replicate range 0; b also exports a range of its
/// own, whose pages two coherence nodes share (`manager` makes each node's
/// manager, on the coordinator at `url`; `configure` sets up each
/// page-server, e.g. for RDMA). Node x owns a page it changed and has not
/// written back, and both hold a shared copy of another. Then b's replica
/// is marked stale and b recovers it, fencing its connections. After the
/// recovery x still owns its page, whose contents y then reads (x writes
/// it back: not lost), and y still holds its shared copy, which x's next
/// write invalidates.
pub fn a_node_keeps_its_pages_through_a_recovery_on_its_home(
    url: &str,
    configure: impl Fn(ServerConfig) -> ServerConfig,
    manager: impl Fn() -> TransportManager,
) -> Seen {
    let server = |node: &str, ranges: Vec<ExportedRange>| -> RunningServer {
        let bytes = ranges.iter().map(|r| r.length_bytes as usize).sum();
        let mut cfg = ServerConfig::new(node, bytes);
        cfg.set_ranges(ranges);
        cfg.heartbeat_interval = Duration::from_millis(200);
        cfg.recovery_grace = Duration::from_millis(300);
        page_server_with(url, configure(cfg))
    };
    let replicated = ExportedRange::new(0, NODE_BYTES as u64);
    let admin = coordinator_client(url);
    let state_of_b = || {
        range_states(&admin, 0)
            .into_iter()
            .find(|(n, _)| n == "b")
            .map(|(_, s)| s)
    };
    let _a = server("a", vec![replicated]);
    let b = server(
        "b",
        vec![replicated, ExportedRange::new(OWN_GPA, NODE_BYTES as u64)],
    );
    // b joins stale and recovers first, before any node connects.
    assert!(
        wait_until(LIMIT, || state_of_b() == Some(ReplicaState::Live)
            && b.stats().recoveries == 1),
        "b never recovered as it joined: {:?}",
        state_of_b()
    );

    let x = Node::with_manager(manager(), 0);
    let y = Node::with_manager(manager(), 0);
    let (owned, shared) = (OWN_GPA + PAGE_SIZE as u64, OWN_GPA + 2 * PAGE_SIZE as u64);
    x.modify(owned, |p| *p = page_for(owned, 1))
        .expect("x writes");
    x.modify(shared, |p| *p = page_for(shared, 2))
        .expect("x writes");
    assert!(y.read(shared).expect("y reads") == page_for(shared, 2));

    admin
        .mark_replica_stale(0, "b", Duration::from_secs(5))
        .expect("b's replica marked stale");
    assert!(
        wait_until(LIMIT, || b.stats().recoveries == 2
            && state_of_b() == Some(ReplicaState::Live)),
        "b never recovered its replica again: {:?}, {} recoveries",
        state_of_b(),
        b.stats().recoveries
    );

    let connections_after = vec![x.c().connections(), y.c().connections()];
    assert!(
        x.copies.copy(owned) == Some((Mode::Exclusive, page_for(owned, 1))),
        "x lost the page it owns when its home recovered another range"
    );
    assert!(
        y.copies.copy(shared) == Some((Mode::Shared, page_for(shared, 2))),
        "y dropped its copy when its home recovered another range"
    );
    match y.read(owned) {
        Ok(page) => assert!(page == page_for(owned, 1), "not x's write"),
        Err(e) => panic!("the page x owned through the recovery is gone: {e}"),
    }
    x.modify(shared, |p| *p = page_for(shared, 3))
        .expect("x writes again");
    assert_eq!(y.copies.copy(shared), None, "y's copy was not invalidated");
    assert!(y.read(shared).expect("y reads") == page_for(shared, 3));
    assert_eq!(b.coherence_stats().home.pages_lost, 0);
    Seen {
        recoveries: b.stats().recoveries,
        connections_after,
        rdma_frames: b.coherence_stats().rdma_frames,
    }
}
