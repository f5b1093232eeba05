//! Coordinators on a real three-member etcd cluster on 127.0.0.1: two
//! coordinator processes share it, page-servers register through one and
//! clients read through the other; the etcd leader and then a coordinator
//! are killed with SIGKILL under a registration load, while page-servers
//! heartbeat with the defaults of both sides (3 s lease, 1 s heartbeat)
//! and must never be reported dead; overlapping claims race through both
//! coordinators.
//!
//! Run with `cargo test -p coordinator --features etcd --test etcd_cluster`
//! (needs Debian's etcd-server; deploy/test-all.sh installs it).
#![cfg(feature = "etcd")]

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use common::coordinator_process::{CoordinatorProcess, ETCD_TIMEOUT_MS, LEASE_MS};
use common::etcd::EtcdCluster;
use common::heartbeats::{Heartbeats, HEARTBEAT_PERIOD};
use common::{POLL_INTERVAL, WAIT_LIMIT};
use rdma_transport::coordinator::CoordinatorClient;
use reqwest::blocking::Client;
use reqwest::Method;
use serde_json::{json, Value};

// Leases are the coordinator's default (3 s), which must ride out an etcd
// election (about a second here) and a coordinator switch with page-servers
// heartbeating at their defaults. Before the coordinator kept dead etcd
// members out of its client's balance (backend/etcd/members.rs) and
// page-servers retried a failed heartbeat soon, a lease lapsed here in 2 of
// 11 runs (2026-11-29).

/// Page-servers that heartbeat under the load.
const PAGE_SERVERS: usize = 3;

/// Page size of the ranges.
const PAGE: u64 = 4096;

fn new_http() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(0)
        .build()
        .expect("http client")
}

/// One request; `None` when it got no answer (connection refused, timeout).
fn call(
    http: &Client,
    url: &str,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Option<(u16, Value)> {
    let mut request = http.request(method, format!("{url}{path}"));
    if let Some(body) = body {
        request = request
            .header("content-type", "application/json")
            .body(body.to_string());
    }
    let response = request.send().ok()?;
    let status = response.status().as_u16();
    let body = response.json().unwrap_or(Value::Null);
    Some((status, body))
}

/// As a page-server or client with several coordinators: the first
/// answer that is not a 5xx, trying each coordinator in turn from
/// `first`; `None` when none gave one.
fn call_any(
    http: &Client,
    urls: &[String],
    first: usize,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> Option<(u16, Value)> {
    (0..urls.len())
        .map(|i| &urls[(first + i) % urls.len()])
        .find_map(|url| {
            call(http, url, method.clone(), path, body.clone()).filter(|(status, _)| *status < 500)
        })
}

/// Polls `condition` until it holds or `limit` passes; panics then.
fn wait_for(what: &str, limit: Duration, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(POLL_INTERVAL);
    }
}

fn register(http: &Client, url: &str, id: &str, port: u16) -> u16 {
    let body = json!({ "tcp_addr": format!("127.0.0.1:{port}") });
    call(
        http,
        url,
        Method::PUT,
        &format!("/v1/nodes/{id}"),
        Some(body),
    )
    .map_or(0, |(status, _)| status)
}

fn claim(http: &Client, url: &str, gpa_start: u64, length_bytes: u64, node: &str) -> u16 {
    let body = json!({
        "gpa_start": gpa_start,
        "length_bytes": length_bytes,
        "node_id": node,
        "remote_offset": 0,
    });
    call(http, url, Method::POST, "/v1/map", Some(body)).map_or(0, |(status, _)| status)
}

#[test]
fn page_servers_register_through_one_coordinator_and_clients_read_through_the_other() {
    let cluster = EtcdCluster::start(3);
    let dir = tempfile::tempdir().expect("tempdir");
    let a = CoordinatorProcess::start(&cluster.endpoints(), dir.path(), "a");
    let b = CoordinatorProcess::start(&cluster.endpoints(), dir.path(), "b");
    let http = new_http();

    let (_, map) = call(&http, &b.url, Method::GET, "/v1/map", None).expect("map");
    let before = map["version"].as_u64().expect("version");
    // A long poll through b, waiting for a change made through a.
    let poll = {
        let url = format!("{}/v1/map?after={before}&timeout_ms=20000", b.url);
        std::thread::spawn(move || -> Value {
            http_long()
                .get(url)
                .send()
                .expect("poll")
                .json()
                .expect("map")
        })
    };
    assert_eq!(register(&http, &a.url, "ps1", 7001), 200);
    assert_eq!(claim(&http, &a.url, 0x10_0000, 4 * PAGE, "ps1"), 201);
    let woken = poll.join().expect("poll thread");
    assert!(woken["version"].as_u64() > Some(before), "{woken}");

    // b answers with what was written through a.
    let (status, resolved) =
        call(&http, &b.url, Method::GET, "/v1/resolve?gpa=0x100800", None).expect("resolve");
    assert_eq!(status, 200, "{resolved}");
    assert_eq!(resolved["node"]["id"], "ps1");
    assert_eq!(resolved["node"]["tcp_addr"], "127.0.0.1:7001");
    assert_eq!(resolved["node"]["alive"], true);
    let (_, node) = call(&http, &b.url, Method::GET, "/v1/nodes/ps1", None).expect("node");
    assert_eq!(node["alive"], true, "{node}");
    // The same range claimed again through b by another node: refused.
    assert_eq!(register(&http, &b.url, "ps2", 7002), 200);
    assert_eq!(claim(&http, &b.url, 0x10_1000, PAGE, "ps2"), 409);
    // Heartbeats through either coordinator renew the same lease.
    for url in [&a.url, &b.url] {
        let (status, beat) =
            call(&http, url, Method::POST, "/v1/nodes/ps1/heartbeat", None).expect("beat");
        assert_eq!((status, beat["alive"].clone()), (200, json!(true)));
    }
    // Versions agree.
    let version = |url: &str| {
        call(&http, url, Method::GET, "/v1/map", None)
            .expect("map")
            .1["version"]
            .as_u64()
    };
    assert_eq!(version(&a.url), version(&b.url));
    // So do generations: both read the one the first wrote on the prefix.
    let generation = |url: &str| {
        call(&http, url, Method::GET, "/v1/map", None)
            .expect("map")
            .1["generation"]
            .as_u64()
    };
    assert!(generation(&a.url).is_some_and(|g| g != 0));
    assert_eq!(generation(&a.url), generation(&b.url));
}

fn http_long() -> Client {
    Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("http client")
}

/// What the load threads saw.
#[derive(Default)]
struct Ledger {
    /// (node, gpa_start) of every registration acknowledged (node 200,
    /// range 201).
    acknowledged: Mutex<Vec<(String, u64)>>,
    resolves_ok: AtomicUsize,
    /// The first time a resolve reported a page-server `alive: false`:
    /// which, and how long after the load started.
    lease_lost: Mutex<Option<String>>,
}

impl Ledger {
    fn acknowledged(&self) -> usize {
        self.acknowledged.lock().expect("ledger").len()
    }

    fn lost(&self, how: &str, id: &str, since: Instant) {
        let mut lost = self.lease_lost.lock().expect("ledger");
        if lost.is_none() {
            *lost = Some(format!(
                "{id} reported dead by {how}, {} ms into the load",
                since.elapsed().as_millis()
            ));
        }
    }
}

#[test]
fn killing_the_etcd_leader_then_a_coordinator_loses_no_acknowledged_registration() {
    let mut cluster = EtcdCluster::start(3);
    let dir = tempfile::tempdir().expect("tempdir");
    let mut a = CoordinatorProcess::start(&cluster.endpoints(), dir.path(), "a");
    let b = CoordinatorProcess::start(&cluster.endpoints(), dir.path(), "b");
    let urls = vec![a.url.clone(), b.url.clone()];
    let http = new_http();

    // Page-servers that heartbeat through a (switching on failure), with a
    // range each that clients resolve through b.
    let page_servers: Vec<String> = (0..PAGE_SERVERS).map(|i| format!("ps{i}")).collect();
    for (i, id) in page_servers.iter().enumerate() {
        assert_eq!(register(&http, &a.url, id, 7000 + i as u16), 200);
        assert_eq!(claim(&http, &a.url, (i as u64) << 30, 16 * PAGE, id), 201);
    }

    let ledger = Arc::new(Ledger::default());
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let mut threads = Vec::new();
    // Each page-server heartbeats on its own thread, as a page-server given
    // both coordinators (`--coordinator a,b`) does; its client moves to b
    // when a is gone.
    let heartbeats: Vec<Heartbeats> = page_servers
        .iter()
        .map(|id| Heartbeats::start(&urls.join(","), id, started))
        .collect();
    // Clients: resolve the page-servers' ranges through b (then a), and
    // watch that no page-server is ever reported dead.
    {
        let (ledger, stop, urls, ids) = (
            ledger.clone(),
            stop.clone(),
            urls.clone(),
            page_servers.clone(),
        );
        threads.push(std::thread::spawn(move || {
            let http = new_http();
            for round in 0..10_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let i = round % ids.len();
                let path = format!("/v1/resolve?gpa={:#x}", ((i as u64) << 30) + PAGE);
                if let Some((200, found)) = call_any(&http, &urls, 1, Method::GET, &path, None) {
                    assert_eq!(found["node"]["id"], json!(ids[i]), "{found}");
                    if found["node"]["alive"] != json!(true) {
                        ledger.lost("a resolve", &ids[i], started);
                    }
                    ledger.resolves_ok.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }));
    }
    // Registration load: two workers, each through both coordinators in
    // turn, every node with a range of its own.
    for worker in 0..2u64 {
        let (ledger, stop, urls) = (ledger.clone(), stop.clone(), urls.clone());
        threads.push(std::thread::spawn(move || {
            let http = new_http();
            for i in 0..2000u64 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let id = format!("load-{worker}-{i}");
                let gpa_start = (1 << 40) + ((worker << 20) + i) * PAGE;
                let first = usize::try_from(i % 2).unwrap_or(0);
                let body = json!({ "tcp_addr": "127.0.0.1:9" });
                let registered = call_any(
                    &http,
                    &urls,
                    first,
                    Method::PUT,
                    &format!("/v1/nodes/{id}"),
                    Some(body),
                );
                if !matches!(registered, Some((200, _))) {
                    continue;
                }
                let range = json!({
                    "gpa_start": gpa_start, "length_bytes": PAGE, "node_id": id, "remote_offset": 0,
                });
                // A retry after a lost answer finds the range already
                // there (200): acknowledged as well.
                if let Some((200 | 201, _)) =
                    call_any(&http, &urls, first, Method::POST, "/v1/map", Some(range))
                {
                    ledger
                        .acknowledged
                        .lock()
                        .expect("ledger")
                        .push((id, gpa_start));
                }
            }
        }));
    }

    // Progress after each event: registrations, resolves and two answered
    // heartbeats of every page-server, and the load kept up for `watch`
    // (so that a lease the event made lapse is seen by the resolves).
    let progress = |what: &str, ledger: &Ledger, watch: Duration| {
        let since = Instant::now();
        let (registered, resolved) = (
            ledger.acknowledged(),
            ledger.resolves_ok.load(Ordering::Relaxed),
        );
        let beats: Vec<usize> = heartbeats.iter().map(Heartbeats::answered).collect();
        wait_for(what, watch + Duration::from_secs(30), || {
            since.elapsed() >= watch
                && ledger.acknowledged() >= registered + 20
                && ledger.resolves_ok.load(Ordering::Relaxed) >= resolved + 10
                && heartbeats
                    .iter()
                    .zip(&beats)
                    .all(|(now, then)| now.answered() >= then + 2)
        });
    };
    progress(
        "registrations, resolves and heartbeats before any failure",
        &ledger,
        Duration::ZERO,
    );
    // A lapse shows within a lease and a heartbeat period of its cause.
    let watch = Duration::from_millis(LEASE_MS) + HEARTBEAT_PERIOD;

    let leader = cluster.leader();
    let killed_leader_ms = started.elapsed().as_millis();
    cluster.kill(leader);
    let new_leader = cluster.leader();
    assert_ne!(new_leader, leader);
    progress(
        "registrations, resolves and heartbeats after the etcd leader died",
        &ledger,
        watch,
    );

    let killed_a_ms = started.elapsed().as_millis();
    a.kill();
    progress(
        "registrations, resolves and heartbeats after coordinator a died",
        &ledger,
        watch,
    );

    // Alive after both failures, asked while they still heartbeat.
    for id in &page_servers {
        let (_, node) =
            call(&http, &b.url, Method::GET, &format!("/v1/nodes/{id}"), None).expect("node");
        assert_eq!(node["alive"], true, "{node}");
    }
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().expect("load thread");
    }

    // Every acknowledged registration is in the map (read through b).
    let (status, map) = call(&http, &b.url, Method::GET, "/v1/map", None).expect("map");
    assert_eq!(status, 200);
    let nodes: BTreeSet<&str> = map["nodes"]
        .as_array()
        .expect("nodes")
        .iter()
        .filter_map(|n| n["id"].as_str())
        .collect();
    let ranges: BTreeSet<(u64, &str)> = map["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .filter_map(|e| Some((e["gpa_start"].as_u64()?, e["node_id"].as_str()?)))
        .collect();
    let acknowledged = ledger.acknowledged.lock().expect("ledger");
    assert!(acknowledged.len() >= 60, "{}", acknowledged.len());
    eprintln!(
        "{} registrations acknowledged, {} resolves answered, etcd leader m{leader} then coordinator a killed",
        acknowledged.len(),
        ledger.resolves_ok.load(Ordering::Relaxed)
    );
    for (id, gpa_start) in acknowledged.iter() {
        assert!(nodes.contains(id.as_str()), "acknowledged node {id} lost");
        assert!(
            ranges.contains(&(*gpa_start, id.as_str())),
            "acknowledged range {gpa_start:#x} of {id} lost"
        );
    }
    // The page-servers' leases lived through both failures.
    for beats in &heartbeats {
        if let Some(ms) = beats.reported_dead_ms() {
            panic!("{} reported dead by a heartbeat's answer {ms} ms into the load (leader killed at {killed_leader_ms} ms, coordinator a at {killed_a_ms} ms)", beats.id);
        }
    }
    let lost = ledger.lease_lost.lock().expect("ledger").clone();
    if let Some(lost) = lost {
        panic!("a page-server's lease lapsed: {lost} (leader killed at {killed_leader_ms} ms, coordinator a at {killed_a_ms} ms)");
    }
}

/// Heartbeats sent one after another after a follower was killed.
const BEATS_AFTER_KILL: usize = 60;

/// `BEATS_AFTER_KILL` heartbeats of `id` through `client`: each answers,
/// and none waits on a dead member (each makes four etcd requests).
/// Without the prober, 5-7 of 60 failed (503) and the slowest took about
/// 1 s; with it, the slowest took 20 ms.
fn heartbeats_answer_at_once(client: &CoordinatorClient, id: &str, when: &str) {
    let mut slowest = Duration::ZERO;
    for beat in 0..BEATS_AFTER_KILL {
        let sent = Instant::now();
        let answer = client.heartbeat(&id.to_owned());
        slowest = slowest.max(sent.elapsed());
        assert!(
            answer.as_ref().is_ok_and(|b| b.alive),
            "heartbeat {beat} {when}: {answer:?}"
        );
    }
    assert!(
        slowest < Duration::from_millis(ETCD_TIMEOUT_MS / 2),
        "a heartbeat {when} took {slowest:?}: it waited on a dead member"
    );
}

#[test]
fn a_dead_etcd_member_leaves_the_balance_and_comes_back_when_it_answers() {
    let mut cluster = EtcdCluster::start(3);
    let dir = tempfile::tempdir().expect("tempdir");
    let a = CoordinatorProcess::start(&cluster.endpoints(), dir.path(), "a");
    let http = new_http();
    assert_eq!(register(&http, &a.url, "ps0", 7000), 200);
    let client =
        CoordinatorClient::new(&a.url, None, Duration::from_secs(10)).expect("client of a");

    // A follower dies: no election, the cluster keeps its quorum, but a
    // third of the endpoints the coordinator was given is dead.
    let leader = cluster.leader();
    let follower = (leader + 1) % 3;
    cluster.kill(follower);
    wait_for(
        "the coordinator to take the dead member out",
        WAIT_LIMIT,
        || a.logged("etcd member does not answer") >= 1,
    );
    heartbeats_answer_at_once(&client, "ps0", "after a follower died");

    // It comes back and is used again: with the other follower dead too,
    // the leader and it keep the quorum, and the coordinator reaches it.
    cluster.restart(follower);
    wait_for("the coordinator to put the member back", WAIT_LIMIT, || {
        a.logged("etcd member answers again") >= 1
    });
    let other = 3 - leader - follower;
    cluster.kill(other);
    wait_for(
        "the coordinator to take the other member out",
        WAIT_LIMIT,
        || a.logged("etcd member does not answer") >= 2,
    );
    let reads_before = cluster.reads_served(follower);
    heartbeats_answer_at_once(&client, "ps0", "after the other follower died");
    // The balance spreads the heartbeats' reads over the leader and the
    // member that came back (the prober itself only asks for status).
    let reads = cluster.reads_served(follower) - reads_before;
    assert!(
        reads >= 10,
        "the restarted member served {reads} of the heartbeats' reads"
    );
}

#[test]
fn overlapping_claims_racing_through_two_coordinators_exactly_one_wins() {
    let cluster = EtcdCluster::start(3);
    let dir = tempfile::tempdir().expect("tempdir");
    let a = CoordinatorProcess::start(&cluster.endpoints(), dir.path(), "a");
    let b = CoordinatorProcess::start(&cluster.endpoints(), dir.path(), "b");
    let http = new_http();
    assert_eq!(register(&http, &a.url, "left", 7001), 200);
    assert_eq!(register(&http, &b.url, "right", 7002), 200);

    const ROUNDS: u64 = 20;
    for round in 0..ROUNDS {
        let base = (round + 1) << 32;
        // left claims [base, base + 2 pages) through a, right
        // [base + 1 page, base + 3 pages) through b, at the same moment.
        let barrier = Arc::new(Barrier::new(2));
        let racers: Vec<_> = [
            (a.url.clone(), "left", base),
            (b.url.clone(), "right", base + PAGE),
        ]
        .into_iter()
        .map(|(url, node, start)| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let http = new_http();
                barrier.wait();
                (node, claim(&http, &url, start, 2 * PAGE, node))
            })
        })
        .collect();
        let outcomes: Vec<(&str, u16)> = racers
            .into_iter()
            .map(|t| t.join().expect("racer"))
            .collect();
        let mut statuses: Vec<u16> = outcomes.iter().map(|(_, s)| *s).collect();
        statuses.sort_unstable();
        assert_eq!(statuses, [201, 409], "round {round}: {outcomes:?}");
        let winner = outcomes.iter().find(|(_, s)| *s == 201).map(|(n, _)| *n);
        // The map holds the winner's range only.
        let (_, map) = call(&http, &b.url, Method::GET, "/v1/map", None).expect("map");
        let in_round: Vec<&Value> = map["entries"]
            .as_array()
            .expect("entries")
            .iter()
            .filter(|e| {
                e["gpa_start"]
                    .as_u64()
                    .is_some_and(|s| s >> 32 == round + 1)
            })
            .collect();
        assert_eq!(in_round.len(), 1, "round {round}: {in_round:?}");
        assert_eq!(in_round[0]["node_id"].as_str(), winner);
    }
}
