//! The measured loops: T threads, each keeping D page requests in flight
//! (one batch of D at a time), random or sequential addresses, every page's
//! content checked.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::ProgressBar;
use rand::{Rng, SeedableRng};
use rdma_transport::{Page, TransportManager, PAGE_SIZE};

use crate::failure::{Disruption, Window};
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
    /// Coherent guest memory shared by `--hv` node processes
    /// (bench/src/coherence.rs).
    Coherence,
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

/// Which library call moves the pages of a read run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `read_pages`/`write_pages` into and from the caller's buffers.
    #[default]
    Copy,
    /// `read_frame`: each page is read into a pool frame and checked there
    /// (one page per call); writes stay `write_pages`.
    Frame,
    /// The completion queue: each thread keeps `--depth` one-page
    /// submissions in flight, a new one going out as each completes.
    Async,
}

impl Api {
    /// The name printed and written to JSON.
    pub fn name(self) -> &'static str {
        match self {
            Api::Copy => "copy",
            Api::Frame => "frame",
            Api::Async => "async",
        }
    }
}

/// Whether worker threads register their page buffers with the transport
/// (`--register-buffers`). Process-wide rather than a `Spec` field: it is
/// set once from the command line and every run of the process uses it.
static REGISTER_BUFFERS: AtomicBool = AtomicBool::new(false);

/// Sets whether worker threads register their page buffers (zero-copy
/// RDMA: reads land in them, writes go out of them, no pool frame).
pub fn set_register_buffers(on: bool) {
    REGISTER_BUFFERS.store(on, Ordering::Relaxed);
}

/// Whether worker threads register their page buffers.
pub fn register_buffers() -> bool {
    REGISTER_BUFFERS.load(Ordering::Relaxed)
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
    /// Nothing done yet, over `elapsed`.
    pub fn empty(elapsed: Duration) -> Self {
        Self {
            latency_ns: new_histogram(),
            elapsed,
            ops_done: 0,
            errors: 0,
            bad_pages: 0,
            pages_checked: 0,
            first_error: None,
        }
    }

    /// Adds `part`'s operations, latencies and errors to these (the
    /// elapsed time stays: the caller knows how the parts overlapped).
    pub fn absorb(&mut self, part: Outcome) {
        let _ = self.latency_ns.add(&part.latency_ns);
        self.ops_done += part.ops_done;
        self.errors += part.errors;
        self.bad_pages += part.bad_pages;
        self.pages_checked += part.pages_checked;
        if self.first_error.is_none() {
            self.first_error = part.first_error;
        }
    }

    /// True when every page moved was checked and correct and nothing failed.
    pub fn verified(&self) -> bool {
        self.errors == 0
            && self.bad_pages == 0
            && self.pages_checked == self.ops_done
            && self.ops_done > 0
    }

    /// As [`Outcome::verified`], with failed operations allowed (counted
    /// and reported elsewhere): every page that did move was checked and
    /// right.
    pub fn verified_despite_errors(&self) -> bool {
        self.bad_pages == 0
            && self.pages_checked == self.ops_done.saturating_sub(self.errors)
            && self.ops_done > self.errors
    }
}

/// The pages under test and the seed each one holds now.
pub struct WorkingSet {
    pub gpas: Vec<u64>,
    seeds: Vec<AtomicU64>,
    /// The seed of a write that failed (0: none since the last
    /// acknowledged one): the page may hold it instead, since a write can
    /// land on some replica and still fail.
    maybe_seeds: Vec<AtomicU64>,
}

/// What reading back the working set after a write run found.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Readback {
    /// Pages read and checked.
    pub pages_checked: u64,
    /// Pages that could not be read.
    pub unreadable: u64,
    /// Pages that hold neither their last acknowledged write nor a failed
    /// later one.
    pub wrong: u64,
    /// Pages acknowledged by the run (`run_seed`) that do not hold it now,
    /// or cannot be read: lost acknowledged writes.
    pub lost_acked: u64,
}

impl WorkingSet {
    /// The index of the node serving each page (its primary holder in
    /// `map`), numbered in the order the nodes are first met: the bare
    /// baseline spreads its pages over as many servers the same way. (Every
    /// page of the set was read from the map, so each has one.)
    pub fn owners(&self, map: &rdma_transport::GpaMap) -> Vec<usize> {
        let mut order: Vec<usize> = Vec::new();
        self.gpas
            .iter()
            .map(|&gpa| {
                let node = map.lookup(gpa).map_or(usize::MAX, |l| l.node_index);
                order.iter().position(|&n| n == node).unwrap_or_else(|| {
                    order.push(node);
                    order.len() - 1
                })
            })
            .collect()
    }

    pub fn new(gpas: Vec<u64>) -> Self {
        let seeds = gpas.iter().map(|_| AtomicU64::new(0)).collect();
        let maybe_seeds = gpas.iter().map(|_| AtomicU64::new(0)).collect();
        Self {
            gpas,
            seeds,
            maybe_seeds,
        }
    }

    /// Page `idx` was written with `seed` and acknowledged.
    pub fn acked(&self, idx: usize, seed: u64) {
        self.seeds[idx].store(seed, Ordering::Relaxed);
        self.maybe_seeds[idx].store(0, Ordering::Relaxed);
    }

    /// A write of `seed` to page `idx` failed: the page may hold it.
    pub fn maybe(&self, idx: usize, seed: u64) {
        self.maybe_seeds[idx].store(seed, Ordering::Relaxed);
    }

    /// Whether `page` holds what page `idx` may hold now.
    pub fn holds(&self, idx: usize, page: &Page) -> bool {
        let gpa = self.gpas[idx];
        let maybe = self.maybe_seeds[idx].load(Ordering::Relaxed);
        pattern::check(page, gpa, self.seeds[idx].load(Ordering::Relaxed))
            || (maybe != 0 && pattern::check(page, gpa, maybe))
    }

    /// Reads every page back, never stopping at an error, and checks it
    /// (see [`Readback`]). A page that holds a failed write's seed takes it
    /// as its seed from now on.
    pub fn readback(&self, mgr: &TransportManager, run_seed: u64) -> Readback {
        let mut found = Readback::default();
        let mut pages = vec![[0u8; PAGE_SIZE]; 64];
        for (chunk_index, chunk) in self.gpas.chunks(64).enumerate() {
            let first = chunk_index * 64;
            let read: Vec<bool> = match mgr.read_pages(chunk, &mut pages[..chunk.len()]) {
                Ok(()) => vec![true; chunk.len()],
                // Page by page, to tell which ones cannot be read.
                Err(_) => chunk
                    .iter()
                    .zip(pages.iter_mut())
                    .map(|(&gpa, page)| mgr.read_pages(&[gpa], std::slice::from_mut(page)).is_ok())
                    .collect(),
            };
            for (i, ok) in read.into_iter().enumerate() {
                let idx = first + i;
                let acked = self.seeds[idx].load(Ordering::Relaxed) == run_seed;
                if !ok {
                    found.unreadable += 1;
                    found.lost_acked += u64::from(acked);
                    continue;
                }
                found.pages_checked += 1;
                let page = &pages[i];
                if acked && !pattern::check(page, self.gpas[idx], run_seed) {
                    found.lost_acked += 1;
                }
                if !self.holds(idx, page) {
                    found.wrong += 1;
                    continue;
                }
                let maybe = self.maybe_seeds[idx].swap(0, Ordering::Relaxed);
                if maybe != 0 && pattern::check(page, self.gpas[idx], maybe) {
                    self.seeds[idx].store(maybe, Ordering::Relaxed);
                }
            }
        }
        found
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
            for (i, page) in pages[..chunk.len()].iter().enumerate() {
                if !self.holds(chunk_index * 64 + i, page) {
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
    run_observed(mgr, set, spec, seed, progress, None, Api::Copy).0
}

/// As [`run`], reads through `api`.
pub fn run_api(
    mgr: &TransportManager,
    set: &WorkingSet,
    spec: Spec,
    seed: u64,
    progress: &ProgressBar,
    api: Api,
) -> Outcome {
    if api == Api::Async {
        return crate::async_loop::run(mgr, set, spec, seed, progress).unwrap_or_else(|e| {
            Outcome {
                errors: 1,
                first_error: Some(format!("{e:#}")),
                ..Outcome::empty(Duration::ZERO)
            }
        });
    }
    run_observed(mgr, set, spec, seed, progress, None, api).0
}

/// As [`run`], and also counts failed pages by kind and, with `window`
/// (a failure injected meanwhile), times the requests that started in it.
/// With a window, the run never stops early on errors: it counts them.
pub fn run_observed(
    mgr: &TransportManager,
    set: &WorkingSet,
    spec: Spec,
    seed: u64,
    progress: &ProgressBar,
    window: Option<Window>,
    api: Api,
) -> (Outcome, Disruption) {
    let start = Instant::now();
    let stop = AtomicBool::new(false);
    let per_thread = spec.ops / spec.threads as u64;
    let extra = spec.ops % spec.threads as u64;
    let results: Vec<(Outcome, Disruption)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..spec.threads)
            .map(|t| {
                let ops = per_thread + u64::from((t as u64) < extra);
                let stop = &stop;
                let window = window.as_ref();
                s.spawn(move || {
                    let ctx = ThreadCtx {
                        mgr,
                        set,
                        spec,
                        api,
                        progress,
                        stop,
                        window,
                    };
                    thread_loop(&ctx, ops, t, seed)
                })
            })
            .collect();
        handles.into_iter().filter_map(|h| h.join().ok()).collect()
    });
    let elapsed = start.elapsed();
    let mut total = Outcome::empty(elapsed);
    let mut disruption = Disruption::new();
    for (r, d) in results {
        disruption.merge(&d);
        total.absorb(r);
    }
    (total, disruption)
}

pub fn new_histogram() -> Histogram<u64> {
    // 1 ns .. 100 s at 3 significant digits: cannot fail for these bounds.
    Histogram::new_with_bounds(1, 100_000_000_000, 3).unwrap_or_else(|_| unreachable!())
}

/// What every thread of a run shares.
struct ThreadCtx<'a> {
    mgr: &'a TransportManager,
    set: &'a WorkingSet,
    spec: Spec,
    api: Api,
    progress: &'a ProgressBar,
    stop: &'a AtomicBool,
    window: Option<&'a Window>,
}

/// Reads `gpas` into `pages` through `api`: with `Frame`, one `read_frame`
/// per page into `frames` (checked there by the caller; `pages` untouched).
fn read_batch(
    mgr: &TransportManager,
    api: Api,
    gpas: &[u64],
    pages: &mut [Page],
    frames: &mut Vec<rdma_transport::PageFrame>,
) -> Result<(), rdma_transport::TransportError> {
    match api {
        // (`Async` runs in async_loop.rs, never here.)
        Api::Copy | Api::Async => mgr.read_pages(gpas, pages),
        Api::Frame => {
            frames.clear();
            for &gpa in gpas {
                frames.push(mgr.read_frame(gpa)?);
            }
            Ok(())
        }
    }
}

fn thread_loop(ctx: &ThreadCtx<'_>, ops: u64, thread: usize, seed: u64) -> (Outcome, Disruption) {
    let ThreadCtx {
        mgr,
        set,
        spec,
        api,
        progress,
        stop,
        window,
    } = *ctx;
    let mut frames = Vec::with_capacity(spec.depth);
    let mut disruption = Disruption::new();
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
    let _registered = if register_buffers() {
        // SAFETY: `pages` is neither moved nor resized for the rest of this
        // function and outlives the handle (declared after it, so dropped
        // first); the loop reads and writes it only between calls, each of
        // which has returned.
        match unsafe { mgr.register_memory(pages.as_mut_ptr().cast(), pages.len() * PAGE_SIZE) } {
            Ok(handle) => Some(handle),
            Err(e) => {
                errors += 1;
                first_error = Some(format!("registering the page buffers: {e}"));
                None
            }
        }
    } else {
        None
    };
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
            // The fault and coherence ops run in their own files, never here.
            Op::Read | Op::Fault | Op::Coherence => {
                read_batch(mgr, api, &gpas[..batch], &mut pages[..batch], &mut frames)
            }
            Op::Write => mgr.write_pages(&gpas[..batch], &pages[..batch]),
        };
        let latency_ns = t0.elapsed().as_nanos() as u64;
        done += batch as u64;
        disruption.record(window, t0, latency_ns, batch as u64, result.as_ref().err());
        match result {
            Ok(()) => {
                let _ = hist.record_n(latency_ns.max(1), batch as u64);
                for i in 0..batch {
                    match spec.op {
                        Op::Read | Op::Fault | Op::Coherence => {
                            // Frame reads are checked in the frame itself.
                            let page: &Page = match frames.get(i) {
                                Some(frame) => frame,
                                None => &pages[i],
                            };
                            if !set.holds(idx[i], page) {
                                if bad == 0 {
                                    tracing::warn!(
                                        gpa = format_args!("{:#x}", gpas[i]),
                                        zeroed = page.iter().all(|&b| b == 0),
                                        word0 = format_args!(
                                            "{:#x}",
                                            u64::from_le_bytes(
                                                page[..8].try_into().unwrap_or_default()
                                            )
                                        ),
                                        "first wrong page read by this thread"
                                    );
                                }
                                bad += 1;
                            }
                        }
                        // Checked by reading back after the run.
                        Op::Write => {
                            set.seeds[idx[i]].store(seed, Ordering::Relaxed);
                            set.maybe_seeds[idx[i]].store(0, Ordering::Relaxed);
                        }
                    }
                }
                if spec.op != Op::Write {
                    checked += batch as u64;
                }
            }
            Err(e) => {
                errors += batch as u64;
                first_error.get_or_insert_with(|| e.to_string());
                if spec.op == Op::Write {
                    for &i in &idx[..batch] {
                        set.maybe_seeds[i].store(seed, Ordering::Relaxed);
                    }
                }
                // Under an injected failure errors are what is measured.
                if errors > 1000 && window.is_none() {
                    stop.store(true, Ordering::Relaxed);
                }
            }
        }
        frames.clear();
        since_tick += batch as u64;
        if since_tick >= 1024 {
            progress.inc(since_tick);
            since_tick = 0;
        }
    }
    progress.inc(since_tick);
    let outcome = Outcome {
        latency_ns: hist,
        elapsed: Duration::ZERO,
        ops_done: done,
        errors,
        bad_pages: bad,
        pages_checked: checked,
        first_error,
    };
    (outcome, disruption)
}
