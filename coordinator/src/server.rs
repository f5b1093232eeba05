//! Binding the listener and serving until a shutdown signal.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::config::CoordinatorConfig;
use crate::error::ServeError;
use crate::routes::router;
use crate::state::AppState;
use crate::store::Store;

/// Largest accepted request body.
pub(crate) const MAX_BODY_BYTES: usize = 64 * 1024;

/// After the shutdown signal, requests in flight get this long to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A coordinator whose database is open and whose socket is bound, not yet
/// serving. Lets the caller learn the bound address (e.g. after asking for
/// port 0) before serving.
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    local_addr: SocketAddr,
    router: Router,
}

impl Server {
    /// Opens the database and binds `config.listen`.
    ///
    /// # Errors
    ///
    /// [`ServeError::InvalidConfig`] for an empty token,
    /// [`ServeError::OpenStore`] and [`ServeError::Bind`] as named.
    pub async fn bind(config: CoordinatorConfig) -> Result<Self, ServeError> {
        if config.token.as_deref() == Some("") {
            return Err(ServeError::InvalidConfig(
                "the token must not be empty".to_owned(),
            ));
        }
        let db_path = config.db_path.clone();
        let store = tokio::task::spawn_blocking(move || Store::open(&db_path))
            .await
            .map_err(|_| ServeError::ThreadPanicked)?
            .map_err(|source| ServeError::OpenStore {
                path: config.db_path.clone(),
                source,
            })?;
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
        let state = AppState::new(store, config.token, config.lease_ms);
        tracing::info!(
            %local_addr,
            db = %config.db_path.display(),
            lease_ms = config.lease_ms,
            auth = state.token().is_some(),
            "coordinator listening"
        );
        Ok(Self {
            listener,
            local_addr,
            router: router(state),
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
        let (stopping_tx, mut stopping_rx) = watch::channel(false);
        let graceful = axum::serve(self.listener, self.router).with_graceful_shutdown(async move {
            shutdown.await;
            tracing::info!("coordinator shutting down");
            // Nobody listening only means the grace timer below is gone too.
            let _ = stopping_tx.send(true);
        });
        let grace_expired = async move {
            if stopping_rx.wait_for(|stopping| *stopping).await.is_ok() {
                tokio::time::sleep(SHUTDOWN_GRACE).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            result = graceful => result.map_err(ServeError::Serve),
            () = grace_expired => {
                tracing::warn!("requests still open after the shutdown grace period; dropping them");
                Ok(())
            }
        }
    }
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
