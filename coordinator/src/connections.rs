//! The accept loop: at most `max_connections` connections at once (more wait
//! in the listen backlog), each served as HTTP/1 with a header read timeout
//! that also closes idle keep-alive connections, and a graceful stop.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, OwnedSemaphorePermit, Semaphore};

use crate::config::Limits;
use crate::server::SHUTDOWN_GRACE;

/// Pause after an accept error that is not about one connection (e.g. out
/// of file descriptors), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Accepts and serves until `shutdown` completes, then asks every connection
/// to finish its request in flight and waits for them (at most
/// [`SHUTDOWN_GRACE`]).
pub(crate) async fn serve_connections<F>(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: F,
) where
    F: Future<Output = ()> + Send + 'static,
{
    // `Server::bind` checked that it fits a u32 and is not zero.
    let slots = u32::try_from(limits.max_connections).unwrap_or(u32::MAX);
    let semaphore = Arc::new(Semaphore::new(slots as usize));
    let header_timeout = Duration::from_millis(limits.header_timeout_ms);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            () = &mut shutdown => break,
            permit = Arc::clone(&semaphore).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_closed) => break,
            },
        };
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _peer)) => stream,
                Err(error) => {
                    if !is_connection_error(&error) {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                    }
                    continue;
                }
            },
        };
        let router = router.clone();
        let stop_rx = stop_rx.clone();
        tokio::spawn(serve_one(stream, router, header_timeout, permit, stop_rx));
    }
    tracing::info!("coordinator shutting down");
    // Nobody listening means every connection already ended.
    let _ = stop_tx.send(true);
    drop(listener);
    let all_closed = semaphore.acquire_many(slots);
    if tokio::time::timeout(SHUTDOWN_GRACE, all_closed)
        .await
        .is_err()
    {
        tracing::warn!("requests still open after the shutdown grace period; dropping them");
    }
}

/// Serves one connection; its slot is free again when this returns.
async fn serve_one(
    stream: TcpStream,
    router: Router,
    header_timeout: Duration,
    _slot: OwnedSemaphorePermit,
    mut stop: watch::Receiver<bool>,
) {
    let connection = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .serve_connection(TokioIo::new(stream), TowerToHyperService::new(router));
    let mut connection = std::pin::pin!(connection);
    // The guard `wait_for` returns is not `Send`: drop it in here.
    let stopping = async move { stop.wait_for(|stopping| *stopping).await.is_ok() };
    let result = tokio::select! {
        result = connection.as_mut() => result,
        true = stopping => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(error) = result {
        // Header timeouts, resets and bad requests from one client.
        tracing::debug!(%error, "connection ended with an error");
    }
}

/// Errors about one accepted connection (it went away before we took it).
fn is_connection_error(error: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        error.kind(),
        ErrorKind::ConnectionRefused | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    )
}
