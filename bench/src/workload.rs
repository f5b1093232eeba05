//! The measured loops: T threads, each keeping D page requests in flight
//! (one batch of D at a time), random or sequential addresses, every page's
//! content checked.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use rand::{Rng, SeedableRng};
use rdma_transport::{Page, TransportManager, PAGE_SIZE};

use crate::pattern;

/// Which operation a run measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    /// Page reads.
    Read,
    /// Page writes.
    Write,
    /// Guest-memory page faults (bench/src/fault.rs).
    Fault,
}

/// Address order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AccessPattern {
    /// Uniformly random pages.
    Random,
    /// Consecutive pages, each thread from its own start.
    Seq,
}

/// What to run.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub op: Op,
    pub ops: u64,
    pub threads: usize,
    pub depth: usize,
    pub pattern: AccessPattern,
}

/// What a run measured.
pub struct Outcome {
    pub latency_ns: Histogram<u64>,
    pub elapsed: Duration,
    pub ops_done: u64,
    pub errors: u64,
    pub bad_pages: u64,
    pub pages_checked: u64,
    pub first_error: Option<String>,
}

impl Outcome {
    /// True when every page moved was checked and correct and nothing failed.
    pub fn verified(&self) -> bool {
        self.errors == 0
            && self.bad_pages == 0
            && self.pages_checked == self.ops_done
            && self.ops_done > 0
    }
}

/// The pages under test and the seed each one holds now.
pub struct WorkingSet {
    pub gpas: Vec<u64>,
    seeds: Vec<AtomicU64>,
}

impl WorkingSet {
    pub fn new(gpas: Vec<u64>) -> Self {
        let seeds = gpas.iter().map(|_| AtomicU64::new(0)).collect();
        Self { gpas, seeds }
    }

    pub fn len(&self) -> usize {
        self.gpas.len()
    }

    /// Writes every page with `seed`'s pattern, batched, and checks the acks.
    pub fn fill(&self, mgr: &TransportManager, seed: u64) -> anyhow::Result<()> {
        let mut pages = vec![[0u8; PAGE_SIZE]; 64];
        for (chunk_index, chunk) in self.gpas.chunks(64).enumerate() {
            for (page, &gpa) in pages.iter_mut().zip(chunk) {
                pattern::fill(page, gpa, seed);
            }
            mgr.write_pages(chunk, &pages[..chunk.len()])?;
            for i in 0..chunk.len() {
                self.seeds[chunk_index * 64 + i].store(seed, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Reads every page back and counts those that differ from what was
    /// last written.
    pub fn verify_all(&self, mgr: &TransportManager) -> anyhow::Result<u64> {
        let mut pages = vec![[0u8; PAGE_SIZE]; 64];
        let mut bad = 0;
        for (chunk_index, chunk) in self.gpas.chunks(64).enumerate() {
            mgr.read_pages(chunk, &mut pages[..chunk.len()])?;
            for (i, (page, &gpa)) in pages.iter().zip(chunk).enumerate() {
                if !pattern::check(
                    page,
                    gpa,
                    self.seeds[chunk_index * 64 + i].load(Ordering::Relaxed),
                ) {
                    bad += 1;
                }
            }
        }
        Ok(bad)
    }
}

/// Runs `spec` against `mgr`; writes use `seed`.
pub fn run(
    mgr: &TransportManager,
    set: &WorkingSet,
    spec: Spec,
    seed: u64,
    progress: &ProgressBar,
) -> Outcome {
    let start = Instant::now();
    let stop = AtomicBool::new(false);
    let per_thread = spec.ops / spec.threads as u64;
    let extra = spec.ops % spec.threads as u64;
    let results: Vec<Outcome> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..spec.threads)
            .map(|t| {
                let ops = per_thread + u64::from((t as u64) < extra);
                let stop = &stop;
                s.spawn(move || thread_loop(mgr, set, spec, ops, t, seed, progress, stop))
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let elapsed = start.elapsed();
    let mut total = Outcome {
        latency_ns: new_histogram(),
        elapsed,
        ops_done: 0,
        errors: 0,
        bad_pages: 0,
        pages_checked: 0,
        first_error: None,
    };
    for r in results {
        let _ = total.latency_ns.add(&r.latency_ns);
        total.ops_done += r.ops_done;
        total.errors += r.errors;
        total.bad_pages += r.bad_pages;
        total.pages_checked += r.pages_checked;
        if total.first_error.is_none() {
            total.first_error = r.first_error;
        }
    }
    total
}

pub fn new_histogram() -> Histogram<u64> {
    // 1 ns .. 100 s at 3 significant digits: cannot fail for these bounds.
    Histogram::new_with_bounds(1, 100_000_000_000, 3).unwrap_or_else(|_| unreachable!())
}

#[allow(clippy::too_many_arguments)]
fn thread_loop(
    mgr: &TransportManager,
    set: &WorkingSet,
    spec: Spec,
    ops: u64,
    thread: usize,
    seed: u64,
    progress: &ProgressBar,
    stop: &AtomicBool,
) -> Outcome {
    let mut rng =
        rand::rngs::SmallRng::seed_from_u64(seed ^ (thread as u64).wrapping_mul(0x9e37_79b9));
    let n = set.len();
    let mut next_seq = (n / spec.threads.max(1)) * thread;
    let mut hist = new_histogram();
    let mut pages: Vec<Page> = vec![[0u8; PAGE_SIZE]; spec.depth];
    let mut gpas = vec![0u64; spec.depth];
    let mut idx = vec![0usize; spec.depth];
    let (mut done, mut errors, mut bad, mut checked) = (0u64, 0u64, 0u64, 0u64);
    let mut first_error = None;
    let mut since_tick = 0u64;
    while done < ops && !stop.load(Ordering::Relaxed) {
        let batch = spec.depth.min((ops - done) as usize);
        for i in 0..batch {
            idx[i] = match spec.pattern {
                AccessPattern::Random => rng.gen_range(0..n),
                AccessPattern::Seq => {
                    let k = next_seq % n;
                    next_seq += 1;
                    k
                }
            };
            gpas[i] = set.gpas[idx[i]];
            if spec.op == Op::Write {
                pattern::fill(&mut pages[i], gpas[i], seed);
            }
        }
        let t0 = Instant::now();
        let result = match spec.op {
            // The fault op runs in fault.rs, never here.
            Op::Read | Op::Fault => mgr.read_pages(&gpas[..batch], &mut pages[..batch]),
            Op::Write => mgr.write_pages(&gpas[..batch], &pages[..batch]),
        };
        let latency_ns = t0.elapsed().as_nanos() as u64;
        done += batch as u64;
        match result {
            Ok(()) => {
                let _ = hist.record_n(latency_ns.max(1), batch as u64);
                for i in 0..batch {
                    match spec.op {
                        Op::Read | Op::Fault => {
                            let expected = set.seeds[idx[i]].load(Ordering::Relaxed);
                            if !pattern::check(&pages[i], gpas[i], expected) {
                                bad += 1;
                            }
                        }
                        // Checked by reading back after the run.
                        Op::Write => set.seeds[idx[i]].store(seed, Ordering::Relaxed),
                    }
                }
                if spec.op != Op::Write {
                    checked += batch as u64;
                }
            }
            Err(e) => {
                errors += batch as u64;
                first_error.get_or_insert_with(|| e.to_string());
                if errors > 1000 {
                    stop.store(true, Ordering::Relaxed);
                }
            }
        }
        since_tick += batch as u64;
        if since_tick >= 1024 {
            progress.inc(since_tick);
            since_tick = 0;
        }
    }
    progress.inc(since_tick);
    Outcome {
        latency_ns: hist,
        elapsed: Duration::ZERO,
        ops_done: done,
        errors,
        bad_pages: bad,
        pages_checked: checked,
        first_error,
    }
}
