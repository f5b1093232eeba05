//! The hand-offs of `receive::wait`: a caller blocked on a socket reads the
//! answers of callers parked on the same connection, and the poller takes
//! over when it leaves.

use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::connection::{ClientAuth, TcpConnection};
use super::inflight::Waiter;
use super::poller::Pollers;
use super::receive::wait;
use crate::config::PollMode;
use crate::page::PAGE_SIZE;
use crate::wire::{Header, HelloAck, Opcode};

/// A connection (with page checksums or not) whose other end the test
/// writes answers to, without a poller.
pub(super) fn bare_connection(checksums: bool) -> (Arc<TcpConnection>, TcpStream) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    let ack = HelloAck {
        region_size_bytes: 1 << 20,
        epoch: 1,
        page_size: PAGE_SIZE as u32,
        rdma: None,
        coherence: None,
        node_bound_limit_ms: None,
        checksums,
        bound_sums: checksums,
    };
    let auth = ClientAuth {
        client_id: 1,
        node_id: "n",
        key: None,
        checksums,
        coherence: false,
        node_bound_ms: None,
        landed_pages: None,
    };
    let conn = Arc::new(TcpConnection::from_handshaken(&auth, "test", client, ack).unwrap());
    (conn, server)
}

/// A connection whose other end the test writes answers to, and its poller.
fn connection() -> (Arc<TcpConnection>, TcpStream, Pollers) {
    let (conn, server) = bare_connection(false);
    let pollers = Pollers::start(1, &[], PollMode::Event, Duration::ZERO).unwrap();
    pollers.add(&conn);
    (conn, server, pollers)
}

/// A caller's thread and its request id.
type Caller = (std::thread::JoinHandle<(bool, u32)>, u64);

/// A caller on its own thread: arms one WRITE at `offset`, sends its id,
/// waits without spinning; (answered, completion code).
fn caller(
    conn: &Arc<TcpConnection>,
    offset: u64,
    ids: mpsc::Sender<u64>,
) -> std::thread::JoinHandle<(bool, u32)> {
    let conn = Arc::clone(conn);
    std::thread::spawn(move || {
        let waiter = Waiter::new();
        let id = conn
            .inflight
            .arm(std::ptr::null_mut(), offset, &waiter, false)
            .unwrap();
        ids.send(id).unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let answered = wait(
            &waiter,
            &[Some(Arc::clone(&conn))],
            Duration::ZERO,
            deadline,
        );
        let code = match answered {
            true => conn.inflight.finish(id),
            false => conn.inflight.cancel(id).unwrap_or(u32::MAX),
        };
        (answered, code)
    })
}

fn answer(server: &mut TcpStream, id: u64, offset: u64) {
    let header = Header::request(Opcode::WriteResp, id, offset, PAGE_SIZE as u32);
    server.write_all(&header.encode()).unwrap();
}

/// Waits (yielding) until `cond` holds: the other threads reached a state.
fn until(cond: impl Fn() -> bool) {
    while !cond() {
        std::thread::yield_now();
    }
}

/// Caller A blocks on the socket, caller B (same connection) parks. Returns
/// both with their ids.
fn blocked_and_parked(conn: &Arc<TcpConnection>) -> (Caller, Caller) {
    let (tx, rx) = mpsc::channel();
    let a = caller(conn, 0, tx.clone());
    let id_a = rx.recv().unwrap();
    until(|| conn.blocking_reader.load(Ordering::SeqCst));
    let b = caller(conn, PAGE_SIZE as u64, tx);
    let id_b = rx.recv().unwrap();
    until(|| conn.parking.any());
    ((a, id_a), (b, id_b))
}

#[test]
fn the_poller_takes_over_when_the_blocked_caller_leaves() {
    let (conn, mut server, _pollers) = connection();
    let ((a, id_a), (b, id_b)) = blocked_and_parked(&conn);
    answer(&mut server, id_a, 0);
    assert_eq!(a.join().unwrap(), (true, 0));
    // Only the poller reads the socket now: B completes only if the
    // blocked caller handed the socket back to it. (How soon is not
    // asserted: without the wake-up in `BlockingReaders::drop` the poller
    // would still look again within its 1 s idle timeout.)
    answer(&mut server, id_b, PAGE_SIZE as u64);
    assert_eq!(b.join().unwrap(), (true, 0));
}

#[test]
fn the_blocked_caller_completes_a_parked_caller() {
    let (conn, mut server, _pollers) = connection();
    let ((a, id_a), (b, id_b)) = blocked_and_parked(&conn);
    answer(&mut server, id_b, PAGE_SIZE as u64);
    assert_eq!(b.join().unwrap(), (true, 0));
    assert!(
        conn.blocking_reader.load(Ordering::SeqCst),
        "A still waits on the socket"
    );
    answer(&mut server, id_a, 0);
    assert_eq!(a.join().unwrap(), (true, 0));
    assert!(!conn.blocking_reader.load(Ordering::SeqCst));
}

#[test]
fn a_blocked_caller_returns_when_the_connection_closes() {
    let (conn, server, _pollers) = connection();
    let (tx, rx) = mpsc::channel();
    let a = caller(&conn, 0, tx);
    let _id = rx.recv().unwrap();
    until(|| conn.blocking_reader.load(Ordering::SeqCst));
    drop(server);
    assert_eq!(a.join().unwrap(), (true, super::CODE_CONN_LOST));
    assert!(conn.is_broken());
}
