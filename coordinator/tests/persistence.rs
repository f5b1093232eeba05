//! State survives `kill -9`: runs the real binary on a temporary database,
//! kills it with SIGKILL, restarts it on the same file and reads it back.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use common::{POLL_INTERVAL, REQUEST_TIMEOUT, WAIT_LIMIT};
use rdma_transport::auth::ClusterKey;
use rdma_transport::coordinator::api::{NodeRegistration, RangeRequest, RdmaEndpoint, RdmaRegion};
use rdma_transport::coordinator::{CoordinatorClient, Credential};

/// Kills and reaps the child when dropped, whatever the test did.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        // Already dead is fine: this only makes sure nothing is left behind.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the binary on `db` at an ephemeral port; returns it with its URL
/// once it has written its ready file.
fn start_binary(db: &Path, ready_file: &Path) -> (ChildGuard, String) {
    let child = Command::new(env!("CARGO_BIN_EXE_coordinator"))
        .arg("--listen")
        .arg("127.0.0.1:0")
        .arg("--db")
        .arg(db)
        .arg("--ready-file")
        .arg(ready_file)
        .arg("--cluster-key-file")
        .arg(key_file(db))
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("coordinator binary starts");
    let mut guard = ChildGuard(child);
    let deadline = Instant::now() + WAIT_LIMIT;
    let addr = loop {
        if let Ok(text) = std::fs::read_to_string(ready_file) {
            break text;
        }
        if let Ok(Some(status)) = guard.0.try_wait() {
            panic!("coordinator exited before listening: {status}");
        }
        assert!(
            Instant::now() < deadline,
            "coordinator never wrote {ready_file:?}"
        );
        std::thread::sleep(POLL_INTERVAL);
    };
    (guard, format!("http://{}", addr.trim()))
}

/// The cluster key of these tests (fixed, so a restart uses the same).
const KEY_HEX: &str = "5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a";

/// Writes the key file next to `db` (mode 600) and returns its path.
fn key_file(db: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = db.with_file_name("cluster.key");
    std::fs::write(&path, KEY_HEX).expect("key file");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    path
}

fn client(url: &str) -> CoordinatorClient {
    let key = ClusterKey::from_hex(KEY_HEX).expect("key");
    CoordinatorClient::with_credential(url, &Credential::Admin { key }, REQUEST_TIMEOUT)
        .expect("client")
}

fn ready_path(dir: &Path, n: u32) -> PathBuf {
    dir.join(format!("ready-{n}"))
}

#[test]
fn state_survives_sigkill_and_restart() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("coordinator.db");

    let (mut first, url) = start_binary(&db, &ready_path(dir.path(), 1));
    let c = client(&url);
    c.health().expect("healthy");
    let endpoint = RdmaEndpoint {
        device: "rxe0".to_owned(),
        port: 1,
        gid: "::ffff:127.0.0.1".to_owned(),
        gid_index: 1,
        lid: 0,
    };
    c.register_node(
        &"n1".to_owned(),
        &NodeRegistration {
            tcp_addr: "127.0.0.1:7001".to_owned(),
            rdma: Some(endpoint.clone()),
            epoch: 0,
        },
    )
    .expect("register n1");
    c.register_node(
        &"n2".to_owned(),
        &NodeRegistration {
            tcp_addr: "127.0.0.1:7002".to_owned(),
            rdma: None,
            epoch: 0,
        },
    )
    .expect("register n2");
    for (gpa_start, node_id, rdma) in [
        (
            0,
            "n1",
            Some(RdmaRegion {
                addr: 0x7f00_0000_0000,
                rkey: 9,
            }),
        ),
        (0x100_0000, "n2", None),
    ] {
        c.add_range(&RangeRequest {
            gpa_start,
            length_bytes: 0x100_0000,
            node_id: node_id.to_owned(),
            remote_offset: 0,
            rdma,
            contents: Default::default(),
        })
        .expect("add range");
    }
    let before = c.map().expect("map");
    assert!(before.version >= 4, "{before:?}");

    // SIGKILL: no chance to flush or clean up.
    first.0.kill().expect("kill -9");
    first.0.wait().expect("reaped");
    drop(first);

    let (mut second, url) = start_binary(&db, &ready_path(dir.path(), 2));
    let c = client(&url);
    let after = c.map().expect("map after restart");
    assert_eq!(after.version, before.version);
    assert_eq!(after.entries, before.entries);
    let summary = |map: &rdma_transport::coordinator::api::MapResponse| {
        map.nodes
            .iter()
            .map(|n| (n.id.clone(), n.tcp_addr.clone(), n.rdma.clone()))
            .collect::<Vec<_>>()
    };
    assert_eq!(summary(&after), summary(&before));
    assert_eq!(
        c.rdma_endpoint(&"n1".to_owned()).expect("endpoint"),
        endpoint
    );
    let hit = c.resolve(0x100_1000).expect("resolve");
    assert_eq!(hit.node.id, "n2");

    // The version keeps increasing from where it was.
    c.remove_range(0).expect("remove");
    assert!(c.map().expect("map").version > before.version);

    // SIGTERM: a clean exit with status 0.
    let status = Command::new("kill")
        .arg("-TERM")
        .arg(second.0.id().to_string())
        .status()
        .expect("kill -TERM runs");
    assert!(status.success());
    let deadline = Instant::now() + WAIT_LIMIT;
    let exit = loop {
        if let Some(exit) = second.0.try_wait().expect("try_wait") {
            break exit;
        }
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        std::thread::sleep(POLL_INTERVAL);
    };
    assert!(exit.success(), "exit after SIGTERM: {exit}");
}

#[test]
fn binary_refuses_to_run_without_key_or_insecure_and_derives_credentials() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_coordinator"))
        .arg("--db")
        .arg(dir.path().join("c.db"))
        .arg("--listen")
        .arg("127.0.0.1:0")
        .env_remove("RT_CLUSTER_KEY_FILE")
        .output()
        .expect("runs");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--insecure"), "{stderr}");

    let key_path = key_file(&dir.path().join("c.db"));
    let key = ClusterKey::from_hex(KEY_HEX).expect("key");
    for (args, expected) in [
        (vec!["--admin"], key.admin_credential()),
        (vec!["--client"], key.client_credential()),
        (
            vec!["--node", "n-1"],
            format!("node:n-1:{}", key.node_credential("n-1")),
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_coordinator"))
            .arg("credential")
            .arg("--cluster-key-file")
            .arg(&key_path)
            .args(&args)
            .output()
            .expect("runs");
        assert!(out.status.success(), "{args:?}: {out:?}");
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), expected);
    }
}
