//! The measured loop of `--api async`: each thread keeps `depth` one-page
//! submissions in flight on its own completion queue (a new one goes out as
//! soon as one completes), the latency of each is submit to reap, and every
//! page is checked as with the blocking API. With `--register-buffers` the
//! pages stay in registered memory the thread keeps (RDMA moves them
//! straight in and out); otherwise each travels with its submission.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use rand::{Rng, SeedableRng};
use rdma_transport::{Page, Reap, RegisteredMemory, TransportManager, PAGE_SIZE};

use crate::pattern;
use crate::workload::{self, new_histogram, AccessPattern, Op, Outcome, Spec, WorkingSet};

/// Runs `spec` with the asynchronous API; writes use `seed`.
pub fn run(
    mgr: &TransportManager,
    set: &WorkingSet,
    spec: Spec,
    seed: u64,
    progress: &ProgressBar,
) -> anyhow::Result<Outcome> {
    let start = Instant::now();
    let per_thread = spec.ops / spec.threads as u64;
    let extra = spec.ops % spec.threads as u64;
    let results: Vec<anyhow::Result<Outcome>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..spec.threads)
            .map(|t| {
                let ops = per_thread + u64::from((t as u64) < extra);
                s.spawn(move || thread_loop(mgr, set, spec, ops, t, seed, progress))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("bench thread panicked")))
            })
            .collect()
    });
    let mut total = Outcome::empty(start.elapsed());
    for r in results {
        total.absorb(r?);
    }
    Ok(total)
}

/// Where a thread's pages live while they are in flight.
enum Buffers {
    /// One buffer per slot, handed to the queue with each submission and
    /// given back in its completion (`submit_read` / `submit_write`).
    Owned(VecDeque<Box<[Page]>>),
    /// One page per slot in memory the thread keeps, registered with the
    /// transport (`--register-buffers`): RDMA moves each page straight
    /// into or out of it (`submit_read_raw` / `submit_write_raw`). Only
    /// `base` is used once the loop starts, never `pages` itself.
    Registered {
        base: *mut Page,
        _handle: RegisteredMemory,
        _pages: Box<[Page]>,
    },
}

impl Buffers {
    fn new(mgr: &TransportManager, depth: usize) -> anyhow::Result<Self> {
        if !workload::register_buffers() {
            return Ok(Self::Owned(
                (0..depth)
                    .map(|_| vec![[0u8; PAGE_SIZE]; 1].into_boxed_slice())
                    .collect(),
            ));
        }
        let mut pages = vec![[0u8; PAGE_SIZE]; depth].into_boxed_slice();
        let base = pages.as_mut_ptr();
        // SAFETY: the boxed pages are never moved or freed before the handle
        // (a field declared before them, so dropped first), and the handle
        // outlives the queue (`thread_loop` makes the queue after this, so
        // drops it first): no request refers to the range once it goes.
        let handle = unsafe { mgr.register_memory(base.cast(), depth * PAGE_SIZE) }
            .map_err(|e| anyhow::anyhow!("registering the page buffers: {e}"))?;
        Ok(Self::Registered {
            base,
            _handle: handle,
            _pages: pages,
        })
    }
}

fn thread_loop(
    mgr: &TransportManager,
    set: &WorkingSet,
    spec: Spec,
    ops: u64,
    thread: usize,
    seed: u64,
    progress: &ProgressBar,
) -> anyhow::Result<Outcome> {
    let depth = spec.depth.max(1);
    // Declared before the queue, so dropped after it: the queue's drop
    // cancels whatever is still in flight in these pages.
    let mut buffers = Buffers::new(mgr, depth)?;
    let queue = mgr.completion_queue(Reap::Poll)?;
    let mut rng =
        rand::rngs::SmallRng::seed_from_u64(seed ^ (thread as u64).wrapping_mul(0x9e37_79b9));
    let n = set.len();
    let mut next_seq = (n / spec.threads.max(1)) * thread;
    let mut hist = new_histogram();
    // Per slot: the page index it moves and when it went out.
    let mut slots: Vec<(usize, Instant)> = vec![(0, Instant::now()); depth];
    let (mut submitted, mut done, mut errors, mut bad, mut checked) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    let mut first_error = None;
    let mut completions = Vec::with_capacity(depth);
    let mut free_slots: Vec<usize> = (0..depth).collect();
    let mut since_tick = 0u64;
    while done < ops {
        // One clock read for the submissions of this pass, as the bare
        // pipelined client reads it once per write of its requests; each
        // latency still runs from before its submission to its reap.
        let burst = Instant::now();
        while submitted < ops {
            let Some(slot) = free_slots.pop() else { break };
            let idx = match spec.pattern {
                AccessPattern::Random => rng.gen_range(0..n),
                AccessPattern::Seq => {
                    let k = next_seq % n;
                    next_seq += 1;
                    k
                }
            };
            let gpa = set.gpas[idx];
            slots[slot] = (idx, burst);
            let tag = slot as u64;
            match &mut buffers {
                Buffers::Owned(free) => {
                    let mut buf = free
                        .pop_front()
                        .ok_or_else(|| anyhow::anyhow!("no buffer for a free slot"))?;
                    if spec.op == Op::Write {
                        pattern::fill(&mut buf[0], gpa, seed);
                        queue.submit_write(&[gpa], buf, tag)?;
                    } else {
                        queue.submit_read(&[gpa], buf, tag)?;
                    }
                }
                Buffers::Registered { base, .. } => {
                    // Slot < depth: inside the pages at `base`.
                    let page = base.wrapping_add(slot);
                    if spec.op == Op::Write {
                        // SAFETY: the slot is free, so no submission in
                        // flight uses its page: nobody else touches it.
                        pattern::fill(unsafe { &mut *page }, gpa, seed);
                        // SAFETY: the page stays untouched until this
                        // submission is reaped (its slot is busy until then)
                        // or the queue is dropped.
                        unsafe { queue.submit_write_raw(&[gpa], page, tag) }?;
                    } else {
                        // SAFETY: as for the write.
                        unsafe { queue.submit_read_raw(&[gpa], page, tag) }?;
                    }
                }
            }
            submitted += 1;
        }
        completions.clear();
        queue.wait(&mut completions, 1, Duration::from_secs(60));
        let reaped = Instant::now();
        for c in completions.drain(..) {
            let slot = c.user_data as usize;
            let (idx, sent) = slots[slot];
            free_slots.push(slot);
            done += 1;
            match c.result {
                Ok(()) => {
                    let latency_ns = reaped.duration_since(sent).as_nanos() as u64;
                    let _ = hist.record(latency_ns.max(1));
                    if spec.op == Op::Write {
                        set.acked(idx, seed);
                    } else {
                        checked += 1;
                        let holds = match (&c.pages, &buffers) {
                            (Some(pages), _) => set.holds(idx, &pages[0]),
                            (None, Buffers::Registered { base, .. }) => {
                                // SAFETY: slot < depth pages at `base`; this
                                // slot's read was reaped, so nothing writes
                                // its page until the slot is used again.
                                let page = unsafe { &*base.wrapping_add(slot) };
                                set.holds(idx, page)
                            }
                            (None, Buffers::Owned(_)) => {
                                anyhow::bail!("a completion without its buffer")
                            }
                        };
                        if !holds {
                            bad += 1;
                        }
                    }
                }
                Err(e) => {
                    errors += 1;
                    first_error.get_or_insert_with(|| e.to_string());
                    if spec.op == Op::Write {
                        set.maybe(idx, seed);
                    }
                }
            }
            if let (Some(pages), Buffers::Owned(free)) = (c.pages, &mut buffers) {
                free.push_back(pages);
            }
            since_tick += 1;
        }
        if since_tick >= 1024 {
            progress.inc(since_tick);
            since_tick = 0;
        }
        if errors > 1000 {
            break;
        }
    }
    progress.inc(since_tick);
    Ok(Outcome {
        latency_ns: hist,
        elapsed: Duration::ZERO,
        ops_done: done,
        errors,
        bad_pages: bad,
        pages_checked: checked,
        first_error,
    })
}
