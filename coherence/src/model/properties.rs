//! What the model checker checks, in every reachable state.

use stateright::Property;

use super::{Coherence, Envelope, State};
use crate::home::Directory;
use crate::messages::{ToHome, ToNode};
use crate::node::LocalCopy;

pub(crate) fn all() -> Vec<Property<Coherence>> {
    vec![
        Property::always("single writer", single_writer),
        Property::always("copies hold the latest write", copies_are_latest),
        Property::always("checks inside transitions hold", no_violation),
        Property::always("the directory covers every copy", directory_covers_copies),
        Property::always("no deadlock", no_deadlock),
        Property::always("no lost acknowledgement", no_lost_ack),
        Property::always(
            "a kept place is for a node that will ask",
            kept_places_are_wanted,
        ),
        Property::always("bounded work per operation", |m: &Coherence, s: &State| {
            s.home.seq() <= 6 * u64::from(m.nodes) * u64::from(m.ops_per_node) + 4
        }),
        // Coverage: the check went through the cases that matter.
        Property::sometimes("two nodes share the page", |_, s: &State| {
            live_copies(s, LocalCopy::Shared) >= 2
        }),
        Property::sometimes("the page is lost", |_, s: &State| s.home.is_lost()),
        Property::sometimes("a callback waits for the hold time", |_, s: &State| {
            s.nodes
                .iter()
                .any(|n| n.alive && n.page.has_deferred_callback())
        }),
        Property::sometimes(
            "a recall waits for the grant it overtook",
            |_, s: &State| {
                s.nodes.iter().any(|n| {
                    n.alive && n.page.has_deferred_callback() && n.page.timer_due_us().is_none()
                })
            },
        ),
        Property::sometimes("a request waits in the home's queue", |_, s: &State| {
            s.home.queued() > 0
        }),
    ]
}

fn live_copies(s: &State, copy: LocalCopy) -> usize {
    s.nodes
        .iter()
        .filter(|n| n.alive && n.page.copy() == copy)
        .count()
}

/// At most one node may write the page, and while one may, no other node
/// holds a copy.
fn single_writer(_: &Coherence, s: &State) -> bool {
    let modified = live_copies(s, LocalCopy::Modified);
    modified == 0 || (modified == 1 && live_copies(s, LocalCopy::Shared) == 0)
}

/// Every copy a node can read holds the latest completed write, unless the
/// page is marked lost.
fn copies_are_latest(_: &Coherence, s: &State) -> bool {
    s.home.is_lost()
        || s.nodes
            .iter()
            .filter(|n| n.alive && n.page.copy() != LocalCopy::None)
            .all(|n| n.value == s.last_write)
}

/// The home's view is conservative: a node holding a shared copy is listed
/// as a holder (or is the owner, its ownership grant or downgrade ack still
/// on the way); a node holding the page modified is its owner.
fn directory_covers_copies(_: &Coherence, s: &State) -> bool {
    s.nodes.iter().enumerate().all(|(i, n)| {
        let owner = matches!(
            s.home.directory(),
            Directory::Modified { owner, .. } if usize::from(owner.get()) == i
        );
        let listed = matches!(
            s.home.directory(),
            Directory::Shared(holders) if holders.iter().any(|h| usize::from(h.get()) == i)
        );
        !n.alive
            || match n.page.copy() {
                LocalCopy::None => true,
                LocalCopy::Shared => owner || listed,
                LocalCopy::Modified => owner,
            }
    })
}

/// Reads returned the latest write, fetches found the version the home
/// announced, woken faults had their access, a Lost answer meant a lost page.
/// Also: the actions leave every copy mapped as the protocol state says.
fn no_violation(_: &Coherence, s: &State) -> bool {
    s.violation.is_none()
        && s.nodes
            .iter()
            .all(|n| !n.alive || n.mapped == n.page.copy())
}

/// If nothing can happen but a node loss, the protocol is at rest: the home
/// waits for nothing, no request is outstanding, no fault waits.
fn no_deadlock(model: &Coherence, s: &State) -> bool {
    let mut actions = Vec::new();
    model.progress_actions(s, &mut actions);
    !actions.is_empty()
        || (!s.home.is_busy()
            && s.home.queued() == 0
            && s.nodes.iter().filter(|n| n.alive).all(|n| {
                n.page.outstanding().is_none()
                    && n.reads_waiting == 0
                    && n.writes_waiting == 0
                    && !n.page.has_deferred_callback()
            }))
}

/// Every node the home keeps a queue place for (it turned it away) is
/// alive and still wants the page, so it will ask again and take the
/// place: a place kept for nobody would turn every other node away for
/// ever (a Retry loop, which "no deadlock" does not see).
fn kept_places_are_wanted(_: &Coherence, s: &State) -> bool {
    s.home.turned_away().iter().all(|node| {
        s.nodes
            .get(usize::from(node.get()))
            .is_some_and(|n| n.alive && n.page.outstanding().is_some())
    })
}

/// Every ack the home waits for can still come: the node is alive and the
/// callback or its ack is in flight, or the callback waits for the hold time.
fn no_lost_ack(_: &Coherence, s: &State) -> bool {
    s.home.awaiting().iter().all(|node| {
        let n = node.get();
        let Some(state) = s.nodes.get(usize::from(n)) else {
            return false;
        };
        state.alive
            && (state.page.has_deferred_callback()
                || s.net.iter().any(|e| match *e {
                    Envelope::ToNode { to, msg } => {
                        to == n
                            && matches!(msg, ToNode::Invalidate { .. } | ToNode::Downgrade { .. })
                    }
                    Envelope::ToHome { from, msg } => {
                        from == n
                            && matches!(
                                msg,
                                ToHome::InvalidateAck { .. } | ToHome::DowngradeAck { .. }
                            )
                    }
                }))
    })
}
