//! The bare RDMA program: what perftest's `ib_read_lat` and `ib_write_bw -t
//! 1` do, in this process. Two RC QPs on the device under test, connected
//! to each other with this project's QP parameters (`connect_qp`); one
//! 4 KiB READ or WRITE posted at a time from a registered page into a
//! registered "remote" region, its completion spun on in the same thread,
//! nothing else in between. Only the post and the spin are timed, as only
//! the library call is in ours. Every page is checked: reads as they land,
//! writes by reading the region after the run.
//!
//! With a depth N > 1 it is `ib_read_bw -t N` (and `ib_write_bw -t N`)
//! instead: N requests outstanding, each from its own registered page, a
//! new one posted as each completes; the CQ is polled for up to N
//! completions at a time. Its figure is pages/s over the whole block.
//!
//! [`BareVerbs`] keeps its QPs and memory between calls of
//! [`BareVerbs::run`], so the bench can alternate short blocks of it with
//! short blocks of ours in one process (bench/src/verbs_compare.rs): the
//! SoftRoCE VM changes speed every few seconds, and a ratio is only fair
//! between two loops that met the same speeds.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use rdma_transport::rdma::{connect_qp, random_psn, PortInfo, QpTimeouts};
use rdma_transport::region::{MapOptions, MappedRegion};
use rdma_transport::verbs::{
    AccessFlags, CompletionQueue, Context, MemoryRegion, QpCaps, QueuePair, SendWr, Verbs,
    WorkCompletion,
};
use rdma_transport::{ManagerConfig, Page, PAGE_SIZE};

use crate::pattern;
use crate::workload::{Op, Outcome};

/// How long one operation may take before the loop gives up (a lost
/// completion must fail the run, not hang it).
const OP_TIMEOUT: Duration = Duration::from_secs(5);

/// Most requests the loop keeps outstanding (the bench's `--depth` at most).
pub const MAX_DEPTH: usize = 1024;

/// Zeroed, page-aligned memory the device reads and writes (the library's
/// own anonymous mapping). Only raw pointers reach it while a memory
/// region covers it.
struct DeviceBuf {
    mem: MappedRegion,
}

impl DeviceBuf {
    fn new(pages: usize) -> anyhow::Result<Self> {
        let mem = MappedRegion::new(pages * PAGE_SIZE, MapOptions::POPULATED)
            .context("mapping memory for the bare RDMA loop")?;
        Ok(Self { mem })
    }

    fn ptr(&self) -> *mut u8 {
        self.mem.as_ptr()
    }

    fn page_addr(&self, i: usize) -> *mut u8 {
        self.ptr().wrapping_add(i * PAGE_SIZE)
    }

    /// Page `i`, for the loop to fill or check.
    ///
    /// # Safety
    /// `i` is in bounds and no work request on this page is outstanding
    /// (the device neither reads nor writes it until the reference is
    /// dropped).
    unsafe fn page(&mut self, i: usize) -> &mut Page {
        debug_assert!((i + 1) * PAGE_SIZE <= self.mem.len_bytes());
        // SAFETY: per this fn's contract the page is in bounds, aligned
        // (page-aligned mapping) and not touched by the device meanwhile;
        // `&mut self` keeps the loop from holding two references.
        unsafe { &mut *self.page_addr(i).cast::<Page>() }
    }
}

/// Two connected QPs and their memory. Field order is drop order: QPs,
/// CQs, MRs, then the buffers under them.
pub struct BareVerbs {
    qp: QueuePair,
    _target_qp: QueuePair,
    cq: CompletionQueue,
    _target_cq: CompletionQueue,
    local_mr: MemoryRegion,
    region_mr: MemoryRegion,
    /// One page per request outstanding (`depth`).
    local: DeviceBuf,
    region: DeviceBuf,
    /// The seed each region page holds now (its last write's): one per
    /// region page.
    seeds: Vec<u64>,
    /// Blocks run so far: each write block writes its own seed.
    blocks: u64,
    /// Requests outstanding at a time.
    depth: usize,
}

impl BareVerbs {
    /// Opens the device `config` names (port, GID index), connects two QPs
    /// on it and fills a region of `pages` pages with `seed`'s pattern;
    /// `depth` requests will be outstanding at a time.
    pub fn connect(
        config: &ManagerConfig,
        pages: usize,
        seed: u64,
        depth: usize,
    ) -> anyhow::Result<Self> {
        if pages == 0 {
            bail!("the bare RDMA loop needs a region of at least one page");
        }
        if !(1..=MAX_DEPTH).contains(&depth) {
            bail!("the bare RDMA loop keeps 1 to {MAX_DEPTH} requests outstanding, not {depth}");
        }
        let verbs = Verbs::load().context("loading libibverbs for the bare RDMA loop")?;
        let ctx = Context::open(&verbs, config.rdma_device.as_deref())
            .context("opening the RDMA device for the bare RDMA loop")?;
        let port = PortInfo::query(&ctx, config.rdma_port, config.rdma_gid_index)
            .context("querying the RDMA port")?;
        let pd = ctx.alloc_pd()?;
        let local = DeviceBuf::new(depth)?;
        let mut region = DeviceBuf::new(pages)?;
        for i in 0..pages {
            // SAFETY: in bounds; nothing is registered yet.
            pattern::fill(unsafe { region.page(i) }, page_gpa(i), seed);
        }
        // SAFETY: both buffers outlive their MRs (drop order of `Self`);
        // the loop touches them only while no request on them is
        // outstanding (`DeviceBuf::page`).
        let local_mr =
            unsafe { pd.register_raw(local.ptr(), depth * PAGE_SIZE, AccessFlags::LOCAL_WRITE) }?;
        let access =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
        // SAFETY: as above.
        let region_mr = unsafe { pd.register_raw(region.ptr(), pages * PAGE_SIZE, access) }?;
        let entries = u32::try_from(depth.max(16))?;
        let cq = ctx.create_cq(entries, None, 0)?;
        let target_cq = ctx.create_cq(entries, None, 0)?;
        let caps = QpCaps {
            max_send_wr: u32::try_from(depth.max(4))?,
            max_recv_wr: 1,
            ..QpCaps::default()
        };
        let qp = pd.create_rc_qp(&cq, &cq, &caps)?;
        let target_qp = pd.create_rc_qp(&target_cq, &target_cq, &caps)?;
        let (psn, target_psn) = (random_psn(), random_psn());
        for q in [&qp, &target_qp] {
            q.modify_to_init(port.port, access)?;
        }
        let hello = port.hello(&qp, psn);
        let target_hello = port.hello(&target_qp, target_psn);
        let timeouts = QpTimeouts {
            ack_timeout_code: config.rdma_ack_timeout,
            retry_count: config.rdma_retry_count,
        };
        connect_qp(&qp, &port, psn, &target_hello, timeouts).context("connecting the bare QP")?;
        connect_qp(&target_qp, &port, target_psn, &hello, timeouts)
            .context("connecting the bare target QP")?;
        Ok(Self {
            qp,
            _target_qp: target_qp,
            cq,
            _target_cq: target_cq,
            local_mr,
            region_mr,
            local,
            region,
            seeds: vec![seed; pages],
            blocks: 0,
            depth,
        })
    }

    /// Runs `ops` READs or WRITEs of region pages picked by `next_page`
    /// (`depth` in flight), reads checked as they land. A write block
    /// writes a seed of its own; [`BareVerbs::check_region`] checks them.
    pub fn run(
        &mut self,
        op: Op,
        ops: u64,
        next_page: impl FnMut() -> usize,
    ) -> anyhow::Result<Outcome> {
        if op != Op::Read && op != Op::Write {
            bail!("the bare RDMA loop reads and writes pages only");
        }
        self.blocks += 1;
        let write_seed = 0x5eed_0000_0000 + self.blocks;
        if self.depth > 1 {
            return self.run_pipelined(op, ops, write_seed, next_page);
        }
        self.run_one(op, ops, write_seed, next_page)
    }

    /// [`BareVerbs::run`] with one request outstanding.
    fn run_one(
        &mut self,
        op: Op,
        ops: u64,
        write_seed: u64,
        mut next_page: impl FnMut() -> usize,
    ) -> anyhow::Result<Outcome> {
        let mut out = Outcome::empty(Duration::ZERO);
        let sge = [self.local_mr.sge(0, PAGE_SIZE).context("local SGE")?];
        let rkey = self.region_mr.rkey();
        let start = Instant::now();
        for _ in 0..ops {
            let i = next_page() % self.seeds.len();
            if op == Op::Write {
                // SAFETY: page 0 of one; no request is outstanding.
                pattern::fill(unsafe { self.local.page(0) }, page_gpa(i), write_seed);
            }
            let remote = self.region.page_addr(i) as u64;
            let wr = match op {
                Op::Write => SendWr::rdma_write(i as u64, &sge, remote, rkey),
                _ => SendWr::rdma_read(i as u64, &sge, remote, rkey),
            };
            let t0 = Instant::now();
            self.qp.post_send(&mut [wr.signaled()])?;
            self.wait_one()?;
            let latency_ns = t0.elapsed().as_nanos() as u64;
            let _ = out.latency_ns.record(latency_ns.max(1));
            if op == Op::Write {
                self.seeds[i] = write_seed;
            } else {
                // SAFETY: the READ completed; nothing else is outstanding.
                unsafe { self.check_landed(0, i, &mut out) };
            }
        }
        out.elapsed = start.elapsed();
        out.ops_done = ops;
        Ok(out)
    }

    /// [`BareVerbs::run`] with `depth` requests outstanding: each slot has
    /// its own local page; a slot is posted again as soon as its
    /// completion is polled (and its page checked). Each request's latency
    /// is post to poll.
    fn run_pipelined(
        &mut self,
        op: Op,
        ops: u64,
        write_seed: u64,
        mut next_page: impl FnMut() -> usize,
    ) -> anyhow::Result<Outcome> {
        let depth = self.depth;
        let mut out = Outcome::empty(Duration::ZERO);
        let sges = (0..depth)
            .map(|s| self.local_mr.sge(s * PAGE_SIZE, PAGE_SIZE).map(|g| [g]))
            .collect::<Option<Vec<_>>>()
            .context("local SGEs")?;
        let rkey = self.region_mr.rkey();
        // Per slot: the region page it moves and when it was posted.
        let mut slots = vec![(0usize, Instant::now()); depth];
        let mut free: Vec<usize> = (0..depth).rev().collect();
        let mut wcs = vec![WorkCompletion::default(); depth];
        let (mut posted, mut done) = (0u64, 0u64);
        let start = Instant::now();
        while done < ops {
            while posted < ops {
                let Some(slot) = free.pop() else { break };
                let i = next_page() % self.seeds.len();
                if op == Op::Write {
                    // SAFETY: slot < depth; the slot is free, so no request
                    // on its page is outstanding.
                    pattern::fill(unsafe { self.local.page(slot) }, page_gpa(i), write_seed);
                }
                let remote = self.region.page_addr(i) as u64;
                let wr = match op {
                    Op::Write => SendWr::rdma_write(slot as u64, &sges[slot], remote, rkey),
                    _ => SendWr::rdma_read(slot as u64, &sges[slot], remote, rkey),
                };
                slots[slot] = (i, Instant::now());
                self.qp.post_send(&mut [wr.signaled()])?;
                posted += 1;
            }
            let n = self.wait_some(&mut wcs)?;
            let polled = Instant::now();
            for wc in &wcs[..n] {
                wc.result().context("bare RDMA request failed")?;
                let slot = usize::try_from(wc.wr_id())?;
                let Some(&(i, posted_at)) = slots.get(slot) else {
                    bail!("a completion for a slot the bare RDMA loop never posted");
                };
                let latency_ns = polled.duration_since(posted_at).as_nanos() as u64;
                let _ = out.latency_ns.record(latency_ns.max(1));
                if op == Op::Write {
                    self.seeds[i] = write_seed;
                } else {
                    // SAFETY: slot < depth; its READ completed and the slot
                    // is not posted again before this check.
                    unsafe { self.check_landed(slot, i, &mut out) };
                }
                free.push(slot);
                done += 1;
            }
        }
        out.elapsed = start.elapsed();
        out.ops_done = ops;
        Ok(out)
    }

    /// Checks the page READ into local slot `slot` against region page
    /// `i`'s pattern, and counts it in `out`.
    ///
    /// # Safety
    /// As [`DeviceBuf::page`]: `slot` is in bounds and no request on it is
    /// outstanding.
    unsafe fn check_landed(&mut self, slot: usize, i: usize, out: &mut Outcome) {
        out.pages_checked += 1;
        // SAFETY: per this fn's contract.
        let page = unsafe { self.local.page(slot) };
        if !pattern::check(page, page_gpa(i), self.seeds[i]) {
            out.bad_pages += 1;
        }
    }

    /// Pages of the region that do not hold their last write's pattern.
    pub fn check_region(&mut self) -> u64 {
        let mut bad = 0;
        for i in 0..self.seeds.len() {
            let seed = self.seeds[i];
            // SAFETY: in bounds; no request is outstanding between runs.
            if !pattern::check(unsafe { self.region.page(i) }, page_gpa(i), seed) {
                bad += 1;
            }
        }
        bad
    }

    /// Spins on the CQ for the one outstanding completion.
    fn wait_one(&self) -> anyhow::Result<()> {
        let mut wc = [WorkCompletion::default()];
        self.wait_some(&mut wc)?;
        wc[0].result().context("bare RDMA request failed")
    }

    /// Spins on the CQ until it gives at least one completion (at most
    /// `wcs.len()`); returns how many.
    fn wait_some(&self, wcs: &mut [WorkCompletion]) -> anyhow::Result<usize> {
        let mut spins = 0u32;
        let mut deadline = None;
        loop {
            let n = self.cq.poll(wcs)?;
            if n > 0 {
                return Ok(n);
            }
            spins = spins.wrapping_add(1);
            if spins % 1024 == 0 {
                let now = Instant::now();
                if now > *deadline.get_or_insert(now + OP_TIMEOUT) {
                    bail!("no completion within {OP_TIMEOUT:?} in the bare RDMA loop");
                }
            }
            std::hint::spin_loop();
        }
    }
}

/// The address the pattern of region page `i` is made from.
fn page_gpa(i: usize) -> u64 {
    (i * PAGE_SIZE) as u64
}
