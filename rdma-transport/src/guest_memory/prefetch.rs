//! Sequential read-ahead.
//!
//! A small lock-free table of streams remembers, for the last few faults,
//! which page would continue them. A fault on that page is sequential: the
//! handler claims the next `window` pages (marks them `FETCHING`, so faults
//! on them wait for the prefetch instead of fetching again) and queues one
//! batch for the prefetch thread, which reads the whole batch with one
//! [`TransportManager::read_pages`](crate::TransportManager::read_pages) (all requests in flight at once) and
//! installs the pages clean while the vCPU works on the page it faulted on.
//! The window doubles on every sequential fault, from 4 up to
//! `prefetch_max_pages` (at most 64). When a fault has to wait for a page
//! still being prefetched, the vCPU has caught up with read-ahead: the next
//! window is queued at once, so one batch is fetched while the vCPU works
//! through the previous one (at most two windows ahead). Random faults never
//! match a stream and cost one table scan.
//!
//! Bounded: at most `QUEUE_DEPTH` batches wait; when the queue is full the
//! claim is undone and the batch dropped.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;

use crossbeam_queue::ArrayQueue;

use crate::page::{Page, PAGE_SIZE};

use super::shared::{Counters, Shared};
use super::state::{generation, DIRTY, FETCHING, LOCKED, POISONED, PRESENT};
use super::uffd::CopyOutcome;

/// Largest prefetch window (pages); a batch's pages fit a `u64` mask.
pub(crate) const MAX_WINDOW: usize = 64;
const FIRST_WINDOW: usize = 4;
const STREAMS: usize = 8;
const QUEUE_DEPTH: usize = 16;

/// Streams: `expect[i]` is the page that continues stream i (plus one; 0 is
/// an empty slot), `window[i]` its current window.
#[derive(Debug)]
pub(crate) struct StreamTable {
    expect: [AtomicUsize; STREAMS],
    window: [AtomicUsize; STREAMS],
    next_slot: AtomicUsize,
}

impl Default for StreamTable {
    fn default() -> Self {
        Self {
            expect: std::array::from_fn(|_| AtomicUsize::new(0)),
            window: std::array::from_fn(|_| AtomicUsize::new(0)),
            next_slot: AtomicUsize::new(0),
        }
    }
}

impl StreamTable {
    /// Records a fault on `page`; returns the window to prefetch after it
    /// when the fault continues a stream.
    fn on_fault(&self, page: usize, max_window: usize) -> Option<usize> {
        let key = page + 1;
        for i in 0..STREAMS {
            if self.expect[i].load(Ordering::Relaxed) == key {
                let window =
                    (self.window[i].load(Ordering::Relaxed) * 2).clamp(FIRST_WINDOW, max_window);
                // Another handler may have taken the same hit; one wins.
                if self.expect[i]
                    .compare_exchange(key, key + 1 + window, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    self.window[i].store(window, Ordering::Relaxed);
                    return Some(window);
                }
                return None;
            }
        }
        let slot = self.next_slot.fetch_add(1, Ordering::Relaxed) % STREAMS;
        self.window[slot].store(0, Ordering::Relaxed);
        self.expect[slot].store(key + 1, Ordering::Relaxed);
        None
    }

    /// A fault on `page` waits for read-ahead: when `page` is within one
    /// window of a stream's frontier, moves the frontier one window on and
    /// returns the pages to fetch now, so one batch is always in flight
    /// ahead of the vCPU (never more than two windows ahead).
    fn extend(&self, page: usize) -> Option<(usize, usize)> {
        for i in 0..STREAMS {
            let key = self.expect[i].load(Ordering::Relaxed);
            let window = self.window[i].load(Ordering::Relaxed);
            if key == 0 || window == 0 {
                continue;
            }
            let frontier = key - 1;
            if frontier > page && frontier - page <= window {
                if self.expect[i]
                    .compare_exchange(key, key + window, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
                {
                    return Some((frontier, window));
                }
                return None;
            }
        }
        None
    }
}

/// One claimed batch: pages `first + i` for every bit i of `mask`, each
/// claimed at generation `gens[i]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Batch {
    first: usize,
    mask: u64,
    gens: [u32; MAX_WINDOW],
}

/// The queue between handlers and the prefetch thread.
#[derive(Debug)]
pub(crate) struct PrefetchQueue {
    queue: ArrayQueue<Batch>,
    thread: OnceLock<Thread>,
    pub(crate) dropped: AtomicU64,
}

impl Default for PrefetchQueue {
    fn default() -> Self {
        Self {
            queue: ArrayQueue::new(QUEUE_DEPTH),
            thread: OnceLock::new(),
            dropped: AtomicU64::new(0),
        }
    }
}

impl PrefetchQueue {
    pub(crate) fn set_thread(&self, thread: Thread) {
        let _ = self.thread.set(thread);
    }

    fn unpark(&self) {
        if let Some(t) = self.thread.get() {
            t.unpark();
        }
    }
}

/// Called by a handler after it installed `page`: starts read-ahead when
/// the fault is sequential.
pub(crate) fn after_fault(shared: &Shared, page: usize) {
    let max_window = shared.config.prefetch_max_pages.min(MAX_WINDOW);
    if max_window == 0 {
        return;
    }
    let Some(window) = shared.streams.on_fault(page, max_window) else {
        return;
    };
    queue_batch(shared, page + 1, window);
}

/// Called by a handler when a fault on `page` waits for read-ahead.
pub(crate) fn after_deferred(shared: &Shared, page: usize) {
    if shared.config.prefetch_max_pages == 0 {
        return;
    }
    if let Some((first, window)) = shared.streams.extend(page) {
        queue_batch(shared, first, window);
    }
}

/// Claims the absent pages of `[first, first + window)` and queues them.
fn queue_batch(shared: &Shared, first: usize, window: usize) {
    let end = (first + window).min(shared.region.pages());
    if first >= end {
        return;
    }
    let mut batch = Batch {
        first,
        mask: 0,
        gens: [0; MAX_WINDOW],
    };
    for p in first..end {
        if let Some(gen) = shared.states.try_start_fetch(p) {
            batch.mask |= 1 << (p - first);
            batch.gens[p - first] = gen;
        }
    }
    if batch.mask == 0 {
        return;
    }
    if let Err(batch) = shared.prefetch.queue.push(batch) {
        shared.prefetch.dropped.fetch_add(1, Ordering::Relaxed);
        unclaim(shared, &batch);
        return;
    }
    shared.prefetch.unpark();
}

fn unclaim(shared: &Shared, batch: &Batch) {
    for_each_page(batch, |p, _| shared.release(p, 0, FETCHING, false));
}

fn for_each_page(batch: &Batch, mut f: impl FnMut(usize, usize)) {
    let mut mask = batch.mask;
    while mask != 0 {
        let i = mask.trailing_zeros() as usize;
        mask &= mask - 1;
        f(batch.first + i, i);
    }
}

/// The prefetch thread: installs queued batches until `stop`.
pub(crate) fn run(shared: &Arc<Shared>) {
    let mut pages: Vec<Page> = vec![[0u8; PAGE_SIZE]; MAX_WINDOW];
    let mut gpas = [0u64; MAX_WINDOW];
    while !shared.stop.load(Ordering::Acquire) {
        match shared.prefetch.queue.pop() {
            Some(batch) => install(shared, &batch, &mut gpas, &mut pages),
            None => std::thread::park_timeout(std::time::Duration::from_millis(100)),
        }
    }
    while let Some(batch) = shared.prefetch.queue.pop() {
        unclaim(shared, &batch);
    }
}

fn install(shared: &Shared, batch: &Batch, gpas: &mut [u64; MAX_WINDOW], pages: &mut [Page]) {
    if shared.region.is_shared() {
        install_shared(shared, batch, gpas);
        return;
    }
    // The claimed pages in ascending order, with their bit in the batch.
    let mut claimed = [(0usize, 0usize); MAX_WINDOW];
    let mut n = 0;
    for_each_page(batch, |p, i| {
        gpas[n] = shared.region.page_gpa(p);
        claimed[n] = (p, i);
        n += 1;
    });
    if let Err(err) = shared.manager.read_pages(&gpas[..n], &mut pages[..n]) {
        tracing::debug!(%err, first = batch.first, "prefetch failed; faults will fetch");
        unclaim(shared, batch);
        return;
    }
    // Lock every page that is still ours to install: absent, at the
    // generation it was claimed at. try_lock only: a page held by evict is
    // dropped from the batch (its generation changes anyway).
    let mut ok = [false; MAX_WINDOW];
    for k in 0..n {
        let (p, i) = claimed[k];
        match shared.states.try_lock(p) {
            None => shared.release(p, 0, FETCHING, false),
            Some(s) if s & (PRESENT | POISONED) != 0 || generation(s) != batch.gens[i] => {
                shared.release(p, 0, LOCKED | FETCHING, false);
            }
            Some(_) => ok[k] = true,
        }
    }
    // One UFFDIO_COPY per run of consecutive pages: a vCPU catching up
    // with read-ahead waits for one ioctl, not for one per page.
    let mut start = 0;
    while start < n {
        if !ok[start] {
            start += 1;
            continue;
        }
        let mut end = start + 1;
        while end < n && ok[end] && claimed[end].0 == claimed[end - 1].0 + 1 {
            end += 1;
        }
        let mut at = start;
        let mut again = 0;
        while at < end {
            let src = pages[at..end].as_ptr().cast::<u8>();
            let dst = shared.region.page_addr(claimed[at].0);
            // Counted before the install wakes the threads that wait for
            // these pages (and taken back for those it did not install), so
            // a reader of the stats never misses them.
            Counters::add(&shared.counters.prefetched_pages, (end - at) as u64);
            // SAFETY: `pages[at..end]` is contiguous (a Vec) and holds
            // `end - at` pages; `claimed[at..end]` are consecutive pages of
            // the region, all locked by us.
            let result = unsafe { shared.uffd.copy_pages(src, dst, end - at, true) };
            let copied = result.as_ref().map_or(0, |&(copied, _)| copied);
            Counters::sub(
                &shared.counters.prefetched_pages,
                (end - at - copied) as u64,
            );
            match result {
                Ok((copied, outcome)) => {
                    for &(p, _) in &claimed[at..at + copied] {
                        shared.release(p, PRESENT, LOCKED | FETCHING, false);
                    }
                    at += copied;
                    match outcome {
                        CopyOutcome::Copied => {}
                        CopyOutcome::Exists => {
                            // Present without our knowledge: dirty, so a
                            // flush write-protects and writes it.
                            shared.release(
                                claimed[at].0,
                                PRESENT | DIRTY,
                                LOCKED | FETCHING,
                                false,
                            );
                            shared.wake(claimed[at].0);
                            at += 1;
                        }
                        CopyOutcome::Again if again < 100 => again += 1,
                        CopyOutcome::Again => break,
                    }
                }
                Err(err) => {
                    tracing::debug!(%err, page = claimed[at].0, "prefetch UFFDIO_COPY failed");
                    break;
                }
            }
        }
        for &(p, _) in &claimed[at..end] {
            shared.release(p, 0, LOCKED | FETCHING, false);
        }
        start = end;
    }
    Counters::add(&shared.counters.prefetch_batches, 1);
}

/// A shared region's batch, without a bounce: each run of consecutive
/// claimed pages is received straight into the alias with one `read_pages`,
/// then the pages still ours are mapped clean with one `UFFDIO_CONTINUE` per
/// run. While claimed (`FETCHING`), faults on the pages wait for us and
/// nothing else writes their alias (evict may drop them meanwhile: their
/// generation changes and they are not mapped).
fn install_shared(shared: &Shared, batch: &Batch, gpas: &mut [u64; MAX_WINDOW]) {
    let mut claimed = [(0usize, 0usize); MAX_WINDOW];
    let mut n = 0;
    for_each_page(batch, |p, i| {
        claimed[n] = (p, i);
        n += 1;
    });
    let mut start = 0;
    while start < n {
        let mut end = start + 1;
        while end < n && claimed[end].0 == claimed[end - 1].0 + 1 {
            end += 1;
        }
        let (first, last) = (claimed[start].0, claimed[end - 1].0 + 1);
        for (k, gpa) in gpas[..end - start].iter_mut().enumerate() {
            *gpa = shared.region.page_gpa(first + k);
        }
        if let Err(err) = shared.region.populate_alias(first, last) {
            tracing::debug!(%err, first, "populating the alias failed; pages fault in");
        }
        // SAFETY: every page of `[first, last)` is claimed `FETCHING` by
        // this batch and absent from the guest mapping: faults on them wait
        // for us, and no one else writes their alias.
        let fetched = match unsafe { shared.region.alias_pages_mut(first, last) } {
            Some(dst) => shared.manager.read_pages(&gpas[..end - start], dst),
            None => Err(crate::TransportError::Config(
                "shared region without alias".into(),
            )),
        };
        if let Err(err) = fetched {
            tracing::debug!(%err, first, "prefetch failed; faults will fetch");
            for &(p, _) in &claimed[start..end] {
                shared.release(p, 0, FETCHING, false);
            }
            start = end;
            continue;
        }
        continue_run(shared, batch, &claimed[start..end]);
        start = end;
    }
    Counters::add(&shared.counters.prefetch_batches, 1);
}

/// Locks the pages of a received run that are still ours (absent, at their
/// claimed generation) and maps them clean: one `UFFDIO_CONTINUE` when all
/// are, else one per page. Counts the pages it maps, before the call that
/// maps them wakes their waiting threads.
fn continue_run(shared: &Shared, batch: &Batch, run: &[(usize, usize)]) {
    let mut ours = [false; MAX_WINDOW];
    for (k, &(p, i)) in run.iter().enumerate() {
        match shared.states.try_lock(p) {
            None => shared.release(p, 0, FETCHING, false),
            Some(s) if s & (PRESENT | POISONED) != 0 || generation(s) != batch.gens[i] => {
                shared.release(p, 0, LOCKED | FETCHING, false);
            }
            Some(_) => ours[k] = true,
        }
    }
    let all = ours[..run.len()].iter().all(|&o| o);
    let counter = &shared.counters.prefetched_pages;
    // Where the kernel maps pages writable before they are protected
    // (Linux < 6.4, `RegionUffd::continue_clean`), they are marked dirty
    // first, as a write fault's page is, and the mark comes off each page
    // nothing wrote meanwhile.
    let writable_first = !shared.uffd.continue_write_protects();
    if writable_first {
        for (k, &(p, _)) in run.iter().enumerate() {
            if ours[k] {
                shared.states.set_bits(p, DIRTY);
            }
        }
    }
    let settle = |p: usize, written: bool| {
        let (set, clear) = if written {
            (PRESENT | DIRTY, LOCKED | FETCHING)
        } else if writable_first {
            (PRESENT, LOCKED | FETCHING | DIRTY)
        } else {
            (PRESENT, LOCKED | FETCHING)
        };
        shared.release(p, set, clear, false);
    };
    if all {
        Counters::add(counter, run.len() as u64);
        // SAFETY: consecutive pages of the registered range, locked by us,
        // whose page cache holds what we just received into the alias (the
        // same pages from `data_ptr` on).
        let mapped = unsafe {
            shared.uffd.continue_clean(
                shared.region.page_addr(run[0].0),
                shared.region.data_ptr(run[0].0),
                run.len(),
            )
        };
        if let Ok((CopyOutcome::Copied, written)) = mapped {
            for (k, &(p, _)) in run.iter().enumerate() {
                settle(p, written & (1 << k) != 0);
            }
            return;
        }
        Counters::sub(counter, run.len() as u64);
    }
    // Some pages are not ours, or the one call failed: page by page.
    for (k, &(p, _)) in run.iter().enumerate() {
        if !ours[k] {
            continue;
        }
        Counters::add(counter, 1);
        // SAFETY: as above, for one page.
        let mapped = unsafe {
            shared
                .uffd
                .continue_clean(shared.region.page_addr(p), shared.region.data_ptr(p), 1)
        };
        match mapped {
            Ok((CopyOutcome::Copied, written)) => settle(p, written != 0),
            // Mapped without our knowledge: dirty, so a flush writes it.
            Ok((CopyOutcome::Exists, _)) => {
                shared.release(p, PRESENT | DIRTY, LOCKED | FETCHING, false);
                shared.wake(p);
            }
            Ok((CopyOutcome::Again, _)) | Err(_) => {
                Counters::sub(counter, 1);
                shared.release(p, 0, LOCKED | FETCHING | DIRTY, false);
                shared.wake(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequential_faults_open_a_growing_window() {
        let t = StreamTable::default();
        assert_eq!(t.on_fault(10, 32), None, "first fault only opens a stream");
        assert_eq!(t.on_fault(11, 32), Some(4));
        // Pages 12..16 are prefetched: the next fault is on 16.
        assert_eq!(t.on_fault(16, 32), Some(8));
        assert_eq!(t.on_fault(25, 32), Some(16));
        assert_eq!(t.on_fault(42, 32), Some(32));
        assert_eq!(t.on_fault(75, 32), Some(32), "window is bounded");
    }

    #[test]
    fn catching_up_with_read_ahead_extends_it_once() {
        let t = StreamTable::default();
        t.on_fault(10, 32);
        assert_eq!(t.on_fault(11, 32), Some(4)); // 12..16 in flight
        assert_eq!(
            t.extend(12),
            Some((16, 4)),
            "vCPU waits on 12: fetch 16..20"
        );
        assert_eq!(t.extend(13), None, "frontier already a window ahead");
        assert_eq!(t.extend(17), Some((20, 4)));
        assert_eq!(
            t.on_fault(24, 32),
            Some(8),
            "the stream goes on after the frontier"
        );
        assert_eq!(t.extend(500), None, "not part of any stream");
    }

    #[test]
    fn random_faults_never_prefetch() {
        let t = StreamTable::default();
        for p in [5usize, 900, 17, 3000, 44, 8, 1234, 99, 7000, 31] {
            assert_eq!(t.on_fault(p, 32), None);
        }
    }
}
