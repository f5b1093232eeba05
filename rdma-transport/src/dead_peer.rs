//! Noticing a peer that went away without a word: its host crashed or
//! lost power, or the network to it was cut. Nothing comes back from such
//! a peer, not even a reset, so without help a connection to it is kept
//! forever while idle (or for ~15 minutes of retransmissions when data was
//! in flight).
//!
//! Both ends of a connection use it. A page-server bounds its clients'
//! connections (`--dead-peer-timeout-ms`), which otherwise keep their
//! threads, RDMA resources and places under `max_connections`, and loses
//! a coherence node that vanished. A coherence node bounds its connection
//! to each home (`CoherenceConfig::dead_home_timeout_ms`): a node cut off
//! from a home must drop its copies of that home's pages before the home,
//! having lost the node, grants them to another node; the home waits
//! [`left_for_sure_within`] that bound first (docs/coherence.md,
//! "Failures").
//!
//! Two TCP options bound it to `within` of the last sign of life:
//! keepalive probes on an idle connection, and `TCP_USER_TIMEOUT` on data
//! sent but never acknowledged (which also ends the probing at `within`).
//! A live peer's kernel answers the probes, so an idle VMM, however long
//! it waits between faults, is never cut off, nor an idle home.

use std::io;
use std::net::TcpStream;
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};

/// Keepalive probes sent before the connection is given up (when
/// `TCP_USER_TIMEOUT` has not ended it first).
const PROBES: u32 = 3;

/// The kernel counts keepalive times in whole seconds.
const MIN_STEP: Duration = Duration::from_secs(1);

/// Ends `stream` once its peer has shown no sign of life for `within`
/// (the kernel notices at its next probe, at most a probe interval
/// later: a sixth of `within`, at least a second; under a second, after
/// two: it counts whole seconds); zero
/// leaves the kernel's defaults (no keepalive).
///
/// # Errors
/// The socket refused an option.
pub fn watch(stream: &TcpStream, within: Duration) -> io::Result<()> {
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

/// Whether `err`, from a connection [`watch`]ed, says the kernel gave the
/// peer up: `ETIMEDOUT`, or the last ICMP error it got meanwhile
/// (`EHOSTUNREACH`, `ENETUNREACH`: a router saying the host or its network
/// is gone), which the kernel reports instead when it had one. On an
/// established connection those are never reported before the bound.
pub fn gave_up_on_peer(err: &io::Error) -> bool {
    matches!(
        err.raw_os_error(),
        Some(libc::ETIMEDOUT | libc::EHOSTUNREACH | libc::ENETUNREACH)
    )
}

/// Time a coherence node takes to drop its copies of a home's pages
/// once that home has sent it nothing more, if its [`watch`] bound on the
/// home is `node_bound`: the bound, the probe interval by which the
/// kernel may notice late, and [`FORGET_MARGIN`] to drop the copies.
/// A home that loses a node to silence waits this long after losing it
/// (which is after the last thing it sent) before it gives the node's
/// pages to others: whichever way the network was cut, the node has left
/// by then. Zero for a node without a bound, which never leaves a silent
/// home: no wait can help there.
///
/// The kernel gives a silent peer up at the first keepalive tick past the
/// bound with a probe out: the first probe goes at the idle time, so the
/// verdict comes one interval after it at the earliest, even for a bound
/// shorter than the idle time (at least a second): hence the larger of
/// the two.
pub fn left_for_sure_within(node_bound: Duration) -> Duration {
    if node_bound.is_zero() {
        return Duration::ZERO;
    }
    let (idle, interval) = probe_times(node_bound);
    node_bound.max(idle) + interval + FORGET_MARGIN
}

/// What [`left_for_sure_within`] allows a node for dropping its copies
/// after it noticed that its home went silent.
pub const FORGET_MARGIN: Duration = Duration::from_secs(2);

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
    fn silence_and_unreachable_hosts_are_given_up_peers_other_errors_not() {
        for errno in [libc::ETIMEDOUT, libc::EHOSTUNREACH, libc::ENETUNREACH] {
            assert!(
                gave_up_on_peer(&io::Error::from_raw_os_error(errno)),
                "{errno}"
            );
        }
        for errno in [libc::ECONNRESET, libc::EPIPE, libc::EINVAL] {
            assert!(
                !gave_up_on_peer(&io::Error::from_raw_os_error(errno)),
                "{errno}"
            );
        }
        assert!(!gave_up_on_peer(&io::Error::other("not an OS error")));
    }

    #[test]
    fn a_node_has_left_within_its_bound_a_probe_interval_and_the_margin() {
        let s = Duration::from_secs;
        // The interval as asked for (5 s / 3), above what the kernel
        // makes of it (whole seconds): never less than it takes.
        assert_eq!(
            left_for_sure_within(s(10)),
            s(10) + s(5) / 3 + FORGET_MARGIN
        );
        assert_eq!(left_for_sure_within(s(30)), s(30) + s(5) + FORGET_MARGIN);
        assert_eq!(left_for_sure_within(s(1)), s(1) + s(1) + FORGET_MARGIN);
        // Under a second the kernel still probes after a second of silence
        // and gives up a second later: the node leaves after 2 s, not 1 ms.
        assert_eq!(
            left_for_sure_within(Duration::from_millis(1)),
            s(1) + s(1) + FORGET_MARGIN
        );
        assert_eq!(left_for_sure_within(Duration::ZERO), Duration::ZERO);
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
