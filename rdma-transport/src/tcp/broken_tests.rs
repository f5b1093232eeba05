//! A connection marked broken discards what its server has not taken yet:
//! nothing written before is sent or retransmitted afterwards.

use std::io::{ErrorKind, Read, Write};

use std::time::Duration;

use super::inflight::CODE_CONN_LOST;
use super::wait_tests::bare_connection;

#[test]
fn a_broken_connection_never_delivers_what_its_server_had_not_taken() {
    let (conn, mut server) = bare_connection(false);
    // The server reads nothing: the client's bytes fill its receive
    // buffer, then the client's own send queue (as when a link is down).
    let chunk = vec![0x5a_u8; 64 * 1024];
    let mut written = 0usize;
    loop {
        match conn.stream().write(&chunk) {
            Ok(n) => written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("writing to the connection: {e}"),
        }
    }

    conn.mark_broken(CODE_CONN_LOST);

    server
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let mut received = 0usize;
    let end = loop {
        match server.read(&mut buf) {
            Ok(0) => break None,
            Ok(n) => received += n,
            Err(e) => break Some(e.kind()),
        }
    };
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
