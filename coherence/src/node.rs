//! The node's side: one page's state on a hypervisor node.
//!
//! A node holds nothing, a read-only copy or the only writable copy, and has
//! at most one request for the page outstanding: concurrent faults on the
//! page wait for that request (they are coalesced). It answers the home's
//! callbacks, after a minimum hold time if it owns the page, so that a page
//! two nodes keep taking from each other still lets each vCPU make progress.
//! See `docs/coherence.md`.

use crate::list::List;
use crate::messages::{Access, Mode, ReqId, Seq, ToHome, ToNode, Version};

/// The most actions one node transition returns.
pub const NODE_ACTIONS_MAX: usize = 8;

/// How long a node waits before it sends a request again that the home
/// answered with [`ToNode::Retry`] (its queue for the page was full): this
/// long after the first Retry, twice as long after each further one for
/// the same request, at most [`RETRY_MAX_US`]. Without it, a node resent
/// at once, a round trip after round trip for as long as the page stayed
/// busy.
pub const RETRY_FIRST_US: u64 = 16;

/// The longest wait before a request is sent again (see [`RETRY_FIRST_US`]).
pub const RETRY_MAX_US: u64 = 1024;

/// What a node transition asks its caller to do, in order. Each must be
/// done before the next (a write-back completes before the message saying
/// so is sent), and all of them before the next event of this page is fed in.
pub type NodeActions = List<NodeAction, NODE_ACTIONS_MAX>;

/// One thing to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeAction {
    /// Write the local copy to the home (RDMA WRITE, or a TCP write) and
    /// wait for it to complete. It is data of `version`.
    WriteBack {
        /// The version of the data written.
        version: Version,
    },
    /// Drop the local copy (zap the mapping): the next access faults.
    Zap,
    /// Make the local copy read-only: the next write faults.
    WriteProtect,
    /// Read the home's data (of `data_version`) into the local copy.
    Fetch {
        /// The version the home says it has.
        data_version: Version,
    },
    /// Map the local copy: read-only (`Shared`) or writable (`Exclusive`).
    Map(Mode),
    /// Send a message to the home.
    Send(ToHome),
    /// Faults waiting on this page may go on: readers if `Read`, everyone
    /// if `Write` (the page is now writable).
    Wake(Access),
    /// Faults waiting on this page fail with the lost-data error.
    FailLost,
}

/// What a fault should do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The local copy allows the access: map it / go on.
    Hit,
    /// Wait for a [`NodeAction::Wake`] or [`NodeAction::FailLost`]; send
    /// `send` first if there is one (else the fault joined a request already
    /// outstanding).
    Wait {
        /// The request to send.
        send: Option<ToHome>,
    },
}

/// The local copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LocalCopy {
    /// No copy: any access faults.
    None,
    /// A read-only copy: a write faults.
    Shared,
    /// The only writable copy.
    Modified,
}

/// Settings of the node side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct NodeConfig {
    min_hold_us: u64,
    #[cfg(test)]
    pub(crate) mutation: Option<NodeMutation>,
    /// The model checker's: every back-off is this long, not counted (the
    /// doubling is only timing, checked by unit tests; counting it would
    /// multiply the model's states).
    #[cfg(test)]
    pub(crate) fixed_retry_wait_us: Option<u64>,
}

impl NodeConfig {
    /// An owner keeps the page at least `min_hold_us` after it was granted
    /// before it answers a callback (0: answer at once).
    pub fn new(min_hold_us: u64) -> NodeConfig {
        NodeConfig {
            min_hold_us,
            #[cfg(test)]
            mutation: None,
            #[cfg(test)]
            fixed_retry_wait_us: None,
        }
    }

    /// The minimum hold time.
    pub fn min_hold_us(&self) -> u64 {
        self.min_hold_us
    }
}

/// Deliberate bugs, to show that the model checker finds them.
#[cfg(test)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum NodeMutation {
    /// Use a grant that a later callback overtook.
    IgnoreFence,
    /// Drop a modified copy on invalidation without writing it back.
    NoWriteBackOnInvalidate,
    /// Answer a recall that overtook its grant at once (as if there were
    /// no grant): the grant is then stale, and two writers can take the
    /// page from each other forever without either writing.
    AnswerRecallBeforeGrant,
}

/// Counters of one node, shared by all its pages. Not part of the protocol's
/// state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Requests sent (read or write, first tries).
    pub requests: u64,
    /// Faults that joined a request already outstanding.
    pub coalesced_faults: u64,
    /// Write faults on a shared copy (upgrades).
    pub upgrades: u64,
    /// Callbacks answered later because the minimum hold time had not passed.
    pub deferred_callbacks: u64,
    /// Grants dropped because a later callback overtook them; the request
    /// was sent again.
    pub stale_grants: u64,
    /// Requests sent again because the home's queue was full (each after a
    /// back-off, [`RETRY_FIRST_US`]).
    pub retries: u64,
    /// Requests answered with Lost.
    pub lost: u64,
    /// Ignored: an answer to no request outstanding (late or repeated).
    pub stale_answers: u64,
    /// Callbacks received again (acked again, nothing else done).
    pub repeated_callbacks: u64,
    /// Callbacks that arrived before the grant they revoke, and waited for it.
    pub callbacks_before_grant: u64,
    /// Ignored: a grant of the wrong kind for the request (never expected).
    pub protocol_errors: u64,
    /// Actions that did not fit in the action list (never expected).
    pub actions_overflow: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Outstanding {
    req: ReqId,
    access: Access,
    /// A write fault came while a read was outstanding: ask for ownership
    /// once the read is granted.
    then_write: bool,
    /// Retry answers to this request so far.
    retries: u8,
    /// The home answered Retry: send the request again then (not before).
    resend_at_us: Option<u64>,
}

impl Outstanding {
    fn new(req: ReqId, access: Access, then_write: bool) -> Outstanding {
        Outstanding {
            req,
            access,
            then_write,
            retries: 0,
            resend_at_us: None,
        }
    }
}

/// The wait before the `retries`-th resend of one request (1 for the first).
fn retry_backoff_us(retries: u8) -> u64 {
    let doublings = u32::from(retries.saturating_sub(1)).min(u64::BITS - 1);
    RETRY_FIRST_US
        .saturating_mul(1 << doublings)
        .min(RETRY_MAX_US)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum CallbackKind {
    Invalidate,
    Downgrade,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Callback {
    kind: CallbackKind,
    seq: Seq,
    /// The owner's grant it revokes, if the home named it.
    grant: Option<Seq>,
}

/// One page's state on a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodePage {
    copy: LocalCopy,
    /// The data version of the copy (the owner's: the version it writes).
    copy_version: Version,
    /// The highest callback sequence number received: a grant with a lower
    /// one was sent before that callback and is stale.
    fence: Seq,
    /// The highest grant sequence number received.
    last_grant: Seq,
    pending: Option<Outstanding>,
    last_req: ReqId,
    /// The newest version this node wrote back.
    written_back: Option<Version>,
    /// Owner: callbacks wait until then.
    hold_until_us: u64,
    deferred: Option<Callback>,
    config: NodeConfig,
}

impl NodePage {
    /// No copy, nothing outstanding.
    pub fn new(config: NodeConfig) -> NodePage {
        NodePage {
            copy: LocalCopy::None,
            copy_version: 0,
            fence: 0,
            last_grant: 0,
            pending: None,
            last_req: 0,
            written_back: None,
            hold_until_us: 0,
            deferred: None,
            config,
        }
    }

    /// The local copy.
    pub fn copy(&self) -> LocalCopy {
        self.copy
    }

    /// The data version of the local copy (meaningless without one).
    pub fn copy_version(&self) -> Version {
        self.copy_version
    }

    /// What the outstanding request asks for, if there is one.
    pub fn outstanding(&self) -> Option<Access> {
        self.pending.map(|p| p.access)
    }

    /// Whether a callback waits (for its grant to arrive or for the hold
    /// time to pass) before it is answered.
    pub fn has_deferred_callback(&self) -> bool {
        self.deferred.is_some()
    }

    /// Whether a request the home answered with Retry waits for its back-off
    /// before it is sent again.
    pub fn waits_to_resend(&self) -> bool {
        self.resend_at_us().is_some()
    }

    fn resend_at_us(&self) -> Option<u64> {
        self.pending.and_then(|p| p.resend_at_us)
    }

    /// When [`NodePage::on_timer`] should be called, if a callback waits for
    /// the hold time or a request for its back-off (the earlier of the two).
    pub fn timer_due_us(&self) -> Option<u64> {
        let hold = self
            .deferred
            .filter(|cb| !self.awaits_grant(cb))
            .map(|_| self.hold_until_us);
        hold.into_iter().chain(self.resend_at_us()).min()
    }

    /// A fault (or an access check) for `access`.
    pub fn on_fault(&mut self, access: Access, stats: &mut NodeStats) -> Fault {
        match (access, self.copy) {
            (Access::Read, LocalCopy::Shared | LocalCopy::Modified)
            | (Access::Write, LocalCopy::Modified) => {
                return Fault::Hit;
            }
            _ => {}
        }
        if let Some(pending) = &mut self.pending {
            stats.coalesced_faults += 1;
            if access == Access::Write && pending.access == Access::Read {
                pending.then_write = true;
            }
            return Fault::Wait { send: None };
        }
        stats.requests += 1;
        if access == Access::Write && self.copy == LocalCopy::Shared {
            stats.upgrades += 1;
        }
        let req = self.next_req();
        self.pending = Some(Outstanding::new(req, access, false));
        Fault::Wait {
            send: Some(self.request_msg(req, access)),
        }
    }

    /// A message from the home, at `now_us` (any monotonic clock).
    pub fn on_message(&mut self, msg: ToNode, now_us: u64, stats: &mut NodeStats) -> NodeActions {
        let mut out = Out {
            actions: NodeActions::new(),
            stats,
        };
        match msg {
            ToNode::Grant {
                req,
                seq,
                mode,
                version,
                data_version,
            } => self.grant(req, seq, mode, version, data_version, now_us, &mut out),
            ToNode::Lost { req } => {
                if self.answers(req) {
                    self.pending = None;
                    out.stats.lost += 1;
                    out.push(NodeAction::FailLost);
                } else {
                    out.stats.stale_answers += 1;
                }
            }
            ToNode::Retry { req } => match &mut self.pending {
                // Sent again after a back-off, from `on_timer`. A Retry
                // while one waits is a repeat.
                Some(p) if p.req == req && p.resend_at_us.is_none() => {
                    // Counted up to the longest wait only: a page's state
                    // takes few values (and the model stays finite).
                    if retry_backoff_us(p.retries) < RETRY_MAX_US {
                        p.retries += 1;
                    }
                    let wait_us = retry_backoff_us(p.retries);
                    #[cfg(test)]
                    let wait_us = match self.config.fixed_retry_wait_us {
                        Some(fixed) => {
                            p.retries = 0;
                            fixed
                        }
                        None => wait_us,
                    };
                    p.resend_at_us = Some(now_us.saturating_add(wait_us));
                }
                _ => out.stats.stale_answers += 1,
            },
            ToNode::Invalidate { seq, grant } => {
                let cb = Callback {
                    kind: CallbackKind::Invalidate,
                    seq,
                    grant,
                };
                self.callback(cb, now_us, &mut out);
            }
            ToNode::Downgrade { seq, grant } => {
                let cb = Callback {
                    kind: CallbackKind::Downgrade,
                    seq,
                    grant: Some(grant),
                };
                self.callback(cb, now_us, &mut out);
            }
        }
        out.actions
    }

    /// The clock passed [`NodePage::timer_due_us`]: answer the callback that
    /// waited for the hold time, send again the request that waited for
    /// its back-off.
    pub fn on_timer(&mut self, now_us: u64, stats: &mut NodeStats) -> NodeActions {
        let mut out = Out {
            actions: NodeActions::new(),
            stats,
        };
        if let Some(p) = &mut self.pending {
            if p.resend_at_us.is_some_and(|at| now_us >= at) {
                p.resend_at_us = None;
                let (req, access) = (p.req, p.access);
                out.stats.retries += 1;
                out.push(NodeAction::Send(self.request_msg(req, access)));
            }
        }
        if let Some(cb) = self.deferred {
            if !self.awaits_grant(&cb) && now_us >= self.hold_until_us {
                self.deferred = None;
                self.answer(cb, &mut out);
            }
        }
        out.actions
    }

    /// Drop the local copy to free memory: a shared copy silently, a
    /// modified one after writing it back. A callback waiting for the hold
    /// time is answered first.
    pub fn evict(&mut self, stats: &mut NodeStats) -> NodeActions {
        let mut out = Out {
            actions: NodeActions::new(),
            stats,
        };
        if let Some(cb) = self.deferred {
            if !self.awaits_grant(&cb) {
                self.deferred = None;
                self.answer(cb, &mut out);
            }
        }
        match self.copy {
            LocalCopy::None => {}
            LocalCopy::Shared => out.push(NodeAction::Zap),
            LocalCopy::Modified => {
                let version = self.copy_version;
                self.written_back = Some(version);
                out.push(NodeAction::WriteBack { version });
                out.push(NodeAction::Zap);
                out.push(NodeAction::Send(ToHome::WriteBack { version }));
            }
        }
        self.copy = LocalCopy::None;
        out.actions
    }

    fn answers(&self, req: ReqId) -> bool {
        self.pending.is_some_and(|p| p.req == req)
    }

    fn next_req(&mut self) -> ReqId {
        self.last_req = self.last_req.wrapping_add(1);
        self.last_req
    }

    fn request_msg(&self, req: ReqId, access: Access) -> ToHome {
        match access {
            Access::Read => ToHome::ReadReq { req },
            Access::Write => ToHome::WriteReq {
                req,
                upgrade: self.copy == LocalCopy::Shared,
            },
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn grant(
        &mut self,
        req: ReqId,
        seq: Seq,
        mode: Mode,
        version: Version,
        data_version: Version,
        now_us: u64,
        out: &mut Out<'_>,
    ) {
        self.last_grant = self.last_grant.max(seq);
        let Some(pending) = self.pending.filter(|p| p.req == req) else {
            out.stats.stale_answers += 1;
            return;
        };
        let expected = match pending.access {
            Access::Read => Mode::Shared,
            Access::Write => Mode::Exclusive,
        };
        if mode != expected {
            out.stats.protocol_errors += 1;
            return;
        }
        if seq < self.fence && !self.ignore_fence() {
            // A callback sent after this grant already reached us (and was
            // answered as if we had no grant): the home no longer counts us
            // as a holder. Ask again.
            out.stats.stale_grants += 1;
            let req = self.next_req();
            self.pending = Some(Outstanding::new(req, pending.access, pending.then_write));
            out.push(NodeAction::Send(self.request_msg(req, pending.access)));
            self.resume_deferred(now_us, out);
            return;
        }
        self.pending = None;
        match mode {
            Mode::Shared => {
                out.push(NodeAction::Fetch { data_version });
                out.push(NodeAction::Map(Mode::Shared));
                self.copy = LocalCopy::Shared;
                self.copy_version = data_version;
                out.push(NodeAction::Wake(Access::Read));
                if pending.then_write {
                    out.stats.requests += 1;
                    out.stats.upgrades += 1;
                    let req = self.next_req();
                    self.pending = Some(Outstanding::new(req, Access::Write, false));
                    out.push(NodeAction::Send(self.request_msg(req, Access::Write)));
                }
            }
            Mode::Exclusive => {
                // An upgrade keeps its copy: nobody wrote since it was
                // granted, or it would have been invalidated.
                if self.copy != LocalCopy::Shared || self.copy_version != data_version {
                    out.push(NodeAction::Fetch { data_version });
                }
                out.push(NodeAction::Map(Mode::Exclusive));
                self.copy = LocalCopy::Modified;
                self.copy_version = version;
                self.hold_until_us = now_us.saturating_add(self.config.min_hold_us);
                out.push(NodeAction::Wake(Access::Write));
            }
        }
        self.resume_deferred(now_us, out);
    }

    /// Whether `cb` names a grant that has not arrived yet.
    fn awaits_grant(&self, cb: &Callback) -> bool {
        cb.grant.is_some_and(|g| g > self.last_grant) && !self.answer_recall_before_grant()
    }

    /// A grant arrived: a callback that waited for it now waits only for
    /// the hold time.
    fn resume_deferred(&mut self, now_us: u64, out: &mut Out<'_>) {
        if let Some(cb) = self.deferred {
            if !self.awaits_grant(&cb) {
                self.deferred = None;
                self.callback(cb, now_us, out);
            }
        }
    }

    fn callback(&mut self, cb: Callback, now_us: u64, out: &mut Out<'_>) {
        // Callbacks to one node come in sequence order (the home waits for
        // each ack before it calls this node back again), so one at or
        // below the fence, or equal to the one waiting, is a repeat.
        if cb.seq <= self.fence {
            // Ack again (the home ignores a repeated ack), change nothing.
            out.stats.repeated_callbacks += 1;
            self.send_ack(cb, out);
            return;
        }
        if self.deferred.is_some_and(|d| d.seq == cb.seq) {
            out.stats.repeated_callbacks += 1;
            return;
        }
        if let Some(older) = self.deferred.take() {
            // The home waits for an ack before it calls back again, so this
            // does not happen; answer the older one rather than lose it.
            self.answer(older, out);
        }
        if self.awaits_grant(&cb) {
            // This callback overtook the grant it revokes: wait for the grant, let the faulting vCPU use it, then
            // answer (after the hold time). The home sent that grant, so it
            // comes (or this node is declared lost).
            out.stats.callbacks_before_grant += 1;
            self.deferred = Some(cb);
            return;
        }
        if self.copy == LocalCopy::Modified && now_us < self.hold_until_us {
            out.stats.deferred_callbacks += 1;
            self.deferred = Some(cb);
            return;
        }
        self.answer(cb, out);
    }

    fn answer(&mut self, cb: Callback, out: &mut Out<'_>) {
        self.fence = self.fence.max(cb.seq);
        if self.copy == LocalCopy::Modified && !self.skip_write_back(cb) {
            let version = self.copy_version;
            self.written_back = Some(version);
            out.push(NodeAction::WriteBack { version });
        }
        match cb.kind {
            CallbackKind::Invalidate => {
                if self.copy != LocalCopy::None {
                    out.push(NodeAction::Zap);
                }
                self.copy = LocalCopy::None;
            }
            CallbackKind::Downgrade => {
                if self.copy == LocalCopy::Modified {
                    out.push(NodeAction::WriteProtect);
                    self.copy = LocalCopy::Shared;
                }
            }
        }
        self.send_ack(cb, out);
    }

    fn send_ack(&self, cb: Callback, out: &mut Out<'_>) {
        let seq = cb.seq;
        let written_back = self.written_back;
        out.push(NodeAction::Send(match cb.kind {
            CallbackKind::Invalidate => ToHome::InvalidateAck { seq, written_back },
            CallbackKind::Downgrade => ToHome::DowngradeAck {
                seq,
                written_back,
                kept: self.copy != LocalCopy::None,
            },
        }));
    }

    /// Moves this page's clock back by `now_us`, so that `now_us` becomes
    /// 0: only differences of times matter, and the model checker keeps
    /// each node's clock at 0 (its states stay finite).
    #[cfg(test)]
    pub(crate) fn rebase_clock(&mut self, now_us: u64) {
        self.hold_until_us = self.hold_until_us.saturating_sub(now_us);
        if let Some(p) = &mut self.pending {
            p.resend_at_us = p.resend_at_us.map(|at| at.saturating_sub(now_us));
        }
    }

    #[cfg(test)]
    fn ignore_fence(&self) -> bool {
        self.config.mutation == Some(NodeMutation::IgnoreFence)
    }
    #[cfg(not(test))]
    fn ignore_fence(&self) -> bool {
        false
    }
    #[cfg(test)]
    fn answer_recall_before_grant(&self) -> bool {
        self.config.mutation == Some(NodeMutation::AnswerRecallBeforeGrant)
    }
    #[cfg(not(test))]
    fn answer_recall_before_grant(&self) -> bool {
        false
    }
    #[cfg(test)]
    fn skip_write_back(&self, cb: Callback) -> bool {
        self.config.mutation == Some(NodeMutation::NoWriteBackOnInvalidate)
            && cb.kind == CallbackKind::Invalidate
    }
    #[cfg(not(test))]
    fn skip_write_back(&self, _cb: Callback) -> bool {
        false
    }
}

/// The actions being collected and the stats being counted.
struct Out<'a> {
    actions: NodeActions,
    stats: &'a mut NodeStats,
}

impl Out<'_> {
    fn push(&mut self, action: NodeAction) {
        if !self.actions.push(action) {
            self.stats.actions_overflow += 1;
        }
    }
}
