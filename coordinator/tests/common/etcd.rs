//! Real etcd processes for the etcd-backend tests: a cluster of one or
//! three members, with data in a temporary directory, on free ports of
//! 127.0.0.1 ([`EtcdCluster::start`]) or each in a network namespace of its
//! own ([`EtcdCluster::start_apart`], where a member can be cut off from its
//! peers); members can be killed with SIGKILL and started again on their
//! data. Every process is killed when the cluster is dropped.
//!
//! The `etcd` binary comes from Debian's etcd-server (deploy/test-all.sh
//! installs it); `ETCD_BIN` names another. A missing binary fails the test.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::netns::{self, Host, PrivateNetwork};

/// How long a cluster may take to elect a leader.
const START_LIMIT: Duration = Duration::from_secs(30);

/// One member.
pub struct Member {
    pub name: String,
    pub client_url: String,
    /// Its command line after the binary, to start it again.
    args: Vec<String>,
    child: Option<Child>,
}

/// A running etcd cluster.
pub struct EtcdCluster {
    pub members: Vec<Member>,
    /// Member `i`'s namespace, for a cluster started apart (dropped after
    /// the members are killed).
    hosts: Vec<Host>,
    _dir: tempfile::TempDir,
}

fn etcd_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("ETCD_BIN") {
        return PathBuf::from(path);
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("etcd"))
            .find(|candidate| candidate.is_file())
    });
    found.unwrap_or_else(|| {
        panic!(
            "the etcd binary was not found (PATH, or ETCD_BIN): these tests need a real etcd; \
             install Debian's etcd-server (deploy/test-all.sh does)"
        )
    })
}

/// A port nobody listens on now (the kernel's pick; released at once, so a
/// race with another process is possible but unlikely).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// Starts an etcd member with `args` (on `host`, or here), its output
/// appended to `log`.
fn spawn_member(binary: &Path, args: &[String], log: &Path, host: Option<&Host>) -> Child {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("log file");
    host.map_or_else(|| Command::new(binary), |host| host.command(binary))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", binary.display()))
}

fn http() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("http client")
}

impl EtcdCluster {
    /// Starts `size` members and waits until they have a leader. A member
    /// that exits at start (most likely a port taken between picking it and
    /// binding it) makes it start again on new ports, three times at most.
    pub fn start(size: usize) -> Self {
        let mut failures = Vec::new();
        for _ in 0..3 {
            match Self::try_start(size, Vec::new()) {
                Ok(cluster) => return cluster,
                Err(why) => failures.push(why),
            }
        }
        panic!("the etcd cluster did not start: {failures:#?}")
    }

    /// Starts `size` members, each on a [`Host`] of its own (member `i` at
    /// 10.77.`i`.2, ports 2379 and 2380), and waits until they have a
    /// leader.
    pub fn start_apart(network: &PrivateNetwork, size: u8) -> Self {
        let hosts = (0..size).map(|i| Host::new(network, i)).collect();
        Self::try_start(usize::from(size), hosts)
            .unwrap_or_else(|why| panic!("the etcd cluster did not start: {why}"))
    }

    /// Starts the cluster on `hosts`, or on 127.0.0.1 when there are none.
    fn try_start(size: usize, hosts: Vec<Host>) -> Result<Self, String> {
        let binary = etcd_binary();
        let dir = tempfile::tempdir().expect("tempdir");
        let token = format!("test-{}-{}", std::process::id(), free_port());
        // (name, client URL, peer URL) of each member.
        let peers: Vec<(String, String, String)> = (0..size)
            .map(|i| {
                let (client, peer) = match hosts.get(i) {
                    Some(host) => (
                        format!("{}:2379", host.address()),
                        format!("{}:2380", host.address()),
                    ),
                    None => (
                        format!("127.0.0.1:{}", free_port()),
                        format!("127.0.0.1:{}", free_port()),
                    ),
                };
                (
                    format!("m{i}"),
                    format!("http://{client}"),
                    format!("http://{peer}"),
                )
            })
            .collect();
        let initial_cluster = peers
            .iter()
            .map(|(name, _, peer_url)| format!("{name}={peer_url}"))
            .collect::<Vec<_>>()
            .join(",");
        let members = peers
            .iter()
            .enumerate()
            .map(|(i, (name, client_url, peer_url))| {
                let args = vec![
                    format!("--name={name}"),
                    format!("--data-dir={}", dir.path().join(name).display()),
                    format!("--listen-client-urls={client_url}"),
                    format!("--advertise-client-urls={client_url}"),
                    format!("--listen-peer-urls={peer_url}"),
                    format!("--initial-advertise-peer-urls={peer_url}"),
                    format!("--initial-cluster={initial_cluster}"),
                    "--initial-cluster-state=new".to_owned(),
                    format!("--initial-cluster-token={token}"),
                    "--heartbeat-interval=100".to_owned(),
                    "--election-timeout=1000".to_owned(),
                    "--pre-vote=true".to_owned(),
                ];
                let log = dir.path().join(format!("{name}.log"));
                let child = spawn_member(&binary, &args, &log, hosts.get(i));
                Member {
                    name: name.clone(),
                    client_url: client_url.clone(),
                    args,
                    child: Some(child),
                }
            })
            .collect();
        let mut cluster = Self {
            members,
            hosts,
            _dir: dir,
        };
        let deadline = Instant::now() + START_LIMIT;
        while cluster.find_leader().is_none() {
            for member in &mut cluster.members {
                if let Some(Ok(Some(status))) = member.child.as_mut().map(Child::try_wait) {
                    let log = cluster._dir.path().join(format!("{}.log", member.name));
                    let log = std::fs::read_to_string(log).unwrap_or_default();
                    let tail: String = log.lines().rev().take(5).collect::<Vec<_>>().join(" | ");
                    return Err(format!(
                        "{} exited at start ({status}): {tail}",
                        member.name
                    ));
                }
            }
            if Instant::now() >= deadline {
                return Err(format!("no leader elected within {START_LIMIT:?}"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(cluster)
    }

    /// Every member's client URL (the dead ones too, as a deployment's
    /// configuration would list them).
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_url.clone()).collect()
    }

    /// The member's status (`/v3/maintenance/status` of etcd's gateway).
    fn status(&self, index: usize) -> Option<Value> {
        let url = format!("{}/v3/maintenance/status", self.members[index].client_url);
        let response = http().post(url).body("{}").send().ok()?;
        response.json().ok()
    }

    /// The sum of member `index`'s Prometheus metrics lines that start with
    /// `name` and contain `label`.
    fn metric(&self, index: usize, name: &str, label: &str) -> u64 {
        let url = format!("{}/metrics", self.members[index].client_url);
        let text = http()
            .get(url)
            .send()
            .and_then(reqwest::blocking::Response::text)
            .unwrap_or_else(|e| panic!("metrics of member {index}: {e}"));
        text.lines()
            .filter(|line| line.starts_with(name) && line.contains(label))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    /// Key-value reads (gRPC `Range`) member `index` has served since it
    /// started.
    pub fn reads_served(&self, index: usize) -> u64 {
        self.metric(index, "grpc_server_handled_total{", "grpc_method=\"Range\"")
    }

    /// The watches member `index` serves now.
    pub fn watchers(&self, index: usize) -> u64 {
        self.metric(index, "etcd_debugging_mvcc_watcher_total ", "")
    }

    /// Makes member `to` the leader (etcd's leadership transfer, asked of
    /// the leader) and waits until it is.
    pub fn move_leader(&self, to: usize) {
        let leader = self.leader();
        if leader == to {
            return;
        }
        let target =
            self.status(to).expect("status of the new leader")["header"]["member_id"].clone();
        let url = format!(
            "{}/v3/maintenance/transfer-leadership",
            self.members[leader].client_url
        );
        let answer = http()
            .post(url)
            .body(json!({ "targetID": target }).to_string())
            .send()
            .and_then(reqwest::blocking::Response::error_for_status);
        assert!(answer.is_ok(), "leadership transfer to m{to}: {answer:?}");
        let deadline = Instant::now() + START_LIMIT;
        while self.find_leader() != Some(to) {
            assert!(
                Instant::now() < deadline,
                "m{to} did not become leader:{}",
                self.diagnosis()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The members' hosts (a cluster started apart).
    pub fn hosts(&self) -> Vec<&Host> {
        self.hosts.iter().collect()
    }

    /// The hosts of the members other than `index`.
    fn other_hosts(&self, index: usize) -> Vec<&Host> {
        (0..self.hosts.len())
            .filter(|&i| i != index)
            .map(|i| &self.hosts[i])
            .collect()
    }

    /// Drops every packet between member `index` and the other members
    /// (a cluster started apart); clients still reach it.
    pub fn cut_off(&self, index: usize) {
        netns::cut_off(&self.hosts[index], &self.other_hosts(index));
    }

    /// Lifts [`Self::cut_off`].
    pub fn reconnect(&self, index: usize) {
        netns::reconnect(&self.hosts[index], &self.other_hosts(index));
    }

    /// Drops every packet sent to member `index` from here (the test's
    /// namespace, where the coordinators run): to them it is gone, to its
    /// peers it is not.
    pub fn unreachable(&self, index: usize) {
        netns::unreachable(&self.hosts[index]);
    }

    /// Lifts [`Self::unreachable`].
    pub fn reachable(&self, index: usize) {
        netns::reachable(&self.hosts[index]);
    }

    /// Whether member `index` knows a leader now (`None`: no answer).
    pub fn knows_leader(&self, index: usize) -> Option<bool> {
        let status = self.status(index)?;
        Some(status["leader"].as_str().is_some_and(|l| l != "0"))
    }

    /// The index of the leader, as a running member reports it (waits,
    /// bounded, for an election).
    pub fn leader(&self) -> usize {
        let deadline = Instant::now() + START_LIMIT;
        loop {
            if let Some(index) = self.find_leader() {
                return index;
            }
            assert!(
                Instant::now() < deadline,
                "the etcd cluster elected no leader within {START_LIMIT:?}: {}",
                self.diagnosis()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// What each member says of itself, and the end of its log: for a
    /// failure message (an election that never ends has been seen once).
    fn diagnosis(&self) -> String {
        let mut out = String::new();
        for (index, member) in self.members.iter().enumerate() {
            let state = if member.child.is_none() {
                "killed".to_owned()
            } else {
                match self.status(index) {
                    Some(status) => format!(
                        "member {} leader {} term {}",
                        status["header"]["member_id"], status["leader"], status["raftTerm"]
                    ),
                    None => "no status".to_owned(),
                }
            };
            let log = self._dir.path().join(format!("{}.log", member.name));
            let log = std::fs::read_to_string(log).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(8).collect();
            out.push_str(&format!(
                "\n{}: {state}; log, newest first: {}",
                member.name,
                tail.join(" | ")
            ));
        }
        out
    }

    /// The running member that reports itself leader now, if any.
    fn find_leader(&self) -> Option<usize> {
        (0..self.members.len()).find(|&index| {
            self.members[index].child.is_some()
                && self.status(index).is_some_and(|status| {
                    let me = &status["header"]["member_id"];
                    !me.is_null() && *me == status["leader"]
                })
        })
    }

    /// Starts member `index` again (after [`Self::kill`]) on its data; it
    /// rejoins the cluster. Returns once it answers its status.
    pub fn restart(&mut self, index: usize) {
        assert!(self.members[index].child.is_none(), "member {index} runs");
        let log = self
            ._dir
            .path()
            .join(format!("{}.log", self.members[index].name));
        let child = spawn_member(
            &etcd_binary(),
            &self.members[index].args,
            &log,
            self.hosts.get(index),
        );
        self.members[index].child = Some(child);
        let deadline = Instant::now() + START_LIMIT;
        while self.status(index).is_none() {
            assert!(
                Instant::now() < deadline,
                "member {index} did not answer after its restart:{}",
                self.diagnosis()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// `kill -9` of member `index`.
    pub fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.members[index].child.take() {
            child.kill().expect("SIGKILL");
            let _ = child.wait();
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for index in 0..self.members.len() {
            self.kill(index);
        }
    }
}
