//! A throw-away local cluster on loopback: a coordinator on a temporary
//! database and K page-servers on ephemeral ports, torn down on drop.
//! With replicas, each range is held by several page-servers (see
//! `replicas::layout`); one can be stopped abruptly and started again.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use coordinator::{CoordinatorConfig, RunningCoordinator};
use page_server::{ExportedRange, RunningServer, ServerConfig};
use rdma_transport::auth::ClusterKey;
use rdma_transport::coordinator::api::RangeState;
use rdma_transport::coordinator::{CoordinatorClient, Credential};

use crate::replicas::Placement;

/// The running pieces; dropping this stops them all.
pub struct LocalCluster {
    /// Each page-server's configuration and, unless stopped, the server.
    servers: Vec<(ServerConfig, Option<RunningServer>)>,
    coordinator: Option<RunningCoordinator>,
    url: String,
    key: Option<ClusterKey>,
    _db_dir: tempfile::TempDir,
}

impl LocalCluster {
    /// Starts a coordinator and one page-server per placement, each
    /// registering its range once the one before it has registered (so the
    /// first of a replica group is its primary).
    pub fn start_placed(
        placements: &[Placement],
        server_spin: Duration,
        key: Option<ClusterKey>,
    ) -> anyhow::Result<Self> {
        let db_dir =
            tempfile::tempdir().context("temporary directory for the coordinator database")?;
        let mut config = CoordinatorConfig::new(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            db_dir.path().join("coordinator.db"),
        );
        // The same key as the page-servers: they register with their node
        // credentials, the manager reads the map with the client one.
        config.cluster_key = key.clone();
        let coordinator = coordinator::spawn(config).context("starting the coordinator")?;
        let url = coordinator.url();
        let mut cluster = Self {
            servers: Vec::with_capacity(placements.len()),
            coordinator: Some(coordinator),
            url,
            key,
            _db_dir: db_dir,
        };
        for p in placements {
            let mut cfg = ServerConfig::new(p.node_id.clone(), p.memory_bytes());
            cfg.set_ranges(
                p.ranges
                    .iter()
                    .map(|&(base, len)| ExportedRange::new(base, len as u64))
                    .collect(),
            );
            cfg.coordinator_url = Some(cluster.url.clone());
            cfg.spin_before_block = server_spin;
            cfg.cluster_key = cluster.key.clone();
            let server = start_server(cfg.clone())?;
            cluster.servers.push((cfg, Some(server)));
        }
        Ok(cluster)
    }

    /// Sets how long every running page-server's connection threads poll
    /// their sockets before they block (each takes it after its next
    /// request).
    pub fn set_server_spin(&self, spin: Duration) {
        for server in self.servers.iter().filter_map(|(_, s)| s.as_ref()) {
            server.set_spin_before_block(spin);
        }
    }

    /// The coordinator's base URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// A read-only client of the coordinator (to watch the map).
    pub fn coordinator_client(&self) -> anyhow::Result<CoordinatorClient> {
        let credential = match &self.key {
            Some(key) => Credential::Client { key: key.clone() },
            None => Credential::None,
        };
        CoordinatorClient::with_credential(&self.url, &credential, Duration::from_secs(5))
            .context("a client of the local coordinator")
    }

    /// READ answers the running page-servers have sent out of their region
    /// with the page's sum kept since its write (no copy), since they
    /// started (`ServerStats::reads_with_kept_sums`).
    pub fn reads_with_kept_sums(&self) -> u64 {
        self.servers
            .iter()
            .filter_map(|(_, server)| server.as_ref())
            .map(|s| s.stats().reads_with_kept_sums)
            .sum()
    }

    /// Takes page-server `node_id` out of the cluster, still running, for
    /// the caller to stop (`RunningServer::abort`). `None` when there is no
    /// such node or it is stopped already.
    pub fn take_server(&mut self, node_id: &str) -> Option<RunningServer> {
        self.servers
            .iter_mut()
            .find(|(cfg, _)| cfg.node_id == node_id)
            .and_then(|(_, server)| server.take())
    }

    /// Starts again every page-server taken out: same id, range and key,
    /// new memory (so the coordinator sees a new epoch) and a new port.
    /// Returns how many were started.
    pub fn restart_stopped(&mut self) -> anyhow::Result<usize> {
        let mut started = 0;
        for (cfg, server) in &mut self.servers {
            if server.is_none() {
                *server = Some(start_server(cfg.clone())?);
                started += 1;
            }
        }
        Ok(started)
    }

    /// With one replica per range, a restarted page-server's ranges are
    /// lost (nothing to recover them from): re-initialises every lost
    /// range, as an operator would, so the run after can fill it again.
    /// Returns how many were.
    pub fn reinitialise_lost(&self) -> anyhow::Result<usize> {
        let credential = match &self.key {
            Some(key) => Credential::Admin { key: key.clone() },
            None => Credential::None,
        };
        let admin =
            CoordinatorClient::with_credential(&self.url, &credential, Duration::from_secs(5))
                .context("an operator client of the local coordinator")?;
        let map = admin.map().context("reading the map")?;
        let mut done = 0;
        for e in map.entries.iter().filter(|e| e.state == RangeState::Lost) {
            admin
                .reinitialise_range(e.gpa_start)
                .with_context(|| format!("re-initialising the range at {:#x}", e.gpa_start))?;
            done += 1;
        }
        Ok(done)
    }
}

/// Starts one page-server and waits for its registration: a few
/// milliseconds here, but up to a minute inside the SoftRoCE VM under
/// valgrind (instruction counts of the RDMA path), where 10 s was too short.
fn start_server(cfg: ServerConfig) -> anyhow::Result<RunningServer> {
    let node = cfg.node_id.clone();
    let server = page_server::spawn(cfg).with_context(|| format!("starting page-server {node}"))?;
    server
        .wait_registered(Duration::from_secs(60))
        .with_context(|| format!("page-server {node} registration"))?;
    Ok(server)
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for (_, s) in self.servers.drain(..) {
            if let Some(s) = s {
                s.shutdown();
            }
        }
        if let Some(c) = self.coordinator.take() {
            if let Err(err) = c.shutdown() {
                tracing::warn!(%err, "coordinator shutdown");
            }
        }
    }
}

/// Pins the local cluster's page-server connection threads (they run in
/// this process, named `page-conn-*`) to `cpus` (empty: every CPU, i.e. not
/// pinned).
pub(crate) fn pin_local_servers(cpus: &[usize]) {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let all: Vec<usize> = (0..ncpu).collect();
    let cpus = if cpus.is_empty() { &all[..] } else { cpus };
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus.iter().filter(|&&c| c < libc::CPU_SETSIZE as usize) {
        // SAFETY: cpu < CPU_SETSIZE, inside the set's bounds.
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    for task in tasks.flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let Some(tid) = task
            .file_name()
            .to_str()
            .and_then(|t| t.parse::<libc::pid_t>().ok())
        else {
            continue;
        };
        if comm.starts_with("page-conn") {
            // SAFETY: `set` is a live cpu_set_t of the size passed.
            let ret = unsafe {
                libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
            };
            if ret != 0 {
                tracing::warn!(tid, "cannot place a page-server thread");
            }
        }
    }
}
