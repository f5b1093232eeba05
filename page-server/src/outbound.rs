//! A connection's outbound side, shared with other threads: the coherence
//! home sends callbacks (invalidate, downgrade) and grants to a node on that
//! node's own connection, from whichever connection's thread triggered them.
//!
//! Every write to such a connection takes its send lock, the connection's
//! own answers included (`connection::Outbox::flush`), so frames never
//! interleave. A connection gets one only when its client first sends a
//! coherence message; plain READ/WRITE connections never pay for it.

use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use rdma_transport::rdma::MessageChannel;

/// The socket (a duplicate of the connection's) and its send lock; over
/// RDMA, the connection's message channel, which frames go through
/// instead (the socket then only ends the connection).
#[derive(Debug)]
pub(crate) struct Outbound {
    stream: TcpStream,
    lock: Mutex<()>,
    channel: Option<Arc<MessageChannel>>,
    /// The connection agreed to offset-bound sums: coherence frames to it
    /// carry them (`wire::coherence_checksum`).
    bound_sums: bool,
    /// A send found that the kernel gave the node up (`dead_peer`): the
    /// connection's own thread may then see only the end of the stream.
    gone_silent: AtomicBool,
    /// The home ended the connection ([`Self::close_from_home`]).
    closed_by_home: AtomicBool,
}

impl Outbound {
    /// For the connection of `stream` (`bound_sums`: it agreed to
    /// offset-bound sums).
    pub(crate) fn new(stream: &TcpStream, bound_sums: bool) -> io::Result<Self> {
        let stream = stream.try_clone()?;
        // A blocking socket (no spin) would otherwise block a sender, which
        // holds a page's lock, for as long as the node takes no data. (A
        // socket option: the connection's own writes get it too.)
        let stall_ms = u64::try_from(crate::connection::SEND_STALL_TIMEOUT_MS).unwrap_or(30_000);
        stream.set_write_timeout(Some(std::time::Duration::from_millis(stall_ms)))?;
        Ok(Self {
            stream,
            lock: Mutex::new(()),
            channel: None,
            bound_sums,
            gone_silent: AtomicBool::new(false),
            closed_by_home: AtomicBool::new(false),
        })
    }

    /// For a coherence connection over RDMA: frames go through `channel`.
    pub(crate) fn over_channel(
        stream: &TcpStream,
        channel: Arc<MessageChannel>,
        bound_sums: bool,
    ) -> io::Result<Self> {
        Ok(Self {
            channel: Some(channel),
            ..Self::new(stream, bound_sums)?
        })
    }

    /// Whether coherence frames on this connection carry offset-bound sums.
    pub(crate) fn bound_sums(&self) -> bool {
        self.bound_sums
    }

    /// Whether a grant carries its page (TCP); over RDMA the node reads it
    /// from the region.
    pub(crate) fn carries_pages(&self) -> bool {
        self.channel.is_none()
    }

    /// Held while the connection's own thread writes its answers.
    pub(crate) fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock()
    }

    /// The home ends the connection: nothing more is sent to the node, and
    /// it is told by the end of the stream (a write-side shutdown), on
    /// which it drops its copies and closes its side. Until it has, its
    /// vCPUs may still read them: the connection's own thread stops
    /// serving it, and waits for that close before the node is declared
    /// lost (`node_exit`). Reading on is what lets it see the close.
    pub(crate) fn close_from_home(&self) {
        self.closed_by_home.store(true, Ordering::SeqCst);
        if let Some(channel) = &self.channel {
            channel.set_broken();
        }
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
    }

    /// Whether the home ended the connection.
    pub(crate) fn closed_by_home(&self) -> bool {
        self.closed_by_home.load(Ordering::SeqCst)
    }

    /// Writes `frames` (whole frames, back to back) under the send lock.
    ///
    /// # Errors
    /// The write failed: the connection is going away (its thread will see
    /// it), stopped taking data for the stall timeout, or the home closed
    /// it ([`Self::close_from_home`]).
    pub(crate) fn send(&self, frames: &[&[u8]]) -> io::Result<()> {
        if self.closed_by_home() {
            return Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the home closed this node's connection",
            ));
        }
        if let Some(channel) = &self.channel {
            // Never blocks: what credits do not allow yet waits in order.
            return channel.send_parts(frames).map_err(io::Error::other);
        }
        let mut iovecs: Vec<libc::iovec> = frames
            .iter()
            .map(|f| libc::iovec {
                iov_base: f.as_ptr().cast_mut().cast(),
                iov_len: f.len(),
            })
            .collect();
        let _guard = self.lock.lock();
        let sent = crate::connection::writev_all(&self.stream, &mut iovecs);
        if sent
            .as_ref()
            .is_err_and(rdma_transport::dead_peer::gave_up_on_peer)
        {
            self.gone_silent.store(true, Ordering::SeqCst);
        }
        sent
    }

    /// Whether a send found that the kernel gave the node up.
    pub(crate) fn gone_silent(&self) -> bool {
        self.gone_silent.load(Ordering::SeqCst)
    }
}
