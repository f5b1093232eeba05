//! Shared set-up of the cluster tests: a coordinator on a temporary database
//! and page-servers, in-process or as real child processes.
#![allow(dead_code)]

pub mod checked_load;
pub mod coherent_copies;
pub mod coherent_recovery;
pub mod fake_coordinator;
pub mod raw;
pub mod shared_cluster;
pub mod stalling_link;
pub mod vmm_view;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use coordinator::{CoordinatorConfig, RunningCoordinator};
use page_server::{RunningServer, ServerConfig};
use rdma_transport::{ManagerConfig, Page, TransportManager, PAGE_SIZE};

pub const NODE_BYTES: usize = 1 << 20;

pub fn coordinator_on(db: &Path, listen: SocketAddr) -> RunningCoordinator {
    coordinator::spawn(CoordinatorConfig::new(listen, db)).expect("coordinator starts")
}

/// A coordinator on a loopback port, its state in a fresh temporary
/// directory (kept while the returned handle lives).
pub fn loopback_coordinator() -> (tempfile::TempDir, RunningCoordinator) {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(
        &db.path().join("c.db"),
        SocketAddr::from(([127, 0, 0, 1], 0)),
    );
    (db, coord)
}

pub fn page_server(url: &str, node: &str, gpa_base: u64) -> RunningServer {
    let mut cfg = ServerConfig::new(node, NODE_BYTES);
    cfg.gpa_base = gpa_base;
    page_server_with(url, cfg)
}

/// Starts `cfg` registered with the coordinator at `url`.
pub fn page_server_with(url: &str, mut cfg: ServerConfig) -> RunningServer {
    cfg.coordinator_url = Some(url.to_owned());
    let s = page_server::spawn(cfg).expect("page-server starts");
    s.wait_registered(Duration::from_secs(10))
        .expect("page-server registers");
    s
}

pub fn manager(url: &str) -> TransportManager {
    TransportManager::connect(ManagerConfig {
        coordinator_url: url.to_owned(),
        request_timeout_ms: 500,
        connect_timeout_ms: 500,
        poller_cpus: Some(vec![]),
        ..ManagerConfig::default()
    })
    .expect("manager connects")
}

/// As [`manager`], with `client_id` (`ManagerConfig::client_id`: the
/// identity a VMM keeps across restarts).
pub fn manager_with_id(url: &str, client_id: u64) -> TransportManager {
    TransportManager::connect(ManagerConfig {
        coordinator_url: url.to_owned(),
        request_timeout_ms: 500,
        connect_timeout_ms: 500,
        poller_cpus: Some(vec![]),
        client_id: Some(client_id),
        ..ManagerConfig::default()
    })
    .expect("manager connects")
}

/// A memfd of `size_bytes`, as a VMM creates for guest RAM.
pub fn memfd(size_bytes: usize) -> std::sync::Arc<std::os::fd::OwnedFd> {
    memfd_with(size_bytes, 0)
}

/// An `MFD_HUGETLB` memfd of `size_bytes` (needs free huge pages: see
/// [`free_huge_pages`]).
pub fn huge_memfd(size_bytes: usize) -> std::sync::Arc<std::os::fd::OwnedFd> {
    memfd_with(size_bytes, libc::MFD_HUGETLB)
}

fn memfd_with(size_bytes: usize, flags: libc::c_uint) -> std::sync::Arc<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    // SAFETY: the name is NUL-terminated; the result is checked.
    let fd = unsafe { libc::memfd_create(c"guest-ram".as_ptr(), libc::MFD_CLOEXEC | flags) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` was just created and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscall on our descriptor.
    let rc = unsafe { libc::ftruncate(fd.as_raw_fd(), size_bytes as libc::off_t) };
    assert_eq!(rc, 0, "ftruncate: {}", std::io::Error::last_os_error());
    std::sync::Arc::new(fd)
}

/// Free 2 MiB huge pages (`HugePages_Free` of /proc/meminfo).
pub fn free_huge_pages() -> usize {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("HugePages_Free:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A page whose every byte depends on `gpa` and `seed`.
pub fn page_for(gpa: u64, seed: u8) -> Page {
    let mut p = [0u8; PAGE_SIZE];
    for (i, b) in p.iter_mut().enumerate() {
        *b = (gpa / PAGE_SIZE as u64) as u8 ^ (i as u8).wrapping_mul(31) ^ seed;
    }
    p
}

/// A page whose every u64 holds its page index, `seed` and its own index
/// in the page.
pub fn page_indexed(index: u64, seed: u64) -> Page {
    let mut page = [0u8; PAGE_SIZE];
    for (w, word) in page.chunks_exact_mut(8).enumerate() {
        let value = (index << 40) | (seed << 20) | w as u64;
        word.copy_from_slice(&value.to_le_bytes());
    }
    page
}

/// A manager over a fixed map that puts `map`'s only range on `node`'s
/// replica alone, valid in that replica's epoch: it reads and writes that
/// one process, whatever the replica's state.
pub fn replica_manager(
    map: &rdma_transport::coordinator::api::MapResponse,
    node: &str,
) -> TransportManager {
    assert_eq!(map.entries.len(), 1, "one range");
    range_replica_manager(map, map.entries[0].gpa_start, node)
}

/// As [`replica_manager`], for the range of `map` that starts at
/// `gpa_start` (the map may hold others): reads and writes of that range
/// go to `node`'s process alone, at its replica's offset.
pub fn range_replica_manager(
    map: &rdma_transport::coordinator::api::MapResponse,
    gpa_start: u64,
    node: &str,
) -> TransportManager {
    use rdma_transport::coordinator::api::{MapEntry, MapResponse, RangeState};
    let entry = map
        .entries
        .iter()
        .find(|e| e.gpa_start == gpa_start)
        .expect("the range is in the map")
        .clone();
    let r = entry
        .replicas
        .iter()
        .find(|r| r.node_id == node)
        .expect("node holds a replica")
        .clone();
    let info = map
        .nodes
        .iter()
        .find(|n| n.id == node)
        .expect("node registered")
        .clone();
    let map = MapResponse {
        version: 1,
        generation: 0,
        entries: vec![MapEntry {
            node_id: r.node_id,
            remote_offset: r.remote_offset,
            valid_epoch: r.valid_epoch,
            state: RangeState::Live,
            replicas: Vec::new(),
            ..entry
        }],
        nodes: vec![info],
    };
    fixed_map_manager(map, None)
}

/// A TCP manager that never refreshes `map` (2 s deadlines), proving `key`
/// when given.
pub fn fixed_map_manager(
    map: rdma_transport::coordinator::api::MapResponse,
    key: Option<&rdma_transport::auth::ClusterKey>,
) -> TransportManager {
    TransportManager::from_map(
        ManagerConfig {
            transport: rdma_transport::TransportKind::Tcp,
            request_timeout_ms: 2000,
            connect_timeout_ms: 2000,
            poller_cpus: Some(vec![]),
            map_refresh_ms: 0,
            cluster_key: key.cloned(),
            ..ManagerConfig::default()
        },
        map,
    )
    .expect("manager over a fixed map")
}

/// A page-server running as a real child process, killed on drop.
pub struct ChildServer {
    pub child: Child,
    pub addr: String,
    _dir: tempfile::TempDir,
}

impl ChildServer {
    pub fn start(url: &str, node: &str, gpa_base: u64) -> Self {
        Self::start_with(url, node, gpa_base, &[])
    }

    /// As [`ChildServer::start`], with more command-line flags.
    pub fn start_with(url: &str, node: &str, gpa_base: u64, extra_args: &[&str]) -> Self {
        let range = [
            "--memory".to_owned(),
            NODE_BYTES.to_string(),
            "--gpa-base".to_owned(),
            gpa_base.to_string(),
        ];
        Self::spawn(url, node, &range, extra_args)
    }

    /// A page-server exporting several ranges (`--range GPA:LENGTH`, in
    /// this order: laid out one after the other in its memory), with more
    /// command-line flags.
    pub fn start_ranges(
        url: &str,
        node: &str,
        ranges: &[(u64, usize)],
        extra_args: &[&str],
    ) -> Self {
        let flags: Vec<String> = ranges
            .iter()
            .flat_map(|(gpa, len)| ["--range".to_owned(), format!("{gpa:#x}:{len}")])
            .collect();
        Self::spawn(url, node, &flags, extra_args)
    }

    fn spawn(url: &str, node: &str, range_flags: &[String], extra_args: &[&str]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let ready = dir.path().join("ready");
        let child = Command::new(env!("CARGO_BIN_EXE_page-server"))
            .args(["--node-id", node, "--listen", "127.0.0.1:0"])
            .args(range_flags)
            .args(["--coordinator", url, "--heartbeat-ms", "200", "--insecure"])
            .args(extra_args)
            .arg("--ready-file")
            .arg(&ready)
            .stdout(Stdio::null())
            // `CHILD_STDERR=inherit` shows the page-servers' logs (with
            // RUST_LOG) among the test's, to follow a replay.
            .stderr(match std::env::var("CHILD_STDERR").as_deref() {
                Ok("inherit") => Stdio::inherit(),
                _ => Stdio::null(),
            })
            .spawn()
            .expect("page-server binary starts");
        let addr = wait_for_file(&ready, Duration::from_secs(20));
        Self {
            child,
            addr,
            _dir: dir,
        }
    }

    /// SIGSTOP: the process answers nothing but keeps its memory and its
    /// epoch (unlike a kill and restart, which lose both).
    /// Returns once every thread of the process is stopped: the signal is
    /// delivered asynchronously, and a thread still running could answer
    /// one more request.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
        let tasks = format!("/proc/{}/task", self.child.id());
        let all_stopped = || {
            std::fs::read_dir(&tasks).is_ok_and(|dir| {
                dir.flatten().all(|task| {
                    std::fs::read_to_string(task.path().join("stat")).is_ok_and(|stat| {
                        // The state follows the parenthesised command name.
                        stat.rsplit_once(") ")
                            .is_some_and(|(_, rest)| rest.starts_with('T'))
                    })
                })
            })
        };
        assert!(
            wait_until(Duration::from_secs(5), all_stopped),
            "page-server {} never stopped",
            self.child.id()
        );
    }

    /// SIGCONT after [`ChildServer::pause`].
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: libc::c_int) {
        let pid = libc::pid_t::try_from(self.child.id()).expect("pid fits");
        // SAFETY: kill(2) on our own child's pid; no memory is passed.
        let rc = unsafe { libc::kill(pid, signal) };
        assert_eq!(rc, 0, "kill({pid}, {signal})");
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The operator's steps after page-server `node`, owner of the range at
/// `gpa_start`, was killed: start it again, wait until the coordinator
/// knows its new epoch (the range is then `lost`), and re-initialise the
/// range (zeros are valid again). Needs an insecure coordinator (no
/// credential). Returns the new process.
pub fn restart_and_reinitialise(
    url: &str,
    node: &str,
    gpa_start: u64,
    old_epoch: u64,
) -> ChildServer {
    let server = ChildServer::start(url, node, gpa_start);
    let client =
        rdma_transport::coordinator::CoordinatorClient::new(url, None, Duration::from_secs(5))
            .expect("coordinator client");
    let id = node.to_owned();
    assert!(
        wait_until(Duration::from_secs(20), || client
            .node(&id)
            .is_ok_and(|n| n.epoch != old_epoch && n.epoch != 0)),
        "the restarted page-server never registered its new epoch"
    );
    client
        .reinitialise_range(gpa_start)
        .expect("re-initialise the range");
    server
}

/// Waits until page-server `node` is registered in an epoch other than
/// `old_epoch` (0: none before) and the map has its range at `gpa_start`;
/// returns that epoch.
pub fn registered_with_range(url: &str, node: &str, gpa_start: u64, old_epoch: u64) -> u64 {
    let coordinator = coordinator_client(url);
    let mut epoch = 0;
    assert!(
        wait_until(Duration::from_secs(20), || {
            epoch = coordinator.node(&node.to_owned()).map_or(0, |n| n.epoch);
            ![0, old_epoch].contains(&epoch)
                && coordinator
                    .map()
                    .is_ok_and(|m| m.entries.iter().any(|e| e.gpa_start == gpa_start))
        }),
        "{node} never registered (in a new epoch) with its range at {gpa_start:#x}"
    );
    epoch
}

/// A client of a coordinator without a key: it may do what an admin may.
pub fn coordinator_client(url: &str) -> rdma_transport::coordinator::CoordinatorClient {
    rdma_transport::coordinator::CoordinatorClient::new(url, None, Duration::from_secs(5))
        .expect("coordinator client")
}

/// The states of the replicas of the range at `gpa_start`, by node.
pub fn range_states(
    admin: &rdma_transport::coordinator::CoordinatorClient,
    gpa_start: u64,
) -> Vec<(String, rdma_transport::coordinator::api::ReplicaState)> {
    let Ok(map) = admin.map() else {
        return Vec::new();
    };
    map.entries
        .iter()
        .find(|e| e.gpa_start == gpa_start)
        .map(|e| {
            e.replicas
                .iter()
                .map(|r| (r.node_id.clone(), r.state))
                .collect()
        })
        .unwrap_or_default()
}

/// Waits (30 s at most) until the coordinator at `url` shows one range,
/// with two replicas, both live.
pub fn wait_both_live(url: &str) {
    let admin = coordinator_client(url);
    assert!(
        wait_until(Duration::from_secs(30), || admin.map().is_ok_and(|m| {
            m.entries.len() == 1
                && m.entries[0].replicas.len() == 2
                && m.entries[0]
                    .replicas
                    .iter()
                    .all(|r| r.state == rdma_transport::coordinator::api::ReplicaState::Live)
        })),
        "both replicas never live: {:?}",
        range_states(&admin, 0)
    );
}

/// The epoch the coordinator has for `node` now.
pub fn node_epoch(url: &str, node: &str) -> u64 {
    coordinator_client(url)
        .node(&node.to_owned())
        .expect("node registered")
        .epoch
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        self.kill();
    }
}

fn wait_for_file(path: &PathBuf, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if !s.is_empty() {
                return s;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} did not appear",
            path.display()
        );
        std::thread::park_timeout(Duration::from_millis(10));
    }
}

/// `GET path` of the HTTP server at `addr`: its status and body.
pub fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    let answer = http(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
    );
    let (head, body) = answer.split_once("\r\n\r\n").expect("head and body");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("a status code");
    (status, body.to_owned())
}

/// One HTTP request on a fresh connection; the whole answer.
pub fn http(addr: SocketAddr, request: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    stream.write_all(request.as_bytes()).expect("send");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("answer");
    answer
}

/// The value of counter or gauge `name` (with its labels, if any) in the
/// metrics at `metrics` (a page-server's, or the coordinator's).
pub fn metric(metrics: SocketAddr, name: &str) -> Option<u64> {
    let (_, text) = http_get(metrics, "/metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Polls `cond` until it holds, for at most `limit`.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::park_timeout(Duration::from_millis(10));
    }
    cond()
}

/// Writes and reads back, with content checked: every `step`-th page one at a
/// time, then every page of `nodes` nodes in batches spanning them, then page
/// `frame_index` into a pool frame.
pub fn round_trip_all_pages(mgr: &TransportManager, nodes: u64, step: usize, frame_index: usize) {
    let pages_per_node = (NODE_BYTES / PAGE_SIZE) as u64;
    let gpas: Vec<u64> = (0..nodes * pages_per_node)
        .step_by(step)
        .map(|p| p * PAGE_SIZE as u64)
        .collect();
    for &gpa in &gpas {
        mgr.write_page(gpa, &page_for(gpa, 1)).unwrap();
    }
    let mut page = [0u8; PAGE_SIZE];
    for &gpa in &gpas {
        mgr.read_page(gpa, &mut page).unwrap();
        assert!(page == page_for(gpa, 1), "page at {gpa:#x} differs");
    }

    // Every page, in batches that span the nodes, many in flight.
    let all: Vec<u64> = (0..nodes * pages_per_node)
        .map(|p| p * PAGE_SIZE as u64)
        .collect();
    let pages: Vec<_> = all.iter().map(|&g| page_for(g, 2)).collect();
    mgr.write_pages(&all, &pages).unwrap();
    let mut back = vec![[0u8; PAGE_SIZE]; all.len()];
    mgr.read_pages(&all, &mut back).unwrap();
    for (i, &gpa) in all.iter().enumerate() {
        assert!(back[i] == pages[i], "batched page at {gpa:#x} differs");
    }

    // Straight into a pool frame.
    let frame = mgr.read_frame(all[frame_index]).unwrap();
    assert!(*frame == pages[frame_index]);
}
