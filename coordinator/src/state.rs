//! State shared by the handlers: the store, the credentials and the lease.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::auth::Authenticator;
use crate::clock::now_unix_ms;
use crate::error::ApiError;
use crate::store::{NodeRecord, Store, StoreError};
use rdma_transport::coordinator::api::NodeInfo;

/// Cloned into every handler.
#[derive(Debug, Clone)]
pub(crate) struct AppState {
    store: Arc<Mutex<Store>>,
    auth: Arc<Authenticator>,
    lease_ms: u64,
    body_timeout_ms: u64,
}

impl AppState {
    pub fn new(store: Store, auth: Authenticator, lease_ms: u64, body_timeout_ms: u64) -> Self {
        Self {
            store: Arc::new(Mutex::new(store)),
            auth: Arc::new(auth),
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

    /// Runs `op` on the store on a blocking thread, so that SQLite (which
    /// may wait on fsync) never stalls the async executor. The mutex is held
    /// only for the duration of `op`.
    pub async fn db<T, F>(&self, op: F) -> Result<T, ApiError>
    where
        T: Send + 'static,
        F: FnOnce(&mut Store) -> Result<T, StoreError> + Send + 'static,
    {
        let store = Arc::clone(&self.store);
        let joined = tokio::task::spawn_blocking(move || op(&mut store.lock())).await;
        match joined {
            Ok(result) => result.map_err(ApiError::from),
            Err(join_error) => Err(ApiError::Internal(format!(
                "database task failed: {join_error}"
            ))),
        }
    }

    /// The API view of `record` now.
    pub fn info(&self, record: &NodeRecord) -> NodeInfo {
        record.to_info(now_unix_ms(), self.lease_ms)
    }
}
