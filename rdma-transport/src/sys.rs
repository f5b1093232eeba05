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
