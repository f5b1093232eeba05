//! The model checked by `cargo test -p coherence`: one home, a few nodes,
//! one page, driving the real [`HomePage`] and [`NodePage`] transitions.
//!
//! Every node runs a few operations (read, write with a fresh value, evict),
//! each of which may fault; up to `vcpus` faults per node wait at once (so
//! concurrent faults get coalesced). Messages travel on an unordered network
//! (a multiset: any message in flight may be delivered next; none is
//! duplicated, unless `duplicate_to_nodes`: then a home → node message may
//! arrive again). A node may be lost (up to `max_losses`): its in-flight
//! messages vanish and the home is told. Time only matters for the owner's
//! hold time and a turned-away request's back-off: a node with a timer may
//! let its clock jump to it at any moment, and that moment is its 0 again
//! (only differences of times matter, so the states stay finite). Data
//! moves as the implementation moves it: a write-back writes the home's
//! storage before its message is sent, a fetch reads the storage when the
//! grant is processed.

mod properties;
#[cfg(test)]
mod tests;

use std::sync::Mutex;

use stateright::{Model, Property};

use crate::home::{HomeAction, HomeConfig, HomeMutation, HomePage, HomeStats};
use crate::messages::{Access, Mode, NodeId, ToHome, ToNode, Version};
use crate::node::{Fault, LocalCopy, NodeAction, NodeConfig, NodeMutation, NodePage, NodeStats};

/// A message in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Envelope {
    ToHome { from: u8, msg: ToHome },
    ToNode { to: u8, msg: ToNode },
}

/// One node of the model: the protocol state and what the model tracks
/// around it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Node {
    pub(crate) page: NodePage,
    pub(crate) alive: bool,
    /// The contents of the local copy (0 without one).
    pub(crate) value: u8,
    /// How the copy is mapped, as the actions left it.
    pub(crate) mapped: LocalCopy,
    pub(crate) ops_left: u8,
    pub(crate) reads_waiting: u8,
    pub(crate) writes_waiting: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct State {
    pub(crate) home: HomePage,
    pub(crate) nodes: Vec<Node>,
    /// Messages in flight, sorted (a multiset).
    pub(crate) net: Vec<Envelope>,
    /// With `duplicate_to_nodes`: home → node messages already delivered,
    /// which may be delivered again (sorted, no repeats).
    pub(crate) delivered: Vec<Envelope>,
    /// The page at the home and the version it is tagged with.
    pub(crate) storage_value: u8,
    pub(crate) storage_version: Version,
    /// The value of the latest completed write (0: the initial contents).
    pub(crate) last_write: u8,
    /// Writes so far (write `k` writes the value `k`).
    pub(crate) writes: u8,
    pub(crate) losses_left: u8,
    /// The first check made inside a transition that failed.
    pub(crate) violation: Option<&'static str>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Action {
    Read(u8),
    Write(u8),
    Evict(u8),
    /// The node's clock reaches its next timer (hold time, back-off).
    Tick(u8),
    Deliver(Envelope),
    /// Deliver a home → node message again (`duplicate_to_nodes`).
    Redeliver(Envelope),
    Lose(u8),
}

/// The model's parameters.
#[derive(Debug)]
pub(crate) struct Coherence {
    pub(crate) nodes: u8,
    pub(crate) ops_per_node: u8,
    pub(crate) vcpus: u8,
    pub(crate) max_losses: u8,
    pub(crate) evictions: bool,
    /// Home → node messages may be delivered more than once.
    pub(crate) duplicate_to_nodes: bool,
    pub(crate) queue_limit: usize,
    pub(crate) min_hold_us: u64,
    pub(crate) home_mutation: Option<HomeMutation>,
    pub(crate) node_mutation: Option<NodeMutation>,
    /// Counters summed over every transition explored: which paths of the
    /// protocol the check went through.
    pub(crate) coverage: Mutex<(HomeStats, NodeStats)>,
}

impl Coherence {
    pub(crate) fn new(nodes: u8, ops_per_node: u8) -> Coherence {
        Coherence {
            nodes,
            ops_per_node,
            vcpus: 2,
            max_losses: 1,
            evictions: true,
            duplicate_to_nodes: false,
            queue_limit: crate::home::QUEUE_MAX,
            min_hold_us: 1,
            home_mutation: None,
            node_mutation: None,
            coverage: Mutex::new((HomeStats::default(), NodeStats::default())),
        }
    }

    pub(crate) fn coverage(&self) -> (HomeStats, NodeStats) {
        *self.coverage.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The actions other than losing a node: a state where none is enabled
    /// is one where nothing more happens without a failure.
    pub(crate) fn progress_actions(&self, state: &State, actions: &mut Vec<Action>) {
        for (i, node) in state.nodes.iter().enumerate() {
            let n = i as u8;
            if !node.alive {
                continue;
            }
            if node.ops_left > 0 && node.reads_waiting + node.writes_waiting < self.vcpus {
                actions.push(Action::Read(n));
                actions.push(Action::Write(n));
                if self.evictions && node.page.copy() != LocalCopy::None {
                    actions.push(Action::Evict(n));
                }
            }
            if node.page.has_deferred_callback() || node.page.waits_to_resend() {
                actions.push(Action::Tick(n));
            }
        }
        let mut last = None;
        for &envelope in &state.net {
            if last != Some(envelope) {
                actions.push(Action::Deliver(envelope));
            }
            last = Some(envelope);
        }
    }

    fn record(&self, home: &HomeStats, node: &NodeStats) {
        let mut coverage = self.coverage.lock().unwrap_or_else(|e| e.into_inner());
        let (h, n) = &mut *coverage;
        h.shared_grants += home.shared_grants;
        h.exclusive_grants += home.exclusive_grants;
        h.upgrades += home.upgrades;
        h.invalidation_rounds += home.invalidation_rounds;
        h.invalidations_sent += home.invalidations_sent;
        h.downgrades_sent += home.downgrades_sent;
        h.queued += home.queued;
        h.retries += home.retries;
        h.lost_answers += home.lost_answers;
        h.pages_lost += home.pages_lost;
        h.write_backs += home.write_backs;
        h.duplicate_requests += home.duplicate_requests;
        h.stale_acks += home.stale_acks;
        h.stale_write_backs += home.stale_write_backs;
        h.actions_overflow += home.actions_overflow;
        n.requests += node.requests;
        n.coalesced_faults += node.coalesced_faults;
        n.upgrades += node.upgrades;
        n.deferred_callbacks += node.deferred_callbacks;
        n.stale_grants += node.stale_grants;
        n.retries += node.retries;
        n.lost += node.lost;
        n.stale_answers += node.stale_answers;
        n.callbacks_before_grant += node.callbacks_before_grant;
        n.repeated_callbacks += node.repeated_callbacks;
        n.protocol_errors += node.protocol_errors;
        n.actions_overflow += node.actions_overflow;
    }

    fn node_id(n: u8) -> NodeId {
        // The model has a handful of nodes, far below NodeId::MAX_NODES.
        NodeId::new(n).unwrap_or_else(|| unreachable!("model node id {n}"))
    }

    fn send(&self, state: &mut State, envelope: Envelope) {
        // With repeated deliveries, the network is a set: a copy of a
        // message already in flight adds nothing (each can arrive again).
        if self.duplicate_to_nodes && state.net.binary_search(&envelope).is_ok() {
            return;
        }
        let at = state.net.partition_point(|e| *e <= envelope);
        state.net.insert(at, envelope);
    }

    fn fail(state: &mut State, what: &'static str) {
        state.violation.get_or_insert(what);
    }

    fn write(state: &mut State, n: usize) {
        state.writes += 1;
        state.nodes[n].value = state.writes;
        state.last_write = state.writes;
    }

    fn check_read(state: &mut State, n: usize) {
        if state.nodes[n].value != state.last_write && !state.home.is_lost() {
            Self::fail(state, "a read returned a value older than the latest write");
        }
    }

    fn apply_home(&self, state: &mut State, actions: crate::home::HomeActions) {
        for action in actions.iter() {
            let (to, msg) = match action {
                HomeAction::Send { to, msg } => (crate::NodeSet::one(to), msg),
                HomeAction::SendAll { to, msg } => (to, msg),
            };
            for node in to.iter() {
                if state.nodes[usize::from(node.get())].alive {
                    self.send(
                        state,
                        Envelope::ToNode {
                            to: node.get(),
                            msg,
                        },
                    );
                }
            }
        }
    }

    fn apply_node(&self, state: &mut State, n: usize, actions: crate::node::NodeActions) {
        for action in actions.iter() {
            match action {
                NodeAction::WriteBack { version } => {
                    state.storage_value = state.nodes[n].value;
                    state.storage_version = version;
                }
                NodeAction::Zap => {
                    state.nodes[n].value = 0;
                    state.nodes[n].mapped = LocalCopy::None;
                }
                NodeAction::WriteProtect | NodeAction::Map(Mode::Shared) => {
                    state.nodes[n].mapped = LocalCopy::Shared;
                }
                NodeAction::Map(Mode::Exclusive) => state.nodes[n].mapped = LocalCopy::Modified,
                NodeAction::Fetch { data_version } => {
                    if state.storage_version != data_version {
                        Self::fail(state, "a fetch found another version than the home said");
                    }
                    state.nodes[n].value = state.storage_value;
                }
                NodeAction::Send(msg) => self.send(state, Envelope::ToHome { from: n as u8, msg }),
                NodeAction::Wake(access) => {
                    let copy = state.nodes[n].mapped;
                    if copy == LocalCopy::None
                        || (access == Access::Write && copy != LocalCopy::Modified)
                    {
                        Self::fail(state, "a fault was woken without the access it needs");
                    }
                    if state.nodes[n].reads_waiting > 0 {
                        state.nodes[n].reads_waiting = 0;
                        Self::check_read(state, n);
                    }
                    if access == Access::Write {
                        for _ in 0..state.nodes[n].writes_waiting {
                            Self::write(state, n);
                        }
                        state.nodes[n].writes_waiting = 0;
                    }
                }
                NodeAction::FailLost => {
                    if !state.home.is_lost() {
                        Self::fail(state, "a request failed as lost but the page is not");
                    }
                    state.nodes[n].reads_waiting = 0;
                    state.nodes[n].writes_waiting = 0;
                }
            }
        }
    }

    fn deliver_to_node(&self, state: &mut State, to: u8, msg: ToNode, stats: &mut NodeStats) {
        let n = usize::from(to);
        // Each node's clock stays at 0 (see `Action::Tick`).
        let actions = state.nodes[n].page.on_message(msg, 0, stats);
        self.apply_node(state, n, actions);
    }

    fn fault(&self, state: &mut State, n: usize, access: Access, stats: &mut NodeStats) {
        state.nodes[n].ops_left -= 1;
        match state.nodes[n].page.on_fault(access, stats) {
            Fault::Hit => match access {
                Access::Read => Self::check_read(state, n),
                Access::Write => Self::write(state, n),
            },
            Fault::Wait { send } => {
                match access {
                    Access::Read => state.nodes[n].reads_waiting += 1,
                    Access::Write => state.nodes[n].writes_waiting += 1,
                }
                if let Some(msg) = send {
                    self.send(state, Envelope::ToHome { from: n as u8, msg });
                }
            }
        }
    }
}

impl Model for Coherence {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let mut home_config = HomeConfig::new(self.queue_limit);
        home_config.mutation = self.home_mutation;
        let mut node_config = NodeConfig::new(self.min_hold_us);
        node_config.mutation = self.node_mutation;
        node_config.fixed_retry_wait_us = Some(1);
        let node = Node {
            page: NodePage::new(node_config),
            alive: true,
            value: 0,
            mapped: LocalCopy::None,
            ops_left: self.ops_per_node,
            reads_waiting: 0,
            writes_waiting: 0,
        };
        vec![State {
            home: HomePage::new(home_config),
            nodes: vec![node; usize::from(self.nodes)],
            net: Vec::new(),
            delivered: Vec::new(),
            storage_value: 0,
            storage_version: 0,
            last_write: 0,
            writes: 0,
            losses_left: self.max_losses,
            violation: None,
        }]
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        if state.violation.is_some() {
            return;
        }
        self.progress_actions(state, actions);
        for &envelope in &state.delivered {
            actions.push(Action::Redeliver(envelope));
        }
        if state.losses_left > 0 {
            for (i, node) in state.nodes.iter().enumerate() {
                if node.alive {
                    actions.push(Action::Lose(i as u8));
                }
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        let mut home_stats = HomeStats::default();
        let mut node_stats = NodeStats::default();
        match action {
            Action::Read(n) => {
                self.fault(&mut state, usize::from(n), Access::Read, &mut node_stats)
            }
            Action::Write(n) => {
                self.fault(&mut state, usize::from(n), Access::Write, &mut node_stats);
            }
            Action::Evict(n) => {
                let n = usize::from(n);
                state.nodes[n].ops_left -= 1;
                let actions = state.nodes[n].page.evict(&mut node_stats);
                self.apply_node(&mut state, n, actions);
            }
            Action::Tick(n) => {
                let n = usize::from(n);
                let node = &mut state.nodes[n];
                // Time passes until the timer is due; only differences of
                // times matter, so that moment becomes the node's 0 again.
                let now_us = node.page.timer_due_us().unwrap_or(0);
                let actions = node.page.on_timer(now_us, &mut node_stats);
                node.page.rebase_clock(now_us);
                self.apply_node(&mut state, n, actions);
            }
            Action::Deliver(envelope) => {
                let at = state.net.iter().position(|e| *e == envelope)?;
                state.net.remove(at);
                match envelope {
                    Envelope::ToHome { from, msg } => {
                        let actions =
                            state
                                .home
                                .on_message(Self::node_id(from), msg, &mut home_stats);
                        self.apply_home(&mut state, actions);
                    }
                    Envelope::ToNode { to, msg } => {
                        if self.duplicate_to_nodes {
                            if let Err(at) = state.delivered.binary_search(&envelope) {
                                state.delivered.insert(at, envelope);
                            }
                        }
                        self.deliver_to_node(&mut state, to, msg, &mut node_stats);
                    }
                }
            }
            Action::Redeliver(envelope) => {
                if let Envelope::ToNode { to, msg } = envelope {
                    self.deliver_to_node(&mut state, to, msg, &mut node_stats);
                }
            }
            Action::Lose(n) => {
                state.losses_left -= 1;
                // A dead node's state no longer matters: one canonical form.
                let node = &mut state.nodes[usize::from(n)];
                *node = Node {
                    page: NodePage::new(NodeConfig::new(0)),
                    alive: false,
                    value: 0,
                    mapped: LocalCopy::None,
                    ops_left: 0,
                    reads_waiting: 0,
                    writes_waiting: 0,
                };
                let unrelated = |e: &Envelope| match *e {
                    Envelope::ToHome { from, .. } => from != n,
                    Envelope::ToNode { to, .. } => to != n,
                };
                state.net.retain(unrelated);
                state.delivered.retain(unrelated);
                let actions = state.home.on_node_lost(Self::node_id(n), &mut home_stats);
                self.apply_home(&mut state, actions);
            }
        }
        self.record(&home_stats, &node_stats);
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        properties::all()
    }
}
