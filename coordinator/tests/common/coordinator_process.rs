//! Coordinator processes (the binary) on an etcd cluster, with the
//! defaults of a deployment: 3 s leases, 1.5 s etcd request timeout.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use super::netns::Host;
use super::{POLL_INTERVAL, WAIT_LIMIT};

/// Leases: the coordinator's default (3 s).
pub const LEASE_MS: u64 = coordinator::CoordinatorConfig::DEFAULT_LEASE_MS;

/// The etcd request timeout: the default, well below the lease, as it
/// must be.
pub const ETCD_TIMEOUT_MS: u64 = coordinator::EtcdConfig::DEFAULT_REQUEST_TIMEOUT_MS;

/// A coordinator process; SIGKILLed and reaped when dropped.
pub struct CoordinatorProcess {
    child: Child,
    pub url: String,
    log: PathBuf,
}

impl Drop for CoordinatorProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl CoordinatorProcess {
    /// The coordinator binary with `--store etcd` on `endpoints`, here.
    pub fn start(endpoints: &[String], dir: &Path, name: &str) -> Self {
        Self::launch(endpoints, dir, name, None)
    }

    /// The same on `host` (its own network namespace), listening on the
    /// host's address.
    pub fn start_on(host: &Host, endpoints: &[String], dir: &Path, name: &str) -> Self {
        Self::launch(endpoints, dir, name, Some(host))
    }

    fn launch(endpoints: &[String], dir: &Path, name: &str, host: Option<&Host>) -> Self {
        let ready_file = dir.join(format!("{name}.addr"));
        let log_path = dir.join(format!("{name}.log"));
        let log = std::fs::File::create(&log_path).expect("log file");
        let binary = Path::new(env!("CARGO_BIN_EXE_coordinator"));
        let listen = format!(
            "{}:0",
            host.map_or_else(|| "127.0.0.1".to_owned(), Host::address)
        );
        let child = host
            .map_or_else(|| Command::new(binary), |host| host.command(binary))
            .args(["--listen", &listen, "--insecure", "--store", "etcd"])
            .arg(format!("--etcd-endpoints={}", endpoints.join(",")))
            .arg("--etcd-prefix=/test-cluster/")
            .arg(format!("--lease-ms={LEASE_MS}"))
            .arg(format!("--etcd-timeout-ms={ETCD_TIMEOUT_MS}"))
            .arg("--ready-file")
            .arg(&ready_file)
            // The etcd member prober says at info level when a member is back.
            .env("RUST_LOG", "warn,coordinator::backend::etcd::members=info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("coordinator binary starts");
        let mut process = Self {
            child,
            url: String::new(),
            log: log_path,
        };
        let deadline = Instant::now() + WAIT_LIMIT;
        process.url = loop {
            if let Ok(text) = std::fs::read_to_string(&ready_file) {
                break format!("http://{}", text.trim());
            }
            if let Ok(Some(status)) = process.child.try_wait() {
                panic!("coordinator {name} exited before listening: {status}");
            }
            assert!(
                Instant::now() < deadline,
                "coordinator {name} never listened"
            );
            std::thread::sleep(POLL_INTERVAL);
        };
        process
    }

    /// How many times its log says `what` so far.
    pub fn logged(&self, what: &str) -> usize {
        std::fs::read_to_string(&self.log).map_or(0, |text| text.matches(what).count())
    }

    /// `kill -9`.
    pub fn kill(&mut self) {
        self.child.kill().expect("SIGKILL");
        let _ = self.child.wait();
    }
}
