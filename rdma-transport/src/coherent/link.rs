//! A node's coherence connection to one home: the socket, the pages of that
//! home the node has asked for, the reader thread that takes every frame the
//! home sends (grants, callbacks, refusals) and answers the hold-time timers
//! of deferred callbacks, and the writer thread that sends the node's
//! frames in the order they were queued.
//!
//! Why a writer thread: the reader must never block on a socket write. If
//! it did, a home thread writing to this node (holding a page's lock) and
//! the home's thread for this connection (waiting for that lock, so not
//! reading) could wait for each other once both sockets' buffers fill.
//! Frames of one page are sent under that page's lock, so they go out in
//! the protocol's order. A frame is written by its sender directly when
//! nothing is queued and the socket takes it whole without blocking (the
//! usual case: a thread hop less on every fault); otherwise it (or what is
//! left of it) is queued for the writer, and so is every frame after it
//! until the writer has written them all.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use coherence::ToHome;
use parking_lot::Mutex;

use super::pages::{self, Slot};
use super::{Dialed, Shared};
use crate::error::TransportError;
use crate::page::Page;
use crate::rdma::MessageChannel;
use crate::wire::{decode_to_node, encode_to_home, Header, HEADER_LEN, MAX_PAYLOAD_BYTES};

/// Longest the reader blocks without looking at its timers.
const READ_TICK: Duration = Duration::from_millis(100);
const RECV_BUF_BYTES: usize = 64 * 1024;

/// One home's connection.
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) node: String,
    /// The home process's epoch (see `Resolve::confirm_epoch`).
    pub(crate) epoch: u64,
    stream: TcpStream,
    /// Over RDMA: the frames go through this channel, and `stream` only
    /// tells that the home is gone (no writer thread then).
    channel: Option<Arc<MessageChannel>>,
    /// Frames carry offset-bound sums both ways (agreed in the handshake).
    bound_sums: bool,
    /// How long an `acquire` waits (and a grant's READ, and a close's
    /// drain of the channel).
    timeout_ms: u64,
    /// Frames for the writer thread; `None` once the connection is shut.
    /// Locked for the whole of a send.
    outgoing: Mutex<Option<mpsc::Sender<Vec<u8>>>>,
    /// Frames queued for the writer and not yet written whole.
    queued: Arc<AtomicUsize>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// The pages of this home the node asked for, by offset in its region.
    slots: Mutex<HashMap<u64, Arc<Slot>>>,
    dead: AtomicBool,
    reader: Mutex<Option<JoinHandle<()>>>,
}

impl Link {
    /// Takes a handshaken, blocking stream and starts its reader.
    pub(crate) fn start(
        shared: &Arc<Shared>,
        node: &str,
        dialed: Dialed,
    ) -> Result<Arc<Self>, TransportError> {
        let Dialed {
            stream,
            channel,
            bound_sums,
            node_bound_limit_ms: _,
            epoch,
        } = dialed;
        let down = |e: io::Error| TransportError::NodeDown {
            node: node.to_owned(),
            reason: format!("coherence connection: {e}"),
        };
        let reader_stream = stream.try_clone().map_err(down)?;
        let writer_stream = stream.try_clone().map_err(down)?;
        stream
            .set_write_timeout(Some(Duration::from_millis(shared.config.timeout_ms.max(1))))
            .map_err(down)?;
        // A home that went silent (its host gone, or the network cut) ends
        // the connection: the reader then drops every copy of its pages,
        // before the home, which waits out this bound after losing a node
        // to silence (`--node-dead-home-timeout-ms`), gives them to others.
        crate::dead_peer::watch(
            &stream,
            Duration::from_millis(shared.config.dead_home_timeout_ms),
        )
        .map_err(down)?;
        let (tx, rx) = mpsc::channel::<Vec<u8>>();
        let link = Arc::new(Self {
            node: node.to_owned(),
            epoch,
            stream,
            channel,
            bound_sums,
            timeout_ms: shared.config.timeout_ms.max(1),
            outgoing: Mutex::new(Some(tx)),
            queued: Arc::new(AtomicUsize::new(0)),
            writer: Mutex::new(None),
            slots: Mutex::new(HashMap::new()),
            dead: AtomicBool::new(false),
            reader: Mutex::new(None),
        });
        if link.channel.is_none() {
            let writer_link = Arc::clone(&link);
            let writer = std::thread::Builder::new()
                .name(format!("coherence-w-{node}"))
                .spawn(move || write_loop(&writer_link, writer_stream, &rx))
                .map_err(|e| {
                    link.shut();
                    down(e)
                })?;
            *link.writer.lock() = Some(writer);
        }
        let (thread_shared, thread_link) = (Arc::clone(shared), Arc::clone(&link));
        let handle = std::thread::Builder::new()
            .name(format!("coherence-{node}"))
            .spawn(move || {
                // Runs on every way out, a panicking handler's included:
                // waiters must not be left waiting for a reader that is gone.
                let exit = ReaderExit(thread_shared, thread_link);
                match exit.1.channel.clone() {
                    Some(channel) => read_channel(&exit.0, &exit.1, &channel, &reader_stream),
                    None => read_loop(&exit.0, &exit.1, reader_stream),
                }
            })
            .map_err(|e| {
                link.shut();
                down(e)
            })?;
        *link.reader.lock() = Some(handle);
        Ok(link)
    }

    /// The RDMA message channel's counters (`None` over TCP).
    pub(crate) fn channel_stats(&self) -> Option<crate::rdma::ChannelStats> {
        self.channel.as_ref().map(|c| c.stats())
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// The slot of the page at `offset` (`gpa` on this node).
    pub(crate) fn slot(&self, shared: &Shared, gpa: u64, offset: u64) -> Arc<Slot> {
        Arc::clone(
            self.slots
                .lock()
                .entry(offset)
                .or_insert_with(|| Arc::new(Slot::new(gpa, offset, shared.config.min_hold_us))),
        )
    }

    /// Queues `msg` about the page at `offset` (with the page written
    /// back) for the writer thread. Frames go out in the order queued; one
    /// that cannot be written breaks the connection (the node is lost to
    /// the home).
    pub(crate) fn send(
        &self,
        offset: u64,
        msg: &ToHome,
        page: Option<&Page>,
    ) -> Result<(), TransportError> {
        let frame = encode_to_home(offset, msg, page, self.bound_sums);
        if let Some(channel) = &self.channel {
            if self.is_dead() {
                return Err(self.down("coherence connection closed"));
            }
            return channel.send(&frame).map_err(|e| {
                tracing::debug!(node = %self.node, err = %e, "coherence send failed; dropping the connection");
                self.shut();
                self.down(&e.to_string())
            });
        }
        let outgoing = self.outgoing.lock();
        let Some(tx) = outgoing.as_ref() else {
            return Err(self.down("coherence connection closed"));
        };
        let mut sent = 0;
        if self.queued.load(Ordering::Acquire) == 0 {
            sent = match send_nonblocking(&self.stream, &frame) {
                Ok(n) => n,
                Err(e) => {
                    tracing::debug!(node = %self.node, err = %e, "coherence send failed; dropping the connection");
                    drop(outgoing);
                    self.shut();
                    return Err(self.down("coherence connection closed"));
                }
            };
            if sent == frame.len() {
                return Ok(());
            }
        }
        self.queued.fetch_add(1, Ordering::AcqRel);
        let rest = if sent == 0 {
            frame
        } else {
            frame[sent..].to_vec()
        };
        tx.send(rest)
            .map_err(|_| self.down("coherence connection closed"))
    }

    pub(crate) fn down(&self, reason: &str) -> TransportError {
        TransportError::NodeDown {
            node: self.node.clone(),
            reason: reason.to_owned(),
        }
    }

    /// Gives the connection up at once (frames still queued are dropped,
    /// nothing more is sent) and wakes the reader, which ends and drops
    /// every copy of this home's pages ([`Self::lost`]). Only then is the
    /// home told, by the end of the socket: it gives this node's pages to
    /// other nodes as soon as it knows, so the copies must be gone first.
    /// (A read-side shutdown sends nothing; the writer ends with the
    /// queue, or at the full shutdown if a write blocks.)
    pub(crate) fn shut(&self) {
        self.dead.store(true, Ordering::SeqCst);
        self.outgoing.lock().take();
        let _ = self.stream.shutdown(Shutdown::Read);
    }

    /// Closes the connection: the frames queued so far are written first
    /// (each within the write timeout), then the socket is shut and both
    /// threads have ended.
    pub(crate) fn close_and_join(&self) {
        if let Some(channel) = &self.channel {
            // What is queued or in flight reaches the home first (the
            // reader still runs, taking the credits that let it go).
            let deadline = std::time::Instant::now() + Duration::from_millis(self.timeout_ms);
            if let Err(e) = channel.flush(deadline) {
                tracing::debug!(node = %self.node, err = %e, "coherence channel not drained before close");
            }
        }
        self.dead.store(true, Ordering::SeqCst);
        self.outgoing.lock().take();
        join(self.writer.lock().take(), &self.node, "writer");
        self.shut();
        join(self.reader.lock().take(), &self.node, "reader");
    }

    /// The connection is gone: every copy of this home's pages is dropped
    /// and every waiter fails; then the socket is closed, which tells the
    /// home (if it does not know yet) that this node is lost.
    fn lost(self: &Arc<Self>, shared: &Shared, call_handler: bool) {
        // `dead` is set before the slots are listed: a slot made later
        // finds it set (`pages::acquire` checks it under the slot's lock).
        self.shut();
        let slots: Vec<Arc<Slot>> = self.slots.lock().values().cloned().collect();
        for slot in slots {
            pages::forget(shared, &slot, &self.node, call_handler);
        }
        // Only now may the home learn that this node left, and give its
        // pages to others: no vCPU here reads a copy any more. (Sooner,
        // another node could change a page this one still read.)
        let _ = self.stream.shutdown(Shutdown::Both);
        // Only now may a caller that finds no link here connect again: by
        // then every copy of the old connection is gone.
        {
            let mut links = shared.links.lock();
            if links.get(&self.node).is_some_and(|l| Arc::ptr_eq(l, self)) {
                links.remove(&self.node);
            }
        }
        tracing::debug!(node = %self.node, "coherence connection closed");
    }
}

fn join(handle: Option<JoinHandle<()>>, node: &str, what: &str) {
    if let Some(handle) = handle {
        if handle.thread().id() != std::thread::current().id() && handle.join().is_err() {
            tracing::error!(node, "coherence {what} panicked");
        }
    }
}

/// Writes the queued frames until the queue is closed or a write fails
/// (which breaks the connection).
fn write_loop(link: &Link, mut stream: TcpStream, rx: &mpsc::Receiver<Vec<u8>>) {
    for frame in rx {
        if let Err(e) = stream.write_all(&frame) {
            tracing::debug!(node = %link.node, err = %e, "coherence send failed; dropping the connection");
            link.shut();
            return;
        }
        // Written whole: a sender may write directly again once none is
        // left.
        link.queued.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Writes what the socket takes of `bytes` now, without blocking; returns
/// how many bytes that was.
fn send_nonblocking(stream: &TcpStream, bytes: &[u8]) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: `bytes` is a live slice of `bytes.len()` bytes; `send`
        // only reads it. MSG_DONTWAIT makes this one call non-blocking
        // (the socket stays blocking for the writer thread); MSG_NOSIGNAL:
        // a closed peer is an EPIPE error, not a signal.
        let ret = unsafe {
            libc::send(
                stream.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        match crate::sys::cvt(ret) {
            Ok(n) => return Ok(n as usize),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(0),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// The reader thread's end: the connection is gone for the node.
struct ReaderExit(Arc<Shared>, Arc<Link>);

impl Drop for ReaderExit {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        if panicking {
            tracing::error!(node = %self.1.node, "coherence reader panicked (in the embedder's handler?); leaving this home");
        }
        // Not the handler again after it panicked: a second panic would abort.
        self.1.lost(&self.0, !panicking);
    }
}

fn read_loop(shared: &Shared, link: &Link, mut stream: TcpStream) {
    let mut buf = vec![0u8; RECV_BUF_BYTES];
    let (mut start, mut end) = (0usize, 0usize);
    let mut timers: Vec<(u64, Arc<Slot>)> = Vec::new();
    loop {
        let wait = until_next_timer(shared, &timers);
        // Timers of deferred callbacks are a few µs to tens of µs away:
        // waited for with ppoll (a socket read timeout would round them up
        // to a scheduler tick, which made every deferral cost 4 ms).
        match crate::sys::wait_readable(std::os::fd::AsFd::as_fd(&stream), wait) {
            Ok(true) => {}
            Ok(false) => {
                if !run_due_timers(shared, link, &mut timers) || link.is_dead() {
                    return;
                }
                continue;
            }
            Err(e) => {
                tracing::debug!(node = %link.node, err = %e, "coherence connection poll failed");
                return;
            }
        }
        match stream.read(&mut buf[end..]) {
            Ok(0) => return,
            Ok(n) => end += n,
            // The kernel gave the home up (`dead_home_timeout_ms`): leave
            // it, dropping every copy of its pages, before the home loses
            // this node and grants them to others.
            Err(e) if crate::dead_peer::gave_up_on_peer(&e) => {
                tracing::warn!(
                    node = %link.node,
                    err = %e,
                    dead_home_timeout_ms = shared.config.dead_home_timeout_ms,
                    "home silent too long; leaving it and dropping the copies of its pages"
                );
                return;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                tracing::debug!(node = %link.node, err = %e, "coherence connection read failed");
                return;
            }
        }
        loop {
            let header = match Header::decode_prefix(&buf[start..end]) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(e) => {
                    tracing::warn!(node = %link.node, err = %e, "malformed coherence frame; dropping the connection");
                    return;
                }
            };
            let total = HEADER_LEN + header.payload_len();
            if end - start < total {
                break;
            }
            let payload = &buf[start + HEADER_LEN..start + total];
            let frame = match decode_to_node(&header, payload, link.bound_sums) {
                Ok(f) => f,
                Err(e) => {
                    tracing::warn!(node = %link.node, err = %e, "malformed coherence message; dropping the connection");
                    return;
                }
            };
            let offset = match frame {
                crate::wire::ToNodeFrame::Msg(f) => f.offset,
                crate::wire::ToNodeFrame::Refused { offset, .. } => offset,
            };
            let slot = link.slots.lock().get(&offset).cloned();
            let Some(slot) = slot else {
                tracing::warn!(node = %link.node, offset, "coherence message about a page this node never asked for; dropping the connection");
                return;
            };
            match pages::on_frame(shared, link, &slot, frame, None) {
                Ok(Some(due)) => timers.push((due, slot)),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(node = %link.node, err = %e, "coherence message not handled; dropping the connection");
                    return;
                }
            }
            start += total;
        }
        if start == end {
            (start, end) = (0, 0);
        } else if buf.len() - end < HEADER_LEN + MAX_PAYLOAD_BYTES as usize {
            buf.copy_within(start..end, 0);
            end -= start;
            start = 0;
        }
        if !run_due_timers(shared, link, &mut timers) {
            return;
        }
        if link.is_dead() {
            return;
        }
    }
}

/// The reader over an RDMA message channel: takes the home's messages
/// (a grant's page is read from the home's region by RDMA READ), runs the
/// hold-time timers, and ends when the socket says the home is gone (EOF,
/// or any byte: nothing else may come on it) or the channel breaks.
fn read_channel(shared: &Shared, link: &Link, channel: &MessageChannel, stream: &TcpStream) {
    use std::os::fd::AsFd;
    let mut timers: Vec<(u64, Arc<Slot>)> = Vec::new();
    let mut armed = false;
    loop {
        let mut failed = false;
        let taken = channel.poll(|bytes| match on_message(shared, link, channel, bytes, &mut timers) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(node = %link.node, err = %e, "coherence message not handled; dropping the connection");
                failed = true;
                false
            }
        });
        let taken = match taken {
            Ok(n) => n,
            Err(e) => {
                tracing::debug!(node = %link.node, err = %e, "coherence channel broke");
                return;
            }
        };
        if failed || link.is_dead() || !run_due_timers(shared, link, &mut timers) {
            return;
        }
        if taken > 0 {
            armed = false;
            continue;
        }
        if !armed {
            // Armed, then polled once more before waiting: a completion
            // that came in between is not missed.
            if let Err(e) = channel.arm() {
                tracing::debug!(node = %link.node, err = %e, "coherence channel broke");
                return;
            }
            armed = true;
            continue;
        }
        let wait = until_next_timer(shared, &timers);
        match channel.wait(stream.as_fd(), wait) {
            Ok(woken) if woken.other => {
                // The home closed the connection (or broke the rules by
                // writing to it): what it sent before is taken first.
                let _ = channel
                    .poll(|bytes| on_message(shared, link, channel, bytes, &mut timers).is_ok());
                return;
            }
            Ok(woken) => armed = !woken.channel,
            Err(e) => {
                tracing::debug!(node = %link.node, err = %e, "coherence channel wait failed");
                return;
            }
        }
    }
}

/// One message from the home over the channel: exactly one frame.
fn on_message(
    shared: &Shared,
    link: &Link,
    channel: &MessageChannel,
    bytes: &[u8],
    timers: &mut Vec<(u64, Arc<Slot>)>,
) -> Result<(), TransportError> {
    let bad = |what: String| TransportError::Protocol {
        node: link.node.clone(),
        detail: what,
    };
    let header = Header::decode_prefix(bytes)
        .map_err(|e| bad(format!("malformed coherence frame: {e}")))?
        .ok_or_else(|| bad("a coherence message shorter than a header".into()))?;
    if HEADER_LEN + header.payload_len() != bytes.len() {
        return Err(bad(format!(
            "a coherence message of {} bytes holding a frame of {}",
            bytes.len(),
            HEADER_LEN + header.payload_len()
        )));
    }
    let frame = decode_to_node(&header, &bytes[HEADER_LEN..], link.bound_sums)
        .map_err(|e| bad(format!("malformed coherence message: {e}")))?;
    let offset = match frame {
        crate::wire::ToNodeFrame::Msg(f) => f.offset,
        crate::wire::ToNodeFrame::Refused { offset, .. } => offset,
    };
    let slot = link.slots.lock().get(&offset).cloned().ok_or_else(|| {
        bad(format!(
            "a coherence message about a page this node never asked for (offset {offset:#x})"
        ))
    })?;
    // A grant's page is not in the message: it is read from the home's
    // region, which only a write-back of the grantee changes next.
    let read = || {
        let deadline = std::time::Instant::now() + Duration::from_millis(link.timeout_ms);
        channel.read_page(offset, deadline).map_err(|e| {
            link.shut();
            link.down(&format!("reading a granted page: {e}"))
        })
    };
    if let Some(due) = pages::on_frame(shared, link, &slot, frame, Some(&read))? {
        timers.push((due, slot));
    }
    Ok(())
}

/// How long the reader may sleep: until the first timer is due, at most
/// `READ_TICK`.
fn until_next_timer(shared: &Shared, timers: &[(u64, Arc<Slot>)]) -> Duration {
    let now = shared.now_us();
    timers
        .iter()
        .map(|(due, _)| Duration::from_micros(due.saturating_sub(now)))
        .min()
        .unwrap_or(READ_TICK)
        .min(READ_TICK)
}

/// Answers the deferred callbacks whose hold time has passed; false when
/// one could not be answered (the connection is dropped).
fn run_due_timers(shared: &Shared, link: &Link, timers: &mut Vec<(u64, Arc<Slot>)>) -> bool {
    let now = shared.now_us();
    let due: Vec<Arc<Slot>> = {
        let (due, later): (Vec<_>, Vec<_>) = timers.drain(..).partition(|(d, _)| *d <= now);
        *timers = later;
        due.into_iter().map(|(_, s)| s).collect()
    };
    for slot in due {
        match pages::on_timer(shared, link, &slot) {
            Ok(Some(again)) => timers.push((again, slot)),
            Ok(None) => {}
            Err(e) => {
                tracing::warn!(node = %link.node, err = %e, "deferred callback not answered; dropping the connection");
                return false;
            }
        }
    }
    true
}
