//! State shared by the handlers: the store, the credentials and the lease.

use std::sync::Arc;

use crate::auth::Authenticator;
use crate::backend::{NodeRecord, Store};
use crate::clock::now_unix_ms;
use crate::metrics::Metrics;
use rdma_transport::coordinator::api::NodeInfo;

/// Cloned into every handler.
#[derive(Debug, Clone)]
pub(crate) struct AppState {
    store: Arc<dyn Store>,
    auth: Arc<Authenticator>,
    metrics: Arc<Metrics>,
    /// Set once the server stops: long polls answer at once.
    stopping: Arc<tokio::sync::watch::Sender<bool>>,
    lease_ms: u64,
    body_timeout_ms: u64,
}

impl AppState {
    pub fn new(
        store: Arc<dyn Store>,
        auth: Authenticator,
        lease_ms: u64,
        body_timeout_ms: u64,
    ) -> Self {
        Self {
            store,
            auth: Arc::new(auth),
            metrics: Arc::new(Metrics::new()),
            stopping: Arc::new(tokio::sync::watch::Sender::new(false)),
            lease_ms,
            body_timeout_ms,
        }
    }

    /// Who may do what.
    pub fn auth(&self) -> &Authenticator {
        &self.auth
    }

    /// How long a request body may take to arrive.
    pub fn body_timeout_ms(&self) -> u64 {
        self.body_timeout_ms
    }

    /// Tells the long polls that the server stops.
    pub fn stop_long_polls(&self) {
        self.stopping.send_replace(true);
    }

    /// Completes once the server stops (at once if it has).
    pub async fn stopping(&self) {
        let mut stopping = self.stopping.subscribe();
        // An error means the sender is gone: the state is being dropped.
        let _ = stopping.wait_for(|stopping| *stopping).await;
    }

    /// The Prometheus metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// The coordinator's state (SQLite or etcd).
    pub fn store(&self) -> &dyn Store {
        self.store.as_ref()
    }

    /// The API view of `record` now.
    pub fn info(&self, record: &NodeRecord) -> NodeInfo {
        record.to_info(now_unix_ms(), self.lease_ms)
    }
}
