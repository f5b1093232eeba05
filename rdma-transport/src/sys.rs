//! Turning libc's `-1`-and-errno convention into `io::Result`, written
//! once, and the few socket calls std does not make for us.

use std::io;

/// Maps a libc return value of `-1` to the thread's `errno`.
pub(crate) fn cvt<T: PartialEq + From<i8>>(ret: T) -> io::Result<T> {
    if ret == T::from(-1) {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// `d` as a `timespec` (seconds capped at `i32::MAX`).
pub(crate) fn timespec(d: std::time::Duration) -> libc::timespec {
    libc::timespec {
        tv_sec: d.as_secs().min(i32::MAX as u64) as libc::time_t,
        tv_nsec: libc::c_long::from(d.subsec_nanos() as i32),
    }
}

/// Waits until `fd` is readable (or hung up) or `timeout` passed, with the
/// precision of `ppoll` (a socket's `SO_RCVTIMEO` counts in scheduler
/// ticks: 4 ms at 250 Hz). Returns whether it is readable; `EINTR` counts
/// as not yet.
pub(crate) fn wait_readable(
    fd: std::os::fd::BorrowedFd<'_>,
    timeout: std::time::Duration,
) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    let mut pollfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let timeout = timespec(timeout);
    // SAFETY: one live, initialised pollfd; `timeout` is a valid timespec
    // and a null signal mask is allowed.
    let ret = unsafe { libc::ppoll(&mut pollfd, 1, &timeout, std::ptr::null()) };
    match cvt(ret) {
        Ok(n) => Ok(n > 0),
        Err(err) if err.kind() == io::ErrorKind::Interrupted => Ok(false),
        Err(err) => Err(err),
    }
}

/// Sends what the socket takes of `bufs` (one `sendmsg`) with
/// `MSG_NOSIGNAL`: a peer that has gone is an `EPIPE` error, never a
/// `SIGPIPE`, which would end a host process that does not ignore it (a
/// hypervisor in C embedding this library). `writev` has no such flag;
/// std's `TcpStream::write` sets it, its `write_vectored` does not.
pub(crate) fn send_vectored(
    stream: &std::net::TcpStream,
    bufs: &[std::io::IoSlice<'_>],
) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    // SAFETY: all-zero bytes are a valid `msghdr` (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // `IoSlice` is ABI-compatible with `iovec` on Unix; `sendmsg` only reads
    // the iovecs and the buffers they point at.
    msg.msg_iov = bufs.as_ptr().cast_mut().cast();
    msg.msg_iovlen = bufs.len().min(libc::UIO_MAXIOV as usize) as _;
    // SAFETY: `msg` is initialised, and its iovecs point at live buffers
    // that `bufs` borrows for the call.
    let ret = unsafe { libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    cvt(ret).map(|n| n as usize)
}

/// Runs `f` with `SIGPIPE` blocked on the calling thread, then restores
/// the thread's mask. Threads `f` starts inherit the blocked signal: for a
/// client whose I/O threads write with `writev` (hyper's), a `SIGPIPE`
/// raised on them stays pending there, never delivered, instead of ending a
/// host process that keeps the default disposition (a hypervisor in C).
pub(crate) fn with_sigpipe_blocked<R>(f: impl FnOnce() -> R) -> R {
    let set = sigpipe_set();
    // SAFETY: all-zero bytes are a valid `sigset_t`; `old` is written by
    // `pthread_sigmask` before use.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is initialised and `old` is a live `sigset_t` to write.
    let blocked = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old) } == 0;
    if !blocked {
        tracing::debug!("cannot block SIGPIPE for a client's threads");
    }
    let result = f();
    if blocked {
        // SAFETY: `old` holds the mask `pthread_sigmask` returned above.
        unsafe { libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut()) };
    }
    result
}

/// The signal set holding SIGPIPE alone.
pub(crate) fn sigpipe_set() -> libc::sigset_t {
    // SAFETY: all-zero bytes are a valid `sigset_t` for `sigemptyset` to
    // initialise.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live `sigset_t`.
    unsafe { libc::sigemptyset(&mut set) };
    // SAFETY: `set` is initialised; SIGPIPE is a valid signal.
    unsafe { libc::sigaddset(&mut set, libc::SIGPIPE) };
    set
}

/// Gives a TCP connection up at once. Bytes its peer has not acknowledged
/// are discarded, with a reset: a socket merely shut down would keep
/// sending and retransmitting them (for minutes, if the link is down), so
/// that a request given up on could land long after, behind newer ones
/// sent another way. Then the socket is shut down both ways, which wakes
/// every thread polling or reading it.
pub(crate) fn abandon(stream: &std::net::TcpStream) {
    use std::os::fd::AsFd;
    if unacknowledged_bytes(stream.as_fd()).is_ok_and(|bytes| bytes > 0) {
        if let Err(err) = reset_connection(stream.as_fd()) {
            tracing::debug!(%err, "cannot reset a connection given up on");
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// Bytes written to the TCP socket `fd` that its peer has not acknowledged
/// yet (sent or not: `SIOCOUTQ`).
fn unacknowledged_bytes(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<usize> {
    use std::os::fd::AsRawFd;
    let mut bytes: libc::c_int = 0;
    // SAFETY: `SIOCOUTQ` (`TIOCOUTQ` on Linux) writes one int through the
    // pointer, which points at a live local.
    cvt(unsafe { libc::ioctl(fd.as_raw_fd(), libc::TIOCOUTQ, &mut bytes) })?;
    Ok(usize::try_from(bytes).unwrap_or(0))
}

/// Drops the TCP connection of `fd` at once: `connect(2)` to an `AF_UNSPEC`
/// address disconnects it, discarding its send queue (nothing written
/// will be sent or retransmitted any more) and sending a reset. Threads
/// polling it see an error and hang-up.
fn reset_connection(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: all-zero bytes are a valid `sockaddr` (family `AF_UNSPEC`).
    let mut addr: libc::sockaddr = unsafe { std::mem::zeroed() };
    addr.sa_family = libc::AF_UNSPEC as libc::sa_family_t;
    // SAFETY: `addr` is a live, initialised `sockaddr` of the length given.
    let ret = unsafe {
        libc::connect(
            fd.as_raw_fd(),
            &addr,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    cvt(ret).map(drop)
}
