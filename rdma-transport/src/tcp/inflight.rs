//! The table of requests in flight on one connection, matched by request id.
//!
//! A request id is `(generation << SLOT_BITS) | slot`. A slot's `state` word
//! packs the id with a phase, so every transition is one compare-and-swap on
//! the exact request: a late answer to a cancelled request can never complete
//! a newer request that reuses the slot.
//!
//! Phases: PENDING (on the wire) → COMPLETING (the poller owns it: copies the
//! payload, records the status, signals the waiter) → DONE. The caller may
//! instead move PENDING → CANCELLED (deadline passed), after which the poller
//! never touches the slot's buffer or waiter again.
//!
//! A request armed `direct` may also go PENDING → LANDING before its answer
//! is read: the reader then owns the slot's buffer and reads the socket
//! straight into it (`receive.rs`). If the bytes were its answer, LANDING →
//! DONE as from COMPLETING; if not, the reader moves those bytes back to
//! its receive buffer and LANDING → PENDING. A caller that cancels meanwhile
//! waits for the slot to leave LANDING (one non-blocking read).

use std::sync::atomic::{fence, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::thread::Thread;
use std::time::{Duration, Instant};

use super::free_slots::FreeSlots;

/// Number of slots per connection (requests in flight at once).
pub(crate) const SLOTS: usize = 1024;
const SLOT_BITS: u32 = 10;
const _: () = assert!(SLOTS == 1 << SLOT_BITS && SLOTS % 64 == 0);
const PHASE_BITS: u32 = 3;
const PHASE_MASK: u64 = 0b111;
const FREE: u64 = 0;
const PENDING: u64 = 1;
const COMPLETING: u64 = 2;
const DONE: u64 = 3;
const LANDING: u64 = 4;
/// `Slot::direct_id` of a request not armed direct (no id is this large).
const NOT_DIRECT: u64 = u64::MAX;
/// A cancelled slot is simply FREE with its id kept (see `cancel`).
const CANCELLED: u64 = FREE;

/// Completion code for "connection lost".
pub(crate) const CODE_CONN_LOST: u32 = 0x100;
/// Completion code for "the answer broke the protocol".
pub(crate) const CODE_PROTOCOL: u32 = 0x101;
/// Completion code for "the page did not match its checksum" (nothing was
/// copied into the caller's page).
pub(crate) const CODE_CHECKSUM: u32 = 0x102;

/// Told when an asynchronous request's round has no completion left (see
/// `crate::completion`): it queues the round for whoever reaps completions.
pub(crate) trait ReadyHook: Send + Sync {
    /// Round `seq` of the operation `token` has every answer (or failure).
    fn ready(&self, token: usize, seq: u64);
}

/// Who a waiter tells when its count reaches zero.
#[derive(Debug)]
enum Notify {
    /// A blocked caller: unpark it, if it parked. Its handle is set only
    /// when it is about to park (`Waiter::wait`): taking a thread's handle
    /// costs two atomic reference counts, which a caller that finds its
    /// answer while spinning (every SoftRoCE READ) never needs.
    Thread(OnceLock<Thread>),
    /// An asynchronous operation: queue it (`hook` outlives every round of
    /// the operation that owns the waiter).
    Queue {
        hook: *const (dyn ReadyHook + 'static),
        token: usize,
    },
}

/// Counts outstanding completions of one call (or one round of an
/// asynchronous operation) and tells its owner when none is left.
pub(crate) struct Waiter {
    remaining: AtomicUsize,
    notify: Notify,
    /// The round this waiter counts for (asynchronous operations only).
    seq: AtomicU64,
}

impl std::fmt::Debug for Waiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiter")
            .field("remaining", &self.remaining)
            .finish_non_exhaustive()
    }
}

// SAFETY: the only field that is not `Send + Sync` is the hook pointer,
// which points at a `Send + Sync` object kept alive by the operation that
// owns the waiter for as long as any request counts on it.
unsafe impl Send for Waiter {}
// SAFETY: as above; every other field is atomic or immutable.
unsafe impl Sync for Waiter {}

impl Waiter {
    pub(crate) fn new() -> Self {
        Self {
            remaining: AtomicUsize::new(0),
            notify: Notify::Thread(OnceLock::new()),
            seq: AtomicU64::new(0),
        }
    }

    /// A waiter that queues operation `token` with `hook` instead of waking
    /// a thread.
    ///
    /// # Safety
    /// `hook` must stay alive until every request armed with this waiter
    /// was finished or cancelled.
    pub(crate) unsafe fn for_queue(hook: *const (dyn ReadyHook + 'static), token: usize) -> Self {
        Self {
            remaining: AtomicUsize::new(0),
            notify: Notify::Queue { hook, token },
            seq: AtomicU64::new(0),
        }
    }

    /// Starts round `seq`: the next time the count reaches zero, the hook
    /// is told about this round.
    pub(crate) fn start_round(&self, seq: u64) {
        self.seq.store(seq, Ordering::Relaxed);
    }

    /// True once a blocked caller set its handle to park (tests).
    #[cfg(test)]
    fn about_to_park(&self) -> bool {
        matches!(&self.notify, Notify::Thread(parked) if parked.get().is_some())
    }

    pub(crate) fn add(&self, n: usize) {
        self.remaining.fetch_add(n, Ordering::SeqCst);
    }

    /// True when every request added so far has completed.
    pub(crate) fn is_done(&self) -> bool {
        self.remaining.load(Ordering::Acquire) == 0
    }

    /// Drops a count taken with `add(1)` that stands for no request (one
    /// held while a round is being submitted, so that answers to its first
    /// requests cannot bring the count to zero before the last is armed);
    /// tells the owner if that was the last.
    pub(crate) fn release_hold(&self) {
        self.complete_one();
    }

    fn complete_one(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            match &self.notify {
                Notify::Thread(parked) => {
                    // Pairs with the fence in `wait`: either the waiter sees
                    // the count at zero, or this sees its handle.
                    fence(Ordering::SeqCst);
                    if let Some(thread) = parked.get() {
                        thread.unpark();
                    }
                }
                // SAFETY: `for_queue`'s contract keeps the hook alive while
                // a request counts on this waiter, and this one just did.
                Notify::Queue { hook, token } => unsafe {
                    (**hook).ready(*token, self.seq.load(Ordering::Relaxed));
                },
            }
        }
    }

    /// Waits until every added request completed, spinning for `spin` first,
    /// then parking. Returns false when `deadline` passed first.
    pub(crate) fn wait(&self, spin: Duration, deadline: Instant) -> bool {
        let start = Instant::now();
        let mut spins = 0u32;
        while self.remaining.load(Ordering::Acquire) != 0 {
            spins = spins.wrapping_add(1);
            if spins % 64 == 0 {
                let now = Instant::now();
                if now >= deadline {
                    return self.remaining.load(Ordering::Acquire) == 0;
                }
                if now.duration_since(start) >= spin {
                    if let Notify::Thread(parked) = &self.notify {
                        parked.get_or_init(std::thread::current);
                        // Pairs with the fence in `complete_one`.
                        fence(Ordering::SeqCst);
                        if self.remaining.load(Ordering::Acquire) == 0 {
                            break;
                        }
                    }
                    std::thread::park_timeout(deadline - now);
                    continue;
                }
            }
            std::hint::spin_loop();
        }
        true
    }
}

#[derive(Debug)]
struct Slot {
    state: AtomicU64,
    dst: AtomicPtr<u8>,
    /// The request's region offset: its answer must echo it.
    offset: AtomicU64,
    waiter: AtomicPtr<Waiter>,
    code: AtomicU32,
    /// The id of the request armed in this slot if it was armed `direct`
    /// (its answer may be read straight into `dst`), else `NOT_DIRECT`.
    /// An id, not a flag: a value left by an earlier request of the slot
    /// can never pass for this one's.
    direct_id: AtomicU64,
}

/// All slots of one connection.
#[derive(Debug)]
pub(crate) struct Inflight {
    slots: Box<[Slot]>,
    free: FreeSlots<{ SLOTS / 64 }>,
}

/// A direct READ whose slot the reader holds (LANDING): it may write the
/// `PAGE_SIZE` bytes at `dst` until it calls `Inflight::landed` or
/// `Inflight::unland`.
#[derive(Debug)]
pub(crate) struct Landing {
    pub(crate) id: u64,
    pub(crate) slot: usize,
    pub(crate) dst: *mut u8,
    pub(crate) offset: u64,
}

/// What the poller should do with an answer's payload.
pub(crate) enum Claim {
    /// The request is live; copy a READ payload to `dst` (null for WRITE).
    /// `offset` is the request's, which a valid answer echoes.
    Live {
        slot: usize,
        dst: *mut u8,
        offset: u64,
    },
    /// Nobody waits for this answer any more (cancelled or unknown): drop it.
    Stale,
}

impl Inflight {
    pub(crate) fn new() -> Self {
        let slots = (0..SLOTS)
            .map(|_| Slot {
                state: AtomicU64::new(FREE),
                dst: AtomicPtr::new(std::ptr::null_mut()),
                offset: AtomicU64::new(0),
                waiter: AtomicPtr::new(std::ptr::null_mut()),
                code: AtomicU32::new(0),
                direct_id: AtomicU64::new(NOT_DIRECT),
            })
            .collect();
        Self {
            slots,
            free: FreeSlots::all_free(),
        }
    }

    /// Takes a free slot and arms it; returns the request id. `dst` is the
    /// READ destination (null for WRITE). The caller must keep `dst` and
    /// `waiter` alive until the slot is released by `finish` or `cancel`.
    /// `direct`: the answer may be read straight into `dst` (see
    /// [`Inflight::land`]); the caller takes `dst`'s contents as unspecified
    /// if the request fails.
    pub(crate) fn arm(
        &self,
        dst: *mut u8,
        offset: u64,
        waiter: &Waiter,
        direct: bool,
    ) -> Option<u64> {
        let slot_index = self.free.take()?;
        let slot = &self.slots[slot_index];
        let old_id = slot.state.load(Ordering::Relaxed) >> PHASE_BITS;
        let generation =
            (old_id >> SLOT_BITS).wrapping_add(1) & ((1 << (64 - SLOT_BITS - PHASE_BITS)) - 1);
        let id = (generation << SLOT_BITS) | slot_index as u64;
        let direct = direct && !dst.is_null();
        slot.dst.store(dst, Ordering::Relaxed);
        slot.offset.store(offset, Ordering::Relaxed);
        slot.waiter
            .store(std::ptr::from_ref(waiter).cast_mut(), Ordering::Relaxed);
        slot.code.store(0, Ordering::Relaxed);
        slot.direct_id
            .store(if direct { id } else { NOT_DIRECT }, Ordering::Relaxed);
        waiter.add(1);
        slot.state
            .store((id << PHASE_BITS) | PENDING, Ordering::SeqCst);
        Some(id)
    }

    /// Reader (holding the receive buffer): takes the slot of request `id`
    /// if it is a direct READ still pending, so that its answer can be read
    /// straight into its buffer. Give it back with [`Inflight::landed`] or
    /// [`Inflight::unland`].
    pub(crate) fn land(&self, id: u64) -> Option<Landing> {
        let slot_index = (id & ((1 << SLOT_BITS) - 1)) as usize;
        let slot = &self.slots[slot_index];
        // Only `arm` stores an id here, and only the id it arms, so this
        // was armed direct; the compare-and-swap below then succeeds only if
        // that very request is still pending.
        if slot.direct_id.load(Ordering::Relaxed) != id {
            return None;
        }
        let pending = (id << PHASE_BITS) | PENDING;
        let landing = (id << PHASE_BITS) | LANDING;
        // On the exact id: a slot re-armed since (another id) is left alone.
        slot.state
            .compare_exchange(pending, landing, Ordering::AcqRel, Ordering::Relaxed)
            .ok()?;
        Some(Landing {
            id,
            slot: slot_index,
            dst: slot.dst.load(Ordering::Relaxed),
            offset: slot.offset.load(Ordering::Relaxed),
        })
    }

    /// Reader: the bytes read into a landing slot were its answer; records
    /// its outcome and wakes its waiter (as `complete` does).
    pub(crate) fn landed(&self, landing: Landing, code: u32) {
        self.complete(landing.slot, code);
    }

    /// Reader: the bytes read were not the landing slot's answer (they
    /// have been moved out of its buffer): the request is pending again.
    pub(crate) fn unland(&self, landing: Landing) {
        self.slots[landing.slot]
            .state
            .store((landing.id << PHASE_BITS) | PENDING, Ordering::SeqCst);
    }

    /// Poller: claims the slot an answer names, if that request still waits.
    pub(crate) fn claim(&self, request_id: u64) -> Claim {
        let Some(slot) = self
            .slots
            .get((request_id & ((1 << SLOT_BITS) - 1)) as usize)
        else {
            return Claim::Stale;
        };
        let Some(pending) = request_id
            .checked_shl(PHASE_BITS)
            .filter(|v| v >> PHASE_BITS == request_id)
        else {
            return Claim::Stale;
        };
        let pending = pending | PENDING;
        let completing = (pending & !PHASE_MASK) | COMPLETING;
        match slot
            .state
            .compare_exchange(pending, completing, Ordering::AcqRel, Ordering::Relaxed)
        {
            Ok(_) => Claim::Live {
                slot: (request_id & ((1 << SLOT_BITS) - 1)) as usize,
                dst: slot.dst.load(Ordering::Relaxed),
                offset: slot.offset.load(Ordering::Relaxed),
            },
            Err(_) => Claim::Stale,
        }
    }

    /// Poller: records the outcome of a claimed slot and wakes its waiter.
    pub(crate) fn complete(&self, slot_index: usize, code: u32) {
        let slot = &self.slots[slot_index];
        slot.code.store(code, Ordering::Relaxed);
        let waiter = slot.waiter.load(Ordering::Relaxed);
        // SAFETY: the slot was claimed (PENDING → COMPLETING or LANDING),
        // so its caller is still blocked in `finish`/`cancel`, which wait
        // for DONE before returning; the waiter it armed the slot with is
        // therefore alive.
        unsafe { (*waiter).complete_one() };
        let state = slot.state.load(Ordering::Relaxed);
        slot.state
            .store((state & !PHASE_MASK) | DONE, Ordering::Release);
    }

    /// Poller: fails every request still pending (connection lost). A
    /// LANDING slot is left to its reader, which fails it or puts it back
    /// to PENDING and then sweeps again (`receive.rs`).
    pub(crate) fn fail_all(&self, code: u32) {
        for (i, slot) in self.slots.iter().enumerate() {
            let state = slot.state.load(Ordering::SeqCst);
            if state & PHASE_MASK == PENDING
                && slot
                    .state
                    .compare_exchange(
                        state,
                        (state & !PHASE_MASK) | COMPLETING,
                        Ordering::AcqRel,
                        Ordering::Relaxed,
                    )
                    .is_ok()
            {
                self.complete(i, code);
            }
        }
    }

    /// Caller: after its waiter reached zero, returns the slot's completion
    /// code and frees it.
    pub(crate) fn finish(&self, request_id: u64) -> u32 {
        let slot_index = (request_id & ((1 << SLOT_BITS) - 1)) as usize;
        let slot = &self.slots[slot_index];
        let done = (request_id << PHASE_BITS) | DONE;
        while slot.state.load(Ordering::Acquire) != done {
            std::hint::spin_loop();
        }
        let code = slot.code.load(Ordering::Relaxed);
        self.release(slot_index, request_id);
        code
    }

    /// Caller: gives up on a request (deadline passed). Returns its code if it
    /// completed after all, `None` if it was cancelled before an answer.
    pub(crate) fn cancel(&self, request_id: u64) -> Option<u32> {
        let slot_index = (request_id & ((1 << SLOT_BITS) - 1)) as usize;
        let slot = &self.slots[slot_index];
        let pending = (request_id << PHASE_BITS) | PENDING;
        let cancelled = (request_id << PHASE_BITS) | CANCELLED;
        let landing = (request_id << PHASE_BITS) | LANDING;
        loop {
            match slot.state.compare_exchange(
                pending,
                cancelled,
                Ordering::SeqCst,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    self.free.put(slot_index);
                    return None;
                }
                // A reader is reading the socket into the buffer (one
                // non-blocking read): wait until it knows whose bytes they
                // were.
                Err(state) if state == landing => std::thread::yield_now(),
                Err(_) => return Some(self.finish(request_id)),
            }
        }
    }

    fn release(&self, slot_index: usize, request_id: u64) {
        let slot = &self.slots[slot_index];
        slot.dst.store(std::ptr::null_mut(), Ordering::Relaxed);
        slot.waiter.store(std::ptr::null_mut(), Ordering::Relaxed);
        slot.state
            .store((request_id << PHASE_BITS) | FREE, Ordering::Release);
        self.free.put(slot_index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answer_completes_matching_request_only() {
        let t = Inflight::new();
        let w = Waiter::new();
        let id = t.arm(std::ptr::null_mut(), 0, &w, false).unwrap();
        assert!(
            matches!(t.claim(id + (1 << SLOT_BITS)), Claim::Stale),
            "other generation"
        );
        let Claim::Live { slot, .. } = t.claim(id) else {
            panic!("live request not claimed")
        };
        assert!(matches!(t.claim(id), Claim::Stale), "claimed twice");
        t.complete(slot, 5);
        assert!(w.wait(Duration::ZERO, Instant::now() + Duration::from_secs(1)));
        assert_eq!(t.finish(id), 5);
    }

    #[test]
    fn cancelled_request_ignores_late_answer_and_slot_is_reused() {
        let t = Inflight::new();
        let w = Waiter::new();
        let id = t.arm(std::ptr::null_mut(), 0, &w, false).unwrap();
        assert_eq!(t.cancel(id), None);
        assert!(matches!(t.claim(id), Claim::Stale));
        // Reuse every slot; none may accept the old id.
        let ids: Vec<_> = (0..SLOTS)
            .map(|_| t.arm(std::ptr::null_mut(), 0, &w, false).unwrap())
            .collect();
        assert!(
            t.arm(std::ptr::null_mut(), 0, &w, false).is_none(),
            "table is bounded"
        );
        assert!(!ids.contains(&id));
        assert!(matches!(t.claim(id), Claim::Stale));
        t.fail_all(CODE_CONN_LOST);
        for id in ids {
            assert_eq!(t.finish(id), CODE_CONN_LOST);
        }
    }

    #[test]
    fn a_parked_caller_is_woken_by_its_completion_not_its_deadline() {
        let waiter = std::sync::Arc::new(Waiter::new());
        waiter.add(1);
        assert!(!waiter.about_to_park(), "no handle taken before it parks");
        let deadline = Instant::now() + Duration::from_secs(60);
        let caller = {
            let waiter = std::sync::Arc::clone(&waiter);
            std::thread::spawn(move || {
                let started = Instant::now();
                (waiter.wait(Duration::ZERO, deadline), started.elapsed())
            })
        };
        // The caller sets its handle just before it parks; complete then,
        // so that only the unpark can end its wait in time.
        while !waiter.about_to_park() {
            assert!(Instant::now() < deadline, "the caller never came to park");
            std::thread::yield_now();
        }
        waiter.complete_one();
        let (answered, waited) = caller.join().unwrap();
        assert!(answered);
        assert!(
            waited < Duration::from_secs(30),
            "woken only by its deadline: {waited:?}"
        );
    }

    #[test]
    fn a_caller_that_finds_its_answer_spinning_takes_no_thread_handle() {
        let waiter = Waiter::new();
        waiter.add(1);
        waiter.complete_one();
        assert!(waiter.wait(
            Duration::from_secs(1),
            Instant::now() + Duration::from_secs(1)
        ));
        assert!(!waiter.about_to_park());
    }

    #[test]
    fn hostile_ids_are_stale() {
        let t = Inflight::new();
        for id in [0, u64::MAX, 1 << 63, 12345] {
            assert!(matches!(t.claim(id), Claim::Stale));
        }
    }
}
