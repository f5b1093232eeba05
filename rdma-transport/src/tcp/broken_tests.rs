//! A connection marked broken, or closed, discards what its server has not
//! taken yet: nothing written before is sent or retransmitted afterwards.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use super::inflight::CODE_CONN_LOST;
use super::wait_tests::bare_connection;

/// Writes to `client` (non-blocking) until its server's receive buffer and
/// its own send queue are full, as when a link is down. Returns the bytes
/// written.
fn fill(mut client: &TcpStream) -> usize {
    let chunk = vec![0x5a_u8; 64 * 1024];
    let mut written = 0usize;
    loop {
        match client.write(&chunk) {
            Ok(n) => written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return written,
            Err(e) => panic!("writing to the connection: {e}"),
        }
    }
}

/// Reads `server` to its end: the bytes it got, and how it ended (`None`:
/// in order).
fn drain(mut server: TcpStream) -> (usize, Option<ErrorKind>) {
    server
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut received = 0usize;
    loop {
        match server.read(&mut buf) {
            Ok(0) => return (received, None),
            Ok(n) => received += n,
            Err(e) => return (received, Some(e.kind())),
        }
    }
}

fn assert_discarded(written: usize, (received, end): (usize, Option<ErrorKind>)) {
    assert!(
        received < written,
        "the server got all {written} bytes, those still queued at the client when it gave up included"
    );
    assert_eq!(
        end,
        Some(ErrorKind::ConnectionReset),
        "the stream ended in order after {received} of {written} bytes"
    );
}

#[test]
fn a_broken_connection_never_delivers_what_its_server_had_not_taken() {
    let (conn, server) = bare_connection(false);
    let written = fill(conn.stream());
    conn.mark_broken(CODE_CONN_LOST);
    assert_discarded(written, drain(server));
}

/// As when its manager is dropped, or its process exits or is killed: the
/// socket is closed.
#[test]
fn a_closed_connection_never_delivers_what_its_server_had_not_taken() {
    let (conn, server) = bare_connection(false);
    let written = fill(conn.stream());
    drop(Arc::into_inner(conn).expect("the only reference"));
    assert_discarded(written, drain(server));
}
