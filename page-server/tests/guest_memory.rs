//! Guest memory over a real local cluster: pages fault in through
//! userfaultfd, go back with flush/evict, and a dead owner turns faults
//! into SIGBUS within the deadline.

mod common;

use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::*;
use rdma_transport::guest_memory::{
    DirtyTracking, FaultAction, FaultMode, GuestBacking, GuestMemory, GuestMemoryConfig,
    GuestMemoryError, SharedFile, SigbusMethod,
};
use rdma_transport::{ManagerConfig, TransportManager, PAGE_SIZE};

const NODE: u64 = NODE_BYTES as u64;
const PAGES_PER_NODE: usize = NODE_BYTES / PAGE_SIZE;

fn config(gpa_base: u64, size_bytes: usize) -> GuestMemoryConfig {
    GuestMemoryConfig {
        handler_cpus: Some(vec![]),
        // Long enough for a loaded host: a fault that times out here raises
        // SIGBUS in the test process. Tests of the deadline set their own.
        fault_timeout_ms: 5000,
        ..GuestMemoryConfig::new(gpa_base, size_bytes)
    }
}

/// Anonymous memory, or a memfd of `size_bytes` (the shared backing).
fn backing(shared: bool, size_bytes: usize) -> GuestBacking {
    if shared {
        GuestBacking::SharedFile(SharedFile::new(memfd(size_bytes), 0))
    } else {
        GuestBacking::Anonymous
    }
}

#[test]
fn written_pattern_survives_evict_and_faults_back_in() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let _b = page_server(&coord.url(), "b", NODE);
    let mgr = Arc::new(manager(&coord.url()));
    let ram = GuestMemory::new(Arc::clone(&mgr), config(0, 2 * NODE_BYTES)).unwrap();

    // Half the pages are read first (installed clean, then a write-protect
    // fault on the write), half are written first.
    let mut page = [0u8; PAGE_SIZE];
    for p in 0..2 * PAGES_PER_NODE {
        let gpa = (p * PAGE_SIZE) as u64;
        if p % 2 == 0 {
            ram.read(gpa, &mut page).unwrap();
            assert!(page.iter().all(|&b| b == 0), "fresh remote memory is zero");
        }
        ram.write(gpa, &page_for(gpa, 7)).unwrap();
    }
    let stats = ram.stats();
    assert_eq!(
        stats.missing_faults + stats.prefetched_pages,
        512,
        "{stats:?}"
    );
    assert!(stats.wp_faults >= 128, "{stats:?}");

    let dropped = ram.evict(0, 2 * NODE).unwrap();
    assert_eq!(dropped, 512);
    // The owners have every page...
    for p in (0..2 * PAGES_PER_NODE).step_by(5) {
        let gpa = (p * PAGE_SIZE) as u64;
        mgr.read_page(gpa, &mut page).unwrap();
        assert!(page == page_for(gpa, 7), "remote page {gpa:#x} differs");
    }
    // ...and touching guest memory faults them back in.
    let before = ram.stats().missing_faults;
    for p in (0..2 * PAGES_PER_NODE).rev() {
        let gpa = (p * PAGE_SIZE) as u64;
        ram.read(gpa, &mut page).unwrap();
        assert!(
            page == page_for(gpa, 7),
            "guest page {gpa:#x} differs after evict"
        );
    }
    assert!(ram.stats().missing_faults > before);
    // Clean pages need no write-back.
    assert_eq!(ram.flush().unwrap(), 0);
}

/// `write(2)` of the guest page at `ptr` into a pipe (a kernel-mode read
/// of guest memory, as KVM's would be), and what came out of the pipe.
fn kernel_mode_read(ptr: *mut u8) -> std::io::Result<Vec<u8>> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a live array of two ints.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: `ptr` is one page of a live guest region; the pipe has room.
    let n = unsafe { libc::write(fds[1], ptr.cast(), PAGE_SIZE) };
    let result = if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        let mut out = vec![0u8; n as usize];
        // SAFETY: `out` has room for the `n` bytes in the pipe.
        let got = unsafe { libc::read(fds[0], out.as_mut_ptr().cast(), out.len()) };
        assert_eq!(got, n);
        Ok(out)
    };
    for fd in fds {
        // SAFETY: our own pipe ends, closed once.
        unsafe { libc::close(fd) };
    }
    result
}

#[test]
fn fault_mode_decides_whether_kernel_mode_accesses_are_served() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let mgr = Arc::new(manager(&coord.url()));
    let gpa = 2 * PAGE_SIZE as u64;
    mgr.write_page(gpa, &page_for(gpa, 3)).unwrap();

    // User-mode faults only: the kernel's access to a page not fetched
    // yet fails, and no fault reaches the handler.
    let ram = GuestMemory::new(
        Arc::clone(&mgr),
        GuestMemoryConfig {
            fault_mode: FaultMode::UserOnly,
            ..config(0, NODE_BYTES)
        },
    )
    .unwrap();
    assert!(!ram.handles_kernel_faults());
    let err = kernel_mode_read(ram.host_addr(gpa).unwrap()).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EFAULT));
    assert_eq!(ram.stats().missing_faults, 0);
    drop(ram);

    // The default serves it: the handler fetches the page and the syscall
    // completes with its content.
    let ram = GuestMemory::new(Arc::clone(&mgr), config(0, NODE_BYTES)).unwrap();
    assert!(ram.handles_kernel_faults(), "tests run as root");
    let bytes = kernel_mode_read(ram.host_addr(gpa).unwrap()).unwrap();
    assert!(bytes == page_for(gpa, 3), "kernel read the wrong bytes");
    // The handler counts a fault once its copy has woken the faulting
    // thread: the count may trail the syscall's return by a moment.
    assert!(
        wait_until(Duration::from_secs(5), || ram.stats().missing_faults >= 1),
        "the handler never counted the kernel-mode fault"
    );
    assert_eq!(ram.stats().missing_faults, 1);
}

#[test]
fn two_regions_on_two_nodes() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let _b = page_server(&coord.url(), "b", NODE);
    let mgr = Arc::new(manager(&coord.url()));
    let ram_a = GuestMemory::new(Arc::clone(&mgr), config(0, NODE_BYTES)).unwrap();
    let ram_b = GuestMemory::new(Arc::clone(&mgr), config(NODE, NODE_BYTES)).unwrap();
    assert!(ram_b.host_addr(NODE).is_some() && ram_b.host_addr(0).is_none());

    std::thread::scope(|s| {
        for (ram, seed) in [(&ram_a, 1u8), (&ram_b, 2u8)] {
            s.spawn(move || {
                for p in 0..PAGES_PER_NODE {
                    let gpa = ram.gpa_base() + (p * PAGE_SIZE) as u64;
                    ram.write(gpa, &page_for(gpa, seed)).unwrap();
                }
                assert_eq!(ram.flush().unwrap(), PAGES_PER_NODE as u64);
                ram.evict(ram.gpa_base(), NODE).unwrap();
            });
        }
    });
    let mut page = [0u8; PAGE_SIZE];
    for (ram, seed) in [(&ram_a, 1u8), (&ram_b, 2u8)] {
        for p in 0..PAGES_PER_NODE {
            let gpa = ram.gpa_base() + (p * PAGE_SIZE) as u64;
            ram.read(gpa, &mut page).unwrap();
            assert!(page == page_for(gpa, seed), "page {gpa:#x} differs");
            mgr.read_page(gpa, &mut page).unwrap();
            assert!(page == page_for(gpa, seed), "remote page {gpa:#x} differs");
        }
    }
    // Out-of-range and unaligned requests are refused, not served.
    assert!(matches!(
        ram_a.evict(NODE, NODE),
        Err(GuestMemoryError::OutOfRange { .. })
    ));
    assert!(matches!(
        ram_a.evict(1, 4096),
        Err(GuestMemoryError::OutOfRange { .. })
    ));
    assert!(ram_a.read(NODE - 2, &mut page[..4]).is_err());
}

/// The scheduler slice (ns) of each of this process's fault handler
/// threads (`uffd-handler-*`), by thread id, as `sched_getattr` reports it
/// (Linux 6.12+; earlier kernels report 0).
fn handler_slices_ns() -> Vec<(i32, u64)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let Ok(tid) = task.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if !comm.starts_with("uffd-handler") {
            continue;
        }
        let mut attr = libc::sched_attr {
            size: 0,
            sched_policy: 0,
            sched_flags: 0,
            sched_nice: 0,
            sched_priority: 0,
            sched_runtime: 0,
            sched_deadline: 0,
            sched_period: 0,
        };
        // SAFETY: the kernel writes at most 48 bytes (the size of `attr`)
        // for thread `tid`; a thread that exited meanwhile gives ESRCH.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_sched_getattr,
                tid,
                std::ptr::from_mut(&mut attr),
                48u32,
                0u32,
            )
        };
        if ret == 0 {
            out.push((tid, attr.sched_runtime));
        }
    }
    out
}

/// `handler_slice_us` reaches the kernel for every handler thread (other
/// tests' handlers, running alongside, keep the kernel's slice), and the
/// handlers still serve faults with the right pages.
#[test]
fn handlers_ask_for_the_configured_slice_and_serve_faults() {
    const SLICE_NS: u64 = 4_321_000;
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let mgr = Arc::new(manager(&coord.url()));
    for p in 0..8u64 {
        let gpa = p * PAGE_SIZE as u64;
        mgr.write_page(gpa, &page_for(gpa, 5)).unwrap();
    }
    let ram = GuestMemory::new(
        Arc::clone(&mgr),
        GuestMemoryConfig {
            handler_threads: 2,
            handler_slice_us: SLICE_NS / 1000,
            ..config(0, NODE_BYTES)
        },
    )
    .unwrap();
    let mut page = [0u8; PAGE_SIZE];
    for p in 0..8u64 {
        let gpa = p * PAGE_SIZE as u64;
        ram.read(gpa, &mut page).unwrap();
        assert!(page == page_for(gpa, 5), "page {gpa:#x} differs");
    }
    let ours = handler_slices_ns()
        .into_iter()
        .filter(|&(_, ns)| ns == SLICE_NS)
        .count();
    if rdma_transport::guest_memory::kernel_honours_handler_slice() {
        assert_eq!(ours, 2, "{:?}", handler_slices_ns());
    } else {
        assert_eq!(ours, 0, "a kernel before 6.12 has no custom slices");
    }
    drop(ram);
    // Their threads are gone with the region.
    assert!(handler_slices_ns().iter().all(|&(_, ns)| ns != SLICE_NS));
}

#[test]
fn flush_while_faults_are_in_flight_loses_no_write() {
    flush_while_faults_are_in_flight(false, DirtyTracking::WriteFaults);
}

#[test]
fn shared_flush_while_faults_are_in_flight_loses_no_write() {
    flush_while_faults_are_in_flight(true, DirtyTracking::WriteFaults);
}

#[test]
fn shared_scan_flush_while_faults_are_in_flight_loses_no_write() {
    flush_while_faults_are_in_flight(true, DirtyTracking::PagemapScan);
}

fn flush_while_faults_are_in_flight(shared: bool, dirty_tracking: DirtyTracking) {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let mgr = Arc::new(manager(&coord.url()));
    let ram = Arc::new(
        GuestMemory::new(
            Arc::clone(&mgr),
            GuestMemoryConfig {
                handler_threads: 2,
                backing: backing(shared, NODE_BYTES),
                dirty_tracking,
                ..config(0, NODE_BYTES)
            },
        )
        .unwrap(),
    );
    const WRITERS: usize = 2;
    // Rounds each writer makes at least; it goes on until two flushes have
    // run during its writes, however slow the host makes them.
    const ROUNDS: u64 = 40;
    const FLUSHES: usize = 2;
    // completed[p] = last value whose write to page p has returned.
    let completed: Arc<Vec<AtomicU64>> =
        Arc::new((0..PAGES_PER_NODE).map(|_| AtomicU64::new(0)).collect());
    let done = Arc::new(AtomicBool::new(false));
    let flushes_done = Arc::new(AtomicUsize::new(0));
    let start = Arc::new(Barrier::new(WRITERS + 2));
    let mut threads = Vec::new();
    for w in 0..WRITERS {
        let (ram, completed, start, flushes_done) = (
            Arc::clone(&ram),
            Arc::clone(&completed),
            Arc::clone(&start),
            Arc::clone(&flushes_done),
        );
        threads.push(std::thread::spawn(move || {
            start.wait();
            let mut round = 0u64;
            while round < ROUNDS || flushes_done.load(Ordering::SeqCst) < FLUSHES {
                round += 1;
                for p in (w..PAGES_PER_NODE).step_by(WRITERS) {
                    let gpa = (p * PAGE_SIZE) as u64;
                    // Same value at both ends: a torn copy would show.
                    ram.write(gpa, &round.to_le_bytes()).unwrap();
                    ram.write(gpa + 4088, &round.to_le_bytes()).unwrap();
                    completed[p].store(round, Ordering::SeqCst);
                }
            }
        }));
    }
    // An evicter keeps pages going away, so MISSING faults are in flight
    // during the flushes.
    {
        let (ram, done, start) = (Arc::clone(&ram), Arc::clone(&done), Arc::clone(&start));
        threads.push(std::thread::spawn(move || {
            start.wait();
            let mut chunk = 0u64;
            while !done.load(Ordering::SeqCst) {
                ram.evict(chunk * 16 * 4096, 16 * 4096).unwrap();
                chunk = (chunk + 3) % (PAGES_PER_NODE as u64 / 16);
            }
        }));
    }
    start.wait();
    let gpas: Vec<u64> = (0..PAGES_PER_NODE)
        .map(|p| (p * PAGE_SIZE) as u64)
        .collect();
    let mut remote = vec![[0u8; PAGE_SIZE]; PAGES_PER_NODE];
    let mut flushes = 0usize;
    let check = |remote: &[[u8; PAGE_SIZE]], snapshot: &[u64], exact: bool| {
        for (p, page) in remote.iter().enumerate() {
            let head = u64::from_le_bytes(page[..8].try_into().unwrap());
            let tail = u64::from_le_bytes(page[4088..].try_into().unwrap());
            if exact {
                assert_eq!((head, tail), (snapshot[p], snapshot[p]), "page {p}");
            } else {
                assert!(
                    head >= snapshot[p],
                    "page {p}: remote has {head}, {} was written before the flush",
                    snapshot[p]
                );
                assert!(tail + 1 >= head, "page {p}: torn copy {head}/{tail}");
            }
        }
    };
    while threads[..WRITERS].iter().any(|t| !t.is_finished()) {
        let snapshot: Vec<u64> = completed.iter().map(|c| c.load(Ordering::SeqCst)).collect();
        ram.flush().unwrap();
        flushes += 1;
        flushes_done.store(flushes, Ordering::SeqCst);
        mgr.read_pages(&gpas, &mut remote).unwrap();
        check(&remote, &snapshot, false);
    }
    done.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
    ram.flush().unwrap();
    mgr.read_pages(&gpas, &mut remote).unwrap();
    // Every page holds its writer's last round (each writer's pages have
    // the same, at least ROUNDS).
    let last: Vec<u64> = completed.iter().map(|c| c.load(Ordering::SeqCst)).collect();
    assert!(last.iter().all(|&r| r >= ROUNDS), "a writer stopped early");
    check(&remote, &last, true);
    let stats = ram.stats();
    assert!(
        flushes >= FLUSHES,
        "{flushes} flushes ran during the writes"
    );
    assert!(stats.pages_evicted > 0, "{stats:?}");
    // Write-protect faults track dirty pages, unless PAGEMAP_SCAN does.
    assert_eq!(
        stats.wp_faults > 0,
        dirty_tracking == DirtyTracking::WriteFaults,
        "{stats:?}"
    );
}

/// Child side of the SIGBUS test: touches a page of a dead node. Run only
/// by `dead_node_faults_raise_sigbus_within_deadline` (with its env vars).
#[test]
#[ignore = "child process of dead_node_faults_raise_sigbus_within_deadline"]
fn child_touches_dead_node() {
    let (Ok(url), Ok(gpa), Ok(ready), Ok(method)) = (
        std::env::var("GM_CHILD_URL"),
        std::env::var("GM_CHILD_GPA"),
        std::env::var("GM_CHILD_READY"),
        std::env::var("GM_CHILD_METHOD"),
    ) else {
        return;
    };
    let gpa: u64 = gpa.parse().unwrap();
    let mgr = Arc::new(
        TransportManager::connect(ManagerConfig {
            coordinator_url: url,
            request_timeout_ms: 200,
            connect_timeout_ms: 200,
            poller_cpus: Some(vec![]),
            ..ManagerConfig::default()
        })
        .unwrap(),
    );
    let reported = format!("{ready}.reported");
    let ram = GuestMemory::new(
        mgr,
        GuestMemoryConfig {
            sigbus_method: if method == "tgkill" {
                SigbusMethod::Tgkill
            } else {
                SigbusMethod::Poison
            },
            fault_timeout_ms: 300,
            on_fault_error: Some(Arc::new(move |report| {
                let _ = std::fs::write(&reported, format!("{:#x} {}", report.gpa, report.error));
                FaultAction::Sigbus
            })),
            ..config(gpa, NODE_BYTES)
        },
    )
    .unwrap();
    std::fs::write(&ready, "touching").unwrap();
    let mut byte = [0u8; 1];
    let _ = ram.read(gpa + 5 * 4096, &mut byte);
    // Only reached if no SIGBUS came.
    std::process::exit(3);
}

#[test]
fn dead_node_faults_raise_sigbus_within_deadline() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let mut b = ChildServer::start(&coord.url(), "b", NODE);
    let mgr = Arc::new(manager(&coord.url()));
    wait_until(Duration::from_secs(10), || {
        mgr.refresh_map().is_ok() && mgr.map().lookup(NODE).is_some()
    });
    let ram_a = GuestMemory::new(Arc::clone(&mgr), config(0, NODE_BYTES)).unwrap();
    let ram_b = GuestMemory::new(Arc::clone(&mgr), config(NODE, NODE_BYTES)).unwrap();
    for p in 0..8u64 {
        ram_b
            .write(NODE + p * 4096, &page_for(NODE + p * 4096, 3))
            .unwrap();
    }
    b.kill();

    // Write-back to the dead node fails within the deadline and drops nothing.
    let t0 = Instant::now();
    assert!(matches!(
        ram_b.flush(),
        Err(GuestMemoryError::WriteBack { .. })
    ));
    assert!(matches!(
        ram_b.evict(NODE, NODE),
        Err(GuestMemoryError::WriteBack { .. })
    ));
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let mut page = [0u8; PAGE_SIZE];
    for p in 0..8u64 {
        ram_b.read(NODE + p * 4096, &mut page).unwrap();
        assert!(
            page == page_for(NODE + p * 4096, 3),
            "dirty page {p} was lost"
        );
    }

    // A thread touching an absent page of the dead node gets SIGBUS, with
    // both methods.
    for method in ["poison", "tgkill"] {
        let dir = tempfile::tempdir().unwrap();
        let ready = dir.path().join("ready");
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "child_touches_dead_node",
                "--ignored",
                "--nocapture",
            ])
            .env("GM_CHILD_URL", coord.url())
            .env("GM_CHILD_GPA", NODE.to_string())
            .env("GM_CHILD_READY", &ready)
            .env("GM_CHILD_METHOD", method)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        assert!(
            wait_until(Duration::from_secs(20), || ready.exists()),
            "child did not start"
        );
        let touched = Instant::now();
        let mut status = None;
        wait_until(Duration::from_secs(10), || {
            status = child.try_wait().unwrap();
            status.is_some()
        });
        let elapsed = touched.elapsed();
        let Some(status) = status else {
            let _ = child.kill();
            panic!("{method}: the faulting thread hung");
        };
        assert_eq!(status.signal(), Some(libc::SIGBUS), "{method}: {status:?}");
        // fault_timeout 300 ms + one request timeout 200 ms + start-up slack.
        assert!(
            elapsed < Duration::from_millis(2500),
            "{method}: {elapsed:?}"
        );
        let reported = std::fs::read_to_string(format!("{}.reported", ready.display())).unwrap();
        assert!(reported.starts_with("0x105000"), "{method}: {reported}");
    }

    // Nothing else broke: the live node's region works end to end.
    for p in 0..PAGES_PER_NODE as u64 {
        ram_a.write(p * 4096, &page_for(p * 4096, 9)).unwrap();
    }
    ram_a.evict(0, NODE).unwrap();
    for p in 0..PAGES_PER_NODE as u64 {
        ram_a.read(p * 4096, &mut page).unwrap();
        assert!(page == page_for(p * 4096, 9));
    }
    assert_eq!(ram_a.stats().fault_errors, 0);
}

#[test]
fn retried_fault_completes_when_the_node_returns() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let mut b = ChildServer::start(&coord.url(), "b", NODE);
    let mgr = Arc::new(manager(&coord.url()));
    assert!(wait_until(Duration::from_secs(10), || {
        mgr.refresh_map().is_ok() && mgr.map().lookup(NODE).is_some()
    }));
    let epoch = node_epoch(&coord.url(), "b");
    let reports = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&reports);
    let ram = Arc::new(
        GuestMemory::new(
            Arc::clone(&mgr),
            GuestMemoryConfig {
                fault_timeout_ms: 200,
                on_fault_error: Some(Arc::new(move |report| {
                    if report.gpa == NODE + 3 * 4096 {
                        counted.fetch_add(1, Ordering::SeqCst);
                    }
                    FaultAction::Retry
                })),
                ..config(NODE, NODE_BYTES)
            },
        )
        .unwrap(),
    );
    b.kill();

    // The embedder asks to retry: the thread waits while the node is down...
    let toucher = {
        let ram = Arc::clone(&ram);
        std::thread::spawn(move || {
            let mut word = [0xffu8; 8];
            ram.read(NODE + 3 * 4096, &mut word).unwrap();
            word
        })
    };
    assert!(wait_until(Duration::from_secs(10), || reports
        .load(Ordering::SeqCst)
        >= 2));
    assert!(!toucher.is_finished(), "the fault must wait, not fail");
    // ...and completes once it is back: a restarted page-server has lost
    // the range (its faults fail with DataLost, retried) until the operator
    // re-initialises it; then the page is served as zeros.
    let _b = restart_and_reinitialise(&coord.url(), "b", NODE, epoch);
    assert!(
        wait_until(Duration::from_secs(20), || toucher.is_finished()),
        "fault not served after the node came back"
    );
    assert_eq!(toucher.join().unwrap(), [0u8; 8]);
    assert_eq!(ram.stats().sigbus_raised, 0);
}

#[test]
fn poisoned_page_is_fetched_again_after_evict() {
    poisoned_page_fetched_again(false);
}

#[test]
fn shared_poisoned_page_is_fetched_again_after_evict() {
    poisoned_page_fetched_again(true);
}

fn poisoned_page_fetched_again(shared: bool) {
    let (_db, coord) = loopback_coordinator();
    let mut b = ChildServer::start(&coord.url(), "b", NODE);
    let mgr = Arc::new(manager(&coord.url()));
    assert!(wait_until(Duration::from_secs(10), || {
        mgr.refresh_map().is_ok() && mgr.map().lookup(NODE).is_some()
    }));
    let epoch = node_epoch(&coord.url(), "b");
    // Until the node is back a failed fault is poisoned (the default);
    // after, it is retried, so a slow fetch on a loaded host cannot raise
    // SIGBUS in the test process.
    let node_back = Arc::new(AtomicBool::new(false));
    let back = Arc::clone(&node_back);
    let ram = GuestMemory::new(
        Arc::clone(&mgr),
        GuestMemoryConfig {
            fault_timeout_ms: 200,
            sigbus_method: SigbusMethod::Poison,
            backing: backing(shared, NODE_BYTES),
            on_fault_error: Some(Arc::new(move |_| {
                if back.load(Ordering::SeqCst) {
                    FaultAction::Retry
                } else {
                    FaultAction::Sigbus
                }
            })),
            ..config(NODE, NODE_BYTES)
        },
    )
    .unwrap();
    assert!(ram.handles_kernel_faults(), "tests run as root");
    b.kill();

    // A kernel-mode access (write(2) from guest memory into a pipe) to a
    // page of the dead node: the page is poisoned, and the kernel's access
    // fails with EFAULT where a vCPU's would take SIGBUS.
    let mut fds = [0; 2];
    // SAFETY: `fds` is a live array of two ints.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    let page = ram.host_addr(NODE + 5 * 4096).unwrap();
    let t0 = Instant::now();
    // SAFETY: `page` is 4096 bytes of the live region; the pipe has room.
    let n = unsafe { libc::write(fds[1], page.cast(), 4096) };
    let err = std::io::Error::last_os_error();
    assert_eq!((n, err.raw_os_error()), (-1, Some(libc::EFAULT)));
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert_eq!(ram.stats().sigbus_raised, 1);

    // The node comes back (restarted, its range re-initialised by the
    // operator); evict drops the poisoned page and the next touch fetches it.
    let _b = restart_and_reinitialise(&coord.url(), "b", NODE, epoch);
    node_back.store(true, Ordering::SeqCst);
    let mut probe = [0u8; PAGE_SIZE];
    assert!(wait_until(Duration::from_secs(20), || mgr
        .read_page(NODE, &mut probe)
        .is_ok()));
    assert_eq!(ram.evict(NODE + 5 * 4096, 4096).unwrap(), 1);
    let mut word = [0xffu8; 8];
    ram.read(NODE + 5 * 4096, &mut word).unwrap();
    assert_eq!(word, [0u8; 8]);
    // SAFETY: closing our own pipe ends.
    unsafe {
        libc::close(fds[0]);
    }
    // SAFETY: as above.
    unsafe {
        libc::close(fds[1]);
    }
}
