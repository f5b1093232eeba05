//! Coherent guest memory (`CoherentMemory`) through real userfaultfd faults:
//! two nodes in this process map the same guest RAM, homed at a
//! page-server; vCPU threads read, write and compare-and-swap it in place.
//! Where two nodes take part, one's guest RAM is a memfd (shared file:
//! pages go in through the alias and `UFFDIO_CONTINUE`), the other's
//! anonymous memory.
//! (Node processes on loopback are in `bench/tests/coherence.rs`.)

mod common;

use std::sync::atomic::{AtomicU64, Ordering};

use common::*;
use rdma_transport::coherent::{Access, CoherenceConfig};
use rdma_transport::guest_memory::{CoherentMemory, GuestBacking, GuestMemoryConfig, SharedFile};
use rdma_transport::{TransportError, TransportManager, PAGE_SIZE};

const PAGES: usize = 64;

fn node(mgr: &TransportManager, threads: usize) -> CoherentMemory {
    node_on(mgr, threads, false)
}

/// A node whose guest RAM is anonymous memory, or (`memfd`) a memfd of its
/// own (what a hypervisor shares with vhost-user back-ends and KVM).
fn node_on(mgr: &TransportManager, threads: usize, memfd_backed: bool) -> CoherentMemory {
    let backing = if memfd_backed {
        GuestBacking::SharedFile(SharedFile::new(memfd(PAGES * PAGE_SIZE), 0))
    } else {
        GuestBacking::Anonymous
    };
    let config = GuestMemoryConfig {
        handler_threads: threads,
        handler_cpus: Some(vec![]),
        backing,
        ..GuestMemoryConfig::new(0, PAGES * PAGE_SIZE)
    };
    CoherentMemory::new(
        mgr,
        config,
        CoherenceConfig {
            min_hold_us: 50,
            timeout_ms: 10_000,
            ..CoherenceConfig::default()
        },
    )
    .expect("coherent region")
}

/// A node on anonymous memory whose owned pages are kept `min_hold_us`
/// after their grant.
fn holding(mgr: &TransportManager, min_hold_us: u64) -> CoherentMemory {
    CoherentMemory::new(
        mgr,
        GuestMemoryConfig {
            handler_cpus: Some(vec![]),
            ..GuestMemoryConfig::new(0, PAGES * PAGE_SIZE)
        },
        CoherenceConfig {
            min_hold_us,
            timeout_ms: 10_000,
            ..CoherenceConfig::default()
        },
    )
    .expect("coherent region")
}

/// The first word of `mem`'s guest RAM.
fn word(mem: &CoherentMemory) -> &AtomicU64 {
    // SAFETY: an aligned u64 inside the live region, only accessed
    // atomically by these tests.
    unsafe { &*mem.as_ptr().cast::<AtomicU64>() }
}

/// Page 0 as `mem` reads it: `count` in its first word, the zeros the home
/// started with in the rest.
fn assert_whole_page(mem: &CoherentMemory, count: u64) {
    let mut expected = vec![0u8; PAGE_SIZE];
    expected[..8].copy_from_slice(&count.to_ne_bytes());
    assert!(
        read_page(mem, 0) == expected,
        "page 0 is not {count} and zeros"
    );
}

fn read_page(mem: &CoherentMemory, page: usize) -> Vec<u8> {
    let mut buf = vec![0u8; PAGE_SIZE];
    mem.read((page * PAGE_SIZE) as u64, &mut buf).unwrap();
    buf
}

#[test]
fn each_node_reads_the_others_latest_write() {
    let (_db, coord) = loopback_coordinator();
    let _home = page_server(&coord.url(), "home", 0);
    let mgr = manager(&coord.url());
    // a's guest RAM is a memfd, b's anonymous memory.
    let (a, b) = (node_on(&mgr, 1, true), node(&mgr, 1));
    for round in 0..4u8 {
        for page in 0..8 {
            let data = page_for((page * PAGE_SIZE) as u64, round * 2);
            a.write((page * PAGE_SIZE) as u64, &data).unwrap();
            assert_eq!(read_page(&b, page), data, "b reads a's write, page {page}");
            // a still reads its own write (a shared copy now).
            assert_eq!(read_page(&a, page), data);
            let data = page_for((page * PAGE_SIZE) as u64, round * 2 + 1);
            b.write((page * PAGE_SIZE) as u64, &data).unwrap();
            assert_eq!(read_page(&a, page), data, "a reads b's write, page {page}");
        }
    }
    let (sa, sb) = (a.stats(), b.stats());
    // a's writes after b's took the page back from b: b was invalidated
    // (or downgraded then invalidated), and a's copy went back each time b
    // read it.
    assert!(sa.downgrades >= 8 && sb.downgrades >= 8, "{sa:?} {sb:?}");
    assert!(
        sa.invalidations >= 8 && sb.invalidations >= 8,
        "{sa:?} {sb:?}"
    );
    assert!(
        sa.upgrade_faults >= 8,
        "a's writes on its shared copies: {sa:?}"
    );
    assert_eq!(sa.fault_errors + sb.fault_errors, 0);
}

/// Two nodes, two vCPU threads each, incrementing eight counters (two per
/// page: false sharing) with compare-and-swap in guest memory.
#[test]
fn compare_and_swap_counters_from_two_nodes_add_up() {
    const INCREMENTS: u64 = 1600; // a multiple of COUNTERS: every counter gets as many
    const COUNTERS: usize = 8;
    let (_db, coord) = loopback_coordinator();
    let _home = page_server(&coord.url(), "home", 0);
    let mgr = manager(&coord.url());
    let nodes = [node_on(&mgr, 2, true), node(&mgr, 2)];
    let counter = |mem: &CoherentMemory, i: usize| -> &AtomicU64 {
        // Counter i: page 1 + i / 2, at byte 0 or 2048.
        let gpa = ((1 + i / 2) * PAGE_SIZE + (i % 2) * 2048) as u64;
        let ptr = mem.host_addr(gpa).unwrap().cast::<AtomicU64>();
        // SAFETY: an aligned u64 inside the live region, only ever accessed
        // atomically by this test.
        unsafe { &*ptr }
    };
    std::thread::scope(|s| {
        for (n, mem) in nodes.iter().enumerate() {
            for t in 0..2 {
                s.spawn(move || {
                    for k in 0..INCREMENTS {
                        let c = counter(mem, (n * 2 + t + k as usize) % COUNTERS);
                        let mut seen = c.load(Ordering::Acquire);
                        while let Err(now) =
                            c.compare_exchange(seen, seen + 1, Ordering::AcqRel, Ordering::Acquire)
                        {
                            seen = now;
                        }
                    }
                });
            }
        }
    });
    let total: u64 = (0..COUNTERS)
        .map(|i| counter(&nodes[1], i).load(Ordering::Acquire))
        .sum();
    assert_eq!(total, 4 * INCREMENTS);
    for i in 0..COUNTERS {
        assert_eq!(
            counter(&nodes[0], i).load(Ordering::Acquire),
            4 * INCREMENTS / COUNTERS as u64,
            "counter {i}"
        );
    }
    let (s0, s1) = (nodes[0].stats(), nodes[1].stats());
    assert_eq!(s0.fault_errors + s1.fault_errors, 0);
    assert!(s0.protocol.requests > 0 && s1.protocol.requests > 0);
}

/// A node that dies owning a page it never wrote back: the other node gets
/// the typed lost-data error for it, never an older version; pages it had
/// handed back (evicted) or only read lose nothing.
#[test]
fn a_page_owned_by_a_dropped_node_is_reported_lost() {
    let (_db, coord) = loopback_coordinator();
    let _home = page_server(&coord.url(), "home", 0);
    let mgr = manager(&coord.url());
    let b = node(&mgr, 1);
    {
        let a = node(&mgr, 1);
        // Page 1: written then handed back. Page 2: written, kept. Page 3:
        // written by b, read by a.
        a.write(PAGE_SIZE as u64, &page_for(PAGE_SIZE as u64, 1))
            .unwrap();
        assert_eq!(a.evict(PAGE_SIZE as u64, PAGE_SIZE as u64).unwrap(), 1);
        a.write(2 * PAGE_SIZE as u64, &page_for(2 * PAGE_SIZE as u64, 2))
            .unwrap();
        b.write(3 * PAGE_SIZE as u64, &page_for(3 * PAGE_SIZE as u64, 3))
            .unwrap();
        assert_eq!(read_page(&a, 3), page_for(3 * PAGE_SIZE as u64, 3));
        // a dies.
    }
    match b.acquire(2 * PAGE_SIZE as u64, Access::Read) {
        Err(TransportError::CoherentDataLost { gpa, .. }) => assert_eq!(gpa, 2 * PAGE_SIZE as u64),
        other => panic!("page 2 should be lost, got {other:?}"),
    }
    b.acquire(PAGE_SIZE as u64, Access::Read).unwrap();
    assert_eq!(read_page(&b, 1), page_for(PAGE_SIZE as u64, 1));
    b.acquire(3 * PAGE_SIZE as u64, Access::Write).unwrap();
    assert_eq!(read_page(&b, 3), page_for(3 * PAGE_SIZE as u64, 3));
    assert!(matches!(
        b.acquire(PAGES as u64 * PAGE_SIZE as u64, Access::Read),
        Err(TransportError::UnknownGpa { .. })
    ));
}

/// A page evicted right after the write that faulted it in goes back to its
/// home, every time. (The fault's install wakes the vCPU before the copy's
/// bookkeeping was done; an eviction at once then skipped the page, and a
/// node that left afterwards lost it.)
#[test]
fn a_page_evicted_right_after_its_fault_goes_back() {
    const ROUNDS: usize = PAGES;
    let (_db, coord) = loopback_coordinator();
    let _home = page_server(&coord.url(), "home", 0);
    let mgr = manager(&coord.url());
    let (a, b) = (node(&mgr, 1), node(&mgr, 1));
    for page in 0..ROUNDS {
        let gpa = (page * PAGE_SIZE) as u64;
        a.write(gpa, &page_for(gpa, 9)).unwrap();
        assert_eq!(a.evict(gpa, PAGE_SIZE as u64).unwrap(), 1, "page {page}");
    }
    drop(a);
    for page in 0..ROUNDS {
        let gpa = (page * PAGE_SIZE) as u64;
        b.acquire(gpa, Access::Read)
            .unwrap_or_else(|e| panic!("page {page}: {e}"));
        assert_eq!(read_page(&b, page), page_for(gpa, 9), "page {page}");
    }
}

/// A node whose map is older than the range (its manager read the map
/// before the home claimed it, and refreshes it in the background no
/// more): its first access refreshes the map and is served, as a read of
/// the data path would be. Until 2026-12-07 the coherent path failed such
/// a fault at once with `UnknownGpa` (a vCPU's SIGBUS by default).
#[test]
fn a_node_whose_map_predates_the_range_refreshes_it_rather_than_failing() {
    let (_db, coord) = loopback_coordinator();
    let mgr = TransportManager::connect(rdma_transport::ManagerConfig {
        coordinator_url: coord.url(),
        map_refresh_ms: 0,
        poller_cpus: Some(vec![]),
        ..rdma_transport::ManagerConfig::default()
    })
    .expect("manager connects");
    assert!(
        mgr.map().lookup(0).is_none(),
        "the map already has the range"
    );
    let _home = page_server(&coord.url(), "home", 0);
    let mem = node(&mgr, 1);
    mem.acquire(0, Access::Read)
        .expect("the first access to a range claimed after the map was read");
    assert!(
        read_page(&mem, 0) == vec![0u8; PAGE_SIZE],
        "a new range reads as zeros"
    );
}

/// Bad settings and addresses get clear errors, and nothing is mapped.
#[test]
fn bad_settings_and_addresses_are_refused() {
    use rdma_transport::guest_memory::GuestMemoryError;
    let (_db, coord) = loopback_coordinator();
    let _home = page_server(&coord.url(), "home", 0);
    let mgr = manager(&coord.url());
    let coherence = CoherenceConfig::default();
    let past_the_file = GuestMemoryConfig {
        backing: GuestBacking::SharedFile(SharedFile::new(memfd(PAGES * PAGE_SIZE), 4096)),
        ..GuestMemoryConfig::new(0, PAGES * PAGE_SIZE)
    };
    assert!(matches!(
        CoherentMemory::new(&mgr, past_the_file, coherence),
        Err(GuestMemoryError::FileTooSmall { .. })
    ));
    let no_threads = GuestMemoryConfig {
        handler_threads: 0,
        ..GuestMemoryConfig::new(0, PAGES * PAGE_SIZE)
    };
    assert!(matches!(
        CoherentMemory::new(&mgr, no_threads, coherence),
        Err(GuestMemoryError::Config(_))
    ));
    // No bound on a home's silence: no home would accept the node.
    let unbound = CoherenceConfig {
        dead_home_timeout_ms: 0,
        ..coherence
    };
    match CoherentMemory::new(&mgr, GuestMemoryConfig::new(0, PAGES * PAGE_SIZE), unbound) {
        Err(GuestMemoryError::Config(why)) => {
            assert!(why.contains("dead_home_timeout_ms"), "{why}")
        }
        other => panic!("expected a configuration error, got {:?}", other.err()),
    }
    let mem = node(&mgr, 1);
    assert!(matches!(
        mem.acquire(12, Access::Read),
        Err(TransportError::Unaligned { gpa: 12 })
    ));
    assert!(matches!(
        mem.evict(4096, 12),
        Err(GuestMemoryError::OutOfRange { .. })
    ));
    let mut buf = [0u8; 16];
    assert!(matches!(
        mem.read((PAGES * PAGE_SIZE - 8) as u64, &mut buf),
        Err(GuestMemoryError::OutOfRange { .. })
    ));
    // Nothing was faulted in by the refusals.
    assert_eq!(mem.stats().protocol.requests, 0);
}

/// Four vCPU threads of one node fault on the same pages at once: each page
/// costs the node one request to its home (the faults are coalesced), and
/// every thread reads the right contents.
#[test]
fn faults_of_one_node_on_one_page_are_one_request() {
    const TOUCHED: usize = 32;
    let (_db, coord) = loopback_coordinator();
    let _home = page_server(&coord.url(), "home", 0);
    let mgr = manager(&coord.url());
    let writer = node(&mgr, 1);
    for page in 0..TOUCHED {
        let gpa = (page * PAGE_SIZE) as u64;
        writer.write(gpa, &page_for(gpa, 11)).unwrap();
    }
    let reader = node(&mgr, 4);
    let start = std::sync::Barrier::new(4);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                start.wait();
                for page in 0..TOUCHED {
                    let gpa = (page * PAGE_SIZE) as u64;
                    assert_eq!(read_page(&reader, page), page_for(gpa, 11), "page {page}");
                }
            });
        }
    });
    let stats = reader.stats();
    assert_eq!(stats.protocol.requests, TOUCHED as u64, "{stats:?}");
    assert!(stats.read_faults >= TOUCHED as u64, "{stats:?}");
    assert_eq!(stats.fault_errors, 0);
}

/// A range held by two page-servers (replicas) is refused with a clear
/// error: its home would keep write-backs in its own memory only, and the
/// other replica would serve an older page after a failover.
#[test]
fn replicated_ranges_are_refused() {
    let (_db, coord) = loopback_coordinator();
    let _a = page_server(&coord.url(), "a", 0);
    let _b = page_server(&coord.url(), "b", 0);
    let mgr = manager(&coord.url());
    assert!(
        wait_until(std::time::Duration::from_secs(30), || {
            mgr.refresh_map().is_ok()
                && mgr
                    .map()
                    .ranges()
                    .next()
                    .is_some_and(|(start, _, _)| mgr.map().replica_count(start) == 2)
        }),
        "the range never had two replicas"
    );
    let mem = node(&mgr, 1);
    match mem.acquire(0, Access::Read) {
        Err(TransportError::Config(reason)) => assert!(reason.contains("replicated"), "{reason}"),
        other => panic!("a replicated range was served coherently: {other:?}"),
    }
}

/// The minimum hold time: a node granted a page keeps it (and writes it
/// without messages) for `min_hold_us` even when another node asks for it
/// at once; the callback is deferred (and counted), then answered.
#[test]
fn an_owner_keeps_a_page_for_its_hold_time() {
    const HOLD: std::time::Duration = std::time::Duration::from_millis(300);
    let (_db, coord) = loopback_coordinator();
    let _home = page_server(&coord.url(), "home", 0);
    let mgr = manager(&coord.url());
    let (a, b) = (holding(&mgr, HOLD.as_micros() as u64), holding(&mgr, 0));
    let granted = std::time::Instant::now();
    word(&a).store(1, Ordering::Release);
    let mut writes = 0u64;
    std::thread::scope(|s| {
        // b asks for the page while a holds it.
        let taker = s.spawn(|| {
            word(&b).fetch_add(1, Ordering::AcqRel);
            granted.elapsed()
        });
        // a keeps writing for half its hold time, without a request,
        // while b's request waits at the home.
        while granted.elapsed() < HOLD / 2 {
            word(&a).fetch_add(2, Ordering::AcqRel);
            writes += 1;
        }
        let during = a.stats();
        assert_eq!(
            during.protocol.requests, 1,
            "a asked again within its hold time: {during:?}"
        );
        assert!(writes > 0);
        let took = taker.join().unwrap();
        assert!(
            took >= HOLD / 2,
            "b had the page after {took:?}, within a's hold time"
        );
    });
    let sa = a.stats();
    assert!(sa.protocol.deferred_callbacks >= 1, "{sa:?}");
    assert_eq!(sa.fault_errors + b.stats().fault_errors, 0);
    // Every write of both is in the page: a's 1, its +2s, then b's +1.
    assert_eq!(word(&b).load(Ordering::Acquire), 1 + 2 * writes + 1);
}

/// More nodes ask for one busy page than its home queues (8): the home
/// turns the rest away (`Retry`), and each of them asks again after a
/// back-off that doubles up to about a millisecond, not a round trip
/// after round trip for as long as the page stays busy. Every write
/// still lands.
#[test]
fn nodes_turned_away_by_a_full_queue_ask_again_after_a_back_off() {
    const HOLD: std::time::Duration = std::time::Duration::from_millis(400);
    const TAKERS: usize = 11;
    let (_db, coord) = loopback_coordinator();
    let home = page_server(&coord.url(), "home", 0);
    let mgr = manager(&coord.url());
    let owner = holding(&mgr, HOLD.as_micros() as u64);
    let takers: Vec<CoherentMemory> = (0..TAKERS).map(|_| holding(&mgr, 0)).collect();
    // The owner holds the page for HOLD: the first taker's request waits
    // at the home for it, 8 more are queued, the others are turned away
    // until the queue has room.
    let granted = std::time::Instant::now();
    word(&owner).store(1, Ordering::Release);
    std::thread::scope(|s| {
        for taker in &takers {
            s.spawn(|| word(taker).fetch_add(1, Ordering::AcqRel));
        }
    });
    let elapsed_ms = granted.elapsed().as_millis() as u64;
    assert!(elapsed_ms >= HOLD.as_millis() as u64 / 2);
    assert_eq!(word(&owner).load(Ordering::Acquire), 1 + TAKERS as u64);
    assert_whole_page(&takers[0], 1 + TAKERS as u64);
    let resent: Vec<u64> = takers.iter().map(|t| t.stats().protocol.retries).collect();
    let turned_away = home.coherence_stats().home.retries;
    assert!(turned_away > 0, "the home's queue never filled: {resent:?}");
    assert_eq!(
        resent.iter().sum::<u64>(),
        turned_away,
        "each Retry is answered by one request sent again"
    );
    // 16, 32, ..., 1024 µs, then one a millisecond at most.
    let most = 8 + elapsed_ms;
    for (i, n) in resent.iter().enumerate() {
        assert!(
            *n <= most,
            "taker {i} asked again {n} times in {elapsed_ms} ms (at most {most} with the back-off): {resent:?}"
        );
    }
    let errors: u64 = takers.iter().map(|t| t.stats().fault_errors).sum();
    assert_eq!(errors + owner.stats().fault_errors, 0);
}

/// Twelve nodes pass a token around in one page: each waits (reading its
/// copy) for its turn, then writes, which takes every other node's copy
/// away, and the eleven read it again at once: more requests than the
/// home queues (8), so some are turned away again and again and wait out
/// their back-off while the others are served. None of them is starved
/// into a fault timeout, and the token goes round every time.
#[test]
fn twelve_nodes_passing_a_token_in_one_page_all_get_their_turns() {
    const NODES: u64 = 12;
    const ROUNDS: u64 = 15;
    let (_db, coord) = loopback_coordinator();
    let home = page_server(&coord.url(), "home", 0);
    let mgr = manager(&coord.url());
    let nodes: Vec<CoherentMemory> = (0..NODES).map(|_| holding(&mgr, 50)).collect();
    std::thread::scope(|s| {
        for (i, mem) in (0..NODES).zip(&nodes) {
            s.spawn(move || {
                for round in 0..ROUNDS {
                    let turn = round * NODES + i;
                    while word(mem).load(Ordering::Acquire) != turn {
                        std::thread::yield_now();
                    }
                    word(mem).store(turn + 1, Ordering::Release);
                }
            });
        }
    });
    assert_eq!(word(&nodes[0]).load(Ordering::Acquire), NODES * ROUNDS);
    assert_whole_page(&nodes[5], NODES * ROUNDS);
    let stats: Vec<_> = nodes.iter().map(CoherentMemory::stats).collect();
    let errors: u64 = stats.iter().map(|s| s.fault_errors).sum();
    assert_eq!(
        errors, 0,
        "a node timed out waiting for the page: {stats:?}"
    );
    let resent: u64 = stats.iter().map(|s| s.protocol.retries).sum();
    let home = home.coherence_stats().home;
    assert!(home.retries > 0, "the queue never overflowed: {home:?}");
    assert_eq!(resent, home.retries);
}
