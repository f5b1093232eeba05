//! A message channel over one RC QP: what coherence uses over RDMA
//! (docs/coherence.md, "Over RDMA").
//!
//! Each side has a ring of [`CHANNEL_SLOTS`] slots of
//! [`CHANNEL_SLOT_BYTES`], registered for REMOTE_WRITE by the peer, and
//! keeps as many zero-length receives posted. A message is one RDMA WRITE
//! WITH IMMEDIATE of its bytes (a whole wire frame, page included) into the
//! peer's next slot: the data moves by WRITE, and the immediate consumes a
//! posted receive, whose completion tells the peer a message is there. The
//! k-th message a side sends goes to slot `k % CHANNEL_SLOTS`, and the peer
//! takes its receive completions in that same order, so it knows the slot
//! from its count of messages taken.
//!
//! Credits: the immediate of every message carries how many messages its
//! sender has taken so far (and re-armed the receive of). A side writes
//! message k only once the peer reported message `k - CHANNEL_SLOTS` taken:
//! a slot is never overwritten before it was read, and a receive is always
//! posted for the immediate. One credit is kept for a credit-only message
//! (zero bytes), which a side sends when it took a quarter of the ring
//! without reporting it and has nothing else to send. Messages that cannot
//! go out yet wait in a queue, in order; `send` never blocks.
//!
//! One thread (the channel's reader) calls [`MessageChannel::poll`]; any
//! thread may call [`MessageChannel::send`]. A failed work completion breaks
//! the channel: every later call fails, and its owner closes the connection.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::credits::Credits;
use super::port::{connect_qp, random_psn, PortInfo, QpTimeouts};
use crate::page::{Page, PAGE_SIZE};
use crate::verbs::{
    AccessFlags, CompletionChannel, CompletionQueue, MemoryRegion, ProtectionDomain, QpCaps,
    QueuePair, RecvWr, SendWr, Sge, VerbsError, WorkCompletion,
};
use crate::wire::{MessageRing, RdmaHello, COH_BODY_LEN, HEADER_LEN};

/// Slots of each side's ring (and receives kept posted).
pub const CHANNEL_SLOTS: u32 = 64;
/// Bytes of one slot: the largest coherence frame (header, body, page).
pub const CHANNEL_SLOT_BYTES: usize = HEADER_LEN + COH_BODY_LEN + PAGE_SIZE;

const SEND_WR_ID: u64 = 1;
const READ_WR_ID: u64 = 2;
const RECV_WR_ID: u64 = 3;
/// Completions taken per poll.
const POLL_BATCH: usize = 16;

/// Why the channel cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// A verb or a work completion failed: the channel is broken.
    #[error("RDMA message channel: {0}")]
    Verbs(#[from] VerbsError),
    /// The channel broke earlier, or was never connected.
    #[error("RDMA message channel is broken")]
    Broken,
    /// The peer broke the channel's rules (a message longer than a slot,
    /// more messages than credits).
    #[error("RDMA message channel: {0}")]
    Protocol(String),
    /// A READ (the channel is broken then: the device may still write its
    /// buffer) or a flush did not complete in time.
    #[error("RDMA message channel: timed out")]
    Timeout,
}

/// Memory the device reads and writes: allocated here, touched only
/// through raw pointers, freed after its MR (field order in the channel).
#[derive(Debug)]
struct Buffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a plain allocation reached only through raw pointers, at
// offsets the channel's protocol gives to one side at a time.
unsafe impl Send for Buffer {}
// SAFETY: as for Send.
unsafe impl Sync for Buffer {}

impl Buffer {
    fn new(len: usize) -> Self {
        let boxed: Box<[u8]> = vec![0u8; len].into_boxed_slice();
        Self {
            ptr: Box::into_raw(boxed).cast::<u8>(),
            len,
        }
    }

    fn at(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset <= self.len);
        // SAFETY: within the allocation (callers pass offsets below `len`).
        unsafe { self.ptr.add(offset) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from `Box::into_raw` of a boxed slice of
        // `len` bytes, freed only here.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

/// The peer's side, known once connected.
#[derive(Debug, Clone, Copy)]
struct Peer {
    ring: MessageRing,
    /// Where RDMA READs go (the peer's exported region), if anywhere.
    read_addr: u64,
    read_rkey: u32,
}

#[derive(Debug, Default)]
struct SendSide {
    /// Written, completed, reported (`credits.rs`).
    credits: Credits,
    /// Messages waiting for a credit or a send slot, in order.
    waiting: VecDeque<Vec<u8>>,
    /// The READ in flight completed.
    read_done: bool,
    stats: ChannelStats,
}

/// What a channel did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChannelStats {
    /// Messages written to the peer (credit-only ones not counted).
    pub sent: u64,
    /// Messages taken from the peer (credit-only ones not counted).
    pub received: u64,
    /// Messages that had to wait for a credit or a send slot.
    pub waited: u64,
    /// Credit-only messages sent.
    pub credit_only: u64,
}

/// What [`MessageChannel::wait`] saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Woken {
    /// The channel has completions to poll.
    pub channel: bool,
    /// The other file descriptor is readable (or closed).
    pub other: bool,
}

/// One side of a message channel (see the module docs).
///
/// Field order is drop order: the QP goes first, then its CQs, then the
/// MRs, then the memory they cover.
#[derive(Debug)]
pub struct MessageChannel {
    qp: QueuePair,
    send_cq: CompletionQueue,
    recv_cq: CompletionQueue,
    events: CompletionChannel,
    ring_mr: MemoryRegion,
    local_mr: MemoryRegion,
    ring: Buffer,
    /// Send slots, then one page for READs.
    local: Buffer,
    port: PortInfo,
    psn: u32,
    peer: OnceLock<Peer>,
    send: Mutex<SendSide>,
    /// Messages taken (their receive posted again) by [`Self::poll`].
    taken: AtomicU32,
    /// One READ at a time.
    read: Mutex<()>,
    /// Messages (not credit-only) taken.
    received: std::sync::atomic::AtomicU64,
    broken: AtomicBool,
}

impl MessageChannel {
    /// A channel in `pd` on `port`: its QP in INIT with every receive
    /// posted, ready for [`Self::connect`]. Its ring is registered for
    /// REMOTE_WRITE: give the channel a PD of its own, so that no other QP
    /// can reach the ring.
    ///
    /// # Errors
    /// Verb failures.
    pub fn new(pd: &ProtectionDomain, port: &PortInfo) -> Result<Self, VerbsError> {
        let ctx = pd.context();
        let events = ctx.create_comp_channel()?;
        events.set_nonblocking(true)?;
        let slots = CHANNEL_SLOTS as usize;
        let send_cq = ctx.create_cq(CHANNEL_SLOTS + 2, Some(&events), 0)?;
        let recv_cq = ctx.create_cq(CHANNEL_SLOTS, Some(&events), 0)?;
        let caps = QpCaps {
            max_send_wr: CHANNEL_SLOTS + 2,
            max_recv_wr: CHANNEL_SLOTS,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
        };
        let qp = pd.create_rc_qp(&send_cq, &recv_cq, &caps)?;
        // What the peer may do is what the keys of this PD allow: the ring
        // takes writes; a home's region (registered by the caller) reads.
        qp.modify_to_init(
            port.port,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE | AccessFlags::REMOTE_READ,
        )?;
        let ring = Buffer::new(slots * CHANNEL_SLOT_BYTES);
        let local = Buffer::new(slots * CHANNEL_SLOT_BYTES + PAGE_SIZE);
        // SAFETY: both buffers live longer than their MRs (field order) and
        // are accessed only through raw pointers: the ring's slots are read
        // only between a receive completion and the credit that lets the
        // peer write the slot again; a send slot is written only when its
        // last WRITE completed, the READ page only while no READ is posted.
        let ring_mr = unsafe {
            pd.register_raw(
                ring.ptr,
                ring.len,
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_WRITE,
            )
        }?;
        // SAFETY: as above.
        let local_mr = unsafe { pd.register_raw(local.ptr, local.len, AccessFlags::LOCAL_WRITE) }?;
        let channel = Self {
            qp,
            send_cq,
            recv_cq,
            events,
            ring_mr,
            local_mr,
            ring,
            local,
            port: port.clone(),
            psn: random_psn(),
            peer: OnceLock::new(),
            send: Mutex::new(SendSide::default()),
            taken: AtomicU32::new(0),
            read: Mutex::new(()),
            received: std::sync::atomic::AtomicU64::new(0),
            broken: AtomicBool::new(false),
        };
        for _ in 0..CHANNEL_SLOTS {
            channel.post_receive()?;
        }
        Ok(channel)
    }

    /// This side's endpoint for the handshake; `region_addr`/`rkey` are
    /// left for the caller.
    pub fn hello(&self) -> RdmaHello {
        self.port.hello(&self.qp, self.psn)
    }

    /// This side's ring, for the peer.
    pub fn ring(&self) -> MessageRing {
        MessageRing {
            addr: self.ring_mr.addr() as u64,
            rkey: self.ring_mr.rkey(),
            slots: CHANNEL_SLOTS,
        }
    }

    /// The QP (a server binds keys on it).
    pub fn qp(&self) -> &QueuePair {
        &self.qp
    }

    /// The CQ of the QP's sends.
    pub fn send_cq(&self) -> &CompletionQueue {
        &self.send_cq
    }

    /// Connects to the peer's endpoint and ring. `remote.region_addr` and
    /// `remote.rkey` are where [`Self::read_page`] reads (0 when the peer
    /// exports nothing to this side).
    ///
    /// # Errors
    /// A ring of another size, a second connect, verb failures.
    pub fn connect(
        &self,
        remote: &RdmaHello,
        ring: MessageRing,
        timeouts: QpTimeouts,
    ) -> Result<(), VerbsError> {
        if ring.slots != CHANNEL_SLOTS || ring.addr == 0 {
            return Err(VerbsError::InvalidArgument(format!(
                "peer's message ring has {} slots at {:#x}; this side uses {CHANNEL_SLOTS}",
                ring.slots, ring.addr
            )));
        }
        let peer = Peer {
            ring,
            read_addr: remote.region_addr,
            read_rkey: remote.rkey,
        };
        self.peer
            .set(peer)
            .map_err(|_| VerbsError::InvalidArgument("channel connected twice".into()))?;
        connect_qp(&self.qp, &self.port, self.psn, remote, timeouts)
    }

    /// Whether a completion failed (or the peer broke the rules).
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// Breaks the channel: every later call fails.
    pub fn set_broken(&self) {
        self.broken.store(true, Ordering::Release);
    }

    fn fail<T>(&self, err: ChannelError) -> Result<T, ChannelError> {
        self.set_broken();
        Err(err)
    }

    fn post_receive(&self) -> Result<(), VerbsError> {
        let mut wr = [RecvWr::new(RECV_WR_ID, &[])];
        self.qp.post_recv(&mut wr)
    }

    /// Sends `frame` (at most [`CHANNEL_SLOT_BYTES`]): now when a credit
    /// and a send slot are free and nothing waits before it, else queued.
    ///
    /// # Errors
    /// A broken channel, a frame too long, a failed post.
    pub fn send(&self, frame: &[u8]) -> Result<(), ChannelError> {
        self.send_parts(&[frame])
    }

    /// As [`Self::send`], for one message made of `parts` back to back
    /// (copied into the send slot one after the other).
    ///
    /// # Errors
    /// As [`Self::send`].
    pub fn send_parts(&self, parts: &[&[u8]]) -> Result<(), ChannelError> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len == 0 || len > CHANNEL_SLOT_BYTES {
            return Err(ChannelError::Protocol(format!(
                "a message of {len} bytes (1..={CHANNEL_SLOT_BYTES})"
            )));
        }
        if self.is_broken() {
            return Err(ChannelError::Broken);
        }
        let mut st = self.send.lock();
        self.reap(&mut st)?;
        if st.waiting.is_empty() && st.credits.can_post(CHANNEL_SLOTS, false) {
            return self.post(&mut st, parts);
        }
        st.waiting.push_back(parts.concat());
        st.stats.waited += 1;
        Ok(())
    }

    /// What the channel did so far.
    pub fn stats(&self) -> ChannelStats {
        let mut stats = self.send.lock().stats;
        stats.received = self.received.load(Ordering::Relaxed);
        stats
    }

    /// Waits until every message sent so far was written and completed
    /// (it is in the peer's ring, its receive completion generated), taking
    /// the send CQ itself; the reader must go on polling meanwhile (the
    /// credits come with the peer's messages).
    ///
    /// # Errors
    /// A broken channel; [`ChannelError::Timeout`] at `deadline`.
    pub fn flush(&self, deadline: Instant) -> Result<(), ChannelError> {
        loop {
            if self.is_broken() {
                return Err(ChannelError::Broken);
            }
            {
                let mut st = self.send.lock();
                self.reap(&mut st)?;
                self.pump(&mut st)?;
                if st.waiting.is_empty() && st.credits.all_completed() {
                    return Ok(());
                }
            }
            if Instant::now() >= deadline {
                return Err(ChannelError::Timeout);
            }
            std::thread::yield_now();
        }
    }

    /// Writes `parts` back to back (none: a credit-only message) into the
    /// peer's next slot. The caller checked `Credits::can_post`.
    fn post(&self, st: &mut SendSide, parts: &[&[u8]]) -> Result<(), ChannelError> {
        let Some(peer) = self.peer.get() else {
            return self.fail(ChannelError::Broken);
        };
        let slot = st.credits.next_slot(CHANNEL_SLOTS) as usize;
        let slot_at = slot * CHANNEL_SLOT_BYTES;
        let local = self.local.at(slot_at);
        let mut len = 0;
        for part in parts {
            let to = self.local.at(slot_at + len);
            // SAFETY: the parts fit a slot together (checked by
            // `send_parts`, or a queued message that was), so `part.len()`
            // bytes from `to` are in this send slot; its last WRITE
            // completed (`Credits::can_post`: fewer than CHANNEL_SLOTS
            // uncompleted), so the device no longer reads it, and only this
            // thread writes it (the send lock is held).
            unsafe { std::ptr::copy_nonoverlapping(part.as_ptr(), to, part.len()) };
            len += part.len();
        }
        let sge = [Sge::new(
            local as u64,
            u32::try_from(len).unwrap_or(0),
            self.local_mr.lkey(),
        )];
        let sges: &[Sge] = if len == 0 { &[] } else { &sge };
        let taken = self.taken.load(Ordering::Acquire);
        let remote = peer.ring.addr + (slot * CHANNEL_SLOT_BYTES) as u64;
        let mut wr = [
            SendWr::rdma_write_with_imm(SEND_WR_ID, sges, remote, peer.ring.rkey, taken).signaled(),
        ];
        if let Err(err) = self.qp.post_send(&mut wr) {
            return self.fail(err.into());
        }
        st.credits.posted(taken);
        if len == 0 {
            st.stats.credit_only += 1;
        } else {
            st.stats.sent += 1;
        }
        Ok(())
    }

    /// Takes the send CQ's completions (send slots free, the READ done).
    fn reap(&self, st: &mut SendSide) -> Result<(), ChannelError> {
        let mut wcs = [WorkCompletion::default(); POLL_BATCH];
        loop {
            let n = match self.send_cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(err) => return self.fail(err.into()),
            };
            for wc in &wcs[..n] {
                if let Err(err) = wc.result() {
                    return self.fail(err.into());
                }
                match wc.wr_id() {
                    READ_WR_ID => st.read_done = true,
                    _ => st.credits.completed(),
                }
            }
            if n < POLL_BATCH {
                return Ok(());
            }
        }
    }

    /// Sends what waits, as far as credits allow, then a credit-only
    /// message if this side took many messages without telling.
    fn pump(&self, st: &mut SendSide) -> Result<(), ChannelError> {
        while !st.waiting.is_empty() && st.credits.can_post(CHANNEL_SLOTS, false) {
            let Some(frame) = st.waiting.pop_front() else {
                break;
            };
            self.post(st, &[&frame])?;
        }
        let taken = self.taken.load(Ordering::Acquire);
        if st.credits.wants_credit_message(taken, CHANNEL_SLOTS) {
            self.post(st, &[])?;
        }
        Ok(())
    }

    /// Takes every message that arrived, in order, calling `on_message`
    /// with each one's bytes (credit-only messages are not shown). When it
    /// returns false, the messages after it are dropped: the caller closes
    /// the channel. Then sends what credits now allow.
    /// Returns how many completions it took. Call from one thread only.
    ///
    /// # Errors
    /// A broken channel, a failed completion, a message too long.
    pub fn poll(&self, mut on_message: impl FnMut(&[u8]) -> bool) -> Result<usize, ChannelError> {
        if self.is_broken() {
            return Err(ChannelError::Broken);
        }
        let mut wcs = [WorkCompletion::default(); POLL_BATCH];
        let mut total = 0;
        let mut keep_going = true;
        while keep_going {
            let n = match self.recv_cq.poll(&mut wcs) {
                Ok(n) => n,
                Err(err) => return self.fail(err.into()),
            };
            for wc in &wcs[..n] {
                if let Err(err) = wc.result() {
                    return self.fail(err.into());
                }
                let Some(peer_taken) = wc.imm_data() else {
                    return self.fail(ChannelError::Protocol(
                        "a message without its immediate".into(),
                    ));
                };
                let len = wc.byte_len() as usize;
                if len > CHANNEL_SLOT_BYTES {
                    return self.fail(ChannelError::Protocol(format!("a message of {len} bytes")));
                }
                {
                    let mut st = self.send.lock();
                    // In order on an RC QP: the latest report is the largest.
                    if !st.credits.peer_reports(peer_taken, CHANNEL_SLOTS) {
                        drop(st);
                        return self.fail(ChannelError::Protocol(
                            "the peer reported messages this side never sent".into(),
                        ));
                    }
                }
                let taken = self.taken.load(Ordering::Acquire);
                let slot = (taken % CHANNEL_SLOTS) as usize;
                if len > 0 && keep_going {
                    // SAFETY: the peer wrote these `len` bytes of the slot
                    // before this completion, and writes the slot again only
                    // after it learns this message was taken (below, after
                    // `on_message` returned): nothing changes them meanwhile.
                    let bytes = unsafe {
                        std::slice::from_raw_parts(
                            self.ring.at(slot * CHANNEL_SLOT_BYTES).cast_const(),
                            len,
                        )
                    };
                    keep_going = on_message(bytes);
                    self.received.fetch_add(1, Ordering::Relaxed);
                }
                if let Err(err) = self.post_receive() {
                    return self.fail(err.into());
                }
                self.taken.store(taken.wrapping_add(1), Ordering::Release);
            }
            total += n;
            if n < POLL_BATCH {
                break;
            }
        }
        let mut st = self.send.lock();
        self.reap(&mut st)?;
        self.pump(&mut st)?;
        Ok(total)
    }

    /// Asks for an event on the next completion of either CQ. Poll once
    /// more after this before waiting, or a completion that came in
    /// between is missed.
    ///
    /// # Errors
    /// Verb failures.
    pub fn arm(&self) -> Result<(), ChannelError> {
        self.recv_cq.req_notify(false)?;
        self.send_cq.req_notify(false)?;
        Ok(())
    }

    /// Waits up to `timeout` for a completion event (after [`Self::arm`])
    /// or for `other` to be readable, and consumes the events.
    ///
    /// # Errors
    /// `ppoll` or verb failures.
    pub fn wait(&self, other: BorrowedFd<'_>, timeout: Duration) -> Result<Woken, ChannelError> {
        let mut fds = [
            libc::pollfd {
                fd: self.events.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: other.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let ts = crate::sys::timespec(timeout);
        // SAFETY: two live, initialised pollfds; `ts` is a valid timespec;
        // a null signal mask is allowed.
        let ret = unsafe { libc::ppoll(fds.as_mut_ptr(), 2, &ts, std::ptr::null()) };
        if ret < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                return Ok(Woken::default());
            }
            return Err(VerbsError::Verb {
                verb: "ppoll",
                source: err,
            }
            .into());
        }
        let woken = Woken {
            channel: fds[0].revents != 0,
            other: fds[1].revents != 0,
        };
        if woken.channel {
            while self.events.get_cq_event(Some(0))?.is_some() {}
        }
        Ok(woken)
    }

    /// Reads the page at `offset` of the peer's exported region by RDMA
    /// READ, waiting (spinning) until `deadline`.
    ///
    /// # Errors
    /// A broken channel, a failed READ, [`ChannelError::Timeout`] (the
    /// channel is broken then).
    pub fn read_page(&self, offset: u64, deadline: Instant) -> Result<Box<Page>, ChannelError> {
        let Some(peer) = self.peer.get().copied() else {
            return Err(ChannelError::Broken);
        };
        if peer.read_rkey == 0 && peer.read_addr == 0 {
            return Err(ChannelError::Protocol(
                "the peer exports nothing to read".into(),
            ));
        }
        let _one = self.read.lock();
        if self.is_broken() {
            return Err(ChannelError::Broken);
        }
        let page_at = self.local.at(CHANNEL_SLOTS as usize * CHANNEL_SLOT_BYTES);
        {
            let mut st = self.send.lock();
            st.read_done = false;
            let sge = [Sge::new(
                page_at as u64,
                PAGE_SIZE as u32,
                self.local_mr.lkey(),
            )];
            let mut wr =
                [
                    SendWr::rdma_read(READ_WR_ID, &sge, peer.read_addr + offset, peer.read_rkey)
                        .signaled(),
                ];
            // The send queue has CHANNEL_SLOTS + 2 entries: the WRITEs
            // (at most CHANNEL_SLOTS uncompleted) and this one READ fit.
            if let Err(err) = self.qp.post_send(&mut wr) {
                return self.fail(err.into());
            }
        }
        loop {
            {
                let mut st = self.send.lock();
                self.reap(&mut st)?;
                if st.read_done {
                    break;
                }
            }
            if Instant::now() >= deadline {
                return self.fail(ChannelError::Timeout);
            }
            std::hint::spin_loop();
            std::thread::yield_now();
        }
        let mut page: Box<Page> = Box::new([0u8; PAGE_SIZE]);
        // SAFETY: the READ into these PAGE_SIZE bytes completed; no other
        // READ is posted while `_one` is held.
        unsafe {
            std::ptr::copy_nonoverlapping(page_at.cast_const(), page.as_mut_ptr(), PAGE_SIZE)
        };
        Ok(page)
    }
}
