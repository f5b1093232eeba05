//! [`Store`] over the embedded SQLite file: each call runs on a blocking
//! thread (SQLite may wait on fsync) under one mutex, and every write
//! publishes the new version to the in-process watchers.

use std::path::Path;
use std::sync::Arc;

use async_trait::async_trait;
use parking_lot::Mutex;
use rdma_transport::coordinator::api::{MapEntry, NodeRegistration, RangeRequest, RdmaEndpoint};
use tokio::sync::watch;

use super::{AddOutcome, NodeRecord, ReplicaOp, Snapshot, Store, StoreError};
use crate::store::{SqliteStore, StoreLimits};

/// The SQLite store behind a mutex, with a version channel.
#[derive(Debug)]
pub(crate) struct SqliteBackend {
    store: Arc<Mutex<SqliteStore>>,
    version_tx: Arc<watch::Sender<u64>>,
    generation: u64,
}

impl SqliteBackend {
    /// Opens (creating if needed) the database at `path` with `limits`.
    /// Blocking: call it from a blocking thread.
    pub fn open(path: &Path, limits: StoreLimits) -> Result<Self, StoreError> {
        let mut store = SqliteStore::open(path)?;
        store.set_limits(limits);
        let version = store.version()?;
        let generation = store.generation()?;
        Ok(Self {
            store: Arc::new(Mutex::new(store)),
            version_tx: Arc::new(watch::Sender::new(version)),
            generation,
        })
    }

    /// Runs `op` on the store on a blocking thread, holding the mutex only
    /// for `op`. With `publish`, the version after `op` is sent to the
    /// watchers (also when `op` failed: nothing changed then, and the
    /// watchers only wake for a greater version).
    async fn run<T, F>(&self, publish: bool, op: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&mut SqliteStore) -> Result<T, StoreError> + Send + 'static,
    {
        let store = Arc::clone(&self.store);
        let version_tx = Arc::clone(&self.version_tx);
        let joined = tokio::task::spawn_blocking(move || {
            let mut store = store.lock();
            let result = op(&mut store);
            if publish {
                match store.version() {
                    Ok(version) => {
                        version_tx.send_if_modified(|current| {
                            let newer = version > *current;
                            if newer {
                                *current = version;
                            }
                            newer
                        });
                    }
                    Err(error) => tracing::warn!(%error, "cannot read the map version"),
                }
            }
            result
        })
        .await;
        joined.map_err(|join_error| {
            StoreError::Backend(format!("database task failed: {join_error}"))
        })?
    }
}

#[async_trait]
impl Store for SqliteBackend {
    async fn snapshot(&self) -> Result<Snapshot, StoreError> {
        self.run(false, SqliteStore::snapshot).await
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        self.run(false, |store| store.nodes()).await
    }

    async fn node(&self, id: &str) -> Result<Option<NodeRecord>, StoreError> {
        let id = id.to_owned();
        self.run(false, move |store| store.node(&id)).await
    }

    async fn upsert_node(
        &self,
        id: &str,
        registration: &NodeRegistration,
        now_unix_ms: u64,
    ) -> Result<NodeRecord, StoreError> {
        let id = id.to_owned();
        let registration = registration.clone();
        self.run(true, move |store| {
            store.upsert_node(&id, &registration, now_unix_ms)
        })
        .await
    }

    async fn heartbeat(
        &self,
        id: &str,
        epoch: Option<u64>,
        now_unix_ms: u64,
    ) -> Result<Option<NodeRecord>, StoreError> {
        let id = id.to_owned();
        self.run(false, move |store| store.heartbeat(&id, epoch, now_unix_ms))
            .await
    }

    async fn set_rdma_endpoint(
        &self,
        id: &str,
        endpoint: &RdmaEndpoint,
    ) -> Result<Option<NodeRecord>, StoreError> {
        let id = id.to_owned();
        let endpoint = endpoint.clone();
        self.run(true, move |store| store.set_rdma_endpoint(&id, &endpoint))
            .await
    }

    async fn delete_node(&self, id: &str) -> Result<bool, StoreError> {
        let id = id.to_owned();
        self.run(true, move |store| store.delete_node(&id)).await
    }

    async fn add_range(
        &self,
        request: &RangeRequest,
    ) -> Result<(MapEntry, AddOutcome), StoreError> {
        let request = request.clone();
        self.run(true, move |store| store.add_range(&request)).await
    }

    async fn remove_range(&self, gpa_start: u64, holder: Option<&str>) -> Result<bool, StoreError> {
        let holder = holder.map(str::to_owned);
        self.run(true, move |store| {
            store.remove_range(gpa_start, holder.as_deref())
        })
        .await
    }

    async fn reinitialise_range(&self, gpa_start: u64) -> Result<MapEntry, StoreError> {
        self.run(true, move |store| store.reinitialise_range(gpa_start))
            .await
    }

    async fn resolve(&self, gpa: u64) -> Result<Option<(u64, MapEntry, NodeRecord)>, StoreError> {
        self.run(false, move |store| store.resolve(gpa)).await
    }

    async fn change_replica(
        &self,
        gpa_start: u64,
        node_id: &str,
        op: ReplicaOp,
    ) -> Result<(u64, MapEntry), StoreError> {
        let node_id = node_id.to_owned();
        self.run(true, move |store| match op {
            ReplicaOp::MarkStale => store.mark_replica_stale(gpa_start, &node_id),
            ReplicaOp::BeginRecovery { epoch } => store.begin_recovery(gpa_start, &node_id, epoch),
            ReplicaOp::FinishRecovery {
                recovery_seq,
                epoch,
            } => store.finish_recovery(gpa_start, &node_id, recovery_seq, epoch),
        })
        .await
    }

    fn versions(&self) -> watch::Receiver<u64> {
        self.version_tx.subscribe()
    }

    fn generation(&self) -> u64 {
        self.generation
    }
}
