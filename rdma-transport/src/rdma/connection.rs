//! One RDMA connection to a page-server: the TCP control connection (it
//! carried the HELLO that exchanged the QP endpoints; its EOF means the
//! peer is gone), one RC QP with its CQ, and the table of batches in flight.
//!
//! A batch is one chain of RDMA READs or WRITEs posted with one
//! `ibv_post_send`, every work request carrying the batch's request id as
//! `wr_id` and only the last one signaled. On an RC QP completions arrive in
//! order, so the last one's success means the whole batch succeeded; any
//! error completion (signaled or not) fails the batch it names and tears
//! the QP down.
//!
//! A batch given up on before its completion tears the QP down too (the
//! device may still move its pages), except a READ into pool frames that a
//! hedged read abandons (`abandon_read`): its frames and send-queue slots
//! are held until its completion, and the QP, with every other batch in
//! flight on it, goes on.

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::deadline::Deadline;
use super::device::ClientDevice;
use super::poller::PollerHandle;
use super::port::{connect_qp, random_psn};
use crate::page::PAGE_SIZE;
use crate::parking::Parking;
use crate::pool::PageFrame;
use crate::tcp::{
    dial, handshake, Claim, ClientAuth, ConnectError, Inflight, TcpConnection, Waiter,
    CODE_CONN_LOST,
};
use crate::verbs::{
    CompletionChannel, CompletionQueue, QueuePair, SendWr, Sge, VerbsError, WcStatus,
    WorkCompletion,
};
use crate::wire::HelloAck;

/// Most work requests in one batch (one `ibv_post_send` chain).
pub(crate) const MAX_BATCH: usize = 64;
/// Completion codes `CODE_WC_BASE + status` carry a failed work completion's
/// `ibv_wc_status` (codes below are the TCP path's).
pub(crate) const CODE_WC_BASE: u32 = 0x1000;
/// Work completions taken per `ibv_poll_cq` call.
const POLL_BATCH: usize = 32;

/// Why an RDMA connection could not be made.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DialError {
    /// TCP connect or HELLO failed.
    #[error(transparent)]
    Tcp(#[from] ConnectError),
    /// Creating or connecting the QP failed.
    #[error("RDMA set-up with {addr}: {source}")]
    Verbs {
        addr: String,
        #[source]
        source: VerbsError,
    },
}

/// What a dial ended with: RDMA, or plain TCP when the server has no RDMA.
#[derive(Debug)]
pub(crate) enum Dialed {
    Rdma(Arc<RdmaConnection>),
    TcpOnly(Arc<TcpConnection>),
}

/// A connected RC QP to one page-server.
///
/// Field order is drop order: the QP is destroyed first, so no device access
/// to a quarantined frame can happen once the frames are freed.
#[derive(Debug)]
pub(crate) struct RdmaConnection {
    qp: QueuePair,
    cq: CompletionQueue,
    pub(crate) node_id: String,
    control: TcpStream,
    remote_addr: u64,
    region_size_bytes: u64,
    rkey: AtomicU32,
    lkey: u32,
    pub(crate) inflight: Inflight,
    /// Work requests of the batch in each inflight slot (for SQ accounting).
    batch_wrs: Box<[AtomicU32]>,
    /// Send-queue slots free; unsignaled requests hold theirs until the
    /// signaled end of their batch completes.
    sq_free: AtomicIsize,
    /// Held by whoever polls the CQ; carries the completion array.
    poll: Mutex<[WorkCompletion; POLL_BATCH]>,
    /// Callers parked on this connection; its poller watches the CQ only
    /// while there are any.
    pub(crate) parking: Parking<PollerHandle>,
    broken: AtomicBool,
    /// The fence marker was posted (once per QP).
    fence_posted: AtomicBool,
    /// The fence marker's completion was polled: every request posted
    /// before it is finished and the device touches none of their pages.
    fenced: AtomicBool,
    pub(crate) ack: HelloAck,
    quarantine: Mutex<Vec<PageFrame>>,
    /// READ batches given up on with the QP kept (`abandon_read`), until
    /// their completions are polled.
    abandoned: Mutex<Vec<Abandoned>>,
}

/// A READ batch of pool frames given up on without a teardown: what it
/// holds until its completion says the device is done with it.
#[derive(Debug)]
struct Abandoned {
    id: u64,
    /// Its work requests (send-queue slots).
    wrs: u32,
    frames: Vec<PageFrame>,
}

/// One page of a batch: its offset in the peer's region and the local page
/// it is read into or written from (a pool frame, or registered caller
/// memory) with that memory's lkey.
#[derive(Clone, Copy)]
pub(crate) struct PageOp {
    pub(crate) offset: u64,
    pub(crate) local: *mut u8,
    pub(crate) lkey: u32,
}

/// `wr_id` of the marker that `fence` posts after the teardown; request ids
/// (`generation << SLOT_BITS | slot`) never reach it.
const FENCE_WR_ID: u64 = u64::MAX;
/// Longest a teardown waits for the device to flush the QP's requests.
const FENCE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// A failed submission. When `armed` is set the batch holds an inflight
/// slot that the caller must still `finish` or `cancel`.
#[derive(Debug)]
pub(crate) struct SubmitError {
    pub(crate) armed: Option<u64>,
    pub(crate) reason: String,
}

/// Connects to `addr`, offering RDMA in the AUTH message. The server answers
/// with its QP endpoint and region key (RDMA) or without (TCP only).
pub(crate) fn dial_rdma(
    addr: &str,
    auth: &ClientAuth<'_>,
    timeout: std::time::Duration,
    device: &ClientDevice,
    channel: &CompletionChannel,
) -> Result<Dialed, DialError> {
    let verbs_err = |source| DialError::Verbs {
        addr: addr.to_owned(),
        source,
    };
    let mut stream = dial(addr, timeout)?;
    let (qp, cq) = device.create_qp(channel).map_err(verbs_err)?;
    let psn = random_psn();
    let ack = handshake(&mut stream, addr, auth, Some(device.port.hello(&qp, psn)))?;
    let node_id = auth.node_id;
    let Some(remote) = ack.rdma else {
        return Ok(Dialed::TcpOnly(Arc::new(TcpConnection::from_handshaken(
            auth, addr, stream, ack,
        )?)));
    };
    connect_qp(&qp, &device.port, psn, &remote, device.timeouts).map_err(verbs_err)?;
    stream
        .set_nonblocking(true)
        .map_err(|source| ConnectError::Io {
            addr: addr.to_owned(),
            source,
        })?;
    let sq_depth = qp.caps().max_send_wr;
    Ok(Dialed::Rdma(Arc::new(RdmaConnection {
        qp,
        cq,
        node_id: node_id.to_owned(),
        control: stream,
        remote_addr: remote.region_addr,
        region_size_bytes: ack.region_size_bytes,
        rkey: AtomicU32::new(remote.rkey),
        lkey: device.lkey(),
        inflight: Inflight::new(),
        batch_wrs: (0..crate::tcp::SLOTS).map(|_| AtomicU32::new(0)).collect(),
        // One slot stays free for the fence marker.
        sq_free: AtomicIsize::new(isize::try_from(sq_depth).unwrap_or(0) - 1),
        poll: Mutex::new([WorkCompletion::default(); POLL_BATCH]),
        parking: Parking::new(),
        broken: AtomicBool::new(false),
        fence_posted: AtomicBool::new(false),
        fenced: AtomicBool::new(false),
        ack,
        quarantine: Mutex::new(Vec::new()),
        abandoned: Mutex::new(Vec::new()),
    })))
}

impl RdmaConnection {
    /// The local QP number (tests check that a torn-down QP was replaced).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    /// The lkey of the page pool (for `PageOp`s on pool frames).
    pub(crate) fn pool_lkey(&self) -> u32 {
        self.lkey
    }

    /// Bytes the peer exports: offsets must stay below this.
    pub(crate) fn region_size_bytes(&self) -> u64 {
        self.region_size_bytes
    }

    pub(crate) fn is_broken(&self) -> bool {
        self.broken.load(Ordering::SeqCst)
    }

    /// Tears the QP down (error state: outstanding requests flush and the
    /// device stops touching their frames), closes the control connection
    /// (so the server destroys its QP) and fails every batch in flight with
    /// `code`. Idempotent.
    pub(crate) fn mark_broken(&self, code: u32) {
        if !self.broken.swap(true, Ordering::SeqCst) {
            if let Err(err) = self.qp.modify_to_error() {
                tracing::debug!(node = %self.node_id, %err, "moving the QP to the error state failed");
            }
            let _ = self.control.shutdown(std::net::Shutdown::Both);
        }
        self.inflight.fail_all(code);
    }

    /// Tears the QP down (`mark_broken`) and waits until the device is done
    /// with every work request posted on it, so that the pages they name
    /// (registered caller memory) can go back to the caller.
    ///
    /// `mark_broken` alone only moves the QP to the error state: the verbs
    /// contract frees a work request's buffers at its completion, and a
    /// READ response being placed while the state changes may still land.
    /// As `ib_drain_qp` does in the kernel, this posts one marker after the
    /// teardown (a signaled zero-length WRITE, which an errored QP completes
    /// with a flush status) and polls the CQ until the marker's completion:
    /// send-queue completions come in order, so every request before it is
    /// finished. True once fenced; false when the marker could not be
    /// posted or did not complete within `FENCE_TIMEOUT` (logged: the
    /// caller's pages may then still be written).
    pub(crate) fn fence(&self) -> bool {
        self.mark_broken(CODE_CONN_LOST);
        if !self.fence_posted.swap(true, Ordering::SeqCst) {
            let mut wr = [SendWr::rdma_write(FENCE_WR_ID, &[], 0, 0).signaled()];
            if let Err(err) = self.qp.post_send(&mut wr) {
                tracing::warn!(node = %self.node_id, %err, "posting the fence marker failed; registered caller pages of failed requests may still be written");
                return false;
            }
        }
        let deadline = Instant::now() + FENCE_TIMEOUT;
        let mut spins = 0u32;
        while !self.fenced.load(Ordering::Acquire) {
            self.progress();
            spins = spins.wrapping_add(1);
            if spins % 16 == 0 && Instant::now() >= deadline {
                tracing::warn!(node = %self.node_id, "the QP was not drained within {FENCE_TIMEOUT:?}; registered caller pages of failed requests may still be written");
                return false;
            }
            std::thread::yield_now();
        }
        true
    }

    /// Keeps `frame` until the QP is destroyed: a request on it failed or
    /// timed out, so the device may still write (or read) it.
    pub(crate) fn quarantine(&self, frame: PageFrame) {
        self.quarantine.lock().push(frame);
    }

    /// Gives up on READ batch `id` without tearing the QP down: a hedged
    /// read that another replica serves now, while the other batches in
    /// flight here go on. Every page of the batch must be a pool frame
    /// (never the caller's memory, which cannot wait for the device). If
    /// the batch is still in flight, `take_frames` hands its frames over:
    /// they stay out of the pool, and its work requests keep their
    /// send-queue slots, until its completion is polled, by the poller
    /// thread if nobody else (a failed one tears the QP down, and the
    /// frames go with the connection). Returns what `Inflight::cancel`
    /// does: the batch's code if it completed after all (its frames were
    /// not taken), `None` if abandoned.
    pub(crate) fn abandon_read(
        &self,
        id: u64,
        take_frames: impl FnOnce() -> Vec<PageFrame>,
    ) -> Option<u32> {
        // Held across the cancel: a completion that finds the batch
        // cancelled (a stale claim) looks for it here only after it is in.
        let mut abandoned = self.abandoned.lock();
        // Read while the slot is still this batch's (`cancel` frees it).
        let wrs = self.batch_wrs[slot_of(id)].load(Ordering::Relaxed);
        let code = self.inflight.cancel(id);
        if code.is_none() {
            abandoned.push(Abandoned {
                id,
                wrs,
                frames: take_frames(),
            });
            // Counts as a parked caller: the poller watches the CQ until
            // the completion comes, so the frames come back even when no
            // request uses this connection meanwhile (its node is avoided
            // for a while after missing the delay).
            self.parking.enter();
        }
        code
    }

    /// The completion of a batch nobody waits for: if it was abandoned
    /// with the QP kept, the device is done with its frames (back to the
    /// pool) and its send-queue slots.
    #[cold]
    fn release_abandoned(&self, id: u64) {
        let mut abandoned = self.abandoned.lock();
        let Some(i) = abandoned.iter().position(|a| a.id == id) else {
            return;
        };
        let batch = abandoned.swap_remove(i);
        drop(abandoned);
        self.parking.leave();
        self.sq_free.fetch_add(batch.wrs as isize, Ordering::AcqRel);
        // The device is done with them: back to the pool.
        drop(batch.frames);
    }

    /// READ batches abandoned with the QP kept whose completion was not
    /// polled yet (tests).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn abandoned_batches(&self) -> usize {
        self.abandoned.lock().len()
    }

    /// Test hook: the next batches use a wrong rkey (until the QP fails and
    /// is rebuilt).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn corrupt_rkey(&self) {
        self.rkey.fetch_xor(0x00ff_ff00, Ordering::SeqCst);
    }

    /// Test hook: the rkey the next batches use.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn rkey(&self) -> u32 {
        self.rkey.load(Ordering::SeqCst)
    }

    /// Test hook: the next batches use `rkey` (until the QP fails and is
    /// rebuilt).
    #[cfg(feature = "test-hooks")]
    pub(crate) fn set_rkey(&self, rkey: u32) {
        self.rkey.store(rkey, Ordering::SeqCst);
    }

    /// Arms the CQ: its next completion raises an event on the poller's
    /// channel.
    pub(crate) fn arm(&self) {
        if let Err(err) = self.cq.req_notify(false) {
            tracing::warn!(node = %self.node_id, %err, "arming the CQ failed; dropping the connection");
            self.mark_broken(CODE_CONN_LOST);
        }
    }

    pub(crate) fn control_fd(&self) -> RawFd {
        self.control.as_raw_fd()
    }

    /// Reads the control connection (non-blocking): EOF or an error means
    /// the page-server is gone, and the connection is torn down.
    pub(crate) fn check_control(&self) {
        let mut buf = [0u8; 64];
        loop {
            match (&self.control).read(&mut buf) {
                Ok(0) => {
                    // After `mark_broken` (this side's own teardown, which
                    // shuts the socket) the EOF is ours, not the server's.
                    if !self.is_broken() {
                        tracing::info!(node = %self.node_id, "page-server closed the control connection");
                    }
                    self.mark_broken(CODE_CONN_LOST);
                    return;
                }
                // The server sends nothing after HELLO_ACK; ignore stray bytes.
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    if !self.is_broken() {
                        tracing::info!(node = %self.node_id, err = %e, "control connection failed");
                    }
                    self.mark_broken(CODE_CONN_LOST);
                    return;
                }
            }
        }
    }

    /// Posts one batch (at most [`MAX_BATCH`] pages) and returns its request
    /// id; the caller waits on `waiter`, then calls `inflight.finish` or
    /// `inflight.cancel` with it. Every `local` must be a pool frame or
    /// registered memory (its `lkey`) that stays untouched until then, or,
    /// when the batch failed, until `fence` (caller memory) or the QP's
    /// destruction (quarantined frames).
    pub(crate) fn submit(
        &self,
        write: bool,
        ops: &[PageOp],
        waiter: &Waiter,
        deadline: &Deadline,
    ) -> Result<u64, SubmitError> {
        let n = ops.len();
        debug_assert!(n > 0 && n <= MAX_BATCH);
        let fail = |armed, reason: &str| SubmitError {
            armed,
            reason: reason.to_owned(),
        };
        if self.is_broken() {
            return Err(fail(None, "connection lost"));
        }
        // Room in the send queue first: a slot, once armed, counts on the
        // caller's waiter and must then be completed.
        if !self.reserve_sq(n, deadline) {
            return Err(fail(None, "send queue full until the deadline"));
        }
        let id = loop {
            if let Some(id) = self.inflight.arm(std::ptr::null_mut(), 0, waiter, false) {
                break id;
            }
            if deadline.passed() {
                self.sq_free.fetch_add(n as isize, Ordering::AcqRel);
                return Err(fail(None, "no free request slot before the deadline"));
            }
            self.progress();
            std::thread::yield_now();
        };
        self.batch_wrs[slot_of(id)].store(n as u32, Ordering::Relaxed);
        // A teardown that ran before the slot was armed did not fail it.
        if self.is_broken() {
            self.inflight.fail_all(CODE_CONN_LOST);
            return Err(fail(Some(id), "connection lost"));
        }
        let posted = match n {
            1 => self.post::<1>(write, ops, id),
            2..=16 => self.post::<16>(write, ops, id),
            _ => self.post::<MAX_BATCH>(write, ops, id),
        };
        if let Err(err) = posted {
            // Requests before the failed one may be posted (unsignaled):
            // only a teardown ends them.
            tracing::warn!(node = %self.node_id, %err, "ibv_post_send failed; dropping the connection");
            self.mark_broken(CODE_CONN_LOST);
            return Err(SubmitError {
                armed: Some(id),
                reason: err.to_string(),
            });
        }
        // A teardown between the check above and the post would leave this
        // batch to a flush completion that nobody may poll.
        if self.is_broken() {
            self.inflight.fail_all(CODE_CONN_LOST);
        }
        Ok(id)
    }

    /// Builds the chain on the stack (`N` >= `ops.len()`, so a single page
    /// does not pay for 64 work requests) and posts it.
    fn post<const N: usize>(&self, write: bool, ops: &[PageOp], id: u64) -> Result<(), VerbsError> {
        let n = ops.len().min(N);
        let mut sges = [Sge::default(); N];
        for (sge, op) in sges.iter_mut().zip(ops) {
            *sge = Sge::new(op.local as u64, PAGE_SIZE as u32, op.lkey);
        }
        let rkey = self.rkey.load(Ordering::Relaxed);
        let mut wrs: [SendWr<'_>; N] = std::array::from_fn(|i| {
            let sge = std::slice::from_ref(&sges[i]);
            let remote = self
                .remote_addr
                .wrapping_add(ops.get(i).map_or(0, |op| op.offset));
            let wr = if write {
                SendWr::rdma_write(id, sge, remote, rkey)
            } else {
                SendWr::rdma_read(id, sge, remote, rkey)
            };
            if i + 1 == n {
                wr.signaled()
            } else {
                wr
            }
        });
        self.qp.post_send(&mut wrs[..n])
    }

    fn reserve_sq(&self, n: usize, deadline: &Deadline) -> bool {
        let n = n as isize;
        let mut spins = 0u32;
        loop {
            let free = self.sq_free.load(Ordering::Acquire);
            if free >= n {
                if self
                    .sq_free
                    .compare_exchange_weak(free, free - n, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    return true;
                }
                continue;
            }
            // Slots come back as batches complete: help them along.
            self.progress();
            spins = spins.wrapping_add(1);
            if spins % 16 == 0 && deadline.passed() {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// Polls the CQ empty unless someone else is polling it now, completing
    /// the batches it names. Returns the number of work completions taken.
    pub(crate) fn progress(&self) -> usize {
        let Some(mut wcs) = self.poll.try_lock() else {
            return 0;
        };
        let mut total = 0;
        loop {
            let n = match self.cq.poll(&mut wcs[..]) {
                Ok(n) => n,
                Err(err) => {
                    tracing::warn!(node = %self.node_id, %err, "polling the CQ failed; dropping the connection");
                    self.mark_broken(CODE_CONN_LOST);
                    return total;
                }
            };
            for wc in &wcs[..n] {
                self.on_completion(wc);
            }
            total += n;
            if n < POLL_BATCH {
                return total;
            }
        }
    }

    fn on_completion(&self, wc: &WorkCompletion) {
        let id = wc.wr_id();
        if id == FENCE_WR_ID {
            self.fenced.store(true, Ordering::Release);
            return;
        }
        if wc.is_success() {
            match self.inflight.claim(id) {
                Claim::Live { slot, .. } => {
                    let wrs = self.batch_wrs[slot].load(Ordering::Relaxed);
                    self.sq_free.fetch_add(wrs as isize, Ordering::AcqRel);
                    self.inflight.complete(slot, 0);
                }
                // A cancelled batch: abandoned with the QP kept, or its
                // cancel tore the connection down (nothing to account).
                Claim::Stale => self.release_abandoned(id),
            }
            return;
        }
        let status = wc.status();
        if status != WcStatus::WrFlush || !self.is_broken() {
            tracing::warn!(
                node = %self.node_id,
                %status,
                vendor_err = wc.vendor_err(),
                "RDMA work request failed; tearing the QP down"
            );
        }
        if let Claim::Live { slot, .. } = self.inflight.claim(id) {
            self.inflight.complete(slot, status_code(status));
        }
        self.mark_broken(status_code(WcStatus::WrFlush));
    }
}

fn slot_of(id: u64) -> usize {
    (id % crate::tcp::SLOTS as u64) as usize
}

/// The completion code that carries `status`.
fn status_code(status: WcStatus) -> u32 {
    let raw = status.to_raw();
    if raw < CODE_WC_BASE {
        CODE_WC_BASE + raw
    } else {
        CODE_WC_BASE + WcStatus::General.to_raw()
    }
}

/// The work completion status a code carries, if it is one.
pub(crate) fn code_status(code: u32) -> Option<WcStatus> {
    code.checked_sub(CODE_WC_BASE)
        .filter(|raw| *raw < CODE_WC_BASE)
        .map(WcStatus::from_raw)
}

/// Polls of the CQs between two looks at the clock and two `sched_yield`s
/// in [`wait`].
const POLLS_PER_YIELD: u32 = 32;

/// Waits until `waiter` has nothing outstanding or `deadline` passes (false
/// then). For up to `spin` the caller polls the CQs of `conns` itself (no
/// hand-off, no wake-up: SoftRoCE often completes a request inside
/// `ibv_post_send`); then it parks and the connections' pollers take over.
///
/// Polling a CQ is a read of user-space memory, so the spin makes no system
/// call per poll: it yields its CPU (and reads the clock, a system call on
/// some VMs) once every [`POLLS_PER_YIELD`] polls. Yielding now and then
/// still matters on a small host: the work that completes the request
/// (SoftRoCE's tasklets in `ksoftirqd`, or another caller) may be queued
/// behind this thread.
pub(crate) fn wait<'a>(
    waiter: &Waiter,
    conns: impl Iterator<Item = &'a RdmaConnection> + Clone,
    spin: std::time::Duration,
    deadline: &Deadline,
) -> bool {
    let conns = || conns.clone();
    let mut spin_until = None;
    let mut spins = 0u32;
    loop {
        for c in conns() {
            c.progress();
        }
        if waiter.is_done() {
            return true;
        }
        if spin.is_zero() {
            break;
        }
        spins = spins.wrapping_add(1);
        if spins % POLLS_PER_YIELD == 0 {
            let now = Instant::now();
            if now >= *spin_until.get_or_insert(now + spin) || now >= deadline.get() {
                break;
            }
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    for c in conns() {
        c.parking.enter();
    }
    let done = waiter.wait(std::time::Duration::ZERO, deadline.get());
    for c in conns() {
        c.parking.leave();
    }
    done
}
