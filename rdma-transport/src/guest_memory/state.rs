//! One atomic word per guest page: what the page is (present, dirty,
//! poisoned, being prefetched), who works on it (a lock bit), whether
//! faulting threads wait for that work (so the worker wakes them), and a
//! generation bumped each time the page is dropped.
//!
//! Faulting (vCPU) threads never touch these words: the kernel parks them in
//! the fault. Handler threads never wait on a lock here: when a page is busy
//! they set `WAITERS` and move on, and whoever releases it wakes the
//! threads. Only `flush`/`evict` spin, and only on the short sections
//! handlers hold (one `UFFDIO_COPY` or `UFFDIO_WRITEPROTECT`).

use std::sync::atomic::{AtomicU32, Ordering};

/// Someone (handler, prefetcher, flush, evict) works on the page.
pub(crate) const LOCKED: u32 = 1 << 0;
/// Threads wait in a fault on this page: wake them on release.
pub(crate) const WAITERS: u32 = 1 << 1;
/// The page is mapped (installed by a handler or the prefetcher).
pub(crate) const PRESENT: u32 = 1 << 2;
/// Written since its last write-back: mapped writable. Implies `PRESENT`.
pub(crate) const DIRTY: u32 = 1 << 3;
/// A poison marker is installed: accesses raise SIGBUS.
pub(crate) const POISONED: u32 = 1 << 4;
/// The prefetcher is fetching the page: faults on it wait for it.
pub(crate) const FETCHING: u32 = 1 << 5;

const GEN_ONE: u32 = 1 << 8;

/// Generation of a state word.
pub(crate) fn generation(state: u32) -> u32 {
    state >> 8
}

/// The state words of a region.
#[derive(Debug)]
pub(crate) struct PageStates {
    words: Box<[AtomicU32]>,
}

impl PageStates {
    pub(crate) fn new(pages: usize) -> Self {
        Self {
            words: (0..pages).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.words.len()
    }

    pub(crate) fn load(&self, page: usize) -> u32 {
        self.words[page].load(Ordering::Acquire)
    }

    /// Sets `LOCKED` unless it is set; returns the state before.
    pub(crate) fn try_lock(&self, page: usize) -> Option<u32> {
        let word = &self.words[page];
        let mut s = word.load(Ordering::Relaxed);
        loop {
            if s & LOCKED != 0 {
                return None;
            }
            match word.compare_exchange_weak(s, s | LOCKED, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Some(s),
                Err(now) => s = now,
            }
        }
    }

    /// Takes the lock, spinning then yielding while a handler holds it.
    /// Never called on a handler thread.
    pub(crate) fn lock_spin(&self, page: usize) -> u32 {
        let mut spins = 0u32;
        loop {
            if let Some(s) = self.try_lock(page) {
                return s;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// Marks that a faulting thread waits on the page while any bit of
    /// `busy` is set. False when none is set any more (the caller handles
    /// the fault itself).
    pub(crate) fn defer(&self, page: usize, busy: u32) -> bool {
        let word = &self.words[page];
        let mut s = word.load(Ordering::Relaxed);
        loop {
            if s & busy == 0 {
                return false;
            }
            match word.compare_exchange_weak(s, s | WAITERS, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(now) => s = now,
            }
        }
    }

    /// Sets `set`, clears `clear` (and bumps the generation when `dropped`).
    /// When this leaves the page neither locked nor being fetched, also
    /// clears `WAITERS` and returns whether the caller must wake the
    /// page's waiters.
    pub(crate) fn release(&self, page: usize, set: u32, clear: u32, dropped: bool) -> bool {
        let word = &self.words[page];
        let mut s = word.load(Ordering::Relaxed);
        loop {
            let mut new = (s | set) & !clear;
            if dropped {
                new = new.wrapping_add(GEN_ONE);
            }
            let wake = new & (LOCKED | FETCHING) == 0 && new & WAITERS != 0;
            if wake {
                new &= !WAITERS;
            }
            match word.compare_exchange_weak(s, new, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return wake,
                Err(now) => s = now,
            }
        }
    }

    /// Claims a page for prefetch when it is absent and nobody works on
    /// it; returns its generation.
    pub(crate) fn try_start_fetch(&self, page: usize) -> Option<u32> {
        let word = &self.words[page];
        let mut s = word.load(Ordering::Relaxed);
        loop {
            if s & (PRESENT | LOCKED | FETCHING | POISONED) != 0 {
                return None;
            }
            match word.compare_exchange_weak(s, s | FETCHING, Ordering::AcqRel, Ordering::Relaxed) {
                Ok(_) => return Some(generation(s)),
                Err(now) => s = now,
            }
        }
    }

    /// Sets `bits` without the lock (flags that only add work, e.g. `DIRTY`
    /// after a failed write-back of a page that stays present).
    pub(crate) fn set_bits(&self, page: usize, bits: u32) {
        self.words[page].fetch_or(bits, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lock_defer_release_wakes_once() {
        let s = PageStates::new(4);
        assert_eq!(s.try_lock(1), Some(0));
        assert_eq!(s.try_lock(1), None);
        assert!(s.defer(1, LOCKED));
        assert!(!s.defer(2, LOCKED), "page 2 is not busy");
        assert!(
            s.release(1, PRESENT, LOCKED, false),
            "waiters must be woken"
        );
        assert_eq!(s.load(1), PRESENT);
        assert!(!s.release(1, 0, 0, false));
    }

    #[test]
    fn fetching_holds_waiters_until_both_bits_clear() {
        let s = PageStates::new(1);
        let gen = s.try_start_fetch(0).unwrap();
        assert_eq!(gen, 0);
        assert!(s.try_start_fetch(0).is_none());
        assert!(s.defer(0, LOCKED | FETCHING));
        assert!(s.try_lock(0).is_some());
        assert!(!s.release(0, 0, FETCHING, false), "still locked");
        assert!(s.release(0, PRESENT, LOCKED, false));
        assert!(
            s.try_start_fetch(0).is_none(),
            "present pages are not fetched"
        );
    }

    #[test]
    fn dropping_bumps_the_generation() {
        let s = PageStates::new(1);
        s.try_lock(0).unwrap();
        s.release(0, 0, LOCKED | PRESENT | DIRTY, true);
        assert_eq!(generation(s.load(0)), 1);
        assert_eq!(s.load(0) & 0xff, 0);
    }
}
