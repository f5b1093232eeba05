//! The vCPU workload of a coherent VM, its victim and its final check.
//! Every access is a plain load, store or compare-and-swap in guest RAM:
//! the coherence protocol underneath is what makes them agree across
//! nodes.

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rdma_transport::coherent::Access;
use rdma_transport::guest_memory::CoherentMemory;
use rdma_transport::{TransportError, PAGE_SIZE};
use serde_json::json;

use super::layout::{self, COUNTERS, LOCK, RING_SLOTS, STRUCT_FIRST, STRUCT_PAGES};

/// The VM as one node sees it, and the workload's sizes.
pub struct Vm<'a> {
    pub memory: &'a CoherentMemory,
    pub nodes: usize,
    pub victim: Option<usize>,
    pub vcpus: usize,
    pub iters: u64,
    pub lock_iters: u64,
    pub messages: u64,
    pub wait_limit: Duration,
}

/// What one vCPU saw go wrong.
#[derive(Debug, Default)]
struct Findings {
    errors: Vec<String>,
}

impl Findings {
    fn push(&mut self, e: String) {
        if self.errors.len() < 20 {
            self.errors.push(e);
        }
    }
}

impl Vm<'_> {
    /// The u64 at `gpa` (8-byte aligned, inside the region).
    fn word(&self, gpa: u64) -> &AtomicU64 {
        let ptr = self
            .memory
            .host_addr(gpa)
            .expect("the layout fits the region (checked at start)");
        // SAFETY: an aligned u64 inside the region, which lives as long as
        // `self`; guest RAM is only ever accessed atomically here.
        unsafe { &*ptr.cast::<AtomicU64>() }
    }

    /// Nodes that run vCPUs (all but the victim).
    fn workers(&self) -> u64 {
        (self.nodes - usize::from(self.victim.is_some())) as u64
    }

    fn vcpus_total(&self) -> u64 {
        self.workers() * self.vcpus as u64
    }

    /// Spins (yielding) until `done`, at most the wait limit.
    fn wait(&self, what: &str, mut done: impl FnMut() -> bool) -> anyhow::Result<()> {
        let started = Instant::now();
        while !done() {
            if started.elapsed() > self.wait_limit {
                bail!("waited {:?} for {what}", self.wait_limit);
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Counts this vCPU in at the barrier on `page`, then waits for
    /// `expected` arrivals.
    fn barrier(&self, page: usize, expected: u64) -> anyhow::Result<()> {
        let word = self.word(layout::gpa(page));
        word.fetch_add(1, Ordering::AcqRel);
        self.wait("the other vCPUs at a barrier", || {
            word.load(Ordering::Acquire) >= expected
        })
    }

    /// `run`: vCPUs (counters, then the lock) and this node's ring end,
    /// then what this node can check, then its pages handed back.
    pub fn run(&self, node: usize) -> anyhow::Result<serde_json::Value> {
        if self.victim == Some(node) {
            bail!("node {node} is the victim");
        }
        let start_expected = self.vcpus_total() + u64::from(self.victim.is_some());
        let ring = layout::ring_of(node, self.nodes).filter(|_| {
            // A ring whose other end is the victim is not run.
            !self.victim.is_some_and(|v| v / 2 == node / 2)
        });
        let started = Instant::now();
        let results: Vec<anyhow::Result<Findings>> = std::thread::scope(|s| {
            let mut handles = Vec::new();
            for v in 0..self.vcpus {
                let id = (node * self.vcpus + v) as u64 + 1;
                handles.push(s.spawn(move || -> anyhow::Result<Findings> {
                    self.barrier(layout::START, start_expected)?;
                    let mut found = Findings::default();
                    self.counters(id);
                    self.locked_updates(id, &mut found)?;
                    self.barrier(layout::DONE, self.vcpus_total())?;
                    Ok(found)
                }));
            }
            if let Some((r, producer)) = ring {
                handles.push(s.spawn(move || {
                    let mut found = Findings::default();
                    if producer {
                        self.produce(r)?;
                    } else {
                        self.consume(r, &mut found)?;
                    }
                    Ok(found)
                }));
            }
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| bail!("a vCPU panicked")))
                .collect()
        });
        let elapsed = started.elapsed();
        let mut found = Findings::default();
        for r in results {
            match r {
                Ok(f) => f.errors.into_iter().for_each(|e| found.push(e)),
                Err(e) => found.push(format!("{e:#}")),
            }
        }
        // Every vCPU passed the end barrier: every increment and update
        // anywhere is done, and must be visible here.
        let (counter_total, struct_version) = self.check_shared_state(&mut found);
        let handed_back = self
            .memory
            .evict(0, self.memory.size_bytes() as u64)
            .context("handing the pages back")?;
        Ok(json!({
            "role": "run",
            "verified": found.errors.is_empty(),
            "errors": found.errors,
            "seconds": elapsed.as_secs_f64(),
            "counter_total": counter_total,
            "lock_acquisitions": struct_version,
            "ring": ring.map(|(r, producer)| json!({ "ring": r, "producer": producer, "messages": self.messages })),
            "pages_handed_back": handed_back,
        }))
    }

    /// `iters` compare-and-swap increments over the counters (each vCPU
    /// starts at another one; `iters` is a multiple of `COUNTERS`, so each
    /// counter gets as many from every vCPU).
    fn counters(&self, id: u64) {
        for k in 0..self.iters {
            let c = self.word(layout::counter(((id + k) % COUNTERS as u64) as usize));
            let mut seen = c.load(Ordering::Acquire);
            while let Err(now) =
                c.compare_exchange_weak(seen, seen + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                seen = now;
            }
        }
    }

    /// `lock_iters` times: take the spinlock, check that every word of the
    /// structure holds the same count, add one to all of them, let go.
    fn locked_updates(&self, id: u64, found: &mut Findings) -> anyhow::Result<()> {
        let lock = self.word(layout::gpa(LOCK));
        for _ in 0..self.lock_iters {
            self.wait("the spinlock", || {
                lock.compare_exchange(0, id, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            })?;
            let version = self.word(layout::gpa(STRUCT_FIRST)).load(Ordering::Relaxed);
            for page in STRUCT_FIRST..STRUCT_FIRST + STRUCT_PAGES {
                for w in 0..PAGE_SIZE / 8 {
                    let word = self.word(layout::gpa(page) + (w * 8) as u64);
                    let seen = word.load(Ordering::Relaxed);
                    if seen != version {
                        found.push(format!(
                            "under the lock, page {page} word {w} holds {seen}, page {STRUCT_FIRST} word 0 {version}"
                        ));
                    }
                    word.store(version + 1, Ordering::Relaxed);
                }
            }
            if lock
                .compare_exchange(id, 0, Ordering::Release, Ordering::Relaxed)
                .is_err()
            {
                found.push(format!("vCPU {id}'s lock was taken from it"));
            }
        }
        Ok(())
    }

    fn produce(&self, ring: usize) -> anyhow::Result<()> {
        let head = self.word(layout::ring_head(ring));
        let tail = self.word(layout::ring_tail(ring));
        for seq in 0..self.messages {
            self.wait("room in the ring", || {
                seq - tail.load(Ordering::Acquire) < RING_SLOTS
            })?;
            let slot = layout::ring_slot(ring, seq);
            self.word(slot).store(seq, Ordering::Relaxed);
            self.word(slot + 8)
                .store(layout::message_check(seq), Ordering::Relaxed);
            head.store(seq + 1, Ordering::Release);
        }
        Ok(())
    }

    fn consume(&self, ring: usize, found: &mut Findings) -> anyhow::Result<()> {
        let head = self.word(layout::ring_head(ring));
        let tail = self.word(layout::ring_tail(ring));
        for seq in 0..self.messages {
            self.wait("a message in the ring", || {
                head.load(Ordering::Acquire) > seq
            })?;
            let slot = layout::ring_slot(ring, seq);
            let (got, check) = (
                self.word(slot).load(Ordering::Relaxed),
                self.word(slot + 8).load(Ordering::Relaxed),
            );
            if got != seq || check != layout::message_check(seq) {
                found.push(format!(
                    "ring {ring}: message {seq} read as {got} (check {check:#x})"
                ));
            }
            tail.store(seq + 1, Ordering::Release);
        }
        Ok(())
    }

    /// Checks the counters, the lock and the structure once every vCPU is
    /// done; returns the counters' sum and the structure's count.
    fn check_shared_state(&self, found: &mut Findings) -> (u64, u64) {
        let per_counter = self.vcpus_total() * self.iters / COUNTERS as u64;
        let mut total = 0;
        for i in 0..COUNTERS {
            let v = self.word(layout::counter(i)).load(Ordering::Acquire);
            total += v;
            if v != per_counter {
                found.push(format!("counter {i} is {v}, not {per_counter}"));
            }
        }
        let lock = self.word(layout::gpa(LOCK)).load(Ordering::Acquire);
        if lock != 0 {
            found.push(format!("the lock is still held by {lock}"));
        }
        let expected = self.vcpus_total() * self.lock_iters;
        for page in STRUCT_FIRST..STRUCT_FIRST + STRUCT_PAGES {
            for w in 0..PAGE_SIZE / 8 {
                let v = self
                    .word(layout::gpa(page) + (w * 8) as u64)
                    .load(Ordering::Acquire);
                if v != expected {
                    found.push(format!(
                        "structure page {page} word {w} is {v}, not {expected}"
                    ));
                    break;
                }
            }
        }
        (total, expected)
    }

    /// `victim`: arrives at the start, writes a page and hands it back
    /// (with the barrier page), then owns another page and keeps reading
    /// the counters until it is killed.
    pub fn victim(&self, node: usize) -> anyhow::Result<serde_json::Value> {
        self.word(layout::gpa(layout::START))
            .fetch_add(1, Ordering::AcqRel);
        let back = layout::victim_handed_back(node);
        for w in 0..PAGE_SIZE / 8 {
            self.word(back + (w * 8) as u64)
                .store(layout::victim_pattern(node), Ordering::Relaxed);
        }
        let page = PAGE_SIZE as u64;
        self.memory.evict(back, page)?;
        self.memory.evict(layout::gpa(layout::START), page)?;
        let owned = self.word(layout::victim_owned(node));
        owned.fetch_add(1, Ordering::AcqRel);
        let mut seen = 0;
        for i in 0..COUNTERS {
            seen += self.word(layout::counter(i)).load(Ordering::Acquire);
        }
        println!(
            "{}",
            json!({ "role": "victim", "holding": true, "counters_seen": seen })
        );
        std::io::stdout().flush()?;
        let started = Instant::now();
        while started.elapsed() < self.wait_limit {
            owned.fetch_add(1, Ordering::AcqRel);
            for i in 0..COUNTERS {
                self.word(layout::counter(i)).load(Ordering::Acquire);
            }
            std::thread::yield_now();
        }
        bail!("the victim was never killed")
    }

    /// `touch`: a plain load from the dead victim's owned page. Returns
    /// only if the load was served (which it must not be).
    pub fn touch_lost(&self) -> anyhow::Result<serde_json::Value> {
        let victim = self.victim.context("touch needs --victim")?;
        let value = self
            .word(layout::victim_owned(victim))
            .load(Ordering::Acquire);
        Ok(
            json!({ "role": "touch", "verified": false, "errors": [format!("the lost page was read as {value}")] }),
        )
    }

    /// `check`: reads everything back (asking for each page first, so that a
    /// lost page is an error here rather than SIGBUS) and checks it.
    pub fn check(&self) -> anyhow::Result<serde_json::Value> {
        let mut found = Findings::default();
        let mut pages: Vec<usize> = vec![layout::START, layout::DONE, LOCK];
        pages.extend(layout::counter_pages());
        pages.extend(STRUCT_FIRST..STRUCT_FIRST + STRUCT_PAGES);
        for page in pages {
            self.memory
                .acquire(layout::gpa(page), Access::Read)
                .with_context(|| format!("page {page}"))?;
        }
        let (counter_total, _) = self.check_shared_state(&mut found);
        let start_expected = self.vcpus_total() + u64::from(self.victim.is_some());
        let start = self
            .word(layout::gpa(layout::START))
            .load(Ordering::Acquire);
        let done = self.word(layout::gpa(layout::DONE)).load(Ordering::Acquire);
        if start != start_expected || done != self.vcpus_total() {
            found.push(format!(
                "barriers: start {start} (not {start_expected}), done {done} (not {})",
                self.vcpus_total()
            ));
        }
        for node in (0..self.nodes).step_by(2) {
            let Some((r, _)) = layout::ring_of(node, self.nodes) else {
                continue;
            };
            if self.victim.is_some_and(|v| v / 2 == r) {
                continue;
            }
            let head = self.word(layout::ring_head(r)).load(Ordering::Acquire);
            let tail = self.word(layout::ring_tail(r)).load(Ordering::Acquire);
            if head != self.messages || tail != self.messages {
                found.push(format!(
                    "ring {r}: head {head}, tail {tail}, not {}",
                    self.messages
                ));
            }
        }
        let mut victim = serde_json::Value::Null;
        if let Some(v) = self.victim {
            let owned = self.memory.acquire(layout::victim_owned(v), Access::Read);
            let owned_lost = matches!(owned, Err(TransportError::CoherentDataLost { .. }));
            if !owned_lost {
                found.push(format!(
                    "the dead victim's owned page: {owned:?}, not the lost-data error"
                ));
            }
            let back = layout::victim_handed_back(v);
            self.memory.acquire(back, Access::Read)?;
            let mut wrong = 0;
            for w in 0..PAGE_SIZE / 8 {
                if self.word(back + (w * 8) as u64).load(Ordering::Acquire)
                    != layout::victim_pattern(v)
                {
                    wrong += 1;
                }
            }
            if wrong > 0 {
                found.push(format!(
                    "{wrong} words of the victim's handed-back page are wrong"
                ));
            }
            victim =
                json!({ "owned_page_lost": owned_lost, "handed_back_page_words_wrong": wrong });
        }
        Ok(json!({
            "role": "check",
            "verified": found.errors.is_empty(),
            "errors": found.errors,
            "counter_total": counter_total,
            "victim": victim,
        }))
    }
}
