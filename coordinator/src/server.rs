//! Binding the listener and serving until a shutdown signal.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;

use crate::auth::Authenticator;
use crate::backend::sqlite::SqliteBackend;
use crate::backend::Store;
use crate::config::StoreConfig;
use crate::config::{CoordinatorConfig, Limits};
use crate::connections::serve_connections;
use crate::error::ServeError;
use crate::routes::router;
use crate::state::AppState;
use crate::store::StoreLimits;

/// Largest accepted request body.
pub(crate) const MAX_BODY_BYTES: usize = 64 * 1024;

/// After the shutdown signal, requests in flight get this long to finish.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A coordinator whose database is open and whose socket is bound, not yet
/// serving. Lets the caller learn the bound address (e.g. after asking for
/// port 0) before serving.
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    local_addr: SocketAddr,
    router: Router,
    state: AppState,
    limits: Limits,
}

impl Server {
    /// Opens the database and binds `config.listen`.
    ///
    /// # Errors
    ///
    /// [`ServeError::InvalidConfig`] for an empty token or a zero limit,
    /// [`ServeError::OpenStore`] and [`ServeError::Bind`] as named.
    pub async fn bind(config: CoordinatorConfig) -> Result<Self, ServeError> {
        check(&config)?;
        let limits = config.limits;
        let store = open_store(&config).await?;
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| ServeError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let local_addr = listener.local_addr().map_err(|source| ServeError::Bind {
            addr: config.listen,
            source,
        })?;
        let store_description = describe_store(&config);
        let auth = Authenticator::new(config.cluster_key, config.token);
        if !auth.is_keyed() {
            tracing::warn!(
                "no cluster key: insecure coordinator, anyone who can reach it reads every node \
                 address and (without --token) can re-register any node and take its traffic"
            );
        }
        let keyed = auth.is_keyed();
        let state = AppState::new(store, auth, config.lease_ms, limits.body_timeout_ms);
        tracing::info!(
            %local_addr,
            store = %store_description,
            lease_ms = config.lease_ms,
            keyed,
            ?limits,
            "coordinator listening"
        );
        Ok(Self {
            listener,
            local_addr,
            router: router(state.clone()),
            state,
            limits,
        })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves until `shutdown` completes, then lets requests in flight finish
    /// (at most a few seconds) and returns.
    ///
    /// # Errors
    ///
    /// [`ServeError::Serve`] when the listener fails.
    pub async fn serve<F>(self, shutdown: F) -> Result<(), ServeError>
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let state = self.state;
        let shutdown = async move {
            shutdown.await;
            state.stop_long_polls();
        };
        serve_connections(self.listener, self.router, self.limits, shutdown).await;
        Ok(())
    }
}

fn store_limits(limits: &Limits) -> StoreLimits {
    StoreLimits {
        max_nodes: limits.max_nodes,
        max_ranges: limits.max_ranges,
        max_ranges_per_node: limits.max_ranges_per_node,
        max_replicas: limits.max_replicas,
    }
}

/// Opens the configured backend.
async fn open_store(config: &CoordinatorConfig) -> Result<Arc<dyn Store>, ServeError> {
    let limits = store_limits(&config.limits);
    match &config.store {
        StoreConfig::Sqlite => {
            let db_path = config.db_path.clone();
            let backend =
                tokio::task::spawn_blocking(move || SqliteBackend::open(&db_path, limits))
                    .await
                    .map_err(|_| ServeError::ThreadPanicked)?
                    .map_err(|source| ServeError::OpenStore {
                        path: config.db_path.clone(),
                        source,
                    })?;
            Ok(Arc::new(backend))
        }
        #[cfg(feature = "etcd")]
        StoreConfig::Etcd(etcd) => {
            let backend = crate::backend::etcd::EtcdBackend::connect(etcd, limits, config.lease_ms)
                .await
                .map_err(|source| ServeError::ConnectStore {
                    endpoints: etcd.endpoints.join(","),
                    source,
                })?;
            Ok(Arc::new(backend))
        }
        #[cfg(not(feature = "etcd"))]
        StoreConfig::Etcd(_) => Err(ServeError::InvalidConfig(
            "this coordinator was built without etcd support: rebuild with `--features etcd`"
                .to_owned(),
        )),
    }
}

/// What the start-up log line says about the store.
fn describe_store(config: &CoordinatorConfig) -> String {
    match &config.store {
        StoreConfig::Sqlite => format!("sqlite:{}", config.db_path.display()),
        StoreConfig::Etcd(etcd) => {
            format!("etcd:{} prefix {:?}", etcd.endpoints.join(","), etcd.prefix)
        }
    }
}

fn check(config: &CoordinatorConfig) -> Result<(), ServeError> {
    if config.token.as_deref() == Some("") {
        return Err(ServeError::InvalidConfig(
            "the token must not be empty".to_owned(),
        ));
    }
    let l = &config.limits;
    let zero = [
        ("max_nodes", l.max_nodes as u64),
        ("max_ranges", l.max_ranges as u64),
        ("max_ranges_per_node", l.max_ranges_per_node as u64),
        ("max_replicas", l.max_replicas as u64),
        ("max_connections", l.max_connections as u64),
        ("header_timeout_ms", l.header_timeout_ms),
        ("body_timeout_ms", l.body_timeout_ms),
    ];
    if let Some((name, _)) = zero.iter().find(|(_, value)| *value == 0) {
        return Err(ServeError::InvalidConfig(format!("{name} must be > 0")));
    }
    if u32::try_from(l.max_connections).is_err() {
        return Err(ServeError::InvalidConfig(
            "max_connections is too large".to_owned(),
        ));
    }
    Ok(())
}

/// Opens, binds and serves `config` until `shutdown` completes.
///
/// # Errors
///
/// See [`Server::bind`] and [`Server::serve`].
pub async fn serve<F>(config: CoordinatorConfig, shutdown: F) -> Result<(), ServeError>
where
    F: Future<Output = ()> + Send + 'static,
{
    Server::bind(config).await?.serve(shutdown).await
}
