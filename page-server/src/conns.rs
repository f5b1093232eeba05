//! The connections being served, recorded so that shutdown can close them.
//!
//! The acceptor records a connection (a duplicate of its socket) *before*
//! the connection's thread exists, and that thread removes the record when
//! the connection ends; both under one lock. Removal can therefore only
//! follow recording: an ended connection is never left recorded. (A record
//! left behind would keep its duplicated socket open, and the client would
//! never see FIN.)

use std::net::{Shutdown, TcpStream};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::Mutex;

/// The recorded connections.
#[derive(Debug, Default)]
pub(crate) struct Connections {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    entries: Vec<Entry>,
    next_id: u64,
    /// Set by [`Connections::close_all`]: nothing is recorded after it.
    closed: bool,
}

/// One connection: a duplicate of its socket (to shut it down) and, once
/// started, its thread.
#[derive(Debug)]
struct Entry {
    id: u64,
    socket: TcpStream,
    thread: Option<JoinHandle<()>>,
}

/// The record of one connection; dropping it removes the record (and
/// closes the recorded duplicate socket). The connection's thread owns it,
/// so the record goes when the thread ends, on every path out of it.
#[derive(Debug)]
pub(crate) struct Recorded {
    conns: Arc<Connections>,
    id: u64,
}

impl Recorded {
    /// The connection's id, unique for the life of the server.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Recorded {
    fn drop(&mut self) {
        let mut inner = self.conns.inner.lock();
        if let Some(at) = inner.entries.iter().position(|e| e.id == self.id) {
            // The thread being dropped here is this connection's own: its
            // handle is only detached.
            inner.entries.swap_remove(at);
        }
    }
}

impl Connections {
    /// Records a connection by a duplicate of its socket. `None` once
    /// [`Connections::close_all`] has run (the connection is then not to be
    /// served).
    pub(crate) fn record(self: &Arc<Self>, socket: TcpStream) -> Option<Recorded> {
        let mut inner = self.inner.lock();
        if inner.closed {
            return None;
        }
        inner.next_id += 1;
        let id = inner.next_id;
        inner.entries.push(Entry {
            id,
            socket,
            thread: None,
        });
        Some(Recorded {
            conns: Arc::clone(self),
            id,
        })
    }

    /// Stores the thread serving connection `id`, so that shutdown can join
    /// it. When the connection has already ended (its record is gone), the
    /// handle is dropped: the thread is finishing on its own.
    pub(crate) fn set_thread(&self, id: u64, thread: JoinHandle<()>) {
        let mut inner = self.inner.lock();
        if let Some(entry) = inner.entries.iter_mut().find(|e| e.id == id) {
            entry.thread = Some(thread);
        }
    }

    /// Connections recorded now.
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().entries.len()
    }

    /// Stops recording, shuts every recorded socket down (its thread then
    /// sees the end of the stream) and returns the threads to join.
    pub(crate) fn close_all(&self) -> Vec<JoinHandle<()>> {
        let entries = {
            let mut inner = self.inner.lock();
            inner.closed = true;
            std::mem::take(&mut inner.entries)
        };
        entries
            .into_iter()
            .filter_map(|entry| {
                let _ = entry.socket.shutdown(Shutdown::Both);
                entry.thread
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;
    use std::time::Duration;

    /// A connected loopback pair: (client side, server side).
    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server)
    }

    fn assert_eof(client: &mut TcpStream) {
        let mut byte = [0u8; 1];
        assert_eq!(
            client.read(&mut byte).expect("EOF, not a timeout"),
            0,
            "the client must see the end of the stream"
        );
    }

    /// The interleaving that used to leak: the connection ends (and its
    /// thread cleans up) before the acceptor stores the thread's handle.
    #[test]
    fn a_connection_that_ends_before_its_thread_is_stored_is_not_left_recorded() {
        let conns = Arc::new(Connections::default());
        let (mut client, server) = pair();
        let recorded = conns.record(server.try_clone().unwrap()).unwrap();
        let id = recorded.id();
        let thread = std::thread::spawn(move || {
            drop(recorded);
            drop(server);
        });
        thread.join().unwrap();
        conns.set_thread(id, std::thread::spawn(|| {}));
        assert_eq!(conns.len(), 0);
        assert_eof(&mut client);
    }

    #[test]
    fn close_all_shuts_recorded_sockets_down_and_refuses_new_records() {
        let conns = Arc::new(Connections::default());
        let (mut client, server) = pair();
        let recorded = conns.record(server.try_clone().unwrap()).unwrap();
        let id = recorded.id();
        let mut server = server;
        let thread = std::thread::spawn(move || {
            // Blocks until the socket is shut down.
            let mut buf = [0u8; 16];
            let n = server.read(&mut buf).unwrap_or(0);
            drop(recorded);
            assert_eq!(n, 0, "the server side sees the end of the stream");
        });
        conns.set_thread(id, thread);
        let threads = conns.close_all();
        assert_eq!(threads.len(), 1);
        for t in threads {
            t.join().unwrap();
        }
        assert_eof(&mut client);
        assert_eq!(conns.len(), 0);
        let (_client, late) = pair();
        assert!(conns.record(late).is_none());
    }
}
