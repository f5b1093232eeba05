//! [`Store`] in an etcd cluster: coordinators keep no state of their own,
//! so several can serve the same cluster and any of them answers any
//! request.
//!
//! - Keys live under a prefix (see [`keys`]).
//! - Every write reads what it needs at one revision, decides in memory
//!   with the same rules as the SQLite store ([`model`]), and commits in
//!   one etcd transaction that holds only if the map has not changed since
//!   that read (the `version` key's mod revision is compared). Two
//!   coordinators claiming overlapping ranges at once: one transaction
//!   commits, the other finds the map changed, reads again and refuses the
//!   overlap. Conflicts are retried, bounded by the request timeout.
//! - The map version is the etcd revision of the last map change.
//! - A node's liveness is an etcd lease: registering grants one, with the
//!   node's `alive` key attached; each heartbeat keeps it alive. When the
//!   node stops, the lease expires and the key goes away: the node is
//!   reported `alive: false`, its registration and ranges stay.
//! - A watch on the `version` key tells long polls of the map that it
//!   changed, whichever coordinator changed it.

mod hedge;
mod keys;
mod members;
mod model;
#[cfg(test)]
mod model_tests;
mod watch;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{Client, Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, Txn, TxnOp};
use rdma_transport::coordinator::api::{MapEntry, NodeRegistration, RangeRequest, RdmaEndpoint};
use serde::de::DeserializeOwned;
use tokio::time::Instant;

use self::keys::{Key, Keys};
use self::model::{AliveValue, Change, NodeValue, State, Write};
use super::{AddOutcome, NodeRecord, ReplicaOp, Snapshot, Store, StoreError};
use crate::config::EtcdConfig;
use crate::store::StoreLimits;

/// A write that lost this many races in a row gives up (503).
const MAX_ATTEMPTS: u32 = 64;

/// The etcd backend.
pub(crate) struct EtcdBackend {
    client: Client,
    keys: Keys,
    limits: StoreLimits,
    lease_ttl_s: i64,
    request_timeout: Duration,
    versions: Arc<tokio::sync::watch::Sender<u64>>,
    /// The prefix's generation (`MapResponse::generation`).
    generation: u64,
    /// Changes each time the prober changes the balance.
    balance: tokio::sync::watch::Receiver<u64>,
    follower: tokio::task::JoinHandle<()>,
    /// Keeps members that do not answer out of the client's balance.
    prober: Option<tokio::task::JoinHandle<()>>,
}

impl std::fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("prefix", &self.keys.prefix())
            .field("lease_ttl_s", &self.lease_ttl_s)
            .finish_non_exhaustive()
    }
}

impl Drop for EtcdBackend {
    fn drop(&mut self) {
        self.follower.abort();
        if let Some(prober) = &self.prober {
            prober.abort();
        }
    }
}

/// Any etcd failure: the cluster is unreachable, has no leader, or timed
/// out. The request may succeed later or through another member.
fn unavailable(error: etcd_client::Error) -> StoreError {
    StoreError::Unavailable(format!("etcd: {error}"))
}

fn decode<T: DeserializeOwned>(key: &str, value: &[u8]) -> Result<T, StoreError> {
    serde_json::from_slice(value)
        .map_err(|error| StoreError::Corrupt(format!("etcd key {key:?}: {error}")))
}

fn encode<T: serde::Serialize>(value: &T) -> Result<Vec<u8>, StoreError> {
    serde_json::to_vec(value).map_err(|error| StoreError::Backend(format!("encoding: {error}")))
}

impl EtcdBackend {
    /// Connects to `config.endpoints` and starts following the version.
    /// Nodes get leases of `lease_ms` (rounded up to whole seconds; etcd
    /// may raise very short ones to its minimum).
    ///
    /// # Errors
    /// [`StoreError::Backend`] for an empty endpoint list or prefix,
    /// [`StoreError::Unavailable`] when no member answers.
    pub async fn connect(
        config: &EtcdConfig,
        limits: StoreLimits,
        lease_ms: u64,
    ) -> Result<Self, StoreError> {
        if config.endpoints.is_empty() || config.endpoints.iter().any(String::is_empty) {
            return Err(StoreError::Backend("no etcd endpoints given".to_owned()));
        }
        if config.prefix.is_empty() {
            return Err(StoreError::Backend(
                "the etcd key prefix must not be empty".to_owned(),
            ));
        }
        let request_timeout = Duration::from_millis(config.request_timeout_ms.max(1));
        let options = ConnectOptions::new()
            .with_timeout(request_timeout)
            .with_connect_timeout(request_timeout)
            .with_keep_alive(Duration::from_secs(1), request_timeout)
            .with_keep_alive_while_idle(true);
        let client = tokio::time::timeout(
            request_timeout,
            Client::connect(config.endpoints.clone(), Some(options.clone())),
        )
        .await
        .map_err(|_| StoreError::Unavailable("etcd: connect timed out".to_owned()))?
        .map_err(unavailable)?;
        let keys = Keys::new(&config.prefix);
        let (balance_changes, balance) = tokio::sync::watch::channel(0);
        let prober = (config.endpoints.len() > 1).then(|| {
            tokio::spawn(members::keep_healthy_members(
                client.clone(),
                config.endpoints.clone(),
                options,
                keys.version(),
                balance_changes,
            ))
        });
        let mut backend = Self {
            client,
            keys,
            limits,
            lease_ttl_s: i64::try_from(lease_ms.div_ceil(1000).max(1)).unwrap_or(i64::MAX),
            request_timeout,
            versions: Arc::new(tokio::sync::watch::Sender::new(0)),
            generation: 0,
            balance: balance.clone(),
            follower: tokio::spawn(async {}),
            prober,
        };
        backend.generation = backend.read_generation().await?;
        // One read proves the cluster answers and seeds the version.
        let state = backend.read_state().await?;
        backend.publish(state.version);
        backend.follower = tokio::spawn(watch::follow_versions(
            backend.client.clone(),
            backend.keys.version(),
            Arc::clone(&backend.versions),
            balance,
        ));
        Ok(backend)
    }

    /// The prefix's generation: written, random, by the first coordinator
    /// that finds none (every coordinator on the prefix then reads the same
    /// one), and read back.
    async fn read_generation(&self) -> Result<u64, StoreError> {
        let key = self.keys.generation();
        self.retrying(|| {
            let mut kv = self.client.kv_client();
            let key = key.clone();
            async move {
                let fresh = (rdma_transport::ids::random_u64() | 1).to_string();
                let txn = Txn::new()
                    .when(vec![Compare::create_revision(
                        key.clone(),
                        CompareOp::Equal,
                        0,
                    )])
                    .and_then(vec![TxnOp::put(key.clone(), fresh, None)]);
                kv.txn(txn).await.map_err(unavailable)?;
                let response = kv.get(key.clone(), None).await.map_err(unavailable)?;
                let value = response
                    .kvs()
                    .first()
                    .and_then(|kv| kv.value_str().ok())
                    .and_then(|v| v.parse::<u64>().ok())
                    .ok_or_else(|| {
                        StoreError::Corrupt(format!("etcd key {key} does not hold a u64"))
                    })?;
                Ok(value)
            }
        })
        .await
    }

    fn publish(&self, version: u64) {
        watch::publish(&self.versions, version);
    }

    /// Runs `attempt` until it succeeds, fails with something other than
    /// [`StoreError::Unavailable`], or the request timeout passes (an
    /// attempt still running then is dropped: one that makes several etcd
    /// requests, each with the request timeout, cannot stretch it). An
    /// attempt still running after half the timeout, or when a member
    /// leaves the balance, is run again alongside ([`hedge::hedged`]):
    /// `attempt` must be safe to run twice.
    async fn retrying<T, F, Fut>(&self, mut attempt: F) -> Result<T, StoreError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        let deadline = Instant::now() + self.request_timeout;
        let hedge_after = self.request_timeout / 2;
        let mut pause = Duration::from_millis(5);
        loop {
            let mut balance = self.balance.clone();
            balance.borrow_and_update();
            let again = async {
                tokio::select! {
                    () = tokio::time::sleep(hedge_after) => {}
                    () = watch::changed(&mut balance) => {}
                }
            };
            let outcome = tokio::time::timeout_at(deadline, hedge::hedged(&mut attempt, again))
                .await
                .unwrap_or_else(|_| {
                    Err(StoreError::Unavailable(
                        "etcd: no answer within the request timeout".to_owned(),
                    ))
                });
            match outcome {
                Err(StoreError::Unavailable(why)) if Instant::now() + pause < deadline => {
                    tracing::debug!(%why, "etcd request failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                other => return other,
            }
        }
    }

    /// Everything under the prefix, read at one revision.
    async fn read_state(&self) -> Result<State, StoreError> {
        let response = self
            .retrying(|| {
                let mut kv = self.client.kv_client();
                let prefix = self.keys.prefix().to_owned();
                async move {
                    kv.get(prefix, Some(GetOptions::new().with_prefix()))
                        .await
                        .map_err(unavailable)
                }
            })
            .await?;
        let mut state = State::default();
        for kv in response.kvs() {
            let Ok(key) = kv.key_str() else { continue };
            match self.keys.parse(key) {
                Some(Key::Version) => {
                    state.version = u64::try_from(kv.mod_revision()).unwrap_or(0);
                }
                Some(Key::Generation) => {}
                Some(Key::Node(id)) => {
                    state
                        .nodes
                        .insert(id.to_owned(), decode::<NodeValue>(key, kv.value())?);
                }
                Some(Key::Alive(id)) => {
                    state
                        .alive
                        .insert(id.to_owned(), decode::<AliveValue>(key, kv.value())?);
                }
                Some(Key::Range(gpa_start)) => {
                    state.ranges.insert(gpa_start, decode(key, kv.value())?);
                }
                None => tracing::debug!(key, "unknown etcd key ignored"),
            }
        }
        Ok(state)
    }

    /// The etcd operations of `change`, the version bump included: the
    /// version key then holds `token`, which names this write.
    fn operations(&self, change: &Change, token: &str) -> Result<Vec<TxnOp>, StoreError> {
        let mut ops = Vec::with_capacity(change.writes.len() + 1);
        for write in &change.writes {
            ops.push(match write {
                Write::PutNode(id, value) => TxnOp::put(self.keys.node(id), encode(value)?, None),
                Write::DeleteNode(id) => TxnOp::delete(self.keys.node(id), None),
                Write::PutAlive(id, value) => TxnOp::put(
                    self.keys.alive(id),
                    encode(value)?,
                    Some(PutOptions::new().with_lease(value.lease_id)),
                ),
                Write::DeleteAlive(id) => TxnOp::delete(self.keys.alive(id), None),
                Write::PutRange(gpa_start, value) => {
                    TxnOp::put(self.keys.range(*gpa_start), encode(value)?, None)
                }
                Write::DeleteRange(gpa_start) => TxnOp::delete(self.keys.range(*gpa_start), None),
            });
        }
        if change.bump {
            ops.push(TxnOp::put(self.keys.version(), token, None));
        }
        Ok(ops)
    }

    /// Reads the state, lets `plan` decide, and commits its change if the
    /// map did not change meanwhile; otherwise reads again (bounded).
    /// Returns the state after the change (its version included) and what
    /// `plan` returned.
    async fn transact<T>(
        &self,
        mut plan: impl FnMut(&State) -> Result<(Change, T), StoreError>,
    ) -> Result<(State, T), StoreError> {
        let deadline = Instant::now() + self.request_timeout;
        for attempt in 0..MAX_ATTEMPTS {
            let mut state = self.read_state().await?;
            let (change, value) = plan(&state)?;
            if change.writes.is_empty() && !change.bump {
                return Ok((state, value));
            }
            let guard = i64::try_from(state.version).unwrap_or(i64::MAX);
            let token = format!("{:016x}", rdma_transport::ids::random_u64());
            let txn = Txn::new()
                .when(vec![Compare::mod_revision(
                    self.keys.version(),
                    CompareOp::Equal,
                    guard,
                )])
                .and_then(self.operations(&change, &token)?);
            let mut kv = self.client.kv_client();
            let committed_at = match kv.txn(txn).await {
                Ok(response) if response.succeeded() => response.header().map(|h| h.revision()),
                Ok(_) => None,
                // The outcome is unknown (the member died, or lost its
                // quorum). A map change names itself in the version key:
                // if that holds our token, it committed. Any other write
                // (a registration rewritten as it was) is simply made
                // again.
                Err(error) => {
                    tracing::debug!(%error, "etcd transaction failed; checking whether it committed");
                    if Instant::now() >= deadline {
                        return Err(unavailable(error));
                    }
                    if change.bump {
                        self.committed_revision(&token).await?
                    } else {
                        None
                    }
                }
            };
            if let Some(revision) = committed_at {
                if change.bump {
                    state.version = u64::try_from(revision).unwrap_or(0);
                    self.publish(state.version);
                }
                state.apply(&change);
                return Ok((state, value));
            }
            tracing::debug!(attempt, "the map changed during a write; reading it again");
            // Spread the retries of coordinators racing for the same key.
            let jitter_ms = u64::from(std::process::id() % 7) + u64::from(attempt % 5);
            tokio::time::sleep(Duration::from_millis(1 + jitter_ms)).await;
        }
        Err(StoreError::Unavailable(format!(
            "the map kept changing during the write ({MAX_ATTEMPTS} attempts)"
        )))
    }

    /// The revision of the write named `token` if it is the last map
    /// change; `None` when another one is (or none committed).
    async fn committed_revision(&self, token: &str) -> Result<Option<i64>, StoreError> {
        let response = self
            .retrying(|| {
                let mut kv = self.client.kv_client();
                let key = self.keys.version();
                async move { kv.get(key, None).await.map_err(unavailable) }
            })
            .await?;
        Ok(response
            .kvs()
            .first()
            .filter(|kv| kv.value() == token.as_bytes())
            .map(|kv| kv.mod_revision()))
    }

    /// A new lease for a node.
    async fn grant_lease(&self) -> Result<i64, StoreError> {
        let ttl = self.lease_ttl_s;
        let response = self
            .retrying(|| {
                let mut lease = self.client.lease_client();
                async move { lease.grant(ttl, None).await.map_err(unavailable) }
            })
            .await?;
        Ok(response.id())
    }

    /// Renews `lease_id`; false when it has expired.
    async fn renew_lease(&self, lease_id: i64) -> Result<bool, StoreError> {
        let mut lease = self.client.lease_client();
        let (mut keeper, mut stream) = lease.keep_alive(lease_id).await.map_err(unavailable)?;
        keeper.keep_alive().await.map_err(unavailable)?;
        let answer = tokio::time::timeout(self.request_timeout, stream.message())
            .await
            .map_err(|_| StoreError::Unavailable("etcd: lease renewal timed out".to_owned()))?
            .map_err(unavailable)?;
        Ok(answer.is_some_and(|a| a.ttl() > 0))
    }

    /// A node key and its liveness key, read directly.
    async fn read_node(&self, id: &str) -> Result<Option<NodeRecord>, StoreError> {
        Ok(self.read_node_alive(id).await?.map(|(record, ..)| record))
    }

    /// A node key and its liveness key, read directly: the node's record
    /// and, while its lease lives, its liveness value.
    async fn read_node_alive(
        &self,
        id: &str,
    ) -> Result<Option<(NodeRecord, Option<AliveValue>, i64)>, StoreError> {
        let mut state = State::default();
        let mut kv = self.client.kv_client();
        let node_key = self.keys.node(id);
        let node = kv.get(node_key.clone(), None).await.map_err(unavailable)?;
        let Some(found) = node.kvs().first() else {
            return Ok(None);
        };
        let node_revision = found.mod_revision();
        state
            .nodes
            .insert(id.to_owned(), decode(&node_key, found.value())?);
        let alive_key = self.keys.alive(id);
        let alive = kv.get(alive_key.clone(), None).await.map_err(unavailable)?;
        if let Some(found) = alive.kvs().first() {
            state
                .alive
                .insert(id.to_owned(), decode(&alive_key, found.value())?);
        }
        let alive = state.alive.get(id).cloned();
        Ok(state.node(id).map(|record| (record, alive, node_revision)))
    }
}

#[async_trait]
impl Store for EtcdBackend {
    async fn snapshot(&self) -> Result<Snapshot, StoreError> {
        let state = self.read_state().await?;
        Ok(Snapshot {
            version: state.version,
            entries: state.entries()?,
            nodes: state.node_records(),
        })
    }

    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        Ok(self.read_state().await?.node_records())
    }

    async fn node(&self, id: &str) -> Result<Option<NodeRecord>, StoreError> {
        self.retrying(|| self.read_node(id)).await
    }

    async fn upsert_node(
        &self,
        id: &str,
        registration: &NodeRegistration,
        now_unix_ms: u64,
    ) -> Result<NodeRecord, StoreError> {
        let lease_id = self.grant_lease().await?;
        let alive = AliveValue {
            last_seen_unix_ms: now_unix_ms,
            lease_id,
        };
        let (state, ()) = self
            .transact(|state| {
                let mut change = state.upsert_node(id, registration, now_unix_ms, self.limits)?;
                change
                    .writes
                    .push(Write::PutAlive(id.to_owned(), alive.clone()));
                Ok((change, ()))
            })
            .await?;
        state
            .node(id)
            .ok_or_else(|| StoreError::Corrupt(format!("node {id:?} vanished")))
    }

    async fn heartbeat(
        &self,
        id: &str,
        epoch: Option<u64>,
        now_unix_ms: u64,
    ) -> Result<Option<NodeRecord>, StoreError> {
        self.retrying(|| async move {
            // The node and its liveness key in two reads; the lease to
            // renew is the one the liveness key names.
            let Some((record, alive, node_revision)) = self.read_node_alive(id).await? else {
                return Ok(None);
            };
            record.check_heartbeat(epoch)?;
            let mut kv = self.client.kv_client();
            let alive_key = self.keys.alive(id);
            let lease_id = match alive.map(|a| a.lease_id) {
                Some(lease_id) if self.renew_lease(lease_id).await? => lease_id,
                _ => self.grant_lease().await?,
            };
            let alive = AliveValue {
                last_seen_unix_ms: now_unix_ms,
                lease_id,
            };
            // Only while the node is registered as read: a removal or
            // another process's registration may race (then read again).
            let txn = Txn::new()
                .when(vec![Compare::mod_revision(
                    self.keys.node(id),
                    CompareOp::Equal,
                    node_revision,
                )])
                .and_then(vec![TxnOp::put(
                    alive_key,
                    encode(&alive)?,
                    Some(PutOptions::new().with_lease(lease_id)),
                )]);
            let response = kv.txn(txn).await.map_err(unavailable)?;
            if !response.succeeded() {
                // Retried by `retrying`, which reads the node again.
                return Err(StoreError::Unavailable(format!(
                    "node {id:?} changed during its heartbeat"
                )));
            }
            Ok(Some(NodeRecord {
                last_seen_unix_ms: now_unix_ms,
                lease_alive: Some(true),
                ..record
            }))
        })
        .await
    }

    async fn set_rdma_endpoint(
        &self,
        id: &str,
        endpoint: &RdmaEndpoint,
    ) -> Result<Option<NodeRecord>, StoreError> {
        let (state, known) = self
            .transact(|state| match state.set_rdma_endpoint(id, endpoint) {
                Some(change) => Ok((change, true)),
                None => Ok((Change::default(), false)),
            })
            .await?;
        Ok(if known { state.node(id) } else { None })
    }

    async fn delete_node(&self, id: &str) -> Result<bool, StoreError> {
        let (_, known) = self
            .transact(|state| match state.delete_node(id) {
                Some(change) => Ok((change, true)),
                None => Ok((Change::default(), false)),
            })
            .await?;
        Ok(known)
    }

    async fn add_range(
        &self,
        request: &RangeRequest,
    ) -> Result<(MapEntry, AddOutcome), StoreError> {
        let (state, outcome) = self
            .transact(|state| {
                let (change, outcome, _) = state.add_range(request, self.limits)?;
                Ok((change, outcome))
            })
            .await?;
        let range = state
            .stored_range(request.gpa_start)?
            .ok_or(StoreError::NoRange(request.gpa_start))?;
        Ok((range.to_entry()?, outcome))
    }

    async fn remove_range(&self, gpa_start: u64, holder: Option<&str>) -> Result<bool, StoreError> {
        let (_, removed) = self
            .transact(|state| match state.remove_range(gpa_start, holder)? {
                Some(change) => Ok((change, true)),
                None => Ok((Change::default(), false)),
            })
            .await?;
        Ok(removed)
    }

    async fn reinitialise_range(&self, gpa_start: u64) -> Result<MapEntry, StoreError> {
        let (state, ()) = self
            .transact(|state| Ok((state.reinitialise_range(gpa_start)?, ())))
            .await?;
        state
            .stored_range(gpa_start)?
            .ok_or(StoreError::NoRange(gpa_start))?
            .to_entry()
    }

    async fn resolve(&self, gpa: u64) -> Result<Option<(u64, MapEntry, NodeRecord)>, StoreError> {
        let state = self.read_state().await?;
        Ok(state
            .resolve(gpa)?
            .map(|(entry, node)| (state.version, entry, node)))
    }

    async fn change_replica(
        &self,
        gpa_start: u64,
        node_id: &str,
        op: ReplicaOp,
    ) -> Result<(u64, MapEntry), StoreError> {
        let (state, ()) = self
            .transact(|state| Ok((state.change_replica(gpa_start, node_id, op)?, ())))
            .await?;
        let entry = state
            .stored_range(gpa_start)?
            .ok_or(StoreError::NoRange(gpa_start))?
            .to_entry()?;
        Ok((state.version, entry))
    }

    fn versions(&self) -> tokio::sync::watch::Receiver<u64> {
        self.versions.subscribe()
    }

    fn generation(&self) -> u64 {
        self.generation
    }
}
