//! One page's coherence home (the `coherence` crate's `HomePage`, what the
//! page-server runs per page) fed any sequence of node messages and node
//! losses, in or out of protocol (late, repeated, from nodes never asked,
//! with made-up sequence numbers and versions): it never panics, its
//! versions never go back, and every message it sends is addressed to a
//! node that has spoken to it, and so is every queue place it keeps.
//!
//! Each step is 12 bytes: node (low 2 bits of byte 0), what (byte 1), and
//! a value (bytes 2..10) and a request id (bytes 10..12).

#![no_main]

use coherence::{HomeAction, HomeConfig, HomePage, HomeStats, NodeId, NodeSet};
use libfuzzer_sys::fuzz_target;
use rdma_transport_fuzz::to_home;

fuzz_target!(|input: &[u8]| {
    let mut home = HomePage::new(HomeConfig::new(
        1 + usize::from(input.first().copied().unwrap_or(0) % 8),
    ));
    let mut stats = HomeStats::default();
    let mut spoken = NodeSet::EMPTY;
    let (mut version, mut stored) = (home.version(), home.stored_version());
    for step in input.chunks_exact(12) {
        let node = NodeId::new(step[0] & 3).expect("a node id below 64");
        let value = u64::from_le_bytes(step[2..10].try_into().expect("8 bytes"));
        // Small values reach the home's current sequence numbers and
        // versions; any other value is as likely on the wire.
        let value = if step[0] & 4 != 0 { value % 8 } else { value };
        let req = u32::from(u16::from_le_bytes([step[10], step[11]]));
        let msg = match step[1] % 7 {
            kind @ 0..=4 => to_home(kind, req, value, step[0] & 8 != 0, step[0] & 16 != 0),
            _ => {
                let _ = home.on_node_lost(node, &mut stats);
                spoken = spoken.without(node);
                if step[1] % 7 == 6 {
                    let _ = home.clear_lost();
                }
                continue;
            }
        };
        spoken = spoken.with(node);
        let actions = home.on_message(node, msg, &mut stats);
        for action in actions.iter() {
            let to = match action {
                HomeAction::Send { to, .. } => NodeSet::one(to),
                HomeAction::SendAll { to, .. } => to,
            };
            assert!(
                to.iter().all(|n| spoken.contains(n)),
                "{action:?} goes to a node that never spoke or was lost"
            );
        }
        assert!(home.version() >= version, "the version went back");
        assert!(
            home.stored_version() >= stored,
            "the stored version went back"
        );
        assert!(
            home.turned_away().iter().all(|n| spoken.contains(n)),
            "a queue place kept for a node that never spoke or was lost"
        );
        (version, stored) = (home.version(), home.stored_version());
    }
});
