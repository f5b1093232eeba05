//! One round of requests: `targets` grouped by node and put on the wire
//! (TCP or RDMA), then, once every answer came or the deadline passed,
//! settled into an [`Outcome`]. A blocking call submits, waits and settles
//! in one go (`Inner::run_targets`); an asynchronous operation keeps its
//! round on the heap and settles it when the round's waiter says it is
//! done (see `async_op.rs`). Both use this code.
//!
//! A round is reusable: `reset` forgets only the entries the last round
//! used, so a one-page request clears no large arrays.

use std::cell::Cell;
use std::sync::Arc;
use std::time::Instant;

use smallvec::SmallVec;

use super::epoch::Fenced;
use super::link::{self, Link};
use super::map_state::MapState;
use super::rdma_batch::{Pages, RdmaChunk};
use super::request::{connection_lost, Outcome, Target};
use super::tcp_chunk::{Sent, TcpChunk};
use super::{Inner, Node};
use crate::error::TransportError;
use crate::rdma::RegionTable;
use crate::tcp::{Request, TcpConnection, Waiter, MAX_CHUNK};
use crate::wire::Opcode;

/// The requests of one round that are (or were) on the wire.
pub(super) struct Round {
    pub(super) tcp: TcpChunk,
    pub(super) rdma: RdmaChunk,
    /// Per group: the index of its node in the round's map.
    group_nodes: [usize; MAX_CHUNK],
    group_count: usize,
    /// Failures found while submitting (before any wait).
    early: Outcome,
    pub(super) opcode: Opcode,
    /// TCP requests are queued on their connections for `flush` (the
    /// completion queue's doorbell) instead of written at once.
    pub(super) deferred: bool,
    /// READ answers may be read from the socket straight into the pages
    /// (asynchronous submissions, whose pages are unspecified after a
    /// failure); false keeps a failed READ's page untouched.
    pub(super) land_direct: bool,
    /// The round's deadline is a hedging delay: a READ not answered by
    /// then goes on at another replica, and an RDMA batch of pool frames
    /// is abandoned with its QP kept (`Inner::settle_rdma`).
    pub(super) hedging: bool,
    /// Whether the round is parked on its connections (`park`).
    parked: bool,
    /// Whether that parking includes the TCP connections.
    parked_tcp: bool,
}

impl Round {
    pub(super) fn new() -> Self {
        Self {
            tcp: TcpChunk::new(),
            rdma: RdmaChunk::new(),
            group_nodes: [usize::MAX; MAX_CHUNK],
            group_count: 0,
            early: Outcome::default(),
            opcode: Opcode::Read,
            deferred: false,
            land_direct: false,
            hedging: false,
            parked: false,
            parked_tcp: false,
        }
    }

    /// Whether any request of the round went out.
    pub(super) fn submitted_any(&self) -> bool {
        !self.tcp.sent.is_empty() || self.rdma.groups > 0
    }

    /// Whether the round queued TCP requests for `flush` (`deferred`).
    pub(super) fn queued_tcp(&self) -> bool {
        self.deferred && !self.tcp.sent.is_empty()
    }

    /// Parks (`enter`) or unparks an asynchronous round on its
    /// connections, so their pollers read its answers. Idempotent.
    pub(super) fn park(&mut self, enter: bool) {
        self.park_some(enter, true);
    }

    /// As `park`; with `tcp` false, only on its RDMA connections (the
    /// reaper reads the TCP sockets itself). Unparking undoes what parking
    /// did.
    pub(super) fn park_some(&mut self, enter: bool, tcp: bool) {
        if self.parked == enter {
            return;
        }
        self.parked = enter;
        if enter {
            self.parked_tcp = tcp;
        }
        if self.parked_tcp {
            for c in self.tcp.groups[..self.group_count].iter().flatten() {
                if enter {
                    c.parking.enter();
                } else {
                    c.parking.leave();
                }
            }
        }
        for c in self.rdma.conns[..self.rdma.groups].iter().flatten() {
            if enter {
                c.parking.enter();
            } else {
                c.parking.leave();
            }
        }
    }

    /// The round's TCP connections (one with several groups comes more
    /// than once).
    pub(super) fn tcp_conns(&self) -> impl Iterator<Item = &Arc<TcpConnection>> {
        self.tcp.groups[..self.group_count].iter().flatten()
    }

    /// The round's RDMA connections (as `tcp_conns`).
    pub(super) fn rdma_conns(&self) -> impl Iterator<Item = &Arc<crate::rdma::RdmaConnection>> {
        self.rdma.conns[..self.rdma.groups].iter().flatten()
    }
}

/// What a round's targets were resolved on: the map, and, when they were
/// resolved on the published view (`fast_view.rs`), the connection each of
/// its nodes had then (`links[i]` for `state.nodes[i]`) and the table of
/// registered memory. A published link that is not broken is used as it
/// is; otherwise (or with no links) the node's current link is loaded, or
/// dialled. Without a table, RDMA groups load the registry's.
#[derive(Clone, Copy)]
pub(super) struct OnMap<'a> {
    pub(super) state: &'a MapState,
    pub(super) links: &'a [Option<Arc<Link>>],
    pub(super) regions: Option<&'a Arc<RegionTable>>,
}

/// Where and until when a round's groups go.
#[derive(Clone, Copy)]
struct Dest<'a> {
    on: OnMap<'a>,
    deadline: Instant,
    rdma_deadline: &'a crate::rdma::Deadline,
}

/// One node's requests of a round: `reqs[k]`, for target `members[k]`,
/// whose address and epoch are `fenced[k]`.
struct Group<'a> {
    node_index: usize,
    reqs: &'a [Request],
    members: &'a [usize],
    fenced: &'a [Fenced],
}

impl Target {
    /// Its request (`direct`: see `Round::land_direct`).
    fn request(&self, direct: bool) -> Request {
        Request {
            offset: self.loc.remote_offset,
            page: self.page,
            direct,
        }
    }

    /// What the epoch check needs of it.
    fn fenced(&self) -> Fenced {
        Fenced {
            gpa: self.gpa,
            remote_offset: self.loc.remote_offset,
            valid_epoch: self.loc.valid_epoch,
        }
    }
}

impl Inner {
    /// Puts `targets` on the wire as `round.opcode` requests, grouped by
    /// node, counting each request on `waiter`. `round` must be fresh or
    /// settled. Requests that cannot go
    /// (no connection, another epoch, a full request table) are failed in
    /// the round's outcome at once.
    pub(super) fn submit_round(
        &self,
        round: &mut Round,
        on: OnMap<'_>,
        targets: &[Target],
        chunk_pages: &mut Pages<'_>,
        waiter: &Waiter,
        deadline: Instant,
    ) {
        let rdma_deadline = crate::rdma::Deadline::at(deadline);
        let to = Dest {
            on,
            deadline,
            rdma_deadline: &rdma_deadline,
        };
        // A one-page round (every asynchronous one-page submission) is its
        // own group: no grouping and no lists to fill.
        if let [t] = targets {
            let group = Group {
                node_index: t.loc.node_index,
                reqs: &[t.request(round.land_direct)],
                members: &[0],
                fenced: &[t.fenced()],
            };
            self.submit_group(round, to, group, chunk_pages, waiter);
            return;
        }
        let n = targets.len();
        // The groups of nodes connected now go first, then those of nodes
        // to dial: a dial waits (up to the deadline, for a node that
        // accepts and never answers), and the requests to the other nodes
        // must not wait behind it. (A write to a replicated range whose
        // first replica had to be dialled, and hung, reached the live
        // second one too late, and failed.)
        let connected = |node_index: usize| {
            let published = to.on.links.get(node_index).and_then(Option::as_deref);
            match published {
                Some(link) => !link.is_broken(),
                None => to.on.state.nodes[node_index]
                    .conn
                    .load()
                    .as_deref()
                    .is_some_and(|link| !link.is_broken()),
            }
        };
        let mut done = 0u64;
        for dialling in [false, true] {
            for i in 0..n {
                if done & (1 << i) != 0 {
                    continue;
                }
                let node_index = targets[i].loc.node_index;
                if !dialling && !connected(node_index) {
                    continue;
                }
                // At most MAX_CHUNK each, so they stay on the stack; unlike
                // arrays they are not zeroed first (a one-page round fills
                // one entry, not ~4 KiB).
                let mut reqs = SmallVec::<[Request; MAX_CHUNK]>::new();
                let mut members = SmallVec::<[usize; MAX_CHUNK]>::new();
                let mut fenced = SmallVec::<[Fenced; MAX_CHUNK]>::new();
                for (j, t) in targets.iter().enumerate().skip(i) {
                    if done & (1 << j) == 0 && t.loc.node_index == node_index {
                        done |= 1 << j;
                        reqs.push(t.request(round.land_direct));
                        members.push(j);
                        fenced.push(t.fenced());
                    }
                }
                let group = Group {
                    node_index,
                    reqs: &reqs,
                    members: &members,
                    fenced: &fenced,
                };
                self.submit_group(round, to, group, chunk_pages, waiter);
            }
        }
    }

    /// Puts one node's requests of the round on the wire (see
    /// `submit_round`).
    fn submit_group(
        &self,
        round: &mut Round,
        to: Dest<'_>,
        group: Group<'_>,
        chunk_pages: &mut Pages<'_>,
        waiter: &Waiter,
    ) {
        let Group {
            node_index,
            reqs,
            members,
            fenced,
        } = group;
        let (on, deadline) = (to.on, to.deadline);
        let opcode = round.opcode;
        let node = &on.state.nodes[node_index];
        let m = reqs.len();
        // Nothing goes to a server that is not in the epoch the
        // group's ranges are valid in (see `epoch.rs`).
        let published = on
            .links
            .get(node_index)
            .and_then(Option::as_deref)
            .filter(|link| !link.is_broken())
            .cloned();
        let link = match published {
            Some(link) => Ok(link),
            None => self.connection(node, deadline, round.hedging),
        };
        let link = link.and_then(|link| {
            self.check_epochs(node, link.epoch(), fenced, deadline)
                .map(|()| link)
        });
        let group = round.group_count;
        let conn = match link {
            Ok(Link::Tcp(c)) => c,
            Ok(Link::Rdma(c)) => {
                if let Some(table) = on.regions {
                    round.rdma.hold_regions(table);
                }
                round.group_count += 1;
                round.group_nodes[group] = node_index;
                let write = opcode == Opcode::Write;
                if let Some(e) = self.submit_rdma(
                    &mut round.rdma,
                    group,
                    c,
                    write,
                    reqs,
                    members,
                    chunk_pages,
                    waiter,
                    to.rdma_deadline,
                    &mut round.early.failed,
                ) {
                    round.early.error.get_or_insert(e);
                }
                return;
            }
            Err(e) => {
                let timed_out = matches!(e, TransportError::Timeout { .. });
                for &j in members {
                    round.early.failed |= 1 << j;
                    if timed_out {
                        round.early.timed_out |= 1 << j;
                    }
                }
                round.early.error.get_or_insert(e);
                return;
            }
        };
        round.group_count += 1;
        round.group_nodes[group] = node_index;
        // Filled as far as the group goes (`from_elem` built it elsewhere
        // and copied it here: 0.5 KiB per round).
        let mut ids = SmallVec::<[u64; MAX_CHUNK]>::new();
        ids.resize(m, 0);
        let result = if round.deferred {
            conn.submit_deferred(opcode, reqs, &mut ids, waiter, deadline)
        } else {
            conn.submit(opcode, reqs, &mut ids, waiter, deadline)
        };
        let armed = match &result {
            Ok(()) => m,
            Err((armed, _)) => *armed,
        };
        for ((&id, &j), f) in ids[..armed].iter().zip(members).zip(fenced) {
            round.tcp.sent.push(Sent {
                group,
                id,
                gpa: f.gpa,
                target: j,
            });
        }
        if let Err((_, err)) = result {
            tracing::debug!(node = %node.id, %err, "submitting to node failed");
            for &j in &members[armed..] {
                round.early.fail(
                    j,
                    crate::error::TransportError::NodeDown {
                        node: node.id.clone(),
                        reason: err.to_string(),
                    },
                );
            }
        }
        round.tcp.groups[group] = Some(conn);
    }

    /// Waits (blocking) until every request of `round` was answered or
    /// `deadline` passed (false then).
    pub(super) fn wait_round(&self, round: &Round, waiter: &Waiter, deadline: Instant) -> bool {
        let spin = self.config.caller_spin();
        let tcp = &round.tcp.groups[..round.group_count];
        let rdma = &round.rdma.conns[..round.rdma.groups];
        if round.rdma.groups == 0 {
            !round.tcp.sent.is_empty() && crate::tcp::wait(waiter, tcp, spin, deadline)
        } else if round.tcp.sent.is_empty() {
            crate::rdma::wait(
                waiter,
                rdma.iter().flatten().map(|c| &**c),
                spin,
                &crate::rdma::Deadline::at(deadline),
            )
        } else {
            link::wait_mixed(waiter, tcp, rdma, deadline)
        }
    }

    /// Collects every request's outcome (`answered`: the waiter reached
    /// zero; else requests still pending are cancelled) and leaves `round`
    /// ready for reuse.
    pub(super) fn settle_round(
        &self,
        round: &mut Round,
        state: &MapState,
        answered: bool,
        chunk_pages: &mut Pages<'_>,
    ) -> Outcome {
        round.park(false);
        let mut outcome = std::mem::take(&mut round.early);
        let write = round.opcode == Opcode::Write;
        // Emptied as it goes (a drain empties the list first): should this
        // unwind, the chunk's drop does not cancel settled requests again.
        for s in round.tcp.sent.drain(..) {
            let Some(conn) = round.tcp.groups[s.group].as_ref() else {
                continue;
            };
            let code = if answered {
                Some(conn.inflight.finish(s.id))
            } else {
                conn.inflight.cancel(s.id)
            };
            let node = &state.nodes[round.group_nodes[s.group]];
            if let Some(e) = self.code_to_error(code, conn, node, s, write) {
                if connection_lost(&e) {
                    outcome.lost |= 1 << s.target;
                }
                outcome.fail(s.target, e);
            }
        }
        if round.rdma.groups > 0 {
            let mut nodes: [&Node; MAX_CHUNK] = [&state.nodes[0]; MAX_CHUNK];
            for (g, &node_index) in round.group_nodes[..round.rdma.groups].iter().enumerate() {
                if let Some(node) = state.nodes.get(node_index) {
                    nodes[g] = node;
                }
            }
            self.settle_rdma(
                &mut round.rdma,
                &nodes,
                answered,
                round.hedging,
                write,
                chunk_pages,
                &mut outcome,
            );
        }
        for g in &mut round.tcp.groups[..round.group_count] {
            *g = None;
        }
        round.rdma.reset();
        round.group_count = 0;
        outcome
    }

    /// Submits `targets` grouped by node, waits until `deadline`, and
    /// settles every request. `hedging`: `deadline` is a hedging delay
    /// (`Round::hedging`).
    pub(super) fn run_targets(
        &self,
        opcode: Opcode,
        state: &MapState,
        targets: &[Target],
        mut chunk_pages: Pages<'_>,
        deadline: Instant,
        hedging: bool,
    ) -> Outcome {
        // Declared before the round: its chunks' guards cancel every
        // request that refers to the waiter before it goes, even when
        // unwinding.
        let waiter = Waiter::new();
        // This thread's settled round from its last call, if any: making
        // a round clears and then drops ~5 KiB of per-request arrays, a
        // sixth of a 16-page batch's instructions.
        let mut round = SPARE_ROUND
            .with(Cell::take)
            .unwrap_or_else(|| Box::new(Round::new()));
        round.opcode = opcode;
        round.deferred = false;
        round.land_direct = false;
        round.hedging = hedging;
        self.submit_round(
            &mut round,
            OnMap {
                state,
                links: &[],
                regions: None,
            },
            targets,
            &mut chunk_pages,
            &waiter,
            deadline,
        );
        #[cfg(any(test, feature = "test-hooks"))]
        super::unwind_hook::maybe_panic_after_submit();
        let answered = round.submitted_any() && self.wait_round(&round, &waiter, deadline);
        let outcome = self.settle_round(&mut round, state, answered, &mut chunk_pages);
        // Settled: it holds no request, frame or connection any more.
        SPARE_ROUND.with(|spare| spare.set(Some(round)));
        outcome
    }
}

thread_local! {
    /// A settled round kept for the thread's next blocking round
    /// (`run_targets`). One that unwinds is dropped instead, which cancels
    /// its requests.
    static SPARE_ROUND: Cell<Option<Box<Round>>> = const { Cell::new(None) };
}
