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

use parking_lot::{Condvar, Mutex};

/// The recorded connections.
#[derive(Debug, Default)]
pub(crate) struct Connections {
    inner: Mutex<Inner>,
    /// Notified whenever a record goes (its connection's thread ended).
    gone: Condvar,
}

#[derive(Debug, Default)]
struct Inner {
    entries: Vec<Entry>,
    next_id: u64,
    /// Entries in [`State::Pending`] and [`State::Handshaken`].
    pending: usize,
    handshaken: usize,
    /// Set by [`Connections::close_all`]: nothing is recorded after it.
    closed: bool,
    /// Set while a replica recovery runs ([`Connections::fence`]): no
    /// connection may keep an RDMA session.
    rdma_paused: bool,
}

/// One connection: a duplicate of its socket (to shut it down), its state
/// and, once started, its thread.
#[derive(Debug)]
struct Entry {
    id: u64,
    socket: TcpStream,
    state: State,
    thread: Option<JoinHandle<()>>,
    rdma: RdmaUse,
    /// The connection joined the coherence directory as a node: a fence
    /// leaves it open (closing it would lose the pages the node owns).
    coherence_node: bool,
    /// Shut down by [`Connections::fence`]; its thread may not have ended.
    fenced: bool,
    /// The client's id, once handshaken as a data connection (not a
    /// coherence node's): a newer data connection of the same client
    /// supersedes it ([`Recorded::supersede_older`]).
    client_id: Option<u64>,
}

/// Whether a connection's client moves pages by RDMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RdmaUse {
    /// TCP only, by the client's choice (or no RDMA here).
    None,
    /// The client has a QP and a memory key: its writes land without this
    /// process seeing them.
    Session,
    /// The client asked for RDMA and was answered without it because a
    /// recovery was running: it is closed when the recovery ends, so that
    /// it comes back with RDMA.
    Withheld,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Accepted; no HELLO handshake yet.
    Pending,
    Handshaken,
    /// Shut down to make room for a newer pending connection; its thread
    /// is ending.
    Evicted,
}

/// What became of a pending connection that finished its handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Promotion {
    Promoted,
    /// `max_connections` handshaken connections are open: close it.
    Full,
    /// It was evicted meanwhile: close it.
    Evicted,
}

/// A newly recorded connection, and whether recording it evicted an older
/// pending one.
#[derive(Debug)]
pub(crate) struct Admitted {
    pub(crate) recorded: Recorded,
    pub(crate) evicted: bool,
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

    /// Records how the connection's client moves pages. Refused (false)
    /// for an RDMA session while RDMA is paused: the caller closes the
    /// connection (its QP goes with it).
    pub(crate) fn note_rdma(&self, rdma: RdmaUse) -> bool {
        let mut inner = self.conns.inner.lock();
        if rdma == RdmaUse::Session && inner.rdma_paused {
            return false;
        }
        if let Some(entry) = inner.entries.iter_mut().find(|e| e.id == self.id) {
            entry.rdma = rdma;
        }
        true
    }

    /// Records that the connection joined the coherence directory as a
    /// node (see [`Connections::fence`]).
    pub(crate) fn note_coherence_node(&self) {
        let mut inner = self.conns.inner.lock();
        if let Some(entry) = inner.entries.iter_mut().find(|e| e.id == self.id) {
            entry.coherence_node = true;
        }
    }

    /// Moves the connection from pending to handshaken, unless
    /// `max_handshaken` are open or it has been evicted.
    pub(crate) fn promote(&self, max_handshaken: usize) -> Promotion {
        let mut inner = self.conns.inner.lock();
        let full = inner.handshaken >= max_handshaken;
        let Some(entry) = inner.entries.iter_mut().find(|e| e.id == self.id) else {
            return Promotion::Evicted;
        };
        match entry.state {
            State::Handshaken => Promotion::Promoted,
            State::Evicted => Promotion::Evicted,
            State::Pending if full => Promotion::Full,
            State::Pending => {
                entry.state = State::Handshaken;
                inner.pending -= 1;
                inner.handshaken += 1;
                Promotion::Promoted
            }
        }
    }

    /// This connection, handshaken as a data connection of client
    /// `client_id`, supersedes that client's older data connections: shuts
    /// them down and waits until their threads have ended (at most
    /// `within`), so that nothing they still read is applied after what
    /// this one brings. Returns how many there were, or `Err` with how
    /// many still run after `within` (this connection must then not be
    /// served).
    ///
    /// A client gives a connection up when it ends or its requests stop
    /// being answered; writes it sent there may still arrive: a stopped
    /// process finds them in its socket, a link that comes back delivers
    /// what the client's TCP retransmits. Had it written the same page
    /// again on its new connection, the older write would land last.
    /// Shut down, the old socket applies what this process already read
    /// from it, before its thread ends, and refuses the rest.
    /// Coherence nodes' connections are not data connections: neither
    /// side of this.
    pub(crate) fn supersede_older(
        &self,
        client_id: u64,
        within: std::time::Duration,
    ) -> Result<usize, usize> {
        let mut inner = self.conns.inner.lock();
        let mut older = Vec::new();
        for entry in inner.entries.iter_mut() {
            if entry.id == self.id {
                entry.client_id = Some(client_id);
            } else if entry.client_id == Some(client_id) && !entry.coherence_node {
                let _ = entry.socket.shutdown(Shutdown::Both);
                entry.client_id = None;
                older.push(entry.id);
            }
        }
        let deadline = std::time::Instant::now() + within;
        let running = |inner: &Inner| {
            inner
                .entries
                .iter()
                .filter(|e| older.contains(&e.id))
                .count()
        };
        while running(&inner) > 0 {
            if self.conns.gone.wait_until(&mut inner, deadline).timed_out() {
                let left = running(&inner);
                return if left == 0 {
                    Ok(older.len())
                } else {
                    Err(left)
                };
            }
        }
        Ok(older.len())
    }
}

impl Drop for Recorded {
    fn drop(&mut self) {
        let mut inner = self.conns.inner.lock();
        if let Some(at) = inner.entries.iter().position(|e| e.id == self.id) {
            // The thread being dropped here is this connection's own: its
            // handle is only detached.
            let entry = inner.entries.swap_remove(at);
            inner.uncount(entry.state);
        }
        self.conns.gone.notify_all();
    }
}

impl Inner {
    fn uncount(&mut self, state: State) {
        match state {
            State::Pending => self.pending -= 1,
            State::Handshaken => self.handshaken -= 1,
            State::Evicted => {}
        }
    }

    /// Shuts down every connection whose RDMA use is `rdma` (their threads
    /// then see the end of the stream and end), but coherence nodes';
    /// returns how many.
    ///
    /// Closing a node declares it lost: the pages it owns and has not
    /// written back are lost for every node, and it may still read its
    /// copies after the home gave them to others (it learns of the close a
    /// round trip later). Neither is a price for a faster transport: a
    /// node stays on the connection it has.
    fn shut_down_where(&mut self, rdma: RdmaUse) -> usize {
        let mut n = 0;
        for entry in self
            .entries
            .iter_mut()
            .filter(|e| e.rdma == rdma && !e.coherence_node)
        {
            let _ = entry.socket.shutdown(Shutdown::Both);
            n += 1;
        }
        n
    }

    /// Shuts the oldest pending connection down (its thread then sees the
    /// end of the stream and ends).
    fn evict_oldest_pending(&mut self) -> bool {
        let oldest = self
            .entries
            .iter_mut()
            .filter(|e| e.state == State::Pending)
            .min_by_key(|e| e.id);
        let Some(entry) = oldest else {
            return false;
        };
        let _ = entry.socket.shutdown(Shutdown::Both);
        entry.state = State::Evicted;
        self.pending -= 1;
        true
    }
}

impl Connections {
    /// Records a new, pending connection by a duplicate of its socket,
    /// first evicting the oldest pending one when `max_pending` are
    /// recorded. `None` once [`Connections::close_all`] has run (the
    /// connection is then not to be served).
    pub(crate) fn record(
        self: &Arc<Self>,
        socket: TcpStream,
        max_pending: usize,
    ) -> Option<Admitted> {
        let mut inner = self.inner.lock();
        if inner.closed {
            return None;
        }
        let evicted = inner.pending >= max_pending.max(1) && inner.evict_oldest_pending();
        inner.next_id += 1;
        let id = inner.next_id;
        inner.entries.push(Entry {
            id,
            socket,
            state: State::Pending,
            thread: None,
            rdma: RdmaUse::None,
            coherence_node: false,
            fenced: false,
            client_id: None,
        });
        inner.pending += 1;
        Some(Admitted {
            recorded: Recorded {
                conns: Arc::clone(self),
                id,
            },
            evicted,
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

    /// Pending and handshaken connections now.
    pub(crate) fn counts(&self) -> (usize, usize) {
        let inner = self.inner.lock();
        (inner.pending, inner.handshaken)
    }

    /// Fences off the connections a replica recovery must not hear from
    /// again (see `recovery.rs`): shuts down every connection but the
    /// coherence nodes', and pauses RDMA: no new session may start until
    /// [`Connections::resume_rdma`]. Returns the connections shut down;
    /// [`Connections::fenced_open`] tells when their threads are gone.
    ///
    /// A node's write-backs go through the write guard, whether they come
    /// over its socket or its RDMA message channel (whose QP may only read
    /// the region and write its own ring); and closing it would declare it
    /// lost: its copies dropped a round trip after the home gave its pages
    /// away, and the pages it owns lost.
    ///
    /// A client's TCP may deliver, long after the client gave a request
    /// up, bytes it sent before a link went down; on a shut-down socket
    /// they are refused. An RDMA WRITE lands without this process seeing
    /// it at all.
    pub(crate) fn fence(&self) -> usize {
        let mut inner = self.inner.lock();
        inner.rdma_paused = true;
        let mut n = 0;
        for entry in inner.entries.iter_mut().filter(|e| !e.coherence_node) {
            let _ = entry.socket.shutdown(Shutdown::Both);
            entry.fenced = true;
            n += 1;
        }
        n
    }

    /// Connections shut down by [`Connections::fence`] (every RDMA session
    /// among them: none can start after it) whose threads, and QPs, are not
    /// gone yet.
    pub(crate) fn fenced_open(&self) -> usize {
        let inner = self.inner.lock();
        inner.entries.iter().filter(|e| e.fenced).count()
    }

    /// Ends the pause: RDMA is offered again, and the connections that were
    /// answered without it are shut down (their clients reconnect, with
    /// RDMA), but coherence nodes', which keep theirs. Returns those shut
    /// down.
    pub(crate) fn resume_rdma(&self) -> usize {
        let mut inner = self.inner.lock();
        inner.rdma_paused = false;
        inner.shut_down_where(RdmaUse::Withheld)
    }

    /// Shuts down every connection with an RDMA data session (their
    /// clients reconnect, and their QPs go with their threads). Returns how
    /// many.
    pub(crate) fn shut_down_rdma_sessions(&self) -> usize {
        self.inner.lock().shut_down_where(RdmaUse::Session)
    }

    /// Stops recording, shuts every recorded socket down (its thread then
    /// sees the end of the stream) and returns the threads to join.
    pub(crate) fn close_all(&self) -> Vec<JoinHandle<()>> {
        let entries = {
            let mut inner = self.inner.lock();
            inner.closed = true;
            (inner.pending, inner.handshaken) = (0, 0);
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

impl Connections {
    /// As [`Connections::close_all`], but as a killed process would: each
    /// socket is first set to linger 0, so that its last close resets the
    /// connection instead of ending it in order. (The shutdown still sends
    /// FIN at once, so a blocked peer wakes whether or not its thread has
    /// closed yet.)
    pub(crate) fn abort_all(&self) -> Vec<JoinHandle<()>> {
        {
            let inner = self.inner.lock();
            for entry in &inner.entries {
                let _ = socket2::SockRef::from(&entry.socket)
                    .set_linger(Some(std::time::Duration::ZERO));
            }
        }
        self.close_all()
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
        let recorded = conns
            .record(server.try_clone().unwrap(), 8)
            .unwrap()
            .recorded;
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
        let recorded = conns
            .record(server.try_clone().unwrap(), 8)
            .unwrap()
            .recorded;
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
        assert!(conns.record(late, 8).is_none());
    }

    /// Over the pending cap, the oldest pending connection is shut down
    /// (its client sees EOF) and a newer one keeps its place; handshaken
    /// ones are neither evicted nor counted against the pending cap.
    #[test]
    fn a_new_connection_over_the_pending_cap_evicts_the_oldest_pending_one() {
        let conns = Arc::new(Connections::default());
        let (mut c1, s1) = pair();
        let (_c2, s2) = pair();
        let (_c3, s3) = pair();
        let (_c4, s4) = pair();
        let r1 = conns.record(s1, 2).unwrap();
        let r2 = conns.record(s2, 2).unwrap();
        assert!(!r1.evicted && !r2.evicted);
        let r3 = conns.record(s3, 2).unwrap();
        assert!(r3.evicted);
        assert_eof(&mut c1);
        assert_eq!(r1.recorded.promote(10), Promotion::Evicted);
        assert_eq!(conns.counts(), (2, 0));
        assert_eq!(r2.recorded.promote(10), Promotion::Promoted);
        assert_eq!(conns.counts(), (1, 1));
        let r4 = conns.record(s4, 2).unwrap();
        assert!(
            !r4.evicted,
            "a handshaken connection does not count as pending"
        );
        assert_eq!(conns.counts(), (2, 1));
        drop(r1);
        assert_eq!(conns.len(), 3);
        drop(r2);
        assert_eq!(conns.counts(), (2, 0));
    }

    #[test]
    fn promotion_is_refused_when_max_handshaken_are_open() {
        let conns = Arc::new(Connections::default());
        let (_c1, s1) = pair();
        let (_c2, s2) = pair();
        let r1 = conns.record(s1, 8).unwrap().recorded;
        let r2 = conns.record(s2, 8).unwrap().recorded;
        assert_eq!(r1.promote(1), Promotion::Promoted);
        assert_eq!(r2.promote(1), Promotion::Full);
        assert_eq!(conns.counts(), (1, 1));
        drop(r1);
        assert_eq!(r2.promote(1), Promotion::Promoted);
        assert_eq!(conns.counts(), (0, 1));
    }

    /// A thread serving `server` as a connection does: it reads until the
    /// end of the stream, then its record goes.
    fn serving(mut server: TcpStream, recorded: Recorded) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || {
            let mut buf = [0u8; 16];
            while server.read(&mut buf).is_ok_and(|n| n > 0) {}
            drop(recorded);
        })
    }

    /// A client's new data connection shuts down that client's older data
    /// connections and returns once their threads have ended; another
    /// client's connection and a coherence node's of the same client stay.
    #[test]
    fn a_clients_new_data_connection_ends_its_older_ones_first() {
        let conns = Arc::new(Connections::default());
        let (mut old_client, old_server) = pair();
        let (mut other_client, other_server) = pair();
        let (mut node_client, node_server) = pair();
        let (_new_client, new_server) = pair();
        let old = conns
            .record(old_server.try_clone().unwrap(), 8)
            .unwrap()
            .recorded;
        let other = conns
            .record(other_server.try_clone().unwrap(), 8)
            .unwrap()
            .recorded;
        let node = conns
            .record(node_server.try_clone().unwrap(), 8)
            .unwrap()
            .recorded;
        let new = conns.record(new_server, 8).unwrap().recorded;
        assert_eq!(old.supersede_older(7, Duration::from_secs(5)), Ok(0));
        assert_eq!(other.supersede_older(8, Duration::from_secs(5)), Ok(0));
        node.note_coherence_node();
        let old_thread = serving(old_server, old);
        let _other_thread = serving(other_server, other);

        assert_eq!(new.supersede_older(7, Duration::from_secs(5)), Ok(1));
        // Its thread has ended: its record is gone.
        assert_eq!(conns.len(), 3);
        old_thread.join().unwrap();
        assert_eof(&mut old_client);
        assert!(
            still_open(&mut other_client),
            "another client's connection was ended"
        );
        assert!(
            still_open(&mut node_client),
            "a coherence node's connection was ended"
        );
        drop(node_server);
    }

    /// An older connection whose thread does not end in time: the new one
    /// is told how many still run (it is then not served).
    #[test]
    fn a_new_connection_is_refused_while_an_older_one_of_its_client_runs_on() {
        let conns = Arc::new(Connections::default());
        let (_old_client, old_server) = pair();
        let (_new_client, new_server) = pair();
        let old = conns.record(old_server, 8).unwrap().recorded;
        let new = conns.record(new_server, 8).unwrap().recorded;
        assert_eq!(old.supersede_older(7, Duration::from_secs(5)), Ok(0));
        // Nothing serves the old one: its record stays.
        assert_eq!(new.supersede_older(7, Duration::from_millis(50)), Err(1));
        drop(old);
    }

    /// Whether the client end of a pair is still open (no end of stream,
    /// nothing to read).
    fn still_open(client: &mut TcpStream) -> bool {
        client
            .set_read_timeout(Some(std::time::Duration::from_millis(50)))
            .unwrap();
        let mut byte = [0u8; 1];
        matches!(
            client.read(&mut byte),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
                || e.kind() == std::io::ErrorKind::TimedOut
        )
    }

    /// A recovery's fence shuts down every connection but a coherence
    /// node's (over TCP or an RDMA channel), counts them until their
    /// threads are gone, and pauses RDMA; when the recovery ends, the
    /// connections answered without RDMA are shut down so that their
    /// clients come back with it, but coherence nodes.
    #[test]
    fn a_fence_closes_all_but_coherence_nodes_and_pauses_rdma() {
        let conns = Arc::new(Connections::default());
        let (mut c_rdma, s_rdma) = pair();
        let (mut c_tcp, s_tcp) = pair();
        let (mut c_node, s_node) = pair();
        let (mut c_channel, s_channel) = pair();
        let (mut c_pending, s_pending) = pair();
        let rdma = conns.record(s_rdma, 8).unwrap().recorded;
        let tcp = conns.record(s_tcp, 8).unwrap().recorded;
        let node = conns.record(s_node, 8).unwrap().recorded;
        let channel = conns.record(s_channel, 8).unwrap().recorded;
        let pending = conns.record(s_pending, 8).unwrap().recorded;
        assert!(rdma.note_rdma(RdmaUse::Session));
        assert!(tcp.note_rdma(RdmaUse::None));
        assert!(node.note_rdma(RdmaUse::None));
        node.note_coherence_node();
        assert!(channel.note_rdma(RdmaUse::Session));
        channel.note_coherence_node();

        assert_eq!(conns.fence(), 3);
        for closed in [&mut c_rdma, &mut c_tcp, &mut c_pending] {
            assert_eof(closed);
        }
        assert!(still_open(&mut c_node), "a coherence node was closed");
        assert!(
            still_open(&mut c_channel),
            "a coherence node over an RDMA channel was closed"
        );
        // Shut down, but their threads (and the QP) not gone yet: counted.
        assert_eq!(conns.fenced_open(), 3);
        drop((rdma, tcp, pending));
        assert_eq!(conns.fenced_open(), 0);
        // A handshake that raced the fence may not keep an RDMA session.
        let (mut c_late, s_late) = pair();
        let late = conns.record(s_late, 8).unwrap().recorded;
        assert!(!late.note_rdma(RdmaUse::Session));
        assert!(late.note_rdma(RdmaUse::Withheld));
        // Nor may a node that came during the pause: it goes on over TCP.
        let (mut c_late_node, s_late_node) = pair();
        let late_node = conns.record(s_late_node, 8).unwrap().recorded;
        assert!(late_node.note_rdma(RdmaUse::Withheld));
        late_node.note_coherence_node();
        assert_eq!(conns.fenced_open(), 0, "opened after the fence");

        assert_eq!(conns.resume_rdma(), 1, "the withheld connection");
        assert_eof(&mut c_late);
        assert!(still_open(&mut c_node));
        // Closing it would lose the pages it owns, for a faster transport.
        assert!(
            still_open(&mut c_late_node),
            "a coherence node was closed to come back with RDMA"
        );
        let (_c_new, s_new) = pair();
        let new = conns.record(s_new, 8).unwrap().recorded;
        assert!(new.note_rdma(RdmaUse::Session), "RDMA is offered again");
        assert!(still_open(&mut c_channel));
        drop((node, channel, late, late_node, new));
    }
}
