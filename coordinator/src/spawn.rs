//! Running a coordinator on its own thread, for synchronous callers (tests,
//! the bench).

use std::net::SocketAddr;
use std::sync::mpsc;
use std::thread::JoinHandle;

use tokio::sync::oneshot;

use crate::config::CoordinatorConfig;
use crate::error::ServeError;
use crate::server::Server;

/// A coordinator serving on a background thread. Dropping it shuts it down
/// like [`shutdown`](Self::shutdown), ignoring the outcome.
#[derive(Debug)]
pub struct RunningCoordinator {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<Result<(), ServeError>>>,
}

/// Starts a coordinator on a new thread with its own tokio runtime and
/// returns once it is listening.
///
/// Call it from synchronous code; it blocks until the database is open and
/// the socket bound.
///
/// # Errors
///
/// Everything [`Server::bind`] can fail with, and
/// [`ServeError::Runtime`] when the thread or runtime cannot start.
///
/// # Example
///
/// ```no_run
/// use coordinator::{spawn, CoordinatorConfig};
///
/// let dir = std::env::temp_dir();
/// let config = CoordinatorConfig::new("127.0.0.1:0".parse()?, dir.join("coordinator.db"));
/// let running = spawn(config)?;
/// println!("coordinator at {}", running.url());
/// running.shutdown()?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn spawn(config: CoordinatorConfig) -> Result<RunningCoordinator, ServeError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ServeError::Runtime)?;
    let (ready_tx, ready_rx) = mpsc::channel::<Result<SocketAddr, ServeError>>();
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("coordinator".to_owned())
        .spawn(move || {
            runtime.block_on(async move {
                let server = match Server::bind(config).await {
                    Ok(server) => server,
                    Err(error) => {
                        let _ = ready_tx.send(Err(error));
                        return Ok(());
                    }
                };
                // The receiver waits for this message; if it is gone, serving
                // until the stop sender drops is still right.
                let _ = ready_tx.send(Ok(server.local_addr()));
                server
                    .serve(async move {
                        // An error means the sender was dropped: stop as well.
                        let _ = stop_rx.await;
                    })
                    .await
            })
        })
        .map_err(ServeError::Runtime)?;
    match ready_rx.recv() {
        Ok(Ok(addr)) => Ok(RunningCoordinator {
            addr,
            stop: Some(stop_tx),
            thread: Some(thread),
        }),
        Ok(Err(error)) => {
            let _ = thread.join();
            Err(error)
        }
        Err(mpsc::RecvError) => match thread.join() {
            Ok(Err(error)) => Err(error),
            _ => Err(ServeError::ThreadPanicked),
        },
    }
}

impl RunningCoordinator {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its base URL, e.g. `http://127.0.0.1:40123`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting, lets requests in flight finish, and joins the thread.
    ///
    /// # Errors
    ///
    /// What serving failed with, or [`ServeError::ThreadPanicked`].
    pub fn shutdown(mut self) -> Result<(), ServeError> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<(), ServeError> {
        if let Some(stop) = self.stop.take() {
            // Err means the server already ended; joining tells why.
            let _ = stop.send(());
        }
        match self.thread.take() {
            Some(thread) => thread.join().unwrap_or(Err(ServeError::ThreadPanicked)),
            None => Ok(()),
        }
    }
}

impl Drop for RunningCoordinator {
    fn drop(&mut self) {
        if let Err(error) = self.stop_and_join() {
            tracing::warn!(%error, "coordinator stopped with an error");
        }
    }
}
