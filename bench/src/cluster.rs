//! A throw-away local cluster on loopback: a coordinator on a temporary
//! database and K page-servers on ephemeral ports, torn down on drop.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use coordinator::{CoordinatorConfig, RunningCoordinator};
use page_server::{RunningServer, ServerConfig};
use rdma_transport::auth::ClusterKey;

/// The running pieces; dropping this stops them all.
pub struct LocalCluster {
    servers: Vec<RunningServer>,
    coordinator: Option<RunningCoordinator>,
    url: String,
    _db_dir: tempfile::TempDir,
}

impl LocalCluster {
    /// Starts a coordinator and `nodes` page-servers that together export
    /// `memory_bytes` (split evenly, contiguous GPA ranges from 0).
    /// `server_spin` is the page-servers' `spin_before_block`; `key` the
    /// cluster key they and the coordinator require (`None`: insecure).
    pub fn start(
        nodes: usize,
        memory_bytes: usize,
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
        let per_node =
            (memory_bytes / nodes).div_ceil(rdma_transport::PAGE_SIZE) * rdma_transport::PAGE_SIZE;
        let mut servers = Vec::with_capacity(nodes);
        for i in 0..nodes {
            let mut cfg = ServerConfig::new(format!("node-{i}"), per_node);
            cfg.gpa_base = (i * per_node) as u64;
            cfg.coordinator_url = Some(url.clone());
            cfg.spin_before_block = server_spin;
            cfg.cluster_key = key.clone();
            servers.push(
                page_server::spawn(cfg)
                    .with_context(|| format!("starting page-server node-{i}"))?,
            );
        }
        for s in &servers {
            s.wait_registered(Duration::from_secs(10))
                .context("page-server registration")?;
        }
        Ok(Self {
            servers,
            coordinator: Some(coordinator),
            url,
            _db_dir: db_dir,
        })
    }

    /// The coordinator's base URL.
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for s in self.servers.drain(..) {
            s.shutdown();
        }
        if let Some(c) = self.coordinator.take() {
            if let Err(err) = c.shutdown() {
                tracing::warn!(%err, "coordinator shutdown");
            }
        }
    }
}
