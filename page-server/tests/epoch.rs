//! Epoch fencing end to end (issue 9): a page-server killed with `kill -9`
//! and restarted has empty memory. Its ranges' pages must never be served
//! as if they were the guest's (all zeros, reported as success): every
//! request fails with `DataLost` until an operator re-initialises the range.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::*;
use rdma_transport::coordinator::api::{MapEntry, RangeState};
use rdma_transport::coordinator::CoordinatorClient;
use rdma_transport::{TransportError, PAGE_SIZE};

/// Pages written before the kill: every other page of the first 32.
fn written() -> Vec<u64> {
    (0..16u64).map(|i| i * 2 * PAGE_SIZE as u64).collect()
}

fn only_entry(admin: &CoordinatorClient) -> (MapEntry, u64) {
    let map = admin.map().unwrap();
    assert_eq!(map.entries.len(), 1);
    let owner_epoch = map.nodes.iter().find(|n| n.id == "b").unwrap().epoch;
    (map.entries[0].clone(), owner_epoch)
}

/// Whether `result` is the typed loss of `gpa` on node b; panics on a page
/// served (`Ok`) or on another typed error than the node being down.
fn is_lost(result: Result<(), TransportError>, gpa: u64) -> bool {
    match result {
        Err(TransportError::DataLost { gpa: lost, node }) => {
            assert_eq!(node, "b");
            assert_eq!(lost, gpa, "DataLost names the address asked for");
            true
        }
        Err(TransportError::NodeDown { .. } | TransportError::Timeout { .. }) => false,
        Err(other) => panic!("unexpected error for {gpa:#x}: {other}"),
        Ok(()) => panic!("page {gpa:#x} of a restarted page-server was served"),
    }
}

#[test]
fn restarted_page_server_gives_data_lost_until_reinitialised() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    // Insecure coordinator: the caller may do what the admin may.
    let admin = coordinator_client(&coord.url());
    let mut b = ChildServer::start(&coord.url(), "b", 0);
    let mgr = manager(&coord.url());
    assert!(wait_until(Duration::from_secs(10), || mgr
        .refresh_map()
        .is_ok()
        && mgr.map().len() == 1));
    let (entry, first_epoch) = only_entry(&admin);
    assert_ne!(first_epoch, 0, "the page-server registers its epoch");
    assert_eq!(
        (entry.valid_epoch, entry.state),
        (first_epoch, RangeState::Live)
    );
    let gpas = written();
    let pages: Vec<_> = gpas.iter().map(|&g| page_for(g, 9)).collect();
    mgr.write_pages(&gpas, &pages).unwrap();
    let mut page = [0u8; PAGE_SIZE];
    mgr.read_page(gpas[3], &mut page).unwrap();
    assert!(page == pages[3]);

    b.kill(); // SIGKILL: the process and its memory are gone
    let _b2 = ChildServer::start(&coord.url(), "b", 0);

    // The coordinator keeps the range's valid epoch: the new process does
    // not hold the contents, so the range is lost.
    assert!(
        wait_until(Duration::from_secs(10), || only_entry(&admin).1
            != first_epoch),
        "the restarted page-server registers its new epoch"
    );
    let (entry, second_epoch) = only_entry(&admin);
    assert_eq!(
        (entry.valid_epoch, entry.state),
        (first_epoch, RangeState::Lost)
    );

    // Until the manager reaches the new process the node is down; from then
    // on every read of a written page is DataLost, never a page.
    assert!(
        wait_until(Duration::from_secs(10), || is_lost(
            mgr.read_page(gpas[0], &mut page),
            gpas[0]
        )),
        "the manager never reached the restarted page-server"
    );
    for &gpa in &gpas {
        assert!(is_lost(mgr.read_page(gpa, &mut page), gpa));
        assert!(is_lost(mgr.read_frame(gpa).map(drop), gpa));
    }
    let mut batch = vec![[0xa5u8; PAGE_SIZE]; gpas.len()];
    assert!(is_lost(mgr.read_pages(&gpas, &mut batch), gpas[0]));
    // Pages of the range never written are lost as well: the range's
    // contents are one whole.
    assert!(is_lost(mgr.read_page(PAGE_SIZE as u64, &mut page), 4096));
    // And a write would mix new pages with lost ones: refused too.
    assert!(is_lost(mgr.write_page(gpas[1], &pages[1]), gpas[1]));

    // The operator accepts the loss: zeros are the range's contents now.
    let entry = admin.reinitialise_range(0).unwrap();
    assert_eq!(
        (entry.valid_epoch, entry.state),
        (second_epoch, RangeState::Live)
    );
    assert_eq!(only_entry(&admin).0.state, RangeState::Live);
    // The manager's next requests refresh its map (at most one refresh per
    // retry interval, hence the bounded loop) and are served again.
    assert!(
        wait_until(Duration::from_secs(10), || {
            match mgr.read_page(gpas[0], &mut page) {
                Ok(()) => true,
                Err(TransportError::DataLost { .. }) => false,
                Err(other) => panic!("unexpected error after re-initialise: {other}"),
            }
        }),
        "reads still fail after the range was re-initialised"
    );
    for &gpa in &gpas {
        mgr.read_page(gpa, &mut page).unwrap();
        assert!(page == [0u8; PAGE_SIZE], "{gpa:#x} reads as zeros");
    }
    mgr.read_pages(&gpas, &mut batch).unwrap();
    assert!(batch.iter().all(|p| *p == [0u8; PAGE_SIZE]));
    mgr.write_page(gpas[1], &pages[1]).unwrap();
    mgr.read_page(gpas[1], &mut page).unwrap();
    assert!(page == pages[1]);
}
