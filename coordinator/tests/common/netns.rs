//! Network namespaces for partition tests, so that a test can cut an etcd
//! member off from its peers for real while the coordinators still reach
//! it.
//!
//! - The test thread moves into a namespace of its own
//!   ([`PrivateNetwork::enter`]). Every process and thread it starts
//!   afterwards lives there, and all of it goes away with them: nothing is
//!   configured on the machine's own network.
//! - Each [`Host`] is one more namespace, held by a `sleep` process, joined
//!   to the test's namespace by a veth pair: host `i` is 10.77.`i`.2, the
//!   test's side 10.77.`i`.1. The test's namespace routes between hosts.
//! - [`cut_off`] drops in that router every packet a host sends to another
//!   host or receives from one; packets between the host and the test's
//!   namespace (the coordinators) still pass. [`reconnect`] lifts it.
//! - [`unreachable`] drops every packet the test's namespace sends the
//!   host (a machine gone, as the coordinators see it: no refusal, no
//!   answer); the hosts still reach each other. [`reachable`] lifts it.
//! - [`LoopbackPartition`] drops what is sent to one TCP port of the test
//!   namespace's own loopback (the page-server tests use this file too).
//!
//! Needs root, iproute2 and util-linux (`unshare`, `nsenter`).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a new host namespace may take to appear.
const SETUP_LIMIT: Duration = Duration::from_secs(10);

/// Proof that the calling thread has a network namespace of its own.
#[derive(Debug)]
pub struct PrivateNetwork {
    _not_send: std::marker::PhantomData<*const ()>,
}

/// Runs `program args` to completion; panics with its output on failure.
fn run(program: &str, args: &[&str]) {
    let output = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        output.status.success(),
        "{program} {}: {}; {}",
        args.join(" "),
        output.status,
        String::from_utf8_lossy(&output.stderr).trim()
    );
}

/// The network namespace `path` (a `/proc/.../ns/net` link) names.
fn namespace_of(path: &str) -> String {
    std::fs::read_link(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .display()
        .to_string()
}

impl PrivateNetwork {
    /// Moves the calling thread into a new network namespace with its
    /// loopback up and forwarding on.
    pub fn enter() -> Self {
        let before = namespace_of("/proc/thread-self/ns/net");
        // SAFETY: unshare takes no pointers; with CLONE_NEWNET it moves only
        // the calling thread into a new network namespace (allowed in a
        // multithreaded process), which the rest of this thread's test
        // expects.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(
            rc,
            0,
            "unshare(CLONE_NEWNET): {} (the partition tests need root)",
            std::io::Error::last_os_error()
        );
        assert_ne!(namespace_of("/proc/thread-self/ns/net"), before);
        run("ip", &["link", "set", "lo", "up"]);
        // /proc/sys/net shows the namespace of the process that opens it.
        run("sh", &["-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"]);
        Self {
            _not_send: std::marker::PhantomData,
        }
    }
}

/// A network namespace joined to the test's by a veth pair.
#[derive(Debug)]
pub struct Host {
    index: u8,
    holder: Child,
}

impl Host {
    /// Host `index` (below 250), reachable from the test's namespace.
    pub fn new(_network: &PrivateNetwork, index: u8) -> Self {
        assert!(index < 250);
        let holder = Command::new("unshare")
            .args(["--net", "sleep", "600"])
            .stdin(Stdio::null())
            .spawn()
            .expect("unshare (util-linux) starts");
        let host = Self { index, holder };
        // `unshare` moves itself, then runs sleep: the veth must not go in
        // before, or it would land in the test's namespace.
        let ours = namespace_of("/proc/thread-self/ns/net");
        let deadline = Instant::now() + SETUP_LIMIT;
        while namespace_of(&host.namespace()) == ours {
            assert!(Instant::now() < deadline, "host {index} got no namespace");
            std::thread::sleep(Duration::from_millis(5));
        }
        let (link, pid) = (host.link(), host.holder.id().to_string());
        run(
            "ip",
            &[
                "link", "add", &link, "type", "veth", "peer", "name", "eth0", "netns", &pid,
            ],
        );
        run(
            "ip",
            &["addr", "add", &format!("10.77.{index}.1/24"), "dev", &link],
        );
        run("ip", &["link", "set", &link, "up"]);
        let inside = format!(
            "ip link set lo up && ip addr add {}/24 dev eth0 && ip link set eth0 up \
             && ip route add default via 10.77.{index}.1",
            host.address()
        );
        let enter = format!("--net={}", host.namespace());
        run("nsenter", &[&enter, "sh", "-c", &inside]);
        host
    }

    /// The host's address.
    pub fn address(&self) -> String {
        format!("10.77.{}.2", self.index)
    }

    /// The test's end of the host's veth pair.
    fn link(&self) -> String {
        format!("m{}", self.index)
    }

    fn namespace(&self) -> String {
        format!("/proc/{}/ns/net", self.holder.id())
    }

    /// `program` to be run in the host's namespace.
    pub fn command(&self, program: &Path) -> Command {
        let mut command = Command::new("nsenter");
        command
            .arg(format!("--net={}", self.namespace()))
            .arg(program);
        command
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

/// The routing rules that cut `host` off from `others`: what it sends
/// through the router, and what they send it. Local deliveries (to the
/// test's namespace) are looked up first (rule 0) and pass.
fn partition_rules(host: &Host, others: &[&Host]) -> Vec<Vec<String>> {
    let preference = (1000 + u32::from(host.index) * 256).to_string();
    let mut rules = vec![vec![
        "iif".to_owned(),
        host.link(),
        "pref".to_owned(),
        preference.clone(),
        "blackhole".to_owned(),
    ]];
    for other in others {
        rules.push(vec![
            "iif".to_owned(),
            other.link(),
            "to".to_owned(),
            host.address(),
            "pref".to_owned(),
            preference.clone(),
            "blackhole".to_owned(),
        ]);
    }
    rules
}

/// `ip rule add` (or `del`) of each of `rules`.
fn ip_rules(verb: &str, rules: &[Vec<String>]) {
    for rule in rules {
        let mut args = vec!["rule", verb];
        args.extend(rule.iter().map(String::as_str));
        run("ip", &args);
    }
}

/// Drops every packet between `host` and `others` (silently, as a cable
/// pulled between them would).
pub fn cut_off(host: &Host, others: &[&Host]) {
    ip_rules("add", &partition_rules(host, others));
}

/// Lifts [`cut_off`].
pub fn reconnect(host: &Host, others: &[&Host]) {
    ip_rules("del", &partition_rules(host, others));
}

/// The routing rule that drops what the test's namespace itself sends
/// `host` (`iif lo`: packets of local origin).
fn unreachable_rule(host: &Host) -> Vec<String> {
    let preference = (1000 + u32::from(host.index) * 256 + 128).to_string();
    [
        "iif",
        "lo",
        "to",
        &host.address(),
        "pref",
        &preference,
        "blackhole",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// Drops every packet the test's namespace sends `host`.
pub fn unreachable(host: &Host) {
    ip_rules("add", &[unreachable_rule(host)]);
}

/// Lifts [`unreachable`].
pub fn reachable(host: &Host) {
    ip_rules("del", &[unreachable_rule(host)]);
}

/// A partition on the test namespace's own loopback: every packet sent to
/// TCP port `port` of 127.0.0.1 ([`LoopbackPartition::to_port`]), or sent
/// from it ([`LoopbackPartition::from_port`]), is dropped, until
/// [`LoopbackPartition::heal`] or drop. Both for one connection's local
/// port cut that connection both ways and nothing else.
#[derive(Debug)]
pub struct LoopbackPartition {
    rule: Vec<String>,
    healed: bool,
}

impl LoopbackPartition {
    /// Drops what is sent to `port` (a link to the process listening there
    /// gone down, as its clients see it; its own packets still leave).
    pub fn to_port(network: &PrivateNetwork, port: u16) -> Self {
        Self::on_port(network, "dport", port)
    }

    /// Drops what is sent from `port` of 127.0.0.1.
    pub fn from_port(network: &PrivateNetwork, port: u16) -> Self {
        Self::on_port(network, "sport", port)
    }

    /// The loopback's addresses are looked up in the `local` table by the
    /// highest-priority rule (0), which no rule can precede: that lookup
    /// moves to priority 100 first, once.
    fn on_port(_network: &PrivateNetwork, selector: &str, port: u16) -> Self {
        let rules = Command::new("ip").args(["rule", "show"]).output();
        let moved = rules.is_ok_and(|o| !String::from_utf8_lossy(&o.stdout).starts_with("0:"));
        if !moved {
            run("ip", &["rule", "add", "pref", "100", "lookup", "local"]);
            run("ip", &["rule", "del", "pref", "0"]);
        }
        let rule = [
            "to",
            "127.0.0.1",
            "ipproto",
            "tcp",
            selector,
            &port.to_string(),
            "pref",
            "10",
            "blackhole",
        ]
        .map(str::to_owned)
        .to_vec();
        ip_rules("add", std::slice::from_ref(&rule));
        Self {
            rule,
            healed: false,
        }
    }

    /// Lets packets through again.
    pub fn heal(&mut self) {
        if !std::mem::replace(&mut self.healed, true) {
            ip_rules("del", std::slice::from_ref(&self.rule));
        }
    }
}

impl Drop for LoopbackPartition {
    fn drop(&mut self) {
        self.heal();
    }
}
