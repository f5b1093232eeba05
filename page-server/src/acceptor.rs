//! The accept loop: admits each connection (see `admission`) and starts its
//! thread; never spins on a failing `accept`.

use std::io;
use std::net::TcpListener;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::connection::serve;
use crate::limits::ConnGuard;
use crate::server::Shared;
use crate::stats::CloseReason;

/// First pause after an `accept` that failed for want of a resource (file
/// descriptors, memory); it doubles while failures go on, up to
/// [`ACCEPT_PAUSE_MAX`].
const ACCEPT_PAUSE_MIN: Duration = Duration::from_millis(5);
const ACCEPT_PAUSE_MAX: Duration = Duration::from_millis(200);

/// The pause after an `accept` failed with `err`, the last pause having
/// been `previous`. A connection that died in the queue (aborted, reset)
/// or an interrupted call is no reason to wait; anything else (EMFILE,
/// ENFILE, ENOBUFS, ENOMEM, or an unknown error) fails again at once, so
/// waiting is what keeps the loop from spinning.
fn accept_pause(err: &io::Error, previous: Duration) -> Duration {
    match err.kind() {
        io::ErrorKind::ConnectionAborted
        | io::ErrorKind::ConnectionReset
        | io::ErrorKind::Interrupted => Duration::ZERO,
        _ => (previous * 2).clamp(ACCEPT_PAUSE_MIN, ACCEPT_PAUSE_MAX),
    }
}

pub(crate) fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    let admission = &shared.admission;
    let mut pause = Duration::ZERO;
    for stream in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            break;
        }
        let accepted_at = Instant::now();
        let (stream, duplicate) = match stream.and_then(|s| s.try_clone().map(|d| (s, d))) {
            Ok(pair) => {
                pause = Duration::ZERO;
                pair
            }
            Err(err) => {
                admission.accept_failed();
                pause = accept_pause(&err, pause);
                if let Some(suppressed) = admission.accept_log.event() {
                    tracing::warn!(%err, suppressed, pause_ms = pause.as_millis(), "accept failed");
                }
                if !pause.is_zero() {
                    // Bounded: at most ACCEPT_PAUSE_MAX, and `stop` is
                    // checked again right after.
                    std::thread::sleep(pause);
                }
                continue;
            }
        };
        let peer = stream.peer_addr().ok();
        if let Err(err) = rdma_transport::dead_peer::watch(&stream, shared.dead_peer_timeout) {
            if let Some(suppressed) = admission.accept_log.event() {
                tracing::warn!(?peer, %err, suppressed, "cannot set keepalive on a connection: a dead client would keep it");
            }
        }
        // Recorded before its thread exists; the thread removes the record
        // (see `conns`), so an ended connection is never left recorded.
        let Some(recorded) = admission.admit(duplicate) else {
            break;
        };
        let id = recorded.id();
        let mut guard = ConnGuard::new(accepted_at, recorded, Arc::clone(admission));
        let conn_shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name(format!("page-conn-{id}"))
            .spawn(move || {
                let result = serve(
                    &stream,
                    &conn_shared.exported,
                    &conn_shared.spin_before_block,
                    &mut guard,
                );
                match result {
                    Ok(()) => tracing::debug!(?peer, "client left"),
                    Err(err) if rdma_transport::dead_peer::gave_up_on_peer(&err) => {
                        conn_shared.admission.closed(CloseReason::DeadPeer);
                        tracing::info!(?peer, %err, "client gone silent: connection closed");
                    }
                    Err(err) => tracing::debug!(?peer, %err, "connection ended"),
                }
                // The record (and its duplicate socket) goes first, then the
                // socket itself: the client sees FIN only once neither is
                // open, and by then the connection is no longer counted.
                drop(guard);
                drop(stream);
            });
        match spawned {
            Ok(handle) => admission.conns.set_thread(id, handle),
            // The closure, and with it the record, has been dropped.
            Err(err) => {
                if let Some(suppressed) = admission.accept_log.event() {
                    tracing::error!(%err, suppressed, "cannot start a connection thread");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_out_of_descriptors_backs_off_boundedly_and_aborts_do_not() {
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        let mut pause = Duration::ZERO;
        let mut pauses = Vec::new();
        for _ in 0..10 {
            pause = accept_pause(&emfile, pause);
            pauses.push(pause);
        }
        assert_eq!(pauses[0], ACCEPT_PAUSE_MIN);
        assert!(pauses.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(*pauses.last().unwrap(), ACCEPT_PAUSE_MAX);
        let enfile = io::Error::from_raw_os_error(libc::ENFILE);
        assert_eq!(accept_pause(&enfile, Duration::ZERO), ACCEPT_PAUSE_MIN);
        let aborted = io::Error::from_raw_os_error(libc::ECONNABORTED);
        assert_eq!(accept_pause(&aborted, ACCEPT_PAUSE_MAX), Duration::ZERO);
    }
}
