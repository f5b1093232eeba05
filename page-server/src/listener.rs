//! The listening socket, with a backlog sized for connection churn.

use std::io;
use std::net::{SocketAddr, TcpListener};

use socket2::{Domain, Protocol, Socket, Type};

/// Connections the kernel queues before the acceptor takes them. The
/// standard library's 128 overflows when many clients (re)connect at once:
/// a dropped SYN costs that client a 1 s retransmit. The kernel caps this
/// at `net.core.somaxconn` (4096 by default since Linux 5.4).
pub(crate) const LISTEN_BACKLOG: i32 = 4096;

/// Binds a TCP listener on `addr` (with `SO_REUSEADDR`, as the standard
/// library sets it) with a [`LISTEN_BACKLOG`] backlog.
///
/// # Errors
/// The socket, bind or listen call's error.
pub(crate) fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpStream;
    use std::time::Duration;

    /// More clients than the old backlog of 128 connect while nobody
    /// accepts: every one completes its handshake (with a backlog of 128,
    /// the 130th SYN is dropped and its connect times out).
    #[test]
    fn more_than_128_pending_connections_are_queued() {
        let somaxconn: usize = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(128);
        let clients = 300.min(somaxconn);
        let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0))).unwrap();
        let addr = listener.local_addr().unwrap();
        let mut pending = Vec::with_capacity(clients);
        for i in 0..clients {
            match TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
                Ok(s) => pending.push(s),
                Err(err) => panic!("client {i} of {clients} could not connect: {err}"),
            }
        }
        assert_eq!(pending.len(), clients);
    }
}
