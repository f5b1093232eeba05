//! Writing to a connection whose page-server is gone is an error, never a
//! `SIGPIPE`: a host process that does not ignore the signal (a hypervisor
//! in C; Rust programs ignore it from `main`) would be ended by it.

use std::io::{ErrorKind, IoSlice, Read};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use super::connection::write_some;
use crate::wire::HEADER_LEN;

/// `SIGPIPE` blocked in this thread while it lives: one raised meanwhile
/// stays pending (even when ignored), so the test can see it.
struct SigpipeWatch {
    set: libc::sigset_t,
}

impl SigpipeWatch {
    fn start() -> Self {
        let set = crate::sys::sigpipe_set();
        // SAFETY: `set` is initialised; a null old set is allowed.
        let ret = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
        assert_eq!(ret, 0, "pthread_sigmask");
        Self { set }
    }

    /// Whether a `SIGPIPE` was raised (and takes it).
    fn raised(&self) -> bool {
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `set` is initialised, a null info pointer is allowed and
        // `zero` is a valid timespec: takes a pending SIGPIPE or returns -1.
        unsafe { libc::sigtimedwait(&self.set, std::ptr::null_mut(), &zero) == libc::SIGPIPE }
    }
}

impl Drop for SigpipeWatch {
    fn drop(&mut self) {
        // SAFETY: `set` is initialised; a null old set is allowed.
        unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &self.set, std::ptr::null_mut()) };
    }
}

/// A client socket whose server reset the connection, the reset already
/// seen (its error taken by a read): every write now fails with `EPIPE`.
fn reset_client() -> TcpStream {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    socket2::SockRef::from(&server)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(server);
    client
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let err = client.read(&mut [0u8; 1]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionReset);
    client
}

#[test]
fn a_write_to_a_connection_whose_server_is_gone_raises_no_sigpipe() {
    let watch = SigpipeWatch::start();
    let client = reset_client();
    let (header, page) = ([0u8; HEADER_LEN], [0u8; 4096]);
    // A WRITE request: header and page, vectored; a lone header: one buffer.
    for bufs in [
        &[IoSlice::new(&header), IoSlice::new(&page)][..],
        &[IoSlice::new(&header)][..],
    ] {
        let err = write_some(&client, bufs).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::BrokenPipe, "{} buffers", bufs.len());
        assert!(
            !watch.raised(),
            "writing {} buffers to a gone server raised SIGPIPE",
            bufs.len()
        );
    }
}
