//! Real verbs on a real device: two RC QPs on one device connected to each
//! other move 4 KiB pages with RDMA WRITE and READ.
//!
//! The tests are `#[ignore]`d: a plain `cargo test` lists them as ignored
//! instead of passing them without a device. They run where a device is:
//! in the SoftRoCE VM (`deploy/softroce/run-rdma-tests.sh` and
//! `cargo-test-in-vm.sh` pass `--include-ignored`; the VM also sets
//! `RDMA_DEVICE` and `RXE_GID_INDEX`), or on a host with one
//! (`cargo test -p rdma-transport --test verbs_loopback -- --include-ignored`).
//! When run, a missing device FAILS them.

use std::cell::Cell;
use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_transport::region::{MapOptions, MappedRegion};
use rdma_transport::verbs::{
    find_roce_v2_ipv4_gid_index, find_roce_v2_ipv4_gid_index_sysfs, list_devices, AccessFlags,
    CompletionChannel, CompletionQueue, Context, DeviceAttr, Gid, LinkLayer, MemoryRegion, Mtu,
    PortState, ProtectionDomain, QpCaps, QpState, QueuePair, RtrParams, RtsParams, SendWr, Sge,
    Verbs, VerbsError, WcOpcode, WcStatus, WorkCompletion,
};

const PAGE_SIZE: usize = 4096;
const PAGES: usize = 128;
const PORT: u8 = 1;
/// Work requests per posted chain; only the last is signaled.
const BATCH: usize = 8;
/// Chains in flight at once.
const CHAINS_IN_FLIGHT: usize = 4;
const COMPLETION_TIMEOUT: Duration = Duration::from_secs(20);

/// Writes past cargo's output capture, so a skip is visible in every run.
fn say(msg: &str) {
    let _ = writeln!(std::io::stderr(), "{msg}");
}

/// The device under test (`RDMA_DEVICE`, else the first one). Fails the
/// test when there is none: a device test never passes without one.
fn open_device(test: &str) -> Context {
    let wanted = std::env::var("RDMA_DEVICE").ok().filter(|v| !v.is_empty());
    let fail = |why: String| -> ! {
        panic!("{test}: {why}; run it where a device is: deploy/softroce/run-rdma-tests.sh")
    };
    let verbs =
        Verbs::load().unwrap_or_else(|e| fail(format!("libibverbs cannot be loaded ({e})")));
    match list_devices(&verbs) {
        Ok(devs) if devs.is_empty() => fail("no RDMA device found".into()),
        Ok(_) => {}
        Err(e) => fail(format!("listing RDMA devices failed ({e})")),
    }
    Context::open(&verbs, wanted.as_deref())
        .unwrap_or_else(|e| fail(format!("cannot open the RDMA device ({e})")))
}

/// Zeroed, page-aligned memory the test hands to the device (the
/// library's anonymous mapping).
struct PageBuf {
    mem: MappedRegion,
}

impl PageBuf {
    fn new(pages: usize) -> Self {
        let mem = MappedRegion::new(pages * PAGE_SIZE, MapOptions::POPULATED)
            .expect("map the test's buffer");
        Self { mem }
    }

    fn ptr(&self) -> *mut u8 {
        self.mem.as_ptr()
    }

    fn page(&self, i: usize) -> *mut u8 {
        assert!((i + 1) * PAGE_SIZE <= self.mem.len_bytes());
        self.ptr().wrapping_add(i * PAGE_SIZE)
    }

    /// Fills page `i` with a pattern unique to (`seed`, `i`).
    fn fill(&self, i: usize, seed: u64) {
        let p = self.page(i);
        for w in 0..PAGE_SIZE / 8 {
            let v = pattern(seed, i, w);
            // SAFETY: in bounds (checked by `page`); the device does not
            // access this page now (no request on it is outstanding), and
            // unaligned writes are allowed.
            unsafe { p.wrapping_add(w * 8).cast::<u64>().write_unaligned(v) };
        }
    }

    /// Checks page `i` holds the pattern of (`seed`, `i`).
    fn check(&self, i: usize, seed: u64, what: &str) {
        let p = self.page(i);
        for w in 0..PAGE_SIZE / 8 {
            // SAFETY: as in `fill`; the transfer into this page completed.
            let got = unsafe { p.wrapping_add(w * 8).cast::<u64>().read_unaligned() };
            let want = pattern(seed, i, w);
            assert_eq!(
                got, want,
                "{what}: page {i} word {w}: got {got:#x}, want {want:#x}"
            );
        }
    }

    fn zero(&self) {
        // SAFETY: the whole buffer is ours and no transfer is outstanding.
        unsafe { self.ptr().write_bytes(0, self.mem.len_bytes()) };
    }
}

fn pattern(seed: u64, page: usize, word: usize) -> u64 {
    let x = seed
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add((page as u64) << 32 | word as u64);
    x ^ (x >> 29) ^ 0x5555_0000_aaaa_0000
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    BusyPoll,
    Event,
}

/// Device facts used to connect.
struct Setup {
    ctx: Context,
    attr: DeviceAttr,
    gid_index: u8,
    gid: Gid,
    mtu: Mtu,
    lid: u16,
}

fn setup(ctx: Context) -> Setup {
    let attr = ctx.query_device().expect("query_device");
    let port = ctx.query_port(PORT).expect("query_port");
    assert_eq!(
        port.state,
        PortState::Active,
        "port {PORT} not active: {port:?}"
    );
    let mtu = port.active_mtu.expect("active MTU");
    // The kernel fills the GID table asynchronously after `rdma link add`.
    let deadline = Instant::now() + Duration::from_secs(10);
    let helper_index = loop {
        match find_roce_v2_ipv4_gid_index(&ctx, PORT) {
            Ok(i) => break Some(i),
            Err(VerbsError::NoRoceV2Gid { .. }) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) if port.link_layer == LinkLayer::InfiniBand => {
                say(&format!(
                    "no RoCE v2 GID on an IB port ({e}); using index 0"
                ));
                break None;
            }
            Err(e) => panic!("find_roce_v2_ipv4_gid_index: {e}"),
        }
    };
    let env_index = std::env::var("RXE_GID_INDEX")
        .ok()
        .map(|v| v.parse::<u8>().expect("RXE_GID_INDEX is a number"));
    let gid_index = env_index.or(helper_index).unwrap_or(0);
    let gid = ctx.query_gid(PORT, gid_index).expect("query_gid");
    if port.link_layer == LinkLayer::Ethernet {
        assert!(
            gid.ipv4().is_some(),
            "GID {gid_index} = {gid} is not IPv4-mapped"
        );
        let helper_gid = ctx
            .query_gid(PORT, helper_index.expect("RoCE port has a RoCE v2 GID"))
            .expect("query_gid");
        assert!(helper_gid.ipv4().is_some(), "helper picked {helper_gid}");
        assert_eq!(
            find_roce_v2_ipv4_gid_index_sysfs(ctx.name(), PORT),
            helper_index,
            "the sysfs scan and ibv_query_gid_ex disagree"
        );
    }
    eprintln!(
        "device {}: fw {:?} max_qp_wr {} max_cqe {} max_sge {} max_qp_rd_atom {} \
         max_qp_init_rd_atom {} max_res_rd_atom {}; port {PORT}: {:?}, MTU {} B, lid {}, {:?}; \
         GID index {gid_index} (RXE_GID_INDEX {env_index:?}, helper {helper_index:?}) = {gid}",
        ctx.name(),
        attr.fw_ver,
        attr.max_qp_wr,
        attr.max_cqe,
        attr.max_sge,
        attr.max_qp_rd_atom,
        attr.max_qp_init_rd_atom,
        attr.max_res_rd_atom,
        port.state,
        mtu.bytes(),
        port.lid,
        port.link_layer,
    );
    Setup {
        ctx,
        attr,
        gid_index,
        gid,
        mtu,
        lid: port.lid,
    }
}

/// Two connected RC QPs on one device: `a` initiates, `b` is the target.
/// Field order is drop order: QPs, then CQs, then MRs, then buffers.
struct Pair {
    qp_a: QueuePair,
    _qp_b: QueuePair,
    cq_a: CompletionQueue,
    _cq_b: CompletionQueue,
    chan: Option<CompletionChannel>,
    mr_a: MemoryRegion,
    mr_b: MemoryRegion,
    buf_a: PageBuf,
    buf_b: PageBuf,
    mode: Mode,
    /// CQ events taken from the channel (event mode).
    events: Cell<u64>,
    /// The last poll filled the caller's array: poll before waiting.
    maybe_more: Cell<bool>,
}

fn connect_pair(s: &Setup, pd: &ProtectionDomain, mode: Mode, psn_seed: u32) -> Pair {
    let buf_a = PageBuf::new(PAGES);
    let buf_b = PageBuf::new(PAGES);
    // SAFETY: both buffers outlive their MRs (drop order of `Pair`) and are
    // touched by the test only while no transfer on them is outstanding.
    let mr_a = unsafe { pd.register_raw(buf_a.ptr(), PAGES * PAGE_SIZE, AccessFlags::LOCAL_WRITE) }
        .expect("register buffer a");
    let access_b = AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
    // SAFETY: as above.
    let mr_b = unsafe { pd.register_raw(buf_b.ptr(), PAGES * PAGE_SIZE, access_b) }
        .expect("register buffer b");

    let chan = match mode {
        Mode::BusyPoll => None,
        Mode::Event => Some(s.ctx.create_comp_channel().expect("create_comp_channel")),
    };
    let cq_a = s.ctx.create_cq(256, chan.as_ref(), 0).expect("create_cq a");
    let cq_b = s.ctx.create_cq(256, None, 0).expect("create_cq b");
    let caps = QpCaps {
        max_send_wr: 128,
        max_recv_wr: 4,
        ..QpCaps::default()
    };
    let qp_a = pd
        .create_rc_qp(&cq_a, &cq_a, &caps)
        .expect("create_rc_qp a");
    let qp_b = pd
        .create_rc_qp(&cq_b, &cq_b, &caps)
        .expect("create_rc_qp b");
    assert!(qp_a.caps().max_send_wr >= 128);
    assert_eq!(qp_a.state().expect("state"), QpState::Reset);

    let rd_atomic = |limit: u32| u8::try_from(limit.min(16)).unwrap_or(16).max(1);
    let psn_a = 0x1000 + psn_seed;
    let psn_b = 0x2000 + psn_seed;
    let ep_a = qp_a.endpoint(psn_a, s.gid, s.lid, s.mtu);
    let ep_b = qp_b.endpoint(psn_b, s.gid, s.lid, s.mtu);
    // What each side would send the other, through the wire form.
    let ep_a = rdma_transport::verbs::QpEndpoint::from_le_bytes(&ep_a.to_le_bytes());
    let ep_b = rdma_transport::verbs::QpEndpoint::from_le_bytes(&ep_b.to_le_bytes());
    let access = AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE | AccessFlags::LOCAL_WRITE;
    for (qp, remote, psn) in [(&qp_a, ep_b, psn_a), (&qp_b, ep_a, psn_b)] {
        qp.modify_to_init(PORT, access).expect("to INIT");
        assert_eq!(qp.state().expect("state"), QpState::Init);
        let mut rtr = RtrParams::new(remote, s.mtu, PORT, s.gid_index);
        rtr.max_dest_rd_atomic = rd_atomic(s.attr.max_qp_rd_atom);
        qp.modify_to_rtr(&rtr).expect("to RTR");
        let mut rts = RtsParams::new(psn);
        rts.max_rd_atomic = rd_atomic(s.attr.max_qp_init_rd_atom);
        rts.timeout = 14;
        rts.retry_cnt = 7;
        qp.modify_to_rts(&rts).expect("to RTS");
        assert_eq!(qp.state().expect("state"), QpState::Rts);
    }
    if let Some(ch) = &chan {
        cq_a.req_notify(false).expect("req_notify");
        assert_eq!(cq_a.channel().map(|c| c.fd()), Some(ch.fd()));
    }
    Pair {
        qp_a,
        _qp_b: qp_b,
        cq_a,
        _cq_b: cq_b,
        chan,
        mr_a,
        mr_b,
        buf_a,
        buf_b,
        mode,
        events: Cell::new(0),
        maybe_more: Cell::new(false),
    }
}

impl Pair {
    /// Waits for at least one completion on `cq_a` and returns how many.
    ///
    /// Busy-poll mode spins on `ibv_poll_cq`. Event mode is strictly
    /// event-driven (rxe often completes a request inside `ibv_post_send`,
    /// so "poll first" would never block): the CQ is armed at connect; each
    /// wait blocks on the channel, acknowledges the event, re-arms, then
    /// polls. Completions that arrive between re-arm and poll raise an extra
    /// (harmless) event; none is lost because the CQ is always re-armed
    /// before it is polled. Only when the last poll filled `wcs` (more may
    /// be queued without a new event) does a wait poll first.
    fn wait(&self, wcs: &mut [WorkCompletion]) -> usize {
        let deadline = Instant::now() + COMPLETION_TIMEOUT;
        loop {
            assert!(
                Instant::now() < deadline,
                "no completion within {COMPLETION_TIMEOUT:?}"
            );
            let event_chan = match (&self.chan, self.mode) {
                (Some(chan), Mode::Event) if !self.maybe_more.get() => Some(chan),
                _ => None,
            };
            if let Some(chan) = event_chan {
                match chan.get_cq_event(Some(1000)).expect("get_cq_event") {
                    Some(handle) => {
                        assert_eq!(handle, self.cq_a.handle());
                        self.events.set(self.events.get() + 1);
                        self.cq_a.req_notify(false).expect("req_notify");
                    }
                    None => continue,
                }
            }
            let n = self.cq_a.poll(wcs).expect("poll_cq");
            self.maybe_more.set(n == wcs.len());
            if n > 0 {
                return n;
            }
            if event_chan.is_none() {
                std::hint::spin_loop();
            }
        }
    }

    /// Runs one request per page (WRITE or READ, page i <-> page i) in
    /// chains of BATCH with the last signaled, CHAINS_IN_FLIGHT chains
    /// outstanding, and checks every completion.
    fn transfer_all(&self, write: bool) {
        let sges: Vec<Sge> = (0..PAGES)
            .map(|i| self.mr_a.sge(i * PAGE_SIZE, PAGE_SIZE).expect("sge in MR"))
            .collect();
        let remote = self.mr_b.addr() as u64;
        let rkey = self.mr_b.rkey();
        let mut wcs = [WorkCompletion::default(); 16];
        let chains = PAGES / BATCH;
        let mut posted = 0;
        let mut completed = 0;
        while completed < chains {
            while posted < chains && posted - completed < CHAINS_IN_FLIGHT {
                let first = posted * BATCH;
                let mut wrs: [SendWr<'_>; BATCH] = std::array::from_fn(|k| {
                    let page = first + k;
                    let sge = std::slice::from_ref(&sges[page]);
                    let addr = remote + (page * PAGE_SIZE) as u64;
                    let wr_id = page as u64;
                    let wr = if write {
                        SendWr::rdma_write(wr_id, sge, addr, rkey)
                    } else {
                        SendWr::rdma_read(wr_id, sge, addr, rkey)
                    };
                    if k == BATCH - 1 {
                        wr.signaled()
                    } else {
                        wr
                    }
                });
                self.qp_a.post_send(&mut wrs).expect("post_send");
                posted += 1;
            }
            let n = self.wait(&mut wcs);
            for wc in &wcs[..n] {
                wc.result().expect("work completion");
                let want = if write {
                    WcOpcode::RdmaWrite
                } else {
                    WcOpcode::RdmaRead
                };
                assert_eq!(wc.opcode(), want);
                assert_eq!(wc.qp_num(), self.qp_a.qpn());
                // In-order completion of a chain's signaled last request.
                assert_eq!(wc.wr_id(), ((completed + 1) * BATCH - 1) as u64);
                completed += 1;
            }
        }
    }

    /// Several rounds of: fill a's pages, WRITE them all to b, check b;
    /// change b, zero a, READ them all back, check a.
    fn exercise(&self, rounds: u64) -> usize {
        for round in 0..rounds {
            let seed = round * 2 + 1;
            for i in 0..PAGES {
                self.buf_a.fill(i, seed);
            }
            self.transfer_all(true);
            for i in 0..PAGES {
                self.buf_b.check(i, seed, "after RDMA WRITE");
            }
            for i in 0..PAGES {
                self.buf_b.fill(i, seed + 1);
            }
            self.buf_a.zero();
            self.transfer_all(false);
            for i in 0..PAGES {
                self.buf_a.check(i, seed + 1, "after RDMA READ");
            }
        }
        usize::try_from(rounds).unwrap_or(0) * PAGES * 2
    }
}

fn run_pages(test: &str, mode: Mode) {
    let ctx = open_device(test);
    let s = setup(ctx);
    let pd = s.ctx.alloc_pd().expect("alloc_pd");
    let pair = connect_pair(&s, &pd, mode, 0);
    let start = Instant::now();
    let ops = pair.exercise(8);
    let elapsed = start.elapsed();
    if mode == Mode::Event {
        // The event path must really have been taken, not only polling.
        assert!(pair.events.get() > 0, "event mode saw no CQ event");
    }
    eprintln!(
        "{test}: {ops} 4 KiB RDMA ops ({mode:?}, {BATCH} per chain, {CHAINS_IN_FLIGHT} chains in flight) \
         checked in {elapsed:?} ({:.0} pages/s, {} CQ events)",
        ops as f64 / elapsed.as_secs_f64(),
        pair.events.get()
    );
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_write_and_read_pages_busy_poll() {
    run_pages("rdma_write_and_read_pages_busy_poll", Mode::BusyPoll);
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn rdma_write_and_read_pages_event_mode() {
    run_pages("rdma_write_and_read_pages_event_mode", Mode::Event);
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn bad_rkey_read_fails_and_fresh_qp_pair_recovers() {
    let test = "bad_rkey_read_fails_and_fresh_qp_pair_recovers";
    let ctx = open_device(test);
    let s = setup(ctx);
    let pd = s.ctx.alloc_pd().expect("alloc_pd");
    let pair = connect_pair(&s, &pd, Mode::BusyPoll, 0x100);
    pair.exercise(1);

    let sge = [pair.mr_a.sge(0, PAGE_SIZE).expect("sge")];
    let bad_rkey = pair.mr_b.rkey() ^ 0x00ff_ff00;
    let mut wrs = [SendWr::rdma_read(77, &sge, pair.mr_b.addr() as u64, bad_rkey).signaled()];
    pair.qp_a
        .post_send(&mut wrs)
        .expect("post_send of the bad READ");
    let mut wcs = [WorkCompletion::default(); 4];
    let n = pair.wait(&mut wcs);
    assert_eq!(n, 1);
    let wc = wcs[0];
    assert_eq!(wc.wr_id(), 77);
    assert!(!wc.is_success(), "a READ with a bad rkey succeeded: {wc:?}");
    let err = wc.result().expect_err("error completion");
    match &err {
        VerbsError::WorkCompletion { wr_id, status, .. } => {
            assert_eq!(*wr_id, 77);
            assert_ne!(*status, WcStatus::Success);
        }
        other => panic!("unexpected error type: {other:?}"),
    }
    eprintln!("{test}: bad-rkey READ -> {err}");
    assert_eq!(pair.qp_a.state().expect("state"), QpState::Error);

    // Recovery: a fresh pair on the same device and PD works again.
    drop(pair);
    let fresh = connect_pair(&s, &pd, Mode::BusyPoll, 0x200);
    let ops = fresh.exercise(1);
    eprintln!("{test}: fresh QP pair moved {ops} pages after the error");
}

#[test]
#[ignore = "needs an RDMA device: run by deploy/softroce/run-rdma-tests.sh"]
fn device_list_and_queries() {
    let test = "device_list_and_queries";
    let ctx = open_device(test);
    let verbs: Arc<Verbs> = Arc::clone(ctx.verbs());
    let devs = list_devices(&verbs).expect("list_devices");
    assert!(devs.iter().any(|d| d.name == ctx.name()), "{devs:?}");
    let attr = ctx.query_device().expect("query_device");
    assert!(attr.max_qp_wr >= 128 && attr.max_cqe >= 256 && attr.phys_port_cnt >= 1);
    assert!(attr.max_qp_rd_atom >= 1 && attr.max_qp_init_rd_atom >= 1);
    // A GID index past the table is an error naming the verb.
    let len = ctx.query_port(PORT).expect("query_port").gid_tbl_len;
    if let Ok(past) = u8::try_from(len) {
        match ctx.query_gid(PORT, past) {
            Err(VerbsError::Verb { verb, .. }) => assert_eq!(verb, "ibv_query_gid"),
            other => panic!("query_gid past the table: {other:?}"),
        }
    }
    eprintln!("{test}: devices {devs:?}");
}
