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
