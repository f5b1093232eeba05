//! Turning libc's `-1`-and-errno convention into `io::Result`, written once.

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
