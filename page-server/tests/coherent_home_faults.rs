//! A coherence home that restarts: the new process's memory is empty, and
//! the range's contents were the old process's (its epoch's). Nodes must
//! not be handed those zeros as the guest's pages, whether they held a
//! copy before the restart or come new: their faults fail with `DataLost`
//! until an operator re-initialises the range, as reads and writes of the
//! data path do (`epoch.rs`).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use rdma_transport::coherent::CoherenceConfig;
use rdma_transport::guest_memory::{CoherentMemory, FaultAction, GuestMemoryConfig};
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
    let coordinator = coordinator_client(&url);
    let epoch = || coordinator.node(&"home".to_owned()).map_or(0, |n| n.epoch);
    let mut home = ChildServer::start_with(&url, "home", 0, HOME_FLAGS);
    assert!(
        wait_until(Duration::from_secs(20), || epoch() != 0),
        "the home never registered"
    );
    let old_epoch = epoch();
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
    assert!(
        wait_until(Duration::from_secs(20), || ![0, old_epoch]
            .contains(&epoch())),
        "the restarted home never registered its new epoch"
    );
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
        if let Some(at) = readers.iter().position(|r| r.is_finished()) {
            let name = ["b", "c"][at];
            let page = readers.into_iter().nth(at).unwrap().join().expect("reader");
            panic!(
                "{name} read page 0 from the restarted home before the range was \
                 re-initialised: {}",
                if page == vec![0u8; PAGE_SIZE] {
                    "the new process's zeros"
                } else {
                    "something"
                }
            );
        }
        assert!(
            data_lost_reported(&reports_b) && data_lost_reported(&reports_c),
            "no DataLost for page 0 from the restarted home: b {:?}, c {:?}",
            reports_b.lock().unwrap(),
            reports_c.lock().unwrap()
        );
        coordinator
            .reinitialise_range(0)
            .expect("re-initialise the range");
        for (name, reader) in ["b", "c"].into_iter().zip(readers) {
            let page = reader.join().expect("reader");
            assert!(
                page == vec![0u8; PAGE_SIZE],
                "{name} read page 0 of the re-initialised range as something else than zeros"
            );
        }
    });
    assert!(reports_a.lock().unwrap().is_empty());
}
