//! A TCP relay between the tests' clients and one page-server that can stall:
//! while held it passes nothing on in either direction, and once released
//! it delivers everything it kept, late. That is what a page-server sees of
//! a link that went down and came back: the clients' TCP retransmits what
//! it sent meanwhile, on the same connections, whatever the clients have
//! done since. Or, severed, it drops what it kept and ends the connections
//! it was kept from (their clients gave up: a client's connection discards
//! what its server has not acknowledged when it is dropped). The
//! page-server advertises the relay's address (`--advertise`), so the
//! coordinator sends every client through it.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// The relay; its threads end with the test process.
pub struct StallingLink {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    target: Option<SocketAddr>,
    held: bool,
    /// Connections numbered below it are held (`hold_open`); later ones
    /// pass.
    held_below: Option<u64>,
    /// Set by the first release after a hold.
    released: bool,
    /// Chunks the page-server sent after a release (its answers to what
    /// was delivered late).
    answers_after_release: u64,
    /// Connections the page-server ended.
    closed_by_server: u64,
    /// Every connection relayed, by number: its client and server side.
    conns: Vec<(u64, TcpStream, TcpStream)>,
    /// Connections something was kept from while the link was held.
    stalled: Vec<u64>,
    /// Connections ended by [`StallingLink::sever`].
    severed: Vec<u64>,
}

impl StallingLink {
    /// Listens on a loopback port; connections are refused until
    /// [`StallingLink::set_target`].
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let addr = listener.local_addr().expect("relay address");
        let shared = Arc::new(Shared::default());
        let accepting = Arc::clone(&shared);
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Some(target) = accepting.state.lock().target else {
                    continue;
                };
                let Ok(server) = TcpStream::connect_timeout(&target, Duration::from_secs(2)) else {
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let id = {
                    let mut state = accepting.state.lock();
                    let id = state.conns.len() as u64;
                    if let (Ok(c), Ok(s)) = (client.try_clone(), server.try_clone()) {
                        state.conns.push((id, c, s));
                    }
                    id
                };
                for (from, to, from_server) in [
                    (client.try_clone(), server.try_clone(), false),
                    (server.try_clone(), client.try_clone(), true),
                ] {
                    if let (Ok(from), Ok(to)) = (from, to) {
                        let shared = Arc::clone(&accepting);
                        std::thread::spawn(move || shared.pump(from, to, from_server, id));
                    }
                }
            }
        });
        Self { addr, shared }
    }

    /// The address clients are to use (the page-server's `--advertise`).
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Where the relay connects each client it accepts.
    pub fn set_target(&self, target: &str) {
        self.shared.state.lock().target = Some(target.parse().expect("page-server address"));
    }

    /// Stops passing bytes on, both ways; what arrives is kept.
    pub fn hold(&self) {
        let mut state = self.shared.state.lock();
        state.held = true;
        state.released = false;
    }

    /// As [`StallingLink::hold`], for the connections open now only: new
    /// ones pass.
    pub fn hold_open(&self) {
        let mut state = self.shared.state.lock();
        state.held_below = Some(state.conns.len() as u64);
        state.released = false;
    }

    /// Ends the client side of every connection held now, keeping what it
    /// sent for the page-server: the client sees its connection end (and
    /// opens a new one), the page-server gets the old one's bytes at the
    /// release, after whatever came on the new one meanwhile.
    pub fn end_held_clients(&self) {
        let state = self.shared.state.lock();
        for (id, client, _) in &state.conns {
            if state.holds(*id) {
                let _ = client.shutdown(Shutdown::Both);
            }
        }
    }

    /// Delivers what was kept, and everything after it.
    pub fn release(&self) {
        let mut state = self.shared.state.lock();
        state.held = false;
        state.held_below = None;
        state.released = true;
        self.shared.changed.notify_all();
    }

    /// Drops what the link kept, ends the connections it was kept from,
    /// and passes everything again.
    pub fn sever(&self) {
        let mut state = self.shared.state.lock();
        let stalled = std::mem::take(&mut state.stalled);
        for (_, client, server) in state.conns.iter().filter(|c| stalled.contains(&c.0)) {
            let _ = (
                client.shutdown(Shutdown::Both),
                server.shutdown(Shutdown::Both),
            );
        }
        state.severed.extend(stalled);
        state.held = false;
        state.held_below = None;
        self.shared.changed.notify_all();
    }

    /// Connections relayed so far (each dial through the link opens one).
    pub fn connections(&self) -> usize {
        self.shared.state.lock().conns.len()
    }

    /// Whether the link keeps something from the page-server now.
    pub fn holds_something(&self) -> bool {
        let state = self.shared.state.lock();
        (state.held || state.held_below.is_some()) && !state.stalled.is_empty()
    }

    /// Whether the page-server answered something delivered after the
    /// release, or has ended a connection: either way it is done with
    /// what it was sent late.
    pub fn server_reacted(&self) -> bool {
        let state = self.shared.state.lock();
        state.answers_after_release > 0 || state.closed_by_server > 0
    }
}

impl State {
    /// Whether connection `id` is held.
    fn holds(&self, id: u64) -> bool {
        self.held || self.held_below.is_some_and(|below| id < below)
    }
}

impl Shared {
    /// Copies `from` to `to` chunk by chunk, each chunk waiting while the
    /// link is held; once the link severed connection `id`, nothing more.
    fn pump(&self, mut from: TcpStream, mut to: TcpStream, from_server: bool, id: u64) {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = from.read(&mut buf).unwrap_or(0);
            {
                let mut state = self.state.lock();
                if n == 0 && from_server {
                    state.closed_by_server += 1;
                }
                // The end of a stream is held back like its bytes.
                if state.holds(id) && !state.stalled.contains(&id) {
                    state.stalled.push(id);
                }
                while state.holds(id) {
                    self.changed.wait(&mut state);
                }
                if state.severed.contains(&id) {
                    return;
                }
                if n > 0 && from_server && state.released {
                    state.answers_after_release += 1;
                }
            }
            if n == 0 {
                let _ = to.shutdown(Shutdown::Write);
                return;
            }
            if to.write_all(&buf[..n]).is_err() {
                let _ = from.shutdown(Shutdown::Both);
                return;
            }
        }
    }
}
