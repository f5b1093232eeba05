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

use parking_lot::{Mutex, MutexGuard};

/// The socket (a duplicate of the connection's) and its send lock.
#[derive(Debug)]
pub(crate) struct Outbound {
    stream: TcpStream,
    lock: Mutex<()>,
}

impl Outbound {
    /// For the connection of `stream`.
    pub(crate) fn new(stream: &TcpStream) -> io::Result<Self> {
        let stream = stream.try_clone()?;
        // A blocking socket (no spin) would otherwise block a sender, which
        // holds a page's lock, for as long as the node takes no data. (A
        // socket option: the connection's own writes get it too.)
        let stall_ms = u64::try_from(crate::connection::SEND_STALL_TIMEOUT_MS).unwrap_or(30_000);
        stream.set_write_timeout(Some(std::time::Duration::from_millis(stall_ms)))?;
        Ok(Self {
            stream,
            lock: Mutex::new(()),
        })
    }

    /// Held while the connection's own thread writes its answers.
    pub(crate) fn lock(&self) -> MutexGuard<'_, ()> {
        self.lock.lock()
    }

    /// Shuts the connection down: its thread sees the end of the stream and
    /// ends (for coherence, the node is then lost).
    pub(crate) fn shut_down(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// Writes `frames` (whole frames, back to back) under the send lock.
    ///
    /// # Errors
    /// The write failed: the connection is going away (its thread will see
    /// it) or stopped taking data for the stall timeout.
    pub(crate) fn send(&self, frames: &[&[u8]]) -> io::Result<()> {
        let mut iovecs: Vec<libc::iovec> = frames
            .iter()
            .map(|f| libc::iovec {
                iov_base: f.as_ptr().cast_mut().cast(),
                iov_len: f.len(),
            })
            .collect();
        let _guard = self.lock.lock();
        crate::connection::writev_all(&self.stream, &mut iovecs)
    }
}
