use super::id;
use crate::home::{Directory, HomeAction, HomeActions, HomeConfig, HomePage, HomeStats};
use crate::messages::{Mode, NodeSet, ToHome, ToNode};

fn sent(actions: HomeActions) -> Vec<(NodeSet, ToNode)> {
    actions
        .iter()
        .map(|a| match a {
            HomeAction::Send { to, msg } => (NodeSet::one(to), msg),
            HomeAction::SendAll { to, msg } => (to, msg),
        })
        .collect()
}

fn read(req: u32) -> ToHome {
    ToHome::ReadReq { req }
}

fn write(req: u32, upgrade: bool) -> ToHome {
    ToHome::WriteReq { req, upgrade }
}

fn grant(req: u32, seq: u64, mode: Mode, version: u64, data_version: u64) -> ToNode {
    ToNode::Grant {
        req,
        seq,
        mode,
        version,
        data_version,
    }
}

/// A page shared by nodes 1 and 2 (seq 2 used).
fn shared_by_1_and_2(stats: &mut HomeStats) -> HomePage {
    let mut home = HomePage::new(HomeConfig::default());
    home.on_message(id(1), read(1), stats);
    home.on_message(id(2), read(1), stats);
    assert_eq!(
        home.directory(),
        Directory::Shared(NodeSet::one(id(1)).with(id(2)))
    );
    home
}

/// A page owned by node 1 (granted at seq 1, version 1).
fn owned_by_1(stats: &mut HomeStats) -> HomePage {
    let mut home = HomePage::new(HomeConfig::default());
    let out = home.on_message(id(1), write(1, false), stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(1)), grant(1, 1, Mode::Exclusive, 1, 0))]
    );
    home
}

#[test]
fn reads_of_an_invalid_page_are_granted_shared_at_once() {
    let mut stats = HomeStats::default();
    let mut home = HomePage::new(HomeConfig::default());
    let out = home.on_message(id(1), read(7), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(1)), grant(7, 1, Mode::Shared, 0, 0))]
    );
    let out = home.on_message(id(2), read(3), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(2)), grant(3, 2, Mode::Shared, 0, 0))]
    );
    assert_eq!(stats.shared_grants, 2);
    assert!(!home.is_busy());
}

#[test]
fn a_write_invalidates_every_other_holder_and_is_granted_after_the_last_ack() {
    let mut stats = HomeStats::default();
    let mut home = shared_by_1_and_2(&mut stats);
    let out = home.on_message(id(3), write(1, false), &mut stats);
    let holders = NodeSet::one(id(1)).with(id(2));
    assert_eq!(
        sent(out),
        vec![(
            holders,
            ToNode::Invalidate {
                seq: 3,
                grant: None
            }
        )]
    );
    assert_eq!(home.awaiting(), holders);
    let ack = |seq| ToHome::InvalidateAck {
        seq,
        written_back: None,
    };
    assert!(home.on_message(id(1), ack(3), &mut stats).is_empty());
    assert_eq!(home.directory(), Directory::Shared(NodeSet::one(id(2))));
    let out = home.on_message(id(2), ack(3), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(3)), grant(1, 4, Mode::Exclusive, 1, 0))]
    );
    assert_eq!(
        home.directory(),
        Directory::Modified {
            owner: id(3),
            grant: 4
        }
    );
    assert_eq!(stats.invalidations_sent, 2);
}

#[test]
fn the_only_holder_upgrades_without_callbacks() {
    let mut stats = HomeStats::default();
    let mut home = HomePage::new(HomeConfig::default());
    home.on_message(id(1), read(1), &mut stats);
    let out = home.on_message(id(1), write(2, true), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(1)), grant(2, 2, Mode::Exclusive, 1, 0))]
    );
    assert_eq!(stats.upgrades, 1);
    assert_eq!(stats.invalidation_rounds, 0);
}

#[test]
fn a_read_of_a_modified_page_downgrades_the_owner_and_gets_its_write_back() {
    let mut stats = HomeStats::default();
    let mut home = owned_by_1(&mut stats);
    let out = home.on_message(id(2), read(1), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(1)), ToNode::Downgrade { seq: 2, grant: 1 })]
    );
    let out = home.on_message(
        id(1),
        ToHome::DowngradeAck {
            seq: 2,
            written_back: Some(1),
            kept: true,
        },
        &mut stats,
    );
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(2)), grant(1, 3, Mode::Shared, 1, 1))]
    );
    assert_eq!(home.stored_version(), 1);
    assert_eq!(
        home.directory(),
        Directory::Shared(NodeSet::one(id(1)).with(id(2)))
    );
}

#[test]
fn requests_during_a_transaction_are_queued_then_retried_when_the_queue_is_full() {
    let mut stats = HomeStats::default();
    let mut home = HomePage::new(HomeConfig::new(1));
    home.on_message(id(1), write(1, false), &mut stats);
    home.on_message(id(2), read(1), &mut stats); // downgrade of 1 in progress
    assert!(home.is_busy());
    assert!(home.on_message(id(3), read(1), &mut stats).is_empty());
    assert_eq!(home.queued(), 1);
    let out = home.on_message(id(4), read(9), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(4)), ToNode::Retry { req: 9 })]
    );
    // The same request again while it is served: ignored.
    assert!(home.on_message(id(2), read(1), &mut stats).is_empty());
    assert_eq!(stats.duplicate_requests, 1);
    // The owner's ack serves the reader, then the queued reader.
    let out = home.on_message(
        id(1),
        ToHome::DowngradeAck {
            seq: 2,
            written_back: Some(1),
            kept: false,
        },
        &mut stats,
    );
    assert_eq!(
        sent(out),
        vec![
            (NodeSet::one(id(2)), grant(1, 3, Mode::Shared, 1, 1)),
            (NodeSet::one(id(3)), grant(1, 4, Mode::Shared, 1, 1)),
        ]
    );
    assert_eq!(home.queued(), 0);
    assert!(!home.is_busy());
    assert_eq!((stats.queued, stats.retries), (1, 1));
}

#[test]
fn stale_acknowledgements_are_ignored_and_counted() {
    let mut stats = HomeStats::default();
    let mut home = shared_by_1_and_2(&mut stats);
    home.on_message(id(3), write(1, false), &mut stats);
    let wrong_seq = ToHome::InvalidateAck {
        seq: 1,
        written_back: None,
    };
    assert!(home.on_message(id(1), wrong_seq, &mut stats).is_empty());
    let not_asked = ToHome::InvalidateAck {
        seq: 3,
        written_back: None,
    };
    assert!(home.on_message(id(4), not_asked, &mut stats).is_empty());
    assert_eq!(stats.stale_acks, 2);
    assert_eq!(home.awaiting(), NodeSet::one(id(1)).with(id(2)));
}

#[test]
fn an_owner_lost_before_writing_back_makes_the_page_lost() {
    let mut stats = HomeStats::default();
    let mut home = owned_by_1(&mut stats);
    assert!(home.on_node_lost(id(1), &mut stats).is_empty());
    assert!(home.is_lost());
    assert_eq!(home.directory(), Directory::Invalid);
    for (msg, req) in [(read(5), 5), (write(6, false), 6)] {
        let out = home.on_message(id(2), msg, &mut stats);
        assert_eq!(sent(out), vec![(NodeSet::one(id(2)), ToNode::Lost { req })]);
    }
    assert_eq!((stats.pages_lost, stats.lost_answers), (1, 2));
    assert!(home.clear_lost());
    let out = home.on_message(id(2), read(7), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(2)), grant(7, 2, Mode::Shared, 0, 0))]
    );
}

#[test]
fn an_owner_lost_during_a_downgrade_fails_the_reader_with_lost() {
    let mut stats = HomeStats::default();
    let mut home = owned_by_1(&mut stats);
    home.on_message(id(2), read(4), &mut stats);
    let out = home.on_node_lost(id(1), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(2)), ToNode::Lost { req: 4 })]
    );
    assert!(!home.is_busy());
}

#[test]
fn an_owner_lost_after_its_write_back_loses_nothing() {
    let mut stats = HomeStats::default();
    let mut home = owned_by_1(&mut stats);
    assert!(home
        .on_message(id(1), ToHome::WriteBack { version: 1 }, &mut stats)
        .is_empty());
    assert_eq!(home.directory(), Directory::Invalid);
    home.on_node_lost(id(1), &mut stats);
    assert!(!home.is_lost());
    let out = home.on_message(id(2), read(1), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(2)), grant(1, 2, Mode::Shared, 1, 1))]
    );
}

#[test]
fn a_holder_lost_during_an_invalidation_counts_as_acknowledged() {
    let mut stats = HomeStats::default();
    let mut home = shared_by_1_and_2(&mut stats);
    home.on_message(id(3), write(1, false), &mut stats);
    let ack = ToHome::InvalidateAck {
        seq: 3,
        written_back: None,
    };
    home.on_message(id(1), ack, &mut stats);
    let out = home.on_node_lost(id(2), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(3)), grant(1, 4, Mode::Exclusive, 1, 0))]
    );
    assert!(!home.is_lost());
}

#[test]
fn a_requester_lost_during_its_transaction_is_granted_nothing() {
    let mut stats = HomeStats::default();
    let mut home = shared_by_1_and_2(&mut stats);
    home.on_message(id(3), write(1, false), &mut stats);
    home.on_node_lost(id(3), &mut stats);
    let ack = |seq| ToHome::InvalidateAck {
        seq,
        written_back: None,
    };
    assert!(home.on_message(id(1), ack(3), &mut stats).is_empty());
    assert!(home.on_message(id(2), ack(3), &mut stats).is_empty());
    assert_eq!(home.directory(), Directory::Invalid);
    assert!(!home.is_busy());
}

#[test]
fn a_write_back_of_an_older_version_is_ignored() {
    let mut stats = HomeStats::default();
    let mut home = owned_by_1(&mut stats);
    home.on_message(id(1), ToHome::WriteBack { version: 1 }, &mut stats);
    home.on_message(id(2), write(1, false), &mut stats); // version 2 to node 2
    assert!(home
        .on_message(id(1), ToHome::WriteBack { version: 1 }, &mut stats)
        .is_empty());
    assert_eq!(stats.stale_write_backs, 1);
    assert_eq!(
        home.directory(),
        Directory::Modified {
            owner: id(2),
            grant: 2
        }
    );
    assert_eq!(home.stored_version(), 1);
}

#[test]
fn a_request_from_the_owner_itself_recalls_its_written_back_copy() {
    // The owner evicted (its WriteBack message is late) and faults again.
    let mut stats = HomeStats::default();
    let mut home = owned_by_1(&mut stats);
    let out = home.on_message(id(1), read(2), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(1)), ToNode::Downgrade { seq: 2, grant: 1 })]
    );
    let out = home.on_message(
        id(1),
        ToHome::DowngradeAck {
            seq: 2,
            written_back: Some(1),
            kept: false,
        },
        &mut stats,
    );
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(1)), grant(2, 3, Mode::Shared, 1, 1))]
    );
    // The late WriteBack changes nothing.
    assert!(home
        .on_message(id(1), ToHome::WriteBack { version: 1 }, &mut stats)
        .is_empty());
    assert_eq!(home.directory(), Directory::Shared(NodeSet::one(id(1))));
}

#[test]
fn a_directory_entry_stays_small() {
    // Every page of a coherent VM has one at its home: its size is memory
    // per guest page (4 KiB). docs/coherence.md quotes it.
    let size = std::mem::size_of::<HomePage>();
    eprintln!(
        "HomePage: {size} bytes, NodePage: {} bytes",
        std::mem::size_of::<crate::node::NodePage>()
    );
    assert!(size <= 256, "{size}");
}

/// A node turned away keeps a place in the queue: once one frees, a node
/// that asks first is turned away too, and the place waits for the node
/// that waited its back-off out. Losing that node frees its place.
#[test]
fn a_node_turned_away_gets_the_next_free_place_before_a_newcomer() {
    let mut stats = HomeStats::default();
    let mut home = HomePage::new(HomeConfig::new(1));
    let inv_ack = |seq| ToHome::InvalidateAck {
        seq,
        written_back: None,
    };
    home.on_message(id(1), write(1, false), &mut stats); // 1 owns, seq 1
    home.on_message(id(2), write(1, false), &mut stats); // invalidates 1
    home.on_message(id(3), write(1, false), &mut stats); // queued
    let out = home.on_message(id(4), write(5, false), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(4)), ToNode::Retry { req: 5 })]
    );
    assert_eq!(home.turned_away(), NodeSet::one(id(4)));
    // 1's ack: 2 is granted, 3's round starts, the queue has a free place.
    home.on_message(id(1), inv_ack(2), &mut stats);
    assert_eq!((home.queued(), home.awaiting()), (0, NodeSet::one(id(2))));
    // It is kept for 4: a newcomer is turned away.
    let out = home.on_message(id(5), write(1, false), &mut stats);
    assert_eq!(
        sent(out),
        vec![(NodeSet::one(id(5)), ToNode::Retry { req: 1 })]
    );
    assert_eq!(home.turned_away(), NodeSet::one(id(4)).with(id(5)));
    // 4 asks again and gets in.
    assert!(home
        .on_message(id(4), write(5, false), &mut stats)
        .is_empty());
    assert_eq!(home.queued(), 1);
    assert_eq!(home.turned_away(), NodeSet::one(id(5)));
    assert_eq!((stats.retries, stats.queued), (2, 2));

    // Lost while turned away: its place goes to whoever asks.
    let mut home = HomePage::new(HomeConfig::new(1));
    home.on_message(id(1), write(1, false), &mut stats);
    home.on_message(id(2), write(1, false), &mut stats);
    home.on_message(id(3), write(1, false), &mut stats);
    home.on_message(id(4), write(5, false), &mut stats);
    home.on_message(id(1), inv_ack(2), &mut stats);
    home.on_node_lost(id(4), &mut stats);
    assert_eq!(home.turned_away(), NodeSet::EMPTY);
    assert!(home
        .on_message(id(5), write(1, false), &mut stats)
        .is_empty());
    assert_eq!(home.queued(), 1);
}
