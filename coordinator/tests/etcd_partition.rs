//! Coordinators on a three-member etcd cluster whose members each live in
//! a network namespace of their own (common/netns.rs), with every packet
//! between some of them dropped:
//! - one member at a time is cut off from its peers while the coordinator
//!   still reaches it: first a follower, then the leader. Such a member
//!   still answers, so the coordinator cannot tell it from a healthy one by
//!   its connection alone. Then a follower becomes unreachable from the
//!   coordinator (a machine gone: no refusal, no answer);
//! - the member a coordinator's watch is on is cut off: a long poll through
//!   it must still see a change made through another at once;
//! - a coordinator is cut off from every member: it answers 503 within its
//!   etcd timeout, and page-servers given two coordinators move on.
//!
//! Page-servers heartbeat with the defaults of both sides (3 s lease, 1 s
//! heartbeat) and must never be reported dead.
//!
//! Run with `cargo test -p coordinator --features etcd --test
//! etcd_partition` as root (network namespaces; needs Debian's etcd-server,
//! iproute2 and util-linux; deploy/test-all.sh installs etcd-server).
#![cfg(feature = "etcd")]

mod common;

use std::time::{Duration, Instant};

use common::coordinator_process::{CoordinatorProcess, LEASE_MS};
use common::etcd::EtcdCluster;
use common::heartbeats::{Heartbeats, HEARTBEAT_PERIOD, HEARTBEAT_TIMEOUT};
use common::netns::{self, Host, PrivateNetwork};
use common::{POLL_INTERVAL, WAIT_LIMIT};
use rdma_transport::coordinator::api::NodeRegistration;
use rdma_transport::coordinator::CoordinatorClient;

/// Page-servers that heartbeat through the coordinator.
const PAGE_SERVERS: u16 = 3;

/// Polls `condition` until it holds or `limit` passes; panics then.
fn wait_for(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(POLL_INTERVAL);
    }
}

/// A page-server's registration (nothing listens on `port`: only its
/// liveness matters here).
fn registration(port: u16) -> NodeRegistration {
    NodeRegistration {
        tcp_addr: format!("127.0.0.1:{port}"),
        rdma: None,
        epoch: 1,
    }
}

/// [`PAGE_SERVERS`] page-servers registered through `admin`, each
/// heartbeating through `coordinators` (comma-separated).
fn page_servers(admin: &CoordinatorClient, coordinators: &str) -> Vec<Heartbeats> {
    let started = Instant::now();
    (0..PAGE_SERVERS)
        .map(|i| {
            let id = format!("ps{i}");
            admin
                .register_node(&id, &registration(7000 + i))
                .expect("registration");
            Heartbeats::start(coordinators, &id, started)
        })
        .collect()
}

/// Waits `watch` at least, and until every page-server has had two more
/// heartbeats answered; then checks none was reported dead. Returns how
/// many heartbeats failed meanwhile.
fn heartbeats_go_on(heartbeats: &[Heartbeats], what: &str, watch: Duration) -> usize {
    let since = Instant::now();
    let before: Vec<usize> = heartbeats.iter().map(Heartbeats::answered).collect();
    let failed_before: usize = heartbeats.iter().map(Heartbeats::failed).sum();
    wait_for(what, watch + WAIT_LIMIT, || {
        since.elapsed() >= watch
            && heartbeats
                .iter()
                .zip(&before)
                .all(|(beats, then)| beats.answered() >= then + 2)
    });
    for beats in heartbeats {
        assert_eq!(
            beats.reported_dead_ms(),
            None,
            "{} reported dead ({what})",
            beats.id
        );
    }
    eprintln!(
        "{what}: heartbeats answered {:?}, failed {:?}, slowest {:?}",
        heartbeats
            .iter()
            .map(Heartbeats::answered)
            .collect::<Vec<_>>(),
        heartbeats
            .iter()
            .map(Heartbeats::failed)
            .collect::<Vec<_>>(),
        heartbeats
            .iter()
            .map(Heartbeats::slowest)
            .collect::<Vec<_>>(),
    );
    heartbeats.iter().map(Heartbeats::failed).sum::<usize>() - failed_before
}

#[test]
fn an_etcd_member_cut_off_from_its_peers_makes_no_page_server_look_dead() {
    let network = PrivateNetwork::enter();
    let cluster = EtcdCluster::start_apart(&network, 3);
    let dir = tempfile::tempdir().expect("tempdir");
    let a = CoordinatorProcess::start(&cluster.endpoints(), dir.path(), "a");
    let admin = CoordinatorClient::new(&a.url, None, Duration::from_secs(10)).expect("client");
    let heartbeats = page_servers(&admin, &a.url);
    heartbeats_go_on(&heartbeats, "before any partition", Duration::ZERO);
    // A lapse shows within a lease and a heartbeat period of its cause.
    let watch = Duration::from_millis(LEASE_MS) + HEARTBEAT_PERIOD;

    for role in ["a follower", "the leader"] {
        let leader = cluster.leader();
        let cut = if role == "the leader" {
            leader
        } else {
            (leader + 1) % 3
        };
        cluster.cut_off(cut);
        let failed = heartbeats_go_on(&heartbeats, &format!("{role} (m{cut}) cut off"), watch);
        // A follower's loss costs nothing: the prober takes it out of the
        // balance, and a request already on it is sent again alongside. (A
        // leader's loss means an election, which may outlast a heartbeat's
        // etcd timeout: then a heartbeat fails and is retried.)
        if role == "a follower" {
            assert_eq!(failed, 0, "heartbeats failed with a follower cut off");
        }
        cluster.reconnect(cut);
        wait_for("every member to know the leader again", WAIT_LIMIT, || {
            (0..3).all(|i| cluster.knows_leader(i) == Some(true))
        });
        heartbeats_go_on(&heartbeats, &format!("m{cut} back"), watch);
    }

    // A member gone as the coordinator sees it (its machine off, say):
    // nothing refuses the connection, nothing answers. Its peers still
    // reach it.
    let gone = (cluster.leader() + 1) % 3;
    cluster.unreachable(gone);
    let failed = heartbeats_go_on(&heartbeats, &format!("m{gone} unreachable"), watch);
    assert_eq!(failed, 0, "heartbeats failed with a follower unreachable");
    cluster.reachable(gone);
    heartbeats_go_on(&heartbeats, &format!("m{gone} reachable"), watch);
}

/// How long the long poll of the map in
/// [`a_map_change_reaches_a_long_poll_while_the_member_its_coordinator_watches_is_cut_off`]
/// may wait for a change, and how soon it must see one: a watch takes
/// milliseconds. (Before the coordinator watched again when its balance
/// changed, it took 3.5 s, when the stream on the member it took out of the
/// balance broke.)
const LONG_POLL_WAIT: Duration = Duration::from_secs(20);
const CHANGE_SEEN_WITHIN: Duration = Duration::from_secs(1);

#[test]
fn a_map_change_reaches_a_long_poll_while_the_member_its_coordinator_watches_is_cut_off() {
    let network = PrivateNetwork::enter();
    let cluster = EtcdCluster::start_apart(&network, 3);
    let dir = tempfile::tempdir().expect("tempdir");
    // b alone first: its watch of the map version is then the only watch in
    // the cluster, so the member that serves it is known.
    let b = CoordinatorProcess::start(&cluster.endpoints(), dir.path(), "b");
    let mut watched = None;
    wait_for("coordinator b's version watch", WAIT_LIMIT, || {
        let serving: Vec<usize> = (0..3).filter(|&i| cluster.watchers(i) > 0).collect();
        watched = serving.first().copied().filter(|_| serving.len() == 1);
        watched.is_some()
    });
    let watched = watched.expect("the watched member");
    // Cut off a follower: the cluster keeps its leader and quorum, only
    // what goes through the cut member stops.
    cluster.move_leader((watched + 1) % 3);
    let a = CoordinatorProcess::start(&cluster.endpoints(), dir.path(), "a");
    let through_a = CoordinatorClient::new(&a.url, None, Duration::from_secs(10)).expect("a");
    let through_b = CoordinatorClient::new(&b.url, None, Duration::from_secs(10)).expect("b");
    through_a
        .register_node(&"ps0".to_owned(), &registration(7000))
        .expect("registration");
    let before = through_b.map().expect("map").version;

    // Both coordinators find the member cut off and send it no more
    // requests; b's watch is another matter.
    cluster.cut_off(watched);
    for coordinator in [&a, &b] {
        wait_for(
            "the coordinators to take the cut-off member out",
            WAIT_LIMIT,
            || coordinator.logged("etcd member does not answer") >= 1,
        );
    }
    let long_poll = std::thread::spawn(move || {
        let asked = Instant::now();
        let answer = through_b.map_after(before, LONG_POLL_WAIT, Duration::from_secs(10));
        (answer, asked.elapsed())
    });
    // The change, through the other coordinator.
    through_a
        .register_node(&"ps1".to_owned(), &registration(7001))
        .expect("registration while a member is cut off");
    let (answer, took) = long_poll.join().expect("long poll");
    let map = answer.expect("long poll answer");
    eprintln!(
        "the long poll answered version {} (was {before}) after {took:?}",
        map.version
    );
    assert!(map.version > before && map.nodes.iter().any(|n| n.id == "ps1"));
    assert!(
        took < CHANGE_SEEN_WITHIN,
        "the change reached the long poll only after {took:?}: coordinator b's watch stayed on the cut-off member m{watched}"
    );
}

#[test]
fn a_coordinator_cut_off_from_etcd_answers_503_and_its_page_servers_move_on() {
    let network = PrivateNetwork::enter();
    let cluster = EtcdCluster::start_apart(&network, 3);
    let dir = tempfile::tempdir().expect("tempdir");
    // a on a host of its own, which can be cut off from the members; b
    // beside the page-servers.
    let a_host = Host::new(&network, 3);
    let a = CoordinatorProcess::start_on(&a_host, &cluster.endpoints(), dir.path(), "a");
    let b = CoordinatorProcess::start(&cluster.endpoints(), dir.path(), "b");
    let through_a = CoordinatorClient::new(&a.url, None, Duration::from_secs(10)).expect("a");
    // Given both coordinators, a first (as `--coordinator a,b`).
    let heartbeats = page_servers(&through_a, &format!("{},{}", a.url, b.url));
    heartbeats_go_on(&heartbeats, "before any partition", Duration::ZERO);
    let watch = Duration::from_millis(LEASE_MS) + HEARTBEAT_PERIOD;

    netns::cut_off(&a_host, &cluster.hosts());
    // a says it cannot serve, within its etcd timeout; it does not hang.
    let asked = Instant::now();
    let answer = through_a.map();
    let took = asked.elapsed();
    assert!(
        answer.as_ref().err().and_then(|e| e.status()) == Some(503),
        "{answer:?}"
    );
    assert!(
        took < HEARTBEAT_TIMEOUT,
        "a took {took:?} to say it cannot reach etcd"
    );
    heartbeats_go_on(&heartbeats, "coordinator a cut off from etcd", watch);

    netns::reconnect(&a_host, &cluster.hosts());
    wait_for("coordinator a to reach etcd again", WAIT_LIMIT, || {
        through_a.map().is_ok()
    });
    heartbeats_go_on(&heartbeats, "coordinator a back", watch);
}
