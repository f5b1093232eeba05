//! The asynchronous API against real page-servers: many pages in flight
//! from one thread, completions reaped by polling, through the eventfd and
//! by a callback, a hung node delaying only the requests that need it, and
//! typed errors in completions.

mod common;

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::*;
use rdma_transport::{
    Completion, ManagerConfig, Page, Reap, TransportError, TransportManager, PAGE_SIZE,
};

fn cluster() -> (
    tempfile::TempDir,
    coordinator::RunningCoordinator,
    page_server::RunningServer,
    page_server::RunningServer,
) {
    let (db, coord) = loopback_coordinator();
    let a = page_server(&coord.url(), "a", 0);
    let b = page_server(&coord.url(), "b", NODE_BYTES as u64);
    (db, coord, a, b)
}

/// Writes a recognisable page at every one of `gpas` (blocking API).
fn fill(mgr: &TransportManager, gpas: &[u64], seed: u8) {
    let pages: Vec<Page> = gpas.iter().map(|&g| page_for(g, seed)).collect();
    mgr.write_pages(gpas, &pages).unwrap();
}

fn zeroed(n: usize) -> Box<[Page]> {
    vec![[0u8; PAGE_SIZE]; n].into_boxed_slice()
}

/// A manager whose requests time out only after `timeout_ms`, once its map
/// holds `nodes` nodes.
fn patient_manager(url: &str, timeout_ms: u64, nodes: usize) -> TransportManager {
    let mgr = TransportManager::connect(ManagerConfig {
        coordinator_url: url.to_owned(),
        request_timeout_ms: timeout_ms,
        poller_cpus: Some(vec![]),
        ..ManagerConfig::default()
    })
    .expect("manager connects");
    assert!(wait_until(Duration::from_secs(10), || {
        mgr.refresh_map().is_ok() && mgr.map().len() == nodes
    }));
    mgr
}

#[test]
fn thirty_two_reads_in_flight_from_one_thread_come_back_with_their_pages() {
    let (_db, coord, _a, _b) = cluster();
    let mgr = manager(&coord.url());
    let gpas: Vec<u64> = (0..64u64)
        .map(|i| (i * 7 % 512) * PAGE_SIZE as u64)
        .collect();
    fill(&mgr, &gpas, 3);
    let queue = mgr.completion_queue(Reap::Poll).unwrap();
    let before = mgr.stats();
    for (i, &gpa) in gpas.iter().take(32).enumerate() {
        queue.submit_read(&[gpa], zeroed(1), i as u64).unwrap();
    }
    assert_eq!(
        queue.in_flight(),
        32,
        "all 32 submitted before any is reaped"
    );
    let mut done = Vec::new();
    let mut next = 32;
    // Keep 32 in flight until every address was read once.
    while done.len() < gpas.len() {
        let before = done.len();
        queue.wait(&mut done, 1, Duration::from_secs(5));
        assert!(done.len() > before, "no completion within 5 s");
        for _ in before..done.len() {
            if next < gpas.len() {
                queue
                    .submit_read(&[gpas[next]], zeroed(1), next as u64)
                    .unwrap();
                next += 1;
            }
        }
    }
    assert_eq!(queue.in_flight(), 0);
    // The queue books its completions per step: all of them are counted
    // by the time they are reaped.
    let after = mgr.stats();
    assert_eq!(after.calls_ok - before.calls_ok, gpas.len() as u64);
    assert_eq!(after.pages_read - before.pages_read, gpas.len() as u64);
    assert_eq!(after.pages_written, before.pages_written);
    assert_eq!(after.calls_failed, before.calls_failed);
    let mut seen = vec![false; gpas.len()];
    for c in done {
        let i = c.user_data as usize;
        c.result.unwrap();
        let pages = c.pages.expect("the buffer comes back");
        assert!(pages[0] == page_for(gpas[i], 3), "page {i} differs");
        assert!(!seen[i], "completion {i} delivered twice");
        seen[i] = true;
    }
    assert!(seen.iter().all(|&s| s));
}

#[test]
fn writes_and_batches_complete_through_the_eventfd() {
    let (_db, coord, _a, _b) = cluster();
    let mgr = manager(&coord.url());
    let queue = mgr.completion_queue(Reap::Eventfd).unwrap();
    let fd = queue.eventfd().expect("an eventfd").as_raw_fd();
    // 300 pages over both nodes: five windows, sliding over the lanes.
    let gpas: Vec<u64> = (0..300u64)
        .map(|i| (i * 5 % 512) * PAGE_SIZE as u64)
        .collect();
    let pages: Box<[Page]> = gpas.iter().map(|&g| page_for(g, 9)).collect();
    queue.submit_write(&gpas, pages, 1).unwrap();
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while done.is_empty() {
        assert!(Instant::now() < deadline, "write batch never completed");
        readable_within(fd, 1000);
        queue.poll(&mut done);
    }
    let c = done.pop().unwrap();
    assert_eq!(c.user_data, 1);
    c.result.unwrap();
    queue.submit_read(&gpas, zeroed(gpas.len()), 2).unwrap();
    while done.is_empty() {
        assert!(Instant::now() < deadline, "read batch never completed");
        readable_within(fd, 1000);
        queue.poll(&mut done);
    }
    let c = done.pop().unwrap();
    c.result.unwrap();
    let back = c.pages.unwrap();
    for (i, &gpa) in gpas.iter().enumerate() {
        assert!(back[i] == page_for(gpa, 9), "page {i} at {gpa:#x} differs");
    }
    // Reaping resets the eventfd: with nothing in flight it does not stay
    // readable, or a VMM's level-triggered epoll would wake for ever. (One
    // more reap: a signal may come after the reap that delivered the last
    // completion, for that same completion.)
    assert_eq!(queue.poll(&mut done), 0);
    assert!(
        !readable_within(fd, 0),
        "the eventfd stays readable after a reap"
    );
}

/// Whether `fd` becomes readable within `timeout_ms` (0: right now), by
/// poll(2).
fn readable_within(fd: i32, timeout_ms: i32) -> bool {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let ret = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    assert!(ret >= 0, "poll failed");
    ret == 1
}

#[test]
fn a_callback_gets_every_completion_on_the_queues_thread() {
    let (_db, coord, _a, _b) = cluster();
    let mgr = manager(&coord.url());
    let gpas: Vec<u64> = (0..40u64)
        .map(|i| NODE_BYTES as u64 - (i + 1) * PAGE_SIZE as u64 * 3)
        .collect();
    fill(&mgr, &gpas, 5);
    let (tx, rx) = mpsc::channel::<(Completion, String)>();
    let queue = mgr
        .completion_queue(Reap::Callback(Box::new(move |c| {
            let name = std::thread::current().name().unwrap_or("").to_owned();
            let _ = tx.send((c, name));
        })))
        .unwrap();
    for (i, &gpa) in gpas.iter().enumerate() {
        queue.submit_read(&[gpa], zeroed(1), i as u64).unwrap();
    }
    for _ in 0..gpas.len() {
        let (c, thread) = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("a completion within 5 s");
        assert_eq!(thread, "page-completions");
        c.result.unwrap();
        let i = c.user_data as usize;
        assert!(
            c.pages.unwrap()[0] == page_for(gpas[i], 5),
            "page {i} differs"
        );
    }
    assert_eq!(queue.in_flight(), 0);
}

#[test]
fn a_hung_node_delays_only_the_requests_that_need_it() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let b = ChildServer::start(&coord.url(), "b", NODE_BYTES as u64);
    let mgr = manager(&coord.url()); // 500 ms request timeout
    assert!(wait_until(Duration::from_secs(10), || {
        mgr.refresh_map().is_ok() && mgr.map().len() == 2
    }));
    let gpa_a: Vec<u64> = (0..16u64).map(|i| i * PAGE_SIZE as u64).collect();
    let gpa_b = NODE_BYTES as u64 + 4 * PAGE_SIZE as u64;
    fill(&mgr, &gpa_a, 6);
    fill(&mgr, &[gpa_b], 6);

    b.pause(); // SIGSTOP: connected, silent
    let queue = mgr.completion_queue(Reap::Poll).unwrap();
    // Before the submission: its deadline is set inside `submit_read`, so
    // a clock read after it returns could see the timeout come "early" by
    // however long the call took on a loaded host.
    let submitted = Instant::now();
    queue.submit_read(&[gpa_b], zeroed(1), 1000).unwrap();
    for (i, &gpa) in gpa_a.iter().enumerate() {
        queue.submit_read(&[gpa], zeroed(1), i as u64).unwrap();
    }
    let mut by_tag: HashMap<u64, (Completion, Duration)> = HashMap::new();
    while by_tag.len() < gpa_a.len() + 1 {
        let mut out = Vec::new();
        queue.wait(&mut out, 1, Duration::from_secs(5));
        assert!(!out.is_empty(), "nothing completed within 5 s");
        for c in out {
            by_tag.insert(c.user_data, (c, submitted.elapsed()));
        }
    }
    b.resume();
    let (hung, hung_after) = by_tag.remove(&1000).unwrap();
    assert!(
        matches!(hung.result, Err(TransportError::Timeout { ref node, .. }) if node == "b"),
        "the hung node's read: {:?}",
        hung.result
    );
    assert!(hung_after >= Duration::from_millis(500), "timed out early");
    for (i, &gpa) in gpa_a.iter().enumerate() {
        let (c, after) = by_tag.remove(&(i as u64)).unwrap();
        assert!(
            after < hung_after,
            "read {i} of node a waited for the hung node ({after:?} vs {hung_after:?})"
        );
        c.result.unwrap();
        assert!(c.pages.unwrap()[0] == page_for(gpa, 6));
    }
}

#[test]
fn bad_addresses_complete_with_typed_errors_and_the_queue_keeps_serving() {
    let (_db, coord, _a, _b) = cluster();
    let mgr = manager(&coord.url());
    let queue = mgr.completion_queue(Reap::Poll).unwrap();
    let before = mgr.stats();
    assert!(matches!(
        queue.submit_read(&[0, 4096], zeroed(1), 0),
        Err(TransportError::Config(_))
    ));
    assert!(matches!(
        queue.submit_read(&[], zeroed(0), 0),
        Err(TransportError::Config(_))
    ));
    queue.submit_read(&[0x10], zeroed(1), 1).unwrap();
    queue
        .submit_read(&[2 * NODE_BYTES as u64], zeroed(1), 2)
        .unwrap();
    queue
        .submit_write(&[8192], vec![page_for(8192, 4)].into_boxed_slice(), 3)
        .unwrap();
    let mut done = Vec::new();
    while done.len() < 3 {
        let before = done.len();
        queue.wait(&mut done, 3, Duration::from_secs(5));
        assert!(done.len() > before, "stuck");
    }
    done.sort_by_key(|c| c.user_data);
    assert!(matches!(
        done[0].result,
        Err(TransportError::Unaligned { gpa: 0x10 })
    ));
    assert!(matches!(
        done[1].result,
        Err(TransportError::UnknownGpa { .. })
    ));
    assert!(done[2].result.is_ok());
    // Two failed calls and one written page, counted once each.
    let after = mgr.stats();
    assert_eq!(after.calls_failed - before.calls_failed, 2);
    assert_eq!(after.calls_ok - before.calls_ok, 1);
    assert_eq!(after.pages_written - before.pages_written, 1);
    assert_eq!(after.pages_read, before.pages_read);
    let mut page = [0u8; PAGE_SIZE];
    mgr.read_page(8192, &mut page).unwrap();
    assert!(page == page_for(8192, 4));
}

#[test]
fn dropping_a_queue_with_requests_in_flight_cancels_them() {
    let (_db, coord) = loopback_coordinator();
    let b = ChildServer::start(&coord.url(), "b", 0);
    let mgr = manager(&coord.url());
    assert!(wait_until(Duration::from_secs(10), || {
        mgr.refresh_map().is_ok() && mgr.map().len() == 1
    }));
    fill(&mgr, &[0], 1);
    b.pause();
    let queue = mgr.completion_queue(Reap::Poll).unwrap();
    for i in 0..8u64 {
        queue
            .submit_read(&[i * PAGE_SIZE as u64], zeroed(1), i)
            .unwrap();
    }
    // Returns with every request cancelled: no late answer may land in
    // the freed buffers (a use after free would show under the sanitizer
    // or as a crash when the answers below arrive).
    drop(queue);
    b.resume();
    // The connection still works for the next caller.
    let mut page = [0u8; PAGE_SIZE];
    mgr.read_page(0, &mut page).unwrap();
    assert!(page == page_for(0, 1));
}

#[test]
fn more_requests_than_a_connection_has_slots_go_out_before_the_first_reap() {
    // One node, one connection: 8 submissions of 600 pages each (up to
    // 512 in flight each) want ~4000 request slots of the connection's
    // 1024 before this thread reaps anything. Requests are queued until a
    // reap (the doorbell): a submitter that finds the table full must send
    // what is queued and read what came, or it waits for its deadline.
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let mgr = manager(&coord.url());
    let page = |i: u64| (i % 128) * PAGE_SIZE as u64;
    let read_gpas: Vec<u64> = (0..600u64)
        .map(|i| page(i) + 128 * PAGE_SIZE as u64)
        .collect();
    let write_gpas: Vec<u64> = (0..600u64).map(page).collect();
    let distinct: Vec<u64> = read_gpas[..128].to_vec();
    fill(&mgr, &distinct, 8);
    let queue = mgr.completion_queue(Reap::Poll).unwrap();
    for k in 0..4u64 {
        let pages: Box<[Page]> = write_gpas.iter().map(|&g| page_for(g, 9)).collect();
        queue.submit_write(&write_gpas, pages, k).unwrap();
        queue
            .submit_read(&read_gpas, zeroed(read_gpas.len()), 100 + k)
            .unwrap();
    }
    let mut done = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    while done.len() < 8 {
        assert!(
            Instant::now() < deadline,
            "only {} of 8 completed",
            done.len()
        );
        queue.wait(&mut done, 8, Duration::from_secs(5));
    }
    for c in done {
        assert!(
            c.result.is_ok(),
            "submission {}: {:?}",
            c.user_data,
            c.result
        );
        if c.user_data >= 100 {
            let back = c.pages.unwrap();
            for (i, &gpa) in read_gpas.iter().enumerate() {
                assert!(back[i] == page_for(gpa, 8), "read {i} at {gpa:#x} differs");
            }
        }
    }
    let mut one = [0u8; PAGE_SIZE];
    for &gpa in &write_gpas[..128] {
        mgr.read_page(gpa, &mut one).unwrap();
        assert!(one == page_for(gpa, 9), "written page {gpa:#x} differs");
    }
}

#[test]
fn a_submission_after_a_failed_or_a_large_one_starts_clean() {
    // A queue reuses the batches of delivered submissions: nothing of one
    // (its error, its buffer, its addresses) may carry over to the next.
    let (_db, coord, _a, _b) = cluster();
    let mgr = manager(&coord.url());
    let total = 2 * (NODE_BYTES / PAGE_SIZE) as u64;
    let gpas: Vec<u64> = (0..total).map(|i| i * PAGE_SIZE as u64).collect();
    fill(&mgr, &gpas, 9);
    let queue = mgr.completion_queue(Reap::Poll).unwrap();
    let pick = |from: u64, step: u64, n: usize| -> Vec<u64> {
        (0..n as u64)
            .map(|i| gpas[((from + i * step) % total) as usize])
            .collect()
    };
    let mut done = Vec::new();
    for round in 0..40u64 {
        let sizes = [1usize, 3, 70, 600];
        // A batch whose last address is unaligned completes with that error.
        let n = sizes[round as usize % 4];
        let mut bad = pick(round * 13, 7, n);
        bad[n - 1] += 1;
        queue.submit_read(&bad, zeroed(n), 2 * round).unwrap();
        // Then one of another size, which must not inherit anything.
        let m = sizes[3 - round as usize % 4];
        let good = pick(round * 31, 5, m);
        queue.submit_read(&good, zeroed(m), 2 * round + 1).unwrap();
        done.clear();
        while done.len() < 2 {
            let before = done.len();
            queue.wait(&mut done, 2, Duration::from_secs(5));
            assert!(done.len() > before, "round {round}: stuck");
        }
        done.sort_by_key(|c| c.user_data);
        assert_eq!(done[0].user_data, 2 * round);
        assert!(
            matches!(done[0].result, Err(TransportError::Unaligned { gpa }) if gpa == bad[n - 1]),
            "round {round}: {:?}",
            done[0].result
        );
        assert_eq!(done[0].pages.as_ref().map(|p| p.len()), Some(n));
        assert_eq!(done[1].user_data, 2 * round + 1);
        assert!(
            done[1].result.is_ok(),
            "round {round}: {:?}",
            done[1].result
        );
        let pages = done[1].pages.as_ref().expect("the buffer comes back");
        assert_eq!(pages.len(), m);
        for (page, &gpa) in pages.iter().zip(&good) {
            assert!(*page == page_for(gpa, 9), "round {round}: page {gpa:#x}");
        }
    }
}

/// A queue reaped with `wait` (poll mode, the library's default event
/// polling) sleeps on its rounds' sockets and a wake fd. What does not come
/// on those sockets must still wake it at once: here reads of a range
/// that joined after the manager read its map, which a fallback job on
/// another thread serves (it refreshes the map). `wait` is given 60 s and
/// the requests 30 s, so a wake-up that went missing would hold each
/// completion for the whole wait (a bound of 20 s cannot be missed by a
/// working queue, however loaded the host).
#[test]
fn a_completion_finished_off_the_sockets_wakes_a_waiting_reaper() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let mgr = patient_manager(&coord.url(), 30_000, 1);
    let _b = page_server(&coord.url(), "b", NODE_BYTES as u64);
    let gpas: Vec<u64> = (0..4u64)
        .map(|i| NODE_BYTES as u64 + i * PAGE_SIZE as u64)
        .collect();
    fill(&manager(&coord.url()), &gpas, 4);
    let queue = mgr.completion_queue(Reap::Poll).unwrap();
    for (i, &gpa) in gpas.iter().enumerate() {
        queue.submit_read(&[gpa], zeroed(1), i as u64).unwrap();
        let started = Instant::now();
        let mut out = Vec::new();
        queue.wait(&mut out, 1, Duration::from_secs(60));
        let waited = started.elapsed();
        assert_eq!(out.len(), 1, "read {i}: nothing completed");
        assert!(
            waited < Duration::from_secs(20),
            "read {i}: the completion waited {waited:?}: its wake-up was lost"
        );
        let c = out.pop().unwrap();
        c.result.unwrap();
        assert!(
            c.pages.unwrap()[0] == page_for(gpa, 4),
            "read {i}: page {gpa:#x}"
        );
    }
    assert_eq!(mgr.map().len(), 2, "the reads refreshed the map");
}

/// The system call `thread` (a task id of this process) is blocked in, or
/// None when it is running or gone (`/proc/<pid>/task/<tid>/syscall`).
fn blocked_in_syscall(thread: &str) -> Option<i64> {
    let text = std::fs::read_to_string(format!("/proc/self/task/{thread}/syscall")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

#[test]
fn a_submission_from_another_thread_wakes_a_reaper_asleep_in_wait() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let b = ChildServer::start(&coord.url(), "b", NODE_BYTES as u64);
    // A hung read that times out long after the test's bound.
    let mgr = patient_manager(&coord.url(), 60_000, 2);
    let (gpa_a, gpa_b) = (3 * PAGE_SIZE as u64, NODE_BYTES as u64);
    fill(&mgr, &[gpa_a], 9);
    fill(&mgr, &[gpa_b], 9);
    let queue = mgr.completion_queue(Reap::Poll).unwrap();
    // Read node a once through the queue: its connection is warm, the
    // later read needs no new one.
    queue.submit_read(&[gpa_a], zeroed(1), 1).unwrap();
    let mut out = Vec::new();
    queue.wait(&mut out, 1, Duration::from_secs(10));
    assert_eq!(out.len(), 1, "the warm-up read did not complete");

    b.pause(); // SIGSTOP: connected, silent
    queue.submit_read(&[gpa_b], zeroed(1), 1000).unwrap();
    let queue = &queue;
    std::thread::scope(|s| {
        let (tid_tx, tid_rx) = mpsc::channel();
        let reaper = s.spawn(move || {
            let me = std::fs::read_link("/proc/thread-self").expect("/proc/thread-self");
            let tid = me.file_name().unwrap().to_string_lossy().into_owned();
            tid_tx.send(tid).unwrap();
            let started = Instant::now();
            let mut out = Vec::new();
            queue.wait(&mut out, 1, Duration::from_secs(30));
            (out, started.elapsed())
        });
        let tid = tid_rx.recv().unwrap();
        // The reaper is asleep in the kernel (ppoll, or futex when the
        // queue has no wake fd) before the other thread submits.
        let asleep = wait_until(Duration::from_secs(10), || {
            matches!(
                blocked_in_syscall(&tid),
                Some(n) if n == libc::SYS_ppoll || n == libc::SYS_futex
            )
        });
        assert!(asleep, "the reaper never went to sleep in wait");
        queue.submit_read(&[gpa_a], zeroed(1), 2).unwrap();
        let (out, waited) = reaper.join().unwrap();
        assert!(
            waited < Duration::from_secs(15),
            "the reaper slept {waited:?} with a submission unsent"
        );
        assert_eq!(out.len(), 1, "one completion, the new read's");
        let c = &out[0];
        assert_eq!(c.user_data, 2);
        c.result.as_ref().unwrap();
        assert!(c.pages.as_ref().unwrap()[0] == page_for(gpa_a, 9));
    });
    b.resume();
    let mut out = Vec::new();
    queue.wait(&mut out, 1, Duration::from_secs(30));
    assert_eq!(
        out.len(),
        1,
        "the paused node's read completes after SIGCONT"
    );
    assert_eq!(out[0].user_data, 1000);
    assert!(out[0].pages.as_ref().unwrap()[0] == page_for(gpa_b, 9));
}
