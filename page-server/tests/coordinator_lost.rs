//! A coordinator that lost its state (it started on an empty database, or a
//! new etcd-backed one took over) sees the running page-servers claim their
//! ranges again, in whatever order their heartbeats come, beside
//! page-servers that just started. The page-server that holds a range's
//! contents must stay its live replica whoever claims first, and no page
//! may come back older or zeroed (docs/operations.md, "Coordinator state
//! lost"). The page-servers are real, in this process; the holder reaches
//! the coordinator through a link the test holds, so the other one claims
//! first.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::stalling_link::StallingLink;
use common::*;
use page_server::{RunningServer, ServerConfig};
use rdma_transport::coordinator::api::{MapResponse, RangeContents, RangeRequest, ReplicaState};
use rdma_transport::coordinator::CoordinatorClient;
use rdma_transport::{Page, TransportError, PAGE_SIZE};

const PAGES: u64 = (NODE_BYTES / PAGE_SIZE) as u64;
const LIMIT: Duration = Duration::from_secs(30);

fn gpas() -> Vec<u64> {
    (0..PAGES).map(|i| i * PAGE_SIZE as u64).collect()
}

/// A page-server holding the range at GPA 0 that looks at the map every
/// 200 ms, registered with the coordinator at `url`.
fn node(url: &str, id: &str, advertise: Option<String>) -> RunningServer {
    let mut cfg = ServerConfig::new(id, NODE_BYTES);
    cfg.heartbeat_interval = Duration::from_millis(200);
    cfg.recovery_grace = Duration::from_millis(300);
    cfg.advertise = advertise;
    page_server_with(url, cfg)
}

/// The coordinator, on a first database, and the link through which the
/// holder reaches it.
struct Cluster {
    dir: tempfile::TempDir,
    coord: Option<coordinator::RunningCoordinator>,
    addr: SocketAddr,
    to_coordinator: StallingLink,
}

impl Cluster {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let coord = coordinator_on(
            &dir.path().join("first.db"),
            SocketAddr::from(([127, 0, 0, 1], 0)),
        );
        let addr = coord.addr();
        let to_coordinator = StallingLink::start();
        to_coordinator.set_target(&addr.to_string());
        Self {
            dir,
            coord: Some(coord),
            addr,
            to_coordinator,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The coordinator's URL through the link.
    fn via_link(&self) -> String {
        format!("http://{}", self.to_coordinator.addr())
    }

    /// Holds the link, and starts the coordinator again at its address on
    /// an empty database: it lost its state.
    fn restart_empty(&mut self) {
        self.to_coordinator.hold();
        if let Some(coord) = self.coord.take() {
            coord.shutdown().unwrap();
        }
        self.coord = Some(coordinator_on(
            &self.dir.path().join("second.db"),
            self.addr,
        ));
    }
}

/// (holder, state) of each replica of the range.
fn states(admin: &CoordinatorClient) -> Vec<(String, ReplicaState)> {
    range_states(admin, 0)
}

fn both_live(admin: &CoordinatorClient) -> bool {
    let s = states(admin);
    s.len() == 2 && s.iter().all(|(_, state)| *state == ReplicaState::Live)
}

/// Writes every page of the range (`seed`) through a manager of `map`'s
/// replica on `node` alone.
fn write_on(map: &MapResponse, node: &str, seed: u64) {
    let pages: Vec<Page> = (0..PAGES).map(|i| page_indexed(i, seed)).collect();
    range_replica_manager(map, 0, node)
        .write_pages(&gpas(), &pages)
        .expect("write the range");
}

/// Reads every page from `node` alone; each must be `seed`'s.
fn check_on(admin: &CoordinatorClient, node: &str, seed: u64) {
    let mut back = vec![[0u8; PAGE_SIZE]; PAGES as usize];
    range_replica_manager(&admin.map().expect("map"), 0, node)
        .read_pages(&gpas(), &mut back)
        .expect("read the range");
    let zeroed = back.iter().filter(|p| p.iter().all(|&b| b == 0)).count();
    let wrong = (0..PAGES)
        .filter(|&i| back[i as usize] != page_indexed(i, seed))
        .count();
    assert_eq!(
        wrong, 0,
        "{wrong} of {PAGES} pages on {node} are not the last written ({zeroed} are zeros)"
    );
}

/// The coordinator restarts on an empty database while the holder `a`
/// cannot reach it; `b`, which just started, claims the range first (a new
/// range, as far as the coordinator knows). When `a` claims it, holding the
/// contents, it becomes the live replica and `b` copies from it, not the
/// other way round. A hypervisor's manager that followed the first
/// coordinator's map, whose version the second one does not reach, follows
/// the second one's (another generation) and reads every page back.
#[test]
fn a_page_server_that_just_started_does_not_displace_the_holder() {
    const SPARE_GPA: u64 = 0x4000_0000;
    let mut cluster = Cluster::start();
    let a = node(&cluster.via_link(), "a", None);
    let admin = coordinator_client(&cluster.url());
    write_on(&admin.map().expect("map"), "a", 1);
    assert!(
        wait_until(LIMIT, || a.range_contents() == [RangeContents::Held]),
        "a never saw its replica live"
    );
    // Map changes that take the first coordinator's version to 80 and more.
    let spare = RangeRequest {
        gpa_start: SPARE_GPA,
        length_bytes: PAGE_SIZE as u64,
        node_id: "a".to_owned(),
        remote_offset: 0,
        rdma: None,
        contents: RangeContents::Unknown,
    };
    for _ in 0..40 {
        admin.add_range(&spare).expect("claim a spare range");
        admin.remove_range(SPARE_GPA).expect("remove it");
    }
    let client = manager(&cluster.url());
    let first_version = client.map().version();
    assert!(first_version >= 80, "version {first_version}");

    cluster.restart_empty();
    let admin = coordinator_client(&cluster.url());
    let b = node(&cluster.url(), "b", None);
    assert_eq!(states(&admin), [("b".to_owned(), ReplicaState::Live)]);

    cluster.to_coordinator.sever();
    assert!(
        wait_until(LIMIT, || both_live(&admin) && b.stats().recoveries >= 1),
        "b did not recover from a (replicas: {:?}; recoveries: a {}, b {})",
        states(&admin),
        a.stats().recoveries,
        b.stats().recoveries
    );
    assert_eq!(a.stats().recoveries, 0, "a copied the range over its own");
    check_on(&admin, "a", 1);
    check_on(&admin, "b", 1);

    assert!(
        admin.map().expect("map").version < first_version,
        "the second coordinator's version passed the first one's: the test proves less"
    );
    assert!(
        wait_until(LIMIT, || client.map().replica_count(0) == 2),
        "the manager kept the lost coordinator's map (version {}, generation {})",
        client.map().version(),
        client.map().generation()
    );
    let mut back = vec![[0u8; PAGE_SIZE]; PAGES as usize];
    client.read_pages(&gpas(), &mut back).expect("read");
    for (i, page) in back.iter().enumerate() {
        assert!(*page == page_indexed(i as u64, 1), "page {i} read wrong");
    }
    drop(client);
    drop(b);
    drop(a);
}

/// `b` missed writes (marked stale, and cut off from `a`, so it cannot
/// recover) when the coordinator restarts on an empty database, and claims
/// the range first: the range is lost, not live with `b`'s older pages,
/// until `a` claims it; then `b` recovers from `a`.
#[test]
fn a_page_server_that_missed_writes_does_not_become_live_on_a_new_coordinator() {
    let mut cluster = Cluster::start();
    // Everybody reaches a's pages through `to_a`, a its coordinator
    // through `to_coordinator`.
    let to_a = StallingLink::start();
    let a = node(&cluster.via_link(), "a", Some(to_a.addr()));
    to_a.set_target(&a.addr().to_string());
    let admin = coordinator_client(&cluster.url());
    write_on(&admin.map().expect("map"), "a", 1);
    let b = node(&cluster.url(), "b", None);
    assert!(
        wait_until(LIMIT, || both_live(&admin)),
        "b never recovered at first"
    );

    // b misses writes: cut off from a, marked stale, then a gets seed 2.
    to_a.hold();
    let failures = b.stats().recovery_failures;
    admin
        .mark_replica_stale(0, "b", Duration::from_secs(5))
        .expect("mark b stale");
    assert!(
        wait_until(LIMIT, || b.stats().recovery_failures > failures),
        "b never tried to recover"
    );
    assert_eq!(b.range_contents(), [RangeContents::Missed]);
    let mut direct = admin.map().expect("map");
    for n in direct.nodes.iter_mut().filter(|n| n.id == "a") {
        n.tcp_addr = a.addr().to_string();
    }
    write_on(&direct, "a", 2);
    assert!(
        wait_until(LIMIT, || a.range_contents() == [RangeContents::Held]),
        "a never saw its replica live"
    );

    cluster.restart_empty();
    let admin = coordinator_client(&cluster.url());
    assert!(
        wait_until(LIMIT, || !states(&admin).is_empty()),
        "b never claimed the range again"
    );
    assert_eq!(
        states(&admin),
        [("b".to_owned(), ReplicaState::Lost)],
        "b, which missed writes, was made the range's live replica"
    );

    cluster.to_coordinator.sever();
    to_a.sever();
    assert!(
        wait_until(LIMIT, || both_live(&admin) && b.stats().recoveries >= 2),
        "b did not recover from a (replicas: {:?})",
        states(&admin)
    );
    check_on(&admin, "a", 2);
    check_on(&admin, "b", 2);
    drop(b);
    drop(a);
}

/// The holders of two ranges are killed (SIGKILL) while the coordinator
/// loses its state; both start again, empty. `a` runs with a state
/// directory, which recorded that it held its range: it claims the range
/// as missed, and the new coordinator makes it `lost` (clients get
/// `DataLost`) instead of live with the zeros of a's new memory. `b` runs
/// without one: its range comes back live, zeros (the case the state
/// directory closes; docs/operations.md, "Coordinator state lost"). Once
/// the operator re-initialises a's range it is served again, and still
/// recorded.
#[test]
fn a_range_whose_holders_all_restarted_is_lost_not_zeros_with_a_state_dir() {
    const B_GPA: u64 = NODE_BYTES as u64;
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("a-state");
    let state_arg = state.to_str().expect("utf-8 path");
    let first = coordinator_on(
        &dir.path().join("first.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    let addr = first.addr();
    let url = format!("http://{addr}");
    let mut a = ChildServer::start_with(&url, "a", 0, &["--state-dir", state_arg]);
    let mut b = ChildServer::start_with(&url, "b", B_GPA, &[]);
    let admin = coordinator_client(&url);
    assert!(
        wait_until(LIMIT, || admin.map().is_ok_and(|m| m.entries.len() == 2)),
        "the page-servers never registered"
    );
    let all: Vec<u64> = (0..2 * PAGES).map(|i| i * PAGE_SIZE as u64).collect();
    let pages: Vec<Page> = (0..2 * PAGES).map(|i| page_indexed(i, 3)).collect();
    let client = manager(&url);
    client.write_pages(&all, &pages).expect("write both ranges");
    let mut back = vec![[0u8; PAGE_SIZE]; all.len()];
    client
        .read_pages(&all, &mut back)
        .expect("read both ranges");
    assert!(
        back == pages,
        "a page read back differs from the one written"
    );
    drop(client);
    let file = state.join("held-ranges.json");
    let recorded = || {
        std::fs::read_to_string(&file).is_ok_and(|text| {
            text.contains("\"gpa_start\": 0") && text.contains(&format!("{NODE_BYTES}"))
        })
    };
    assert!(
        wait_until(LIMIT, recorded),
        "a never recorded its range as held"
    );

    a.kill();
    b.kill();
    first.shutdown().unwrap();
    let _second = coordinator_on(&dir.path().join("second.db"), addr);
    let _a = ChildServer::start_with(&url, "a", 0, &["--state-dir", state_arg]);
    let _b = ChildServer::start_with(&url, "b", B_GPA, &[]);
    assert!(
        wait_until(LIMIT, || admin.map().is_ok_and(|m| m.entries.len() == 2)),
        "the restarted page-servers never claimed their ranges"
    );
    assert_eq!(
        range_states(&admin, 0),
        [("a".to_owned(), ReplicaState::Lost)],
        "a's range, whose memory is gone, is not lost"
    );
    assert_eq!(
        range_states(&admin, B_GPA),
        [("b".to_owned(), ReplicaState::Live)]
    );

    let client = manager(&url);
    let mut page = [0u8; PAGE_SIZE];
    for i in 0..PAGES {
        match client.read_page(i * PAGE_SIZE as u64, &mut page) {
            Err(TransportError::DataLost { gpa, node }) => {
                assert_eq!(gpa, i * PAGE_SIZE as u64);
                assert_eq!(node, "a");
            }
            other => panic!(
                "page {i} of a's lost range: {other:?} (contents {:?})",
                &page[..8]
            ),
        }
    }
    // Without a state directory: b's new memory is served as the range.
    client
        .read_page(B_GPA, &mut page)
        .expect("b's range is live");
    assert!(page.iter().all(|&x| x == 0), "b's new memory is not zeros");

    admin
        .reinitialise_range(0)
        .expect("re-initialise a's range");
    assert!(
        wait_until(LIMIT, || client.read_page(0, &mut page).is_ok()),
        "a's range is not served after the operator re-initialised it"
    );
    assert!(
        page.iter().all(|&x| x == 0),
        "a re-initialised page is not zeros"
    );
    client
        .write_page(0, &pages[1])
        .expect("write a's range again");
    client.read_page(0, &mut page).expect("read it back");
    assert!(page == pages[1], "a's range does not keep what is written");
    assert!(recorded(), "the state directory forgot a's range");
}
