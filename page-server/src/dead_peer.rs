//! Noticing a client that went away without a word: its host crashed or
//! lost power, or the network to it was cut. Nothing comes back from such
//! a peer, not even a reset, so without help its connection keeps its
//! thread, its RDMA resources and its place under `max_connections`
//! forever when idle (or for ~15 minutes of retransmissions when answers
//! were in flight), and enough of them keep every new client out.
//!
//! Two TCP options bound it to `within` of the last sign of life:
//! keepalive probes on an idle connection, and `TCP_USER_TIMEOUT` on data
//! sent but never acknowledged (which also ends the probing at `within`).
//! A live client's kernel answers the probes, so an idle VMM, however long
//! it waits between faults, is never cut off (unlike `idle_timeout`).

use std::io;
use std::net::TcpStream;
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};

/// Keepalive probes sent before the connection is given up (when
/// `TCP_USER_TIMEOUT` has not ended it first).
const PROBES: u32 = 3;

/// The kernel counts keepalive times in whole seconds.
const MIN_STEP: Duration = Duration::from_secs(1);

/// Ends `stream` once its peer has shown no sign of life for about
/// `within`; zero leaves the kernel's defaults (no keepalive).
pub(crate) fn watch(stream: &TcpStream, within: Duration) -> io::Result<()> {
    if within.is_zero() {
        return Ok(());
    }
    let (idle, interval) = probe_times(within);
    let socket = SockRef::from(stream);
    socket.set_tcp_keepalive(
        &TcpKeepalive::new()
            .with_time(idle)
            .with_interval(interval)
            .with_retries(PROBES),
    )?;
    socket.set_tcp_user_timeout(Some(within))
}

/// First probe after half of `within` idle, the others spread over the
/// rest; each at least a second (the kernel's unit).
fn probe_times(within: Duration) -> (Duration, Duration) {
    let idle = (within / 2).max(MIN_STEP);
    let interval = (within.saturating_sub(idle) / PROBES).max(MIN_STEP);
    (idle, interval)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn probes_fit_in_the_timeout_and_never_go_below_a_second() {
        assert_eq!(
            probe_times(Duration::from_secs(30)),
            (Duration::from_secs(15), Duration::from_secs(5))
        );
        assert_eq!(
            probe_times(Duration::from_millis(1500)),
            (Duration::from_secs(1), Duration::from_secs(1))
        );
        assert_eq!(
            probe_times(Duration::from_millis(1)),
            (Duration::from_secs(1), Duration::from_secs(1))
        );
    }

    #[test]
    fn the_options_are_set_on_the_socket_and_zero_sets_none() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let stream = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        watch(&stream, Duration::ZERO).unwrap();
        let socket = SockRef::from(&stream);
        assert!(!socket.keepalive().unwrap());
        assert_eq!(socket.tcp_user_timeout().unwrap(), None);

        watch(&stream, Duration::from_secs(30)).unwrap();
        assert!(socket.keepalive().unwrap());
        assert_eq!(
            socket.tcp_keepalive_time().unwrap(),
            Duration::from_secs(15)
        );
        assert_eq!(
            socket.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(5)
        );
        assert_eq!(socket.tcp_keepalive_retries().unwrap(), PROBES);
        assert_eq!(
            socket.tcp_user_timeout().unwrap(),
            Some(Duration::from_secs(30))
        );
    }
}
