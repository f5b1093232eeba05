//! One page's node-side state (`coherence::NodePage`) and the carrying out
//! of its actions: each event of a page (a fault, a frame from the home, a
//! timer, an eviction) is fed with the page's state locked, and its actions
//! (handler calls, messages to the home, wake-ups) are all done before the
//! lock is released.

use std::time::Instant;

use coherence::{Access, Fault, NodeAction, NodeActions, NodeConfig, NodePage, ToNode};
use parking_lot::{Condvar, Mutex, MutexGuard};

use super::link::Link;
use super::{Recall, RecallAnswer, Shared};
use crate::error::TransportError;
use crate::page::{Page, PAGE_SIZE};
use crate::wire::{Status, ToNodeFrame};

/// A page of one home, as this node sees it.
#[derive(Debug)]
pub(crate) struct Slot {
    gpa: u64,
    offset: u64,
    state: Mutex<SlotState>,
    /// Signalled on every event waiters care about.
    changed: Condvar,
}

#[derive(Debug)]
struct SlotState {
    page: NodePage,
    /// Counts wake-ups and failures: a waiter waits for it to change.
    events: u64,
    /// The latest failure and the event number it came with.
    failure: Option<(u64, Failure)>,
    /// The event numbers of the latest grants that allowed reads, and
    /// writes.
    granted: [u64; 2],
}

#[derive(Debug, Clone)]
enum Failure {
    Lost,
    Refused(Status),
    Down,
}

impl Slot {
    pub(crate) fn new(gpa: u64, offset: u64, min_hold_us: u64) -> Self {
        Self {
            gpa,
            offset,
            state: Mutex::new(SlotState {
                page: NodePage::new(NodeConfig::new(min_hold_us)),
                events: 0,
                failure: None,
                granted: [0; 2],
            }),
            changed: Condvar::new(),
        }
    }
}

fn access_index(access: Access) -> usize {
    match access {
        Access::Read => 0,
        Access::Write => 1,
    }
}

impl SlotState {
    /// A grant woke the faults waiting for `access` (a write grant allows
    /// reads too).
    fn granted(&mut self, access: Access) {
        self.signal(None);
        self.granted[0] = self.events;
        if access == Access::Write {
            self.granted[1] = self.events;
        }
    }

    fn signal(&mut self, failure: Option<Failure>) {
        self.events += 1;
        if let Some(f) = failure {
            self.failure = Some((self.events, f));
        }
    }
}

fn failure_error(failure: &Failure, gpa: u64, link: &Link) -> TransportError {
    match failure {
        Failure::Lost => TransportError::CoherentDataLost {
            gpa,
            node: link.node.clone(),
        },
        Failure::Refused(status) => TransportError::Refused {
            node: link.node.clone(),
            status: *status,
        },
        Failure::Down => link.down("coherence connection lost"),
    }
}

/// See [`super::CoherentNode::acquire`].
pub(crate) fn acquire(
    shared: &Shared,
    link: &Link,
    gpa: u64,
    offset: u64,
    access: Access,
    deadline: Instant,
) -> Result<(), TransportError> {
    let slot = link.slot(shared, gpa, offset);
    let mut st = slot.state.lock();
    loop {
        if link.is_dead() {
            return Err(link.down("coherence connection lost"));
        }
        let seen = st.events;
        let fault = {
            let mut stats = shared.stats.lock();
            st.page.on_fault(access, &mut stats)
        };
        match fault {
            Fault::Hit => return Ok(()),
            Fault::Wait { send: Some(msg) } => link.send(offset, &msg, None)?,
            Fault::Wait { send: None } => {}
        }
        while st.events == seen {
            if slot.changed.wait_until(&mut st, deadline).timed_out() {
                return Err(TransportError::Timeout {
                    node: link.node.clone(),
                    timeout_ms: shared.config.timeout_ms,
                });
            }
        }
        if let Some((at, failure)) = &st.failure {
            if *at > seen {
                return Err(failure_error(failure, gpa, link));
            }
        }
        // A grant for this access was installed: done, even if the page
        // was taken away since (by a recall, or an eviction by the thread
        // the install woke): asking again would bring back a page nobody
        // is waiting for. The faulting thread faults again if it needs it.
        if st.granted[access_index(access)] > seen {
            return Ok(());
        }
        // Woken by another grant (a read one, for a write fault that joined
        // it): the fault is looked at again.
    }
}

/// See [`super::CoherentNode::evict`].
pub(crate) fn evict(
    shared: &Shared,
    link: &Link,
    gpa: u64,
    offset: u64,
) -> Result<(), TransportError> {
    let slot = link.slot(shared, gpa, offset);
    let mut st = slot.state.lock();
    let actions = {
        let mut stats = shared.stats.lock();
        st.page.evict(&mut stats)
    };
    run(shared, link, &slot, &mut st, actions, Grant::None)
}

/// Reads a granted page from the home (over RDMA, where grants come
/// without it).
pub(crate) type ReadGranted<'a> = &'a dyn Fn() -> Result<Box<Page>, TransportError>;

/// A frame from the home about `slot`'s page. Returns when the page's
/// timer is due, if a callback waits for the hold time. `read`: how a
/// grant that came without its page gets it.
pub(crate) fn on_frame(
    shared: &Shared,
    link: &Link,
    slot: &Slot,
    frame: ToNodeFrame<'_>,
    read: Option<ReadGranted<'_>>,
) -> Result<Option<u64>, TransportError> {
    let mut st = slot.state.lock();
    match frame {
        ToNodeFrame::Refused { status, .. } => {
            tracing::debug!(node = %link.node, gpa = slot.gpa, %status, "coherence request refused");
            // The home did not take the request: nothing of this page is
            // held or asked for now.
            if st.page.copy() == coherence::LocalCopy::None {
                st.page = NodePage::new(NodeConfig::new(shared.config.min_hold_us));
            }
            st.signal(Some(Failure::Refused(status)));
            slot.changed.notify_all();
            Ok(None)
        }
        ToNodeFrame::Msg(f) => {
            let page = match f.page {
                Some(bytes) if matches!(f.msg, ToNode::Grant { .. }) => Some(bytes),
                Some(_) => return Err(link.down("a page with a message that carries none")),
                None => None,
            };
            let actions = {
                let mut stats = shared.stats.lock();
                st.page.on_message(f.msg, shared.now_us(), &mut stats)
            };
            let grant = match (page, read) {
                (Some(bytes), _) => Grant::Came(bytes),
                (None, Some(read)) => Grant::Read(read),
                (None, None) => Grant::None,
            };
            run(shared, link, slot, &mut st, actions, grant)?;
            Ok(st.page.timer_due_us())
        }
    }
}

/// The hold time of `slot`'s deferred callback may have passed.
pub(crate) fn on_timer(
    shared: &Shared,
    link: &Link,
    slot: &Slot,
) -> Result<Option<u64>, TransportError> {
    let mut st = slot.state.lock();
    let actions = {
        let mut stats = shared.stats.lock();
        st.page.on_timer(shared.now_us(), &mut stats)
    };
    run(shared, link, slot, &mut st, actions, Grant::None)?;
    Ok(st.page.timer_due_us())
}

/// The connection to the page's home is gone: the copy is dropped (the
/// home forgets this node), the page starts afresh, waiters fail.
/// `call_handler`: tell the embedder to drop the copy (not after it panicked).
pub(crate) fn forget(shared: &Shared, slot: &Slot, node: &str, call_handler: bool) {
    let mut st = slot.state.lock();
    if call_handler && st.page.copy() != coherence::LocalCopy::None {
        tracing::debug!(
            node,
            gpa = slot.gpa,
            "dropping a copy: its home connection is gone"
        );
        let _ = shared
            .handler
            .recall(slot.gpa, Recall::Invalidate { write_back: false });
    }
    st.page = NodePage::new(NodeConfig::new(shared.config.min_hold_us));
    st.signal(Some(Failure::Down));
    slot.changed.notify_all();
}

/// Where a `Fetch` gets a grant's page.
enum Grant<'a> {
    /// Not with this event.
    None,
    /// With the frame (TCP).
    Came(&'a [u8]),
    /// Read from the home when needed (RDMA; an upgrade needs none).
    Read(ReadGranted<'a>),
}

/// A fetched page, until it is installed.
enum Fetched<'a> {
    Nothing,
    Borrowed(&'a Page),
    Owned(Box<Page>),
}

impl Fetched<'_> {
    fn page(&self) -> Option<&Page> {
        match self {
            Fetched::Nothing => None,
            Fetched::Borrowed(p) => Some(p),
            Fetched::Owned(p) => Some(p),
        }
    }
}

/// Carries out `actions` in order. `grant`: where a `Fetch` gets the
/// page. The handler's recall is asked once per
/// group of local actions (write back, zap, write-protect) before the
/// message that reports them.
fn run(
    shared: &Shared,
    link: &Link,
    slot: &Slot,
    st: &mut MutexGuard<'_, SlotState>,
    actions: NodeActions,
    grant: Grant<'_>,
) -> Result<(), TransportError> {
    let mut recall = Pending::default();
    let mut fetched = Fetched::Nothing;
    let mut written: Option<Box<Page>> = None;
    for action in actions.iter() {
        match action {
            NodeAction::WriteBack { .. } => recall.write_back = true,
            NodeAction::Zap => recall.zap = true,
            NodeAction::WriteProtect => recall.protect = true,
            NodeAction::Fetch { .. } => {
                fetched = match &grant {
                    Grant::Came(bytes) => {
                        Fetched::Borrowed(<&Page>::try_from(*bytes).map_err(|_| {
                            link.shut();
                            link.down("a grant with a page of the wrong size")
                        })?)
                    }
                    Grant::Read(read) => Fetched::Owned(read()?),
                    Grant::None => {
                        link.shut();
                        return Err(link.down("a grant without the page to fetch"));
                    }
                };
            }
            NodeAction::Map(mode) => {
                shared.handler.install(slot.gpa, mode, fetched.page());
                fetched = Fetched::Nothing;
            }
            NodeAction::Send(msg) => {
                if let Some(data) = recall.ask(shared, link, slot.gpa)? {
                    written = Some(data);
                }
                link.send(slot.offset, &msg, written.take().as_deref())?;
            }
            NodeAction::Wake(access) => {
                st.granted(access);
                slot.changed.notify_all();
            }
            NodeAction::FailLost => {
                st.signal(Some(Failure::Lost));
                slot.changed.notify_all();
            }
        }
    }
    // A shared copy evicted: dropped silently, no message.
    recall.ask(shared, link, slot.gpa)?;
    Ok(())
}

/// Local actions gathered before the message that reports them.
#[derive(Default)]
struct Pending {
    write_back: bool,
    zap: bool,
    protect: bool,
}

impl Pending {
    /// Asks the handler to carry them out; the contents to write back.
    fn ask(
        &mut self,
        shared: &Shared,
        link: &Link,
        gpa: u64,
    ) -> Result<Option<Box<Page>>, TransportError> {
        let recall = match (self.zap, self.protect, self.write_back) {
            (true, _, write_back) => Recall::Invalidate { write_back },
            (false, true, _) | (false, false, true) => Recall::Downgrade,
            (false, false, false) => return Ok(None),
        };
        *self = Pending::default();
        let answer = shared.handler.recall(gpa, recall);
        match (recall.needs_data(), answer) {
            (true, RecallAnswer::WriteBack(data)) => Ok(Some(data)),
            (true, RecallAnswer::Done) => {
                // Nothing to write back: the home must not think it has
                // the data. This node gives up its connection to that home
                // (it is lost there; its modified pages are marked lost).
                tracing::error!(node = %link.node, gpa, "the embedder returned no contents for a write-back; leaving this home");
                link.shut();
                Err(link.down("the embedder gave no contents to write back"))
            }
            (false, _) => Ok(None),
        }
    }
}

const _: () = assert!(PAGE_SIZE == std::mem::size_of::<Page>());
