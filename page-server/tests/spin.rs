//! `RunningServer::set_spin_before_block` changes how a connection that is
//! already open waits for its next request: from blocking reads to polling
//! its socket, and back. (One test in this file: it finds the server's
//! connection thread among this process's threads by name.)

mod common;

use std::time::{Duration, Instant};

use common::{loopback_coordinator, manager, page_for, page_server_with};
use page_server::ServerConfig;
use rdma_transport::{Page, TransportManager, PAGE_SIZE};

const RECVFROM: i64 = 45;

/// The task id of the one `page-conn-*` thread of this process.
fn connection_thread() -> String {
    let mut found = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        if comm.starts_with("page-conn") {
            found.push(task.file_name().to_string_lossy().into_owned());
        }
    }
    assert_eq!(found.len(), 1, "one connection thread: {found:?}");
    found.pop().unwrap()
}

/// (state, CPU ticks used, system call it is in) of task `tid`, from
/// `/proc/self/task/<tid>/{stat,syscall}`.
fn task(tid: &str) -> (char, u64, Option<i64>) {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).unwrap();
    // The fields after the command, which is in parentheses.
    let rest: Vec<&str> = stat.rsplit_once(") ").unwrap().1.split(' ').collect();
    let state = rest[0].chars().next().unwrap();
    let ticks = rest[11].parse::<u64>().unwrap() + rest[12].parse::<u64>().unwrap();
    let syscall = std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall"))
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok());
    (state, ticks, syscall)
}

/// Polls `tid` until `done` holds, for at most 20 s.
fn until(tid: &str, what: &str, done: impl Fn((char, u64, Option<i64>)) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = task(tid);
        if done(now) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: still {now:?}");
        std::thread::yield_now();
    }
}

/// A blocking read of the socket: asleep in `recvfrom`. (A polling
/// connection's socket does not block: it is never asleep there.)
fn blocked_in_read((state, _, syscall): (char, u64, Option<i64>)) -> bool {
    state == 'S' && syscall == Some(RECVFROM)
}

fn read_back(mgr: &TransportManager, gpa: u64, seed: u8) {
    let mut page: Page = [0u8; PAGE_SIZE];
    mgr.read_page(gpa, &mut page).unwrap();
    assert!(page == page_for(gpa, seed), "page {gpa:#x}");
}

#[test]
fn an_open_connection_takes_a_new_spin_after_its_next_request() {
    let (_db, coord) = loopback_coordinator();
    let mut cfg = ServerConfig::new("a", common::NODE_BYTES);
    cfg.spin_before_block = Duration::ZERO;
    let server = page_server_with(&coord.url(), cfg);
    let mgr = manager(&coord.url());
    let gpa = 5 * PAGE_SIZE as u64;
    mgr.write_page(gpa, &page_for(gpa, 3)).unwrap();
    read_back(&mgr, gpa, 3);
    let conn = connection_thread();
    until(&conn, "spin 0: a blocking read", blocked_in_read);

    // A spin far longer than the test: after its next request the thread
    // polls its socket, and burns CPU while no request comes.
    server.set_spin_before_block(Duration::from_secs(3600));
    read_back(&mgr, gpa, 3);
    let (_, before, _) = task(&conn);
    until(
        &conn,
        "spinning: 0.3 s of CPU without a request",
        |(_, t, _)| t >= before + 30,
    );

    server.set_spin_before_block(Duration::ZERO);
    read_back(&mgr, gpa, 3);
    until(&conn, "spin 0 again: a blocking read", blocked_in_read);
    assert_eq!(connection_thread(), conn, "the same connection throughout");
}
