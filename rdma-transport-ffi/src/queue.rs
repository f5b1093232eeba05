//! `RtQueue`: the asynchronous API (`CompletionQueue`) for C. Submissions
//! move pages in the caller's memory; completions are reaped with
//! `rt_queue_poll` / `rt_queue_wait` (poll and eventfd modes) or delivered
//! to a callback on the queue's thread (callback mode).
//!
//! The Rust queue hands back every ready completion at once; what does not
//! fit in the caller's array waits in the `RtQueue` (`Reaped::surplus`) for
//! the next call, so `max` is honoured and nothing is lost. In eventfd mode
//! a non-empty surplus re-arms the eventfd, so an epoll loop that reaps a
//! few at a time is woken again.

use std::cell::Cell;
use std::collections::VecDeque;
use std::ffi::{c_int, c_void};
use std::mem::MaybeUninit;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rdma_transport::{Completion, CompletionQueue, Page, Reap, TransportManager, PAGE_SIZE};

use crate::manager::RtManager;
use crate::status::{chain, fail, guard, transport_status, RtStatus};

/// How a queue's completions reach the caller (`rt_queue_create`'s `mode`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RtReapMode {
    /// The caller reaps with `rt_queue_poll` / `rt_queue_wait`.
    Poll = 0,
    /// As `RT_REAP_MODE_POLL`, and `rt_queue_eventfd` becomes readable when
    /// there is something to reap.
    Eventfd = 1,
    /// The queue's own thread calls the callback for every completion.
    Callback = 2,
}

/// The outcome of one submission, as `rt_queue_poll` / `rt_queue_wait`
/// return it.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtCompletion {
    /// The submitter's tag.
    pub user_data: u64,
    /// An `RtStatus` value: `RT_STATUS_OK` when every page was moved, else
    /// the first error (the other pages may or may not have been moved), as
    /// the blocking calls return it.
    pub status: i32,
}

/// The completion callback (`RT_REAP_MODE_CALLBACK`): called on the
/// queue's thread, once per submission, with the `callback_ctx` given to
/// `rt_queue_create`. During the call, `rt_last_error()` on that thread is
/// the message of a failed completion. It may submit to its own queue, but
/// must not destroy it, must not block for long (it holds up the other
/// completions of the queue) and must not unwind (C++ exceptions, longjmp).
pub type RtCompletionFn =
    Option<unsafe extern "C" fn(ctx: *mut c_void, user_data: u64, status: i32)>;

/// An opaque handle to a completion queue.
#[derive(Debug)]
pub struct RtQueue {
    // Field order is drop order: the queue cancels what is in flight (and
    // stops its thread) before the manager reference goes.
    queue: CompletionQueue,
    reaped: Mutex<Reaped>,
    mode: RtReapMode,
    /// Tells this queue's callbacks from others' (`IN_CALLBACK_OF`).
    id: u64,
    /// The queue uses the manager's connections: it keeps the manager alive
    /// when `rt_manager_destroy` comes first.
    _manager: Arc<TransportManager>,
}

/// Completions taken from the Rust queue, not yet returned to the caller.
#[derive(Debug, Default)]
struct Reaped {
    surplus: VecDeque<Completion>,
    scratch: Vec<Completion>,
}

static NEXT_QUEUE_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// The id of the queue whose callback runs on this thread (0: none).
    static IN_CALLBACK_OF: Cell<u64> = const { Cell::new(0) };
}

/// The embedder's callback and its context, moved to the queue's thread.
struct CCallback {
    f: unsafe extern "C" fn(*mut c_void, u64, i32),
    ctx: *mut c_void,
    queue_id: u64,
}

// SAFETY: `ctx` is never dereferenced here, only passed back to `f`. It is
// the caller's obligation (documented at `rt_queue_create`) that `f` may be
// called with `ctx` from the queue's thread, i.e. that whatever `ctx`
// points to is safe to use from another thread, until `rt_queue_destroy`
// returns.
unsafe impl Send for CCallback {}

impl CCallback {
    fn call(&self, c: &Completion) {
        let status = match &c.result {
            Ok(()) => RtStatus::Ok,
            Err(e) => fail(transport_status(e), chain(e)),
        };
        IN_CALLBACK_OF.with(|id| id.set(self.queue_id));
        // SAFETY: `f` is the embedder's function, called as its contract
        // (`RtCompletionFn`) says, with the context it gave us.
        unsafe { (self.f)(self.ctx, c.user_data, status as i32) };
        IN_CALLBACK_OF.with(|id| id.set(0));
    }
}

impl RtQueue {
    fn reaped(&self) -> MutexGuard<'_, Reaped> {
        // A panic caught by `guard` may have poisoned it; the deque is
        // consistent at every step, so go on with it.
        self.reaped.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Moves completions from the surplus to `out` while it has room;
    /// records the message of the last failed one for `rt_last_error`. In
    /// eventfd mode, what stays behind re-arms the eventfd.
    fn deliver(&self, reaped: &mut Reaped, out: &mut [MaybeUninit<RtCompletion>]) -> usize {
        let mut n = 0;
        for slot in out.iter_mut() {
            let Some(c) = reaped.surplus.pop_front() else {
                break;
            };
            let status = match &c.result {
                Ok(()) => RtStatus::Ok,
                Err(e) => fail(transport_status(e), chain(e)),
            };
            slot.write(RtCompletion {
                user_data: c.user_data,
                status: status as i32,
            });
            n += 1;
        }
        if !reaped.surplus.is_empty() {
            self.rearm_eventfd();
        }
        n
    }

    /// Makes the eventfd readable (eventfd mode; a no-op otherwise).
    fn rearm_eventfd(&self) {
        if let Some(fd) = self.queue.eventfd() {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live buffer to the queue's
            // eventfd, open while `self.queue` lives.
            let ret = unsafe { libc::write(fd.as_raw_fd(), one.as_ptr().cast(), one.len()) };
            if ret < 0 {
                tracing::debug!(err = %std::io::Error::last_os_error(), "cannot re-arm the completion eventfd");
            }
        }
    }

    /// Eventfd mode's `wait`: reaps until `need` completions, nothing in
    /// flight or `timeout`, sleeping in poll(2) on the eventfd (the Rust
    /// queue signals the eventfd, not a waiting thread, in this mode).
    fn wait_eventfd(&self, got: &mut Vec<Completion>, need: usize, timeout: Duration) {
        let until = Instant::now() + timeout;
        let Some(fd) = self.queue.eventfd().map(|fd| fd.as_raw_fd()) else {
            return;
        };
        loop {
            self.queue.poll(got);
            if got.len() >= need || self.queue.in_flight() == 0 {
                return;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            let mut pfd = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // Round up: a wait of 0.5 ms must not become a busy loop.
            let left_ms = left.as_nanos().div_ceil(1_000_000).min(c_int::MAX as u128) as c_int;
            // SAFETY: one live pollfd for an fd the queue keeps open.
            let ret = unsafe { libc::poll(&mut pfd, 1, left_ms) };
            if ret < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() != std::io::ErrorKind::Interrupted {
                    tracing::debug!(%err, "poll on the completion eventfd failed");
                    return;
                }
            }
        }
    }
}

/// The queue behind a handle, or the status of a NULL one.
///
/// # Safety
/// `queue` must be NULL or a live handle.
unsafe fn queue_ref<'a>(queue: *const RtQueue) -> Result<&'a RtQueue, RtStatus> {
    // SAFETY: the caller passes NULL or a live handle.
    match unsafe { queue.as_ref() } {
        Some(q) => Ok(q),
        None => Err(fail(RtStatus::InvalidArgument, "queue is NULL")),
    }
}

/// Creates a completion queue of `manager`; `*out` receives it (destroy it
/// with `rt_queue_destroy`). `mode` is an `RtReapMode` value. `callback` is
/// required in `RT_REAP_MODE_CALLBACK` and must be NULL in the other modes.
///
/// The queue keeps the manager's connections alive: `rt_manager_destroy`
/// may come before `rt_queue_destroy` (the queue goes on working), and the
/// connections close when the last of them is destroyed. Many queues may
/// share a manager.
///
/// Calls on one queue may come from any thread, but a queue is meant for
/// one reaping thread: `rt_last_error()` after a reap is per thread.
///
/// # Safety
/// `manager` must be NULL or a live handle, `out` NULL or writable. In
/// callback mode, `callback` is called from the queue's own thread with
/// `callback_ctx` until `rt_queue_destroy` returns: whatever `callback_ctx`
/// points to must stay valid until then and be safe to use from that
/// thread.
#[no_mangle]
pub unsafe extern "C" fn rt_queue_create(
    manager: *const RtManager,
    mode: u32,
    callback: RtCompletionFn,
    callback_ctx: *mut c_void,
    out: *mut *mut RtQueue,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let Some(manager) = (unsafe { manager.as_ref() }) else {
            return fail(RtStatus::InvalidArgument, "manager is NULL");
        };
        let mode = match mode {
            0 => RtReapMode::Poll,
            1 => RtReapMode::Eventfd,
            2 => RtReapMode::Callback,
            other => {
                return fail(
                    RtStatus::InvalidArgument,
                    format!("mode {other} is not an RtReapMode (0 poll, 1 eventfd, 2 callback)"),
                )
            }
        };
        if out.is_null() {
            return fail(RtStatus::InvalidArgument, "out is NULL");
        }
        let id = NEXT_QUEUE_ID.fetch_add(1, Ordering::Relaxed);
        let reap = match (mode, callback) {
            (RtReapMode::Poll, None) => Reap::Poll,
            (RtReapMode::Eventfd, None) => Reap::Eventfd,
            (RtReapMode::Callback, Some(f)) => {
                let cb = CCallback {
                    f,
                    ctx: callback_ctx,
                    queue_id: id,
                };
                Reap::Callback(Box::new(move |c: Completion| cb.call(&c)))
            }
            (RtReapMode::Callback, None) => {
                return fail(
                    RtStatus::InvalidArgument,
                    "callback is NULL in RT_REAP_MODE_CALLBACK",
                )
            }
            (_, Some(_)) => return fail(
                RtStatus::InvalidArgument,
                "callback is set but mode is not RT_REAP_MODE_CALLBACK (it would never be called)",
            ),
        };
        match manager.inner.completion_queue(reap) {
            Ok(queue) => {
                let handle = Box::into_raw(Box::new(RtQueue {
                    queue,
                    reaped: Mutex::new(Reaped::default()),
                    mode,
                    id,
                    _manager: Arc::clone(&manager.inner),
                }));
                // SAFETY: `out` is non-null and writable (caller's contract).
                unsafe { out.write(handle) };
                RtStatus::Ok
            }
            Err(e) => fail(transport_status(&e), chain(&e)),
        }
    })
}

/// Destroys a queue. What is still in flight is cancelled (no completion
/// is delivered for it, no callback called); it returns once nothing will
/// touch the pages of any submission any more, so the caller may free or
/// reuse them after it returns. It may wait up to one request timeout for
/// requests the blocking engine is running.
///
/// Must not be called from the queue's own callback: that call is refused
/// (the queue stays live, `rt_last_error()` says why).
///
/// # Safety
/// `queue` must be NULL or a handle from `rt_queue_create` not yet
/// destroyed, and no other thread may be using it.
#[no_mangle]
pub unsafe extern "C" fn rt_queue_destroy(queue: *mut RtQueue) {
    let _ = guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let Some(q) = (unsafe { queue.as_ref() }) else {
            return RtStatus::Ok;
        };
        if IN_CALLBACK_OF.with(Cell::get) == q.id {
            return fail(
                RtStatus::InvalidArgument,
                "rt_queue_destroy called from the queue's own callback: refused",
            );
        }
        // SAFETY: a live handle from Box::into_raw, destroyed once.
        drop(unsafe { Box::from_raw(queue) });
        RtStatus::Ok
    });
}

/// The addresses of a submission, after checking its arguments.
///
/// # Safety
/// `gpas` must be NULL or point to `count` addresses readable for `'a`.
unsafe fn submission<'a>(
    gpas: *const u64,
    count: usize,
    pages_null: bool,
) -> Result<&'a [u64], RtStatus> {
    if count == 0 {
        return Err(fail(
            RtStatus::InvalidArgument,
            "count is 0: a submission needs at least one page",
        ));
    }
    if gpas.is_null() {
        return Err(fail(
            RtStatus::InvalidArgument,
            format!("gpas is NULL with count {count}"),
        ));
    }
    if pages_null {
        return Err(fail(
            RtStatus::InvalidArgument,
            format!("pages is NULL with count {count}"),
        ));
    }
    if count > isize::MAX as usize / PAGE_SIZE {
        return Err(fail(
            RtStatus::InvalidArgument,
            format!("count {count} pages is too large"),
        ));
    }
    // SAFETY: non-null and `count` readable addresses (caller's contract).
    Ok(unsafe { std::slice::from_raw_parts(gpas, count) })
}

/// Submits a read of the `count` pages at `gpas[0..count]` into `pages`
/// (page i at `pages + i * 4096`), all in flight at once; `user_data` comes
/// back in its completion. `gpas` is copied: it may be reused at once.
/// Errors of the transfer (unknown address, node down, ...) come in the
/// completion; this call only fails on bad arguments (`count` 0, a NULL
/// pointer).
///
/// # Safety
/// `queue` must be NULL or a live handle; `gpas` must point to `count`
/// readable addresses. `pages` must point to `count * 4096` writable bytes
/// that stay valid, and that nobody else reads or writes, until this
/// submission's completion was returned by `rt_queue_poll` /
/// `rt_queue_wait` (or passed to the callback) or `rt_queue_destroy`
/// returned.
#[no_mangle]
pub unsafe extern "C" fn rt_queue_submit_read(
    queue: *mut RtQueue,
    gpas: *const u64,
    count: usize,
    pages: *mut c_void,
    user_data: u64,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let q = match unsafe { queue_ref(queue) } {
            Ok(q) => q,
            Err(status) => return status,
        };
        // SAFETY: the caller's contract on `gpas` and `count`.
        let gpas = match unsafe { submission(gpas, count, pages.is_null()) } {
            Ok(g) => g,
            Err(status) => return status,
        };
        // SAFETY: `pages` holds `count` writable pages that nobody else
        // touches until the completion is reaped or the queue destroyed
        // (caller's contract); `RtQueue` drops the Rust queue on destroy and
        // keeps reaped completions until they are returned. A `Page` is
        // 4096 bytes of alignment 1.
        match unsafe {
            q.queue
                .submit_read_raw(gpas, pages.cast::<Page>(), user_data)
        } {
            Ok(()) => RtStatus::Ok,
            Err(e) => fail(transport_status(&e), chain(&e)),
        }
    })
}

/// Submits a write of the `count` pages at `pages` (page i at
/// `pages + i * 4096`) to `gpas[0..count]`; as `rt_queue_submit_read`.
///
/// # Safety
/// `queue` must be NULL or a live handle; `gpas` must point to `count`
/// readable addresses. `pages` must point to `count * 4096` readable bytes
/// that stay valid, and that nobody writes, until this submission's
/// completion was returned by `rt_queue_poll` / `rt_queue_wait` (or passed
/// to the callback) or `rt_queue_destroy` returned.
#[no_mangle]
pub unsafe extern "C" fn rt_queue_submit_write(
    queue: *mut RtQueue,
    gpas: *const u64,
    count: usize,
    pages: *const c_void,
    user_data: u64,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle.
        let q = match unsafe { queue_ref(queue) } {
            Ok(q) => q,
            Err(status) => return status,
        };
        // SAFETY: the caller's contract on `gpas` and `count`.
        let gpas = match unsafe { submission(gpas, count, pages.is_null()) } {
            Ok(g) => g,
            Err(status) => return status,
        };
        // SAFETY: `pages` holds `count` readable pages that nobody writes
        // until the completion is reaped or the queue destroyed (caller's
        // contract, kept as in `rt_queue_submit_read`).
        match unsafe {
            q.queue
                .submit_write_raw(gpas, pages.cast::<Page>(), user_data)
        } {
            Ok(()) => RtStatus::Ok,
            Err(e) => fail(transport_status(&e), chain(&e)),
        }
    })
}

/// The arguments of a reaping call, checked: the queue (not in callback
/// mode) and the caller's array.
///
/// # Safety
/// `queue` must be NULL or a live handle; `out` must be valid for writes of
/// `max` completions for `'a` (or NULL with `max` 0).
unsafe fn reaper<'a>(
    queue: *const RtQueue,
    out: *mut RtCompletion,
    max: usize,
    n: *mut usize,
) -> Result<(&'a RtQueue, &'a mut [MaybeUninit<RtCompletion>]), RtStatus> {
    // SAFETY: the caller passes NULL or a live handle.
    let q = unsafe { queue_ref(queue) }?;
    if n.is_null() {
        return Err(fail(RtStatus::InvalidArgument, "n is NULL"));
    }
    if out.is_null() && max > 0 {
        return Err(fail(
            RtStatus::InvalidArgument,
            format!("out is NULL with max {max}"),
        ));
    }
    if q.mode == RtReapMode::Callback {
        return Err(fail(
            RtStatus::InvalidArgument,
            "the queue is in RT_REAP_MODE_CALLBACK: its completions go to the callback",
        ));
    }
    let out = match max {
        0 => &mut [][..],
        // SAFETY: non-null and `max` writable completions (caller's
        // contract); `MaybeUninit` makes no claim on their contents.
        max => unsafe {
            std::slice::from_raw_parts_mut(out.cast::<MaybeUninit<RtCompletion>>(), max)
        },
    };
    Ok((q, out))
}

/// Moves whatever is ready on (puts the next windows of large submissions
/// on the wire) and writes up to `max` completions to `out`, without
/// blocking; `*n` receives how many. Completions that do not fit stay in
/// the queue for the next call (in eventfd mode they keep the eventfd
/// readable). Not for callback mode (`RT_STATUS_INVALID_ARGUMENT`).
///
/// Returns `RT_STATUS_OK` even when completions failed: their `status`
/// says so, and `rt_last_error()` on this thread is then the message of the
/// last failed completion in `out` (reap one at a time to see each).
///
/// # Safety
/// `queue` must be NULL or a live handle; `out` must point to `max`
/// writable `RtCompletion`s (NULL when `max` is 0); `n` must be NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn rt_queue_poll(
    queue: *mut RtQueue,
    out: *mut RtCompletion,
    max: usize,
    n: *mut usize,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle, and `max`
        // writable completions at `out`.
        let (q, out) = match unsafe { reaper(queue, out, max, n) } {
            Ok(r) => r,
            Err(status) => return status,
        };
        let mut reaped = q.reaped();
        let reaped = &mut *reaped;
        q.queue.poll(&mut reaped.scratch);
        reaped.surplus.extend(reaped.scratch.drain(..));
        let got = q.deliver(reaped, out);
        // SAFETY: non-null (checked by `reaper`) and writable (caller's contract).
        unsafe { n.write(got) };
        RtStatus::Ok
    })
}

/// As `rt_queue_poll`, waiting up to `timeout_ms` until at least `min`
/// completions are ready (`min` at most `max`) or nothing is in flight any
/// more; `*n` may be less than `min` after the timeout. `min` 0 does not
/// wait.
///
/// # Safety
/// As `rt_queue_poll`.
#[no_mangle]
pub unsafe extern "C" fn rt_queue_wait(
    queue: *mut RtQueue,
    out: *mut RtCompletion,
    max: usize,
    min: usize,
    timeout_ms: u32,
    n: *mut usize,
) -> RtStatus {
    guard(|| {
        // SAFETY: the caller passes NULL or a live handle, and `max`
        // writable completions at `out`.
        let (q, out) = match unsafe { reaper(queue, out, max, n) } {
            Ok(r) => r,
            Err(status) => return status,
        };
        if min > max {
            return fail(
                RtStatus::InvalidArgument,
                format!("min {min} is more than max {max}"),
            );
        }
        let held = q.reaped().surplus.len();
        let mut got = Vec::new();
        if held < min {
            // Not under the lock: another thread may poll meanwhile.
            let need = min - held;
            let timeout = Duration::from_millis(timeout_ms.into());
            match q.mode {
                RtReapMode::Eventfd => q.wait_eventfd(&mut got, need, timeout),
                _ => {
                    q.queue.wait(&mut got, need, timeout);
                }
            }
        } else {
            q.queue.poll(&mut got);
        }
        let mut reaped = q.reaped();
        reaped.surplus.extend(got);
        let delivered = q.deliver(&mut reaped, out);
        // SAFETY: non-null (checked by `reaper`) and writable (caller's contract).
        unsafe { n.write(delivered) };
        RtStatus::Ok
    })
}

/// The queue's eventfd (`RT_REAP_MODE_EVENTFD`), or -1 (other modes, or
/// `queue` NULL). It is readable when `rt_queue_poll` has something to do:
/// add it to an epoll set with `EPOLLIN`; on readiness call `rt_queue_poll`
/// (it drains the eventfd). Owned by the queue: do not read, write or
/// close it; remove it from the epoll set before `rt_queue_destroy`.
///
/// # Safety
/// `queue` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_queue_eventfd(queue: *const RtQueue) -> c_int {
    // SAFETY: the caller passes NULL or a live handle.
    match unsafe { queue.as_ref() } {
        Some(q) => q.queue.eventfd().map_or(-1, |fd| fd.as_raw_fd()),
        None => -1,
    }
}

/// Submissions whose completion was not yet returned to the caller (in
/// flight, or ready and held for the next `rt_queue_poll`); 0 for NULL. In
/// callback mode, a submission stops counting just before its callback.
///
/// # Safety
/// `queue` must be NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn rt_queue_in_flight(queue: *const RtQueue) -> usize {
    // SAFETY: the caller passes NULL or a live handle.
    match unsafe { queue.as_ref() } {
        Some(q) => {
            let held = q.reaped().surplus.len();
            q.queue.in_flight() + held
        }
        None => 0,
    }
}
