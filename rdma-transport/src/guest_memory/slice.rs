//! The scheduler slice a fault handler thread asks for.
//!
//! Linux's EEVDF scheduler (6.6+) does not let a woken thread preempt the
//! running one before the latter's slice is used up, unless the woken one
//! asks for a shorter slice (6.12+, `sched_attr.sched_runtime` of a fair
//! task). A handler sharing a CPU with the vCPU thread it serves then wakes
//! that thread with the page and keeps the CPU until it blocks again: the
//! vCPU waits out the rest of the handler's pass and its `poll`. A handler
//! that asks for a slice longer than the vCPU threads' is preempted at the
//! wake instead (see `GuestMemoryConfig::handler_slice_us`).

use std::io;

use crate::sys::cvt;

/// `sched_attr` as the kernel's first version of it (48 bytes).
const SCHED_ATTR_SIZE_VER0: u32 = 48;

/// Whether the running kernel honours
/// [`super::GuestMemoryConfig::handler_slice_us`]: Linux 6.12 or later,
/// where a fair thread may ask for its slice (from
/// `/proc/sys/kernel/osrelease`; `false` when it cannot be read).
#[must_use]
pub fn kernel_honours_handler_slice() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release.trim().split(['.', '-']);
    let mut next = || {
        parts
            .next()
            .and_then(|p| p.parse::<u32>().ok())
            .unwrap_or(0)
    };
    (next(), next()) >= (6, 12)
}

/// Asks for `slice_us` (0: nothing to ask) for the calling handler thread
/// and logs what came of it: handlers run either way.
pub(super) fn apply_to_current_thread(slice_us: u64) {
    if slice_us == 0 {
        return;
    }
    match request_for_current_thread(slice_us) {
        Ok(true) => tracing::debug!(slice_us, "fault handler slice set"),
        Ok(false) => tracing::info!(
            slice_us,
            "fault handler slice not set: a real-time thread, or a kernel before 6.12"
        ),
        Err(err) => tracing::warn!(%err, slice_us, "cannot set the fault handler's slice"),
    }
}

/// Asks for a slice of `slice_us` µs for the calling thread, keeping its
/// policy, nice value and reset-on-fork flag. Returns `Ok(false)` when the
/// thread is not under the fair scheduler (a real-time handler is left
/// alone) or the kernel ignores the request (before 6.12, which keeps the
/// default slice).
fn request_for_current_thread(slice_us: u64) -> io::Result<bool> {
    let mut attr = current()?;
    let policy = attr.sched_policy as libc::c_int;
    if policy != libc::SCHED_OTHER && policy != libc::SCHED_BATCH {
        return Ok(false);
    }
    attr.sched_runtime = slice_us.saturating_mul(1000);
    // The only flag `sched_getattr` reports for a fair thread that
    // `sched_setattr` takes back as it is.
    attr.sched_flags &= libc::SCHED_FLAG_RESET_ON_FORK as u64;
    // SAFETY: `attr` is a live, initialised sched_attr whose `size` is the
    // size the kernel reads; pid 0 is the calling thread.
    cvt(unsafe { libc::syscall(libc::SYS_sched_setattr, 0, std::ptr::from_ref(&attr), 0) })?;
    // A kernel that knows custom slices reports the thread's slice back.
    Ok(current()?.sched_runtime != 0)
}

/// The calling thread's scheduling attributes.
fn current() -> io::Result<libc::sched_attr> {
    let mut attr = libc::sched_attr {
        size: 0,
        sched_policy: 0,
        sched_flags: 0,
        sched_nice: 0,
        sched_priority: 0,
        sched_runtime: 0,
        sched_deadline: 0,
        sched_period: 0,
    };
    // SAFETY: the kernel writes at most `SCHED_ATTR_SIZE_VER0` bytes, the
    // size of `attr`; pid 0 is the calling thread; flags must be 0.
    cvt(unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            0,
            std::ptr::from_mut(&mut attr),
            SCHED_ATTR_SIZE_VER0,
            0,
        )
    })?;
    attr.size = SCHED_ATTR_SIZE_VER0;
    Ok(attr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_gets_the_slice_it_asks_for_and_keeps_its_nice_value() {
        std::thread::spawn(|| {
            // SAFETY: setpriority on the calling thread (who 0).
            assert_eq!(unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 3) }, 0);
            let mut attr = current().expect("sched_getattr");
            attr.sched_flags = libc::SCHED_FLAG_RESET_ON_FORK as u64;
            // SAFETY: as in `request_for_current_thread`.
            let set =
                unsafe { libc::syscall(libc::SYS_sched_setattr, 0, std::ptr::from_ref(&attr), 0) };
            assert_eq!(set, 0, "{}", io::Error::last_os_error());
            let applied = request_for_current_thread(4000).expect("sched_setattr");
            let now = current().expect("sched_getattr");
            assert_eq!(now.sched_nice, 3, "the nice value was lost");
            assert_eq!(
                now.sched_flags & libc::SCHED_FLAG_RESET_ON_FORK as u64,
                libc::SCHED_FLAG_RESET_ON_FORK as u64,
                "reset-on-fork was lost"
            );
            assert_eq!(now.sched_policy as libc::c_int, libc::SCHED_OTHER);
            if kernel_honours_handler_slice() {
                assert!(applied, "a 6.12+ kernel ignored the slice");
                assert_eq!(now.sched_runtime, 4_000_000);
            } else {
                assert!(!applied);
            }
        })
        .join()
        .expect("slice test thread");
    }
}
