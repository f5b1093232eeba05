use crate::messages::{Access, Mode, ToHome, ToNode};
use crate::node::{
    Fault, LocalCopy, NodeAction, NodeConfig, NodePage, NodeStats, RETRY_FIRST_US, RETRY_MAX_US,
};

fn grant(req: u32, seq: u64, mode: Mode, version: u64, data_version: u64) -> ToNode {
    ToNode::Grant {
        req,
        seq,
        mode,
        version,
        data_version,
    }
}

fn actions(list: crate::node::NodeActions) -> Vec<NodeAction> {
    list.iter().collect()
}

/// A node that owns the page (version 1, granted at seq 1, at time 0).
fn owner(min_hold_us: u64, stats: &mut NodeStats) -> NodePage {
    let mut page = NodePage::new(NodeConfig::new(min_hold_us));
    page.on_fault(Access::Write, stats);
    page.on_message(grant(1, 1, Mode::Exclusive, 1, 0), 0, stats);
    assert_eq!(page.copy(), LocalCopy::Modified);
    page
}

#[test]
fn concurrent_faults_on_a_page_make_one_request() {
    let mut stats = NodeStats::default();
    let mut page = NodePage::new(NodeConfig::new(0));
    assert_eq!(
        page.on_fault(Access::Read, &mut stats),
        Fault::Wait {
            send: Some(ToHome::ReadReq { req: 1 })
        }
    );
    assert_eq!(
        page.on_fault(Access::Read, &mut stats),
        Fault::Wait { send: None }
    );
    assert_eq!(
        page.on_fault(Access::Write, &mut stats),
        Fault::Wait { send: None }
    );
    assert_eq!((stats.requests, stats.coalesced_faults), (1, 2));
    // The read grant wakes the readers and asks for ownership for the writer.
    let out = page.on_message(grant(1, 1, Mode::Shared, 0, 0), 0, &mut stats);
    assert_eq!(
        actions(out),
        vec![
            NodeAction::Fetch { data_version: 0 },
            NodeAction::Map(Mode::Shared),
            NodeAction::Wake(Access::Read),
            NodeAction::Send(ToHome::WriteReq {
                req: 2,
                upgrade: true
            }),
        ]
    );
    assert_eq!(page.outstanding(), Some(Access::Write));
    assert_eq!(page.on_fault(Access::Read, &mut stats), Fault::Hit);
}

#[test]
fn an_upgrade_keeps_the_shared_copy_and_a_miss_fetches() {
    let mut stats = NodeStats::default();
    let mut page = NodePage::new(NodeConfig::new(0));
    page.on_fault(Access::Read, &mut stats);
    page.on_message(grant(1, 1, Mode::Shared, 0, 0), 0, &mut stats);
    assert_eq!(
        page.on_fault(Access::Write, &mut stats),
        Fault::Wait {
            send: Some(ToHome::WriteReq {
                req: 2,
                upgrade: true
            })
        }
    );
    let out = page.on_message(grant(2, 2, Mode::Exclusive, 1, 0), 0, &mut stats);
    assert_eq!(
        actions(out),
        vec![
            NodeAction::Map(Mode::Exclusive),
            NodeAction::Wake(Access::Write)
        ]
    );
    assert_eq!(page.on_fault(Access::Write, &mut stats), Fault::Hit);

    let mut other = NodePage::new(NodeConfig::new(0));
    other.on_fault(Access::Write, &mut stats);
    let out = other.on_message(grant(1, 3, Mode::Exclusive, 2, 1), 0, &mut stats);
    assert_eq!(
        actions(out),
        vec![
            NodeAction::Fetch { data_version: 1 },
            NodeAction::Map(Mode::Exclusive),
            NodeAction::Wake(Access::Write)
        ]
    );
    assert_eq!(stats.upgrades, 1);
}

#[test]
fn an_owner_answers_an_invalidation_only_after_its_hold_time() {
    let mut stats = NodeStats::default();
    let mut page = owner(50, &mut stats);
    let invalidate = ToNode::Invalidate {
        seq: 2,
        grant: Some(1),
    };
    assert!(page.on_message(invalidate, 10, &mut stats).is_empty());
    assert_eq!(page.timer_due_us(), Some(50));
    assert_eq!(stats.deferred_callbacks, 1);
    assert!(page.on_timer(49, &mut stats).is_empty());
    // The owner still writes meanwhile.
    assert_eq!(page.on_fault(Access::Write, &mut stats), Fault::Hit);
    assert_eq!(
        actions(page.on_timer(50, &mut stats)),
        vec![
            NodeAction::WriteBack { version: 1 },
            NodeAction::Zap,
            NodeAction::Send(ToHome::InvalidateAck {
                seq: 2,
                written_back: Some(1)
            }),
        ]
    );
    assert_eq!(page.copy(), LocalCopy::None);
    assert!(!page.has_deferred_callback());
}

#[test]
fn a_downgrade_writes_back_and_keeps_a_read_only_copy() {
    let mut stats = NodeStats::default();
    let mut page = owner(0, &mut stats);
    let out = page.on_message(ToNode::Downgrade { seq: 2, grant: 1 }, 0, &mut stats);
    assert_eq!(
        actions(out),
        vec![
            NodeAction::WriteBack { version: 1 },
            NodeAction::WriteProtect,
            NodeAction::Send(ToHome::DowngradeAck {
                seq: 2,
                written_back: Some(1),
                kept: true
            }),
        ]
    );
    assert_eq!(page.copy(), LocalCopy::Shared);
    assert_eq!(
        page.on_fault(Access::Write, &mut stats),
        Fault::Wait {
            send: Some(ToHome::WriteReq {
                req: 2,
                upgrade: true
            })
        }
    );
}

#[test]
fn a_grant_overtaken_by_an_invalidation_is_dropped_and_asked_again() {
    let mut stats = NodeStats::default();
    let mut page = NodePage::new(NodeConfig::new(0));
    page.on_fault(Access::Read, &mut stats);
    // The home granted (seq 1), then invalidated (seq 2); the invalidation
    // arrives first: no copy yet, so the ack is immediate.
    let out = page.on_message(
        ToNode::Invalidate {
            seq: 2,
            grant: None,
        },
        0,
        &mut stats,
    );
    assert_eq!(
        actions(out),
        vec![NodeAction::Send(ToHome::InvalidateAck {
            seq: 2,
            written_back: None
        })]
    );
    let out = page.on_message(grant(1, 1, Mode::Shared, 0, 0), 0, &mut stats);
    assert_eq!(
        actions(out),
        vec![NodeAction::Send(ToHome::ReadReq { req: 2 })]
    );
    assert_eq!(page.copy(), LocalCopy::None);
    assert_eq!(stats.stale_grants, 1);
    // The answer to the new request is used.
    let out = page.on_message(grant(2, 3, Mode::Shared, 0, 0), 0, &mut stats);
    assert!(actions(out).contains(&NodeAction::Wake(Access::Read)));
}

#[test]
fn a_recall_that_overtook_the_owners_grant_waits_for_it() {
    let mut stats = NodeStats::default();
    let mut page = NodePage::new(NodeConfig::new(0));
    page.on_fault(Access::Write, &mut stats);
    let recall = ToNode::Invalidate {
        seq: 2,
        grant: Some(1),
    };
    assert!(page.on_message(recall, 0, &mut stats).is_empty());
    assert!(page.has_deferred_callback());
    assert_eq!(page.timer_due_us(), None);
    // The grant comes: the writer goes first, then the recall is answered.
    let out = page.on_message(grant(1, 1, Mode::Exclusive, 1, 0), 0, &mut stats);
    assert_eq!(
        actions(out),
        vec![
            NodeAction::Fetch { data_version: 0 },
            NodeAction::Map(Mode::Exclusive),
            NodeAction::Wake(Access::Write),
            NodeAction::WriteBack { version: 1 },
            NodeAction::Zap,
            NodeAction::Send(ToHome::InvalidateAck {
                seq: 2,
                written_back: Some(1)
            }),
        ]
    );
    assert_eq!(stats.callbacks_before_grant, 1);
    assert_eq!(stats.stale_grants, 0);
}

#[test]
fn lost_and_retry_answer_the_outstanding_request_only() {
    let mut stats = NodeStats::default();
    let mut page = NodePage::new(NodeConfig::new(0));
    page.on_fault(Access::Read, &mut stats);
    assert!(page
        .on_message(ToNode::Retry { req: 1 }, 0, &mut stats)
        .is_empty());
    assert_eq!(
        actions(page.on_timer(RETRY_FIRST_US, &mut stats)),
        vec![NodeAction::Send(ToHome::ReadReq { req: 1 })]
    );
    assert!(page
        .on_message(ToNode::Lost { req: 9 }, 0, &mut stats)
        .is_empty());
    assert_eq!(
        actions(page.on_message(ToNode::Lost { req: 1 }, 0, &mut stats)),
        vec![NodeAction::FailLost]
    );
    assert_eq!(page.outstanding(), None);
    assert!(page
        .on_message(grant(1, 1, Mode::Shared, 0, 0), 0, &mut stats)
        .is_empty());
    assert_eq!((stats.retries, stats.lost, stats.stale_answers), (1, 1, 2));
}

/// A request the home's full queue turned away is sent again after a
/// back-off that doubles with each Retry, up to a cap: not at once, round
/// trip after round trip, for as long as the page is busy.
#[test]
fn a_retried_request_is_sent_again_after_a_growing_back_off() {
    let mut stats = NodeStats::default();
    let mut page = NodePage::new(NodeConfig::new(0));
    page.on_fault(Access::Write, &mut stats);
    let mut now = 1_000;
    let mut waits = Vec::new();
    for _ in 0..9 {
        assert!(page
            .on_message(ToNode::Retry { req: 1 }, now, &mut stats)
            .is_empty());
        assert!(page.waits_to_resend());
        // A repeat of that Retry changes nothing.
        assert!(page
            .on_message(ToNode::Retry { req: 1 }, now, &mut stats)
            .is_empty());
        let due = page.timer_due_us().expect("a timer for the resend");
        assert!(page.on_timer(due - 1, &mut stats).is_empty());
        assert_eq!(
            actions(page.on_timer(due, &mut stats)),
            vec![NodeAction::Send(ToHome::WriteReq {
                req: 1,
                upgrade: false
            })]
        );
        assert!(!page.waits_to_resend());
        assert_eq!(page.timer_due_us(), None);
        waits.push(due - now);
        now = due + 5;
    }
    assert_eq!(
        waits,
        [16, 32, 64, 128, 256, 512, 1024, 1024, 1024],
        "first {RETRY_FIRST_US} µs, doubling up to {RETRY_MAX_US} µs"
    );
    assert_eq!((stats.retries, stats.stale_answers), (9, 9));
    // The grant ends it; a new request starts from the first wait again.
    page.on_message(grant(1, 1, Mode::Exclusive, 1, 0), now, &mut stats);
    assert_eq!(page.outstanding(), None);
    page.evict(&mut stats);
    page.on_fault(Access::Read, &mut stats);
    page.on_message(ToNode::Retry { req: 2 }, now, &mut stats);
    assert_eq!(page.timer_due_us(), Some(now + RETRY_FIRST_US));
}

#[test]
fn a_grant_of_the_wrong_kind_is_ignored_and_counted() {
    let mut stats = NodeStats::default();
    let mut page = NodePage::new(NodeConfig::new(0));
    page.on_fault(Access::Write, &mut stats);
    assert!(page
        .on_message(grant(1, 1, Mode::Shared, 0, 0), 0, &mut stats)
        .is_empty());
    assert_eq!(stats.protocol_errors, 1);
    assert_eq!(page.outstanding(), Some(Access::Write));
}

#[test]
fn eviction_writes_a_modified_copy_back_and_drops_a_shared_one_silently() {
    let mut stats = NodeStats::default();
    let mut page = owner(0, &mut stats);
    assert_eq!(
        actions(page.evict(&mut stats)),
        vec![
            NodeAction::WriteBack { version: 1 },
            NodeAction::Zap,
            NodeAction::Send(ToHome::WriteBack { version: 1 }),
        ]
    );
    // A later recall is answered at once, reporting the write-back.
    let out = page.on_message(ToNode::Downgrade { seq: 2, grant: 1 }, 0, &mut stats);
    assert_eq!(
        actions(out),
        vec![NodeAction::Send(ToHome::DowngradeAck {
            seq: 2,
            written_back: Some(1),
            kept: false
        })]
    );

    let mut reader = NodePage::new(NodeConfig::new(0));
    reader.on_fault(Access::Read, &mut stats);
    reader.on_message(grant(1, 1, Mode::Shared, 0, 0), 0, &mut stats);
    assert_eq!(actions(reader.evict(&mut stats)), vec![NodeAction::Zap]);
    assert_eq!(reader.copy(), LocalCopy::None);
}

#[test]
fn a_repeated_callback_is_acked_again_and_changes_nothing() {
    let mut stats = NodeStats::default();
    let mut page = owner(0, &mut stats);
    let downgrade = ToNode::Downgrade { seq: 2, grant: 1 };
    let first = actions(page.on_message(downgrade, 0, &mut stats));
    assert_eq!(first.len(), 3); // write-back, write-protect, ack
                                // A new ownership (seq 4), then the old downgrade again.
    page.on_fault(Access::Write, &mut stats);
    page.on_message(grant(2, 4, Mode::Exclusive, 2, 1), 0, &mut stats);
    assert_eq!(
        actions(page.on_message(downgrade, 0, &mut stats)),
        vec![NodeAction::Send(ToHome::DowngradeAck {
            seq: 2,
            written_back: Some(1),
            kept: true
        })]
    );
    assert_eq!(page.copy(), LocalCopy::Modified);
    assert_eq!(stats.repeated_callbacks, 1);
}
