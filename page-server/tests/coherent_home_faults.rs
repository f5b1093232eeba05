//! A coherence home that fails under its nodes, a real page-server
//! process: stopped (SIGSTOP) again and again while nodes work, its nodes
//! wait and lose nothing; restarted, the new process's memory is empty and
//! the range's contents were the old process's (its epoch's), and nodes
//! must not be handed those zeros as the guest's pages, whether they held
//! a copy before the restart or come new: their faults fail with
//! `DataLost` until an operator re-initialises the range, as reads and
//! writes of the data path do (`epoch.rs`).

mod common;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use rdma_transport::coherent::CoherenceConfig;
use rdma_transport::guest_memory::{
    CoherentMemory, FaultAction, GuestBacking, GuestMemoryConfig, SharedFile,
};
use rdma_transport::{TransportError, TransportManager, PAGE_SIZE};

const PAGES: usize = 16;
const HOME_FLAGS: &[&str] = &["--node-dead-home-timeout-ms", "1000"];

/// The errors of the faults a node could not serve in time (each then
/// retried): whether it was `DataLost` from the home, and the error.
type Reports = Arc<Mutex<Vec<(bool, String)>>>;

/// A coherent node over `mgr` whose failed faults are recorded in
/// `reports` and retried: the faulting thread waits.
fn node(mgr: &TransportManager, reports: &Reports) -> CoherentMemory {
    let reports = Arc::clone(reports);
    CoherentMemory::new(
        mgr,
        GuestMemoryConfig {
            handler_cpus: Some(vec![]),
            fault_timeout_ms: 300,
            on_fault_error: Some(Arc::new(move |report| {
                let lost = matches!(&report.error, TransportError::DataLost { node, .. } if node == "home");
                reports.lock().unwrap().push((lost, report.error.to_string()));
                FaultAction::Retry
            })),
            ..GuestMemoryConfig::new(0, PAGES * PAGE_SIZE)
        },
        CoherenceConfig {
            min_hold_us: 50,
            timeout_ms: 3000,
            dead_home_timeout_ms: 1000,
        },
    )
    .expect("coherent region")
}

/// Waits until page-server "home" is registered in an epoch other than
/// `old_epoch` (0: none before) with its range; returns that epoch.
fn home_registered(url: &str, old_epoch: u64) -> u64 {
    registered_with_range(url, "home", 0, old_epoch)
}

/// Sets its flag when dropped, unwinding included.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

fn data_lost_reported(reports: &Reports) -> bool {
    reports.lock().unwrap().iter().any(|(lost, _)| *lost)
}

/// Node a writes page 0, node b reads it (a shared copy; the home holds
/// the page). The home is killed and started again: b (which held the
/// page) and c (a node new since) both fault on page 0. Neither may get
/// the new process's zeros: each fault fails with `DataLost` (retried,
/// the threads wait) until the range is re-initialised, after which both
/// read the re-initialised page (zeros, now valid). Until 2026-12-07 the
/// coherent path did not check the home's epoch: c read zeros as page 0.
#[test]
fn a_restarted_home_never_hands_out_its_empty_memory_as_the_guests_pages() {
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let mut home = ChildServer::start_with(&url, "home", 0, HOME_FLAGS);
    let old_epoch = home_registered(&url, 0);
    let (mgr_a, mgr_b) = (manager(&url), manager(&url));
    let (reports_a, reports_b) = (Reports::default(), Reports::default());
    let (a, b) = (node(&mgr_a, &reports_a), node(&mgr_b, &reports_b));
    let data = page_for(0, 7);
    a.write(0, &data).unwrap();
    let mut page = vec![0u8; PAGE_SIZE];
    b.read(0, &mut page).unwrap();
    assert!(page == data, "b does not read a's write");

    home.kill();
    let _home = ChildServer::start_with(&url, "home", 0, HOME_FLAGS);
    home_registered(&url, old_epoch);
    let mgr_c = manager(&url);
    let reports_c = Reports::default();
    let c = node(&mgr_c, &reports_c);

    std::thread::scope(|s| {
        let readers: Vec<_> = [&b, &c]
            .into_iter()
            .map(|mem| {
                s.spawn(move || {
                    let mut page = vec![0u8; PAGE_SIZE];
                    mem.read(0, &mut page).unwrap();
                    page
                })
            })
            .collect();
        wait_until(Duration::from_secs(20), || {
            (data_lost_reported(&reports_b) && data_lost_reported(&reports_c))
                || readers.iter().any(|r| r.is_finished())
        });
        let finished_early: Vec<bool> = readers.iter().map(|r| r.is_finished()).collect();
        let both_reported = data_lost_reported(&reports_b) && data_lost_reported(&reports_c);
        // Re-initialised whatever happened: a reader still waiting then
        // returns, and a failure below fails the test instead of hanging it.
        coordinator_client(&url)
            .reinitialise_range(0)
            .expect("re-initialise the range");
        let pages: Vec<Vec<u8>> = readers
            .into_iter()
            .map(|r| r.join().expect("reader"))
            .collect();
        for (at, name) in ["b", "c"].into_iter().enumerate() {
            assert!(
                !finished_early[at],
                "{name} read page 0 from the restarted home before the range was \
                 re-initialised: {}",
                if pages[at] == vec![0u8; PAGE_SIZE] {
                    "the new process's zeros"
                } else {
                    "something"
                }
            );
        }
        assert!(
            both_reported,
            "no DataLost for page 0 from the restarted home: b {:?}, c {:?}",
            reports_b.lock().unwrap(),
            reports_c.lock().unwrap()
        );
        for (name, page) in ["b", "c"].into_iter().zip(&pages) {
            assert!(
                *page == vec![0u8; PAGE_SIZE],
                "{name} read page 0 of the re-initialised range as something else than zeros"
            );
        }
    });
    assert!(reports_a.lock().unwrap().is_empty());
}

/// Two nodes (one on a memfd, one on anonymous memory), two vCPU threads
/// each, add to eight counters on four pages with compare-and-swap while
/// their home is stopped (SIGSTOP) for 300 ms every 300 ms, eight times:
/// grants, callbacks and write-backs wait in its sockets. With a fault
/// deadline beyond any stop, nothing fails and every increment counts.
#[test]
fn nodes_working_through_a_home_stopped_again_and_again_lose_no_update() {
    const COUNTERS: usize = 8;
    const STOPS: usize = 8;
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let home = ChildServer::start_with(&url, "home", 0, HOME_FLAGS);
    home_registered(&url, 0);
    let mgr = manager(&url);
    let config = |backing| GuestMemoryConfig {
        handler_cpus: Some(vec![]),
        handler_threads: 2,
        fault_timeout_ms: 60_000,
        // A fault that fails is a test failure: said, then SIGBUS (as a
        // vCPU's), so that nothing waits forever on it.
        on_fault_error: Some(Arc::new(
            |report: &rdma_transport::guest_memory::FaultReport| {
                eprintln!("fault at {:#x} failed: {}", report.gpa, report.error);
                FaultAction::Sigbus
            },
        )),
        backing,
        ..GuestMemoryConfig::new(0, PAGES * PAGE_SIZE)
    };
    let coherence = CoherenceConfig {
        min_hold_us: 50,
        timeout_ms: 30_000,
        dead_home_timeout_ms: 1000,
    };
    let nodes = [
        CoherentMemory::new(
            &mgr,
            config(GuestBacking::SharedFile(SharedFile::new(
                memfd(PAGES * PAGE_SIZE),
                0,
            ))),
            coherence,
        )
        .expect("coherent region"),
        CoherentMemory::new(&mgr, config(GuestBacking::Anonymous), coherence)
            .expect("coherent region"),
    ];
    let counter = |mem: &CoherentMemory, i: usize| -> &AtomicU64 {
        // Counter i: page 1 + i / 2, at byte 0 or 2048.
        let gpa = ((1 + i / 2) * PAGE_SIZE + (i % 2) * 2048) as u64;
        let ptr = mem.host_addr(gpa).unwrap().cast::<AtomicU64>();
        // SAFETY: an aligned u64 inside the live region, only ever accessed
        // atomically by this test.
        unsafe { &*ptr }
    };
    // Thread (n, t)'s k-th increment goes to counter (2n + t + k) % 8.
    let first_counter = |n: usize, t: usize| 2 * n + t;
    let stop = AtomicBool::new(false);
    let counts: Vec<(usize, u64)> = std::thread::scope(|s| {
        let threads: Vec<_> = (0..4)
            .map(|thread| {
                let (n, t) = (thread / 2, thread % 2);
                let (mem, stop) = (&nodes[n], &stop);
                s.spawn(move || {
                    let mut k = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        let c = counter(mem, (first_counter(n, t) + k as usize) % COUNTERS);
                        let mut seen = c.load(Ordering::Acquire);
                        while let Err(now) =
                            c.compare_exchange(seen, seen + 1, Ordering::AcqRel, Ordering::Acquire)
                        {
                            seen = now;
                        }
                        k += 1;
                    }
                    (first_counter(n, t), k)
                })
            })
            .collect();
        // The vCPU threads stop however this thread leaves the scope.
        let _stop_them = StopOnDrop(&stop);
        // Fault injection, not synchronisation: 300 ms stopped, 300 ms
        // running, while the vCPU threads work.
        for _ in 0..STOPS {
            home.pause();
            std::thread::sleep(Duration::from_millis(300));
            home.resume();
            std::thread::sleep(Duration::from_millis(300));
        }
        stop.store(true, Ordering::Relaxed);
        threads.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut expected = [0u64; COUNTERS];
    for &(first, increments) in &counts {
        for k in 0..increments {
            expected[(first + k as usize) % COUNTERS] += 1;
        }
    }
    eprintln!("increments by thread through {STOPS} stops of the home: {counts:?}");
    for (i, &want) in expected.iter().enumerate() {
        for (n, mem) in nodes.iter().enumerate() {
            assert_eq!(
                counter(mem, i).load(Ordering::Acquire),
                want,
                "counter {i} as node {n} reads it"
            );
        }
    }
    let errors: u64 = nodes.iter().map(|m| m.stats().fault_errors).sum();
    assert_eq!(errors, 0, "faults failed");
    // Pages went back and forth through the home.
    for (n, mem) in nodes.iter().enumerate() {
        assert!(mem.stats().invalidations > 0, "node {n}: {:?}", mem.stats());
    }
}
