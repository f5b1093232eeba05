//! How a coherence node's connection ends, and when its pages may go to
//! other nodes (docs/coherence.md, "Failures").
//!
//! The home gives a lost node's pages to others as soon as it declares it
//! lost, so it must not do that while the node's vCPUs may still read its
//! copies:
//! - the node closed its side: it drops its copies before it closes, so
//!   they are gone (a crashed node has none);
//! - the kernel gave the node up (silent for the dead-peer timeout): it
//!   may be cut off rather than dead, and drops its copies only when its
//!   own bound on the home's silence passes; the home waits that out;
//! - the home ended the connection (a refused write-back, a send that
//!   failed or stalled, a broken rule or limit): the node learns it from
//!   the end of the stream, a round trip later at best, then drops its
//!   copies. The home waits for its close, within the same bound.

use std::io::{self, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::coherence_home::{CohSession, CoherenceHome};

/// How often a node's connection thread, waiting for data, looks whether
/// another thread closed the connection ([`crate::outbound::Outbound::close_from_home`]).
pub(crate) const CLOSED_CHECK_INTERVAL: Duration = Duration::from_secs(1);

/// The error that ends serving a connection the home closed.
pub(crate) fn closed_by_home() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "the coherence home closed this node's connection",
    )
}

/// Whether the home closed the connection of `coh` (from any thread).
pub(crate) fn is_closed_by_home(coh: &CohSession) -> bool {
    coh.outbound().is_some_and(|o| o.closed_by_home())
}

/// Called when serving the connection of `coh` ended with `result`, before
/// its node is declared lost: returns once the node has surely dropped
/// its copies (or the server stops).
pub(crate) fn wait_until_copies_dropped(
    stream: &TcpStream,
    home: &CoherenceHome,
    coh: &CohSession,
    result: &io::Result<()>,
) {
    if !coh.is_node() {
        return;
    }
    // The kernel's verdict goes to whichever call sees it first: this
    // thread's read, or a coherence send from another thread.
    let silent = result
        .as_ref()
        .is_err_and(rdma_transport::dead_peer::gave_up_on_peer)
        || coh.outbound().is_some_and(|o| o.gone_silent());
    if silent {
        tracing::info!(
            "coherence node gone silent: its pages stay its own until it has surely left"
        );
        home.wait_until(Instant::now() + coh.silence_wait());
        return;
    }
    let closed_by_node = match result {
        // The end of the stream: the node's own close. (The home never
        // shuts a node's reading side; the server's stop does, and waits
        // for nothing, and so does a replica recovery's fence for a node
        // over RDMA: docs/coherence.md, "Failures", not covered.)
        Ok(()) => true,
        Err(e) => match e.kind() {
            io::ErrorKind::ConnectionReset => true,
            // The home's own write-side shutdown fails later sends so.
            io::ErrorKind::BrokenPipe => !is_closed_by_home(coh),
            _ => false,
        },
    };
    if !closed_by_node {
        await_close(stream, home, coh);
    }
}

/// The home ended the connection: tells the node (the end of the stream),
/// then discards what it still sends until it closes its side, the kernel
/// gives it up, `coh.silence_wait()` passes or the server stops.
fn await_close(stream: &TcpStream, home: &CoherenceHome, coh: &CohSession) {
    let wait = coh.silence_wait();
    let deadline = Instant::now() + wait;
    // (A node always has one.) Marks it closed too, so that no thread
    // sends to it any more.
    if let Some(outbound) = coh.outbound() {
        outbound.close_from_home();
    }
    tracing::info!(
        wait_ms = wait.as_millis() as u64,
        "coherence node closed by the home: its pages stay its own until it closes its side"
    );
    if stream.set_nonblocking(false).is_err() {
        home.wait_until(deadline);
        return;
    }
    let mut scratch = [0u8; 4096];
    loop {
        let now = Instant::now();
        let left = deadline.saturating_duration_since(now);
        if left.is_zero() {
            tracing::warn!(
                wait_ms = wait.as_millis() as u64,
                "coherence node did not close its side after the home closed it; its pages go to others now"
            );
            return;
        }
        if home.is_stopping() {
            return;
        }
        // Comes back at least every check interval to notice a stop.
        if stream
            .set_read_timeout(Some(left.min(CLOSED_CHECK_INTERVAL)))
            .is_err()
        {
            home.wait_until(deadline);
            return;
        }
        match (&*stream).read(&mut scratch) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                ) => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => return,
            Err(e) => {
                // Given up by the kernel, or broken: the node may be cut
                // off, and still hold its copies until its own bound on
                // this home's silence passes, which the deadline covers.
                tracing::debug!(%e, "closed coherence node's connection failed; waiting out its bound");
                home.wait_until(deadline);
                return;
            }
        }
    }
}
