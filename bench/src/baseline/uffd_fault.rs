//! A bare userfaultfd fault: a private region whose missing pages one
//! handler thread fills with `UFFDIO_COPY` from a page it gets from a
//! `fetch` function (a local pattern, or the bare ping-pong server over
//! TCP), and one thread that touches the pages, timing each first touch
//! and checking each page. No library in the way: what a fault costs a
//! bare program on this machine.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rdma_transport::region::{MapOptions, MappedRegion};
use rdma_transport::uffd::{Event, EventBuffer, FaultMode, RegisterMode, Userfaultfd};
use rdma_transport::{Page, PAGE_SIZE};

use super::layout::pin_current;
use crate::pattern;
use crate::workload::{Outcome, Spec};

/// Fills `page` with the page at byte offset `off` of the region.
pub type Fetch = Box<dyn FnMut(u64, &mut Page) -> anyhow::Result<()>>;

/// Faults in `spec.ops` pages of a `pages`-page region (`spec.pattern`'s
/// order, one toucher thread on `cpu`) served by a handler thread on `cpu`
/// that blocks in `poll(2)` for the next fault, like ours, and gets each
/// page from the fetch `connect` makes (on the handler thread, after it is
/// pinned). Each page must hold `seed`'s pattern. A fetch that fails ends
/// the run with its error (the faulting thread gets a zero page first, so
/// it is not left waiting).
pub fn run(
    pages: usize,
    spec: Spec,
    seed: u64,
    cpu: usize,
    connect: impl FnOnce() -> anyhow::Result<Fetch> + Send,
) -> anyhow::Result<Outcome> {
    let len = pages * PAGE_SIZE;
    let region = MappedRegion::new(len, MapOptions::LAZY)?;
    let uffd = Userfaultfd::open(FaultMode::UserOnly).context("userfaultfd")?;
    uffd.enable(0).context("UFFDIO_API")?;
    uffd.register(region.as_ptr(), len, RegisterMode::MISSING)
        .context("UFFDIO_REGISTER")?;
    let stop = AtomicBool::new(false);
    let base = region.as_ptr() as usize;
    std::thread::scope(|s| {
        let handler = s.spawn(|| -> anyhow::Result<()> {
            // Whatever fails here, the handler keeps answering faults until
            // `stop`: the toucher must never be left waiting.
            let fetch = pin_current(cpu).and_then(|()| connect());
            serve(&uffd, base, &stop, fetch)
        });
        let toucher = s.spawn(|| -> anyhow::Result<Outcome> {
            pin_current(cpu)?;
            let check = |i: usize| {
                // SAFETY: page i was faulted in by the touch before this
                // check and stays mapped until the round's eviction.
                let page = unsafe { &*((base + i * PAGE_SIZE) as *const Page) };
                pattern::check(page, (i * PAGE_SIZE) as u64, seed)
            };
            touch(base, pages, spec, check, &region)
        });
        let touched = toucher
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("bare fault toucher panicked")));
        stop.store(true, Ordering::Relaxed);
        let served = handler
            .join()
            .unwrap_or_else(|_| Err(anyhow::anyhow!("bare fault handler panicked")));
        served.and(touched)
    })
}

/// The handler: until `stop`, fills every missing page that faults, with
/// `fetch`, or once it failed (or could not be had) with zeros.
fn serve(
    uffd: &Userfaultfd,
    base: usize,
    stop: &AtomicBool,
    fetch: anyhow::Result<Fetch>,
) -> anyhow::Result<()> {
    let mut src: Page = [0u8; PAGE_SIZE];
    let mut events = EventBuffer::new(16);
    let (mut fetch, mut failed) = match fetch {
        Ok(f) => (Some(f), None),
        Err(e) => (None, Some(e)),
    };
    while !stop.load(Ordering::Relaxed) {
        let mut fd = libc::pollfd {
            fd: uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        if unsafe { libc::poll(&mut fd, 1, 50) } <= 0 {
            continue;
        }
        if uffd.read_events(&mut events).is_err() {
            continue;
        }
        for event in events.events() {
            let Event::Pagefault(fault) = event else {
                continue;
            };
            let page_addr = fault.addr & !(PAGE_SIZE - 1);
            let off = (page_addr - base) as u64;
            if let (Some(f), None) = (fetch.as_mut(), &failed) {
                if let Err(e) = f(off, &mut src) {
                    failed = Some(e);
                }
            }
            if failed.is_some() {
                // The toucher must not wait for ever: it gets a zero page
                // (its check fails) and the run ends with the error.
                src.fill(0);
            }
            // SAFETY: `src` is a live page; `page_addr` is a missing page
            // of the registered region, which the kernel fills before the
            // toucher's faulting access returns (nothing else touches it).
            let _ =
                unsafe { uffd.copy(src.as_ptr(), page_addr as *mut u8, PAGE_SIZE, false, true) };
        }
    }
    failed.map_or(Ok(()), Err)
}

/// Touches `spec.ops` pages in rounds of at most `pages`, timing each first
/// touch and checking each page; evicts the region between rounds (not
/// timed), so every touch faults.
fn touch(
    base: usize,
    pages: usize,
    spec: Spec,
    check: impl Fn(usize) -> bool,
    region: &MappedRegion,
) -> anyhow::Result<Outcome> {
    let mut total = Outcome::empty(Duration::ZERO);
    let per_round = (pages as u64).min(spec.ops);
    let rounds = spec.ops.div_ceil(per_round);
    for round in 0..rounds {
        let touches = per_round.min(spec.ops - round * per_round) as usize;
        let order =
            crate::fault::orders(pages, touches, Spec { threads: 1, ..spec }, round).remove(0);
        let t0 = Instant::now();
        for &i in &order {
            let addr = (base + i * PAGE_SIZE) as *const u64;
            let t = Instant::now();
            // SAFETY: first word of page i of the live region.
            let word = unsafe { std::ptr::read_volatile(addr) };
            let ns = t.elapsed().as_nanos() as u64;
            std::hint::black_box(word);
            let _ = total.latency_ns.record(ns.max(1));
            if !check(i) {
                total.bad_pages += 1;
            }
        }
        total.elapsed += t0.elapsed();
        total.ops_done += touches as u64;
        total.pages_checked += touches as u64;
        // SAFETY: drops the pages of our own region so the next round
        // faults again.
        let ret = unsafe {
            libc::madvise(
                region.as_ptr().cast(),
                region.len_bytes(),
                libc::MADV_DONTNEED,
            )
        };
        if ret != 0 {
            bail!("madvise: {}", std::io::Error::last_os_error());
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{AccessPattern, Op};

    fn spec(ops: u64) -> Spec {
        Spec {
            op: Op::Fault,
            ops,
            threads: 1,
            depth: 1,
            pattern: AccessPattern::Random,
        }
    }

    #[test]
    fn every_faulted_page_is_the_fetched_one_and_checked() -> anyhow::Result<()> {
        // Two rounds over 32 pages: the eviction between them faults again.
        let outcome = run(32, spec(64), 7, 0, || {
            let fill: Fetch = Box::new(|off, page| {
                pattern::fill(page, off, 7);
                Ok(())
            });
            Ok(fill)
        })?;
        assert_eq!(
            (outcome.ops_done, outcome.pages_checked, outcome.bad_pages),
            (64, 64, 0)
        );
        // A fetch of the wrong pages is seen.
        let outcome = run(32, spec(32), 7, 0, || {
            let fill: Fetch = Box::new(|off, page| {
                pattern::fill(page, off, 8);
                Ok(())
            });
            Ok(fill)
        })?;
        assert_eq!(outcome.bad_pages, 32);
        Ok(())
    }

    #[test]
    fn a_fetch_that_fails_ends_the_run_with_its_error_instead_of_hanging() {
        let mut served = 0;
        let result = run(32, spec(32), 7, 0, move || {
            let fill: Fetch = Box::new(move |off, page| {
                served += 1;
                if served > 5 {
                    anyhow::bail!("server gone");
                }
                pattern::fill(page, off, 7);
                Ok(())
            });
            Ok(fill)
        });
        let Err(err) = result else {
            panic!("a run whose fetch failed returned Ok")
        };
        assert!(err.to_string().contains("server gone"), "{err:#}");
        // And a fetch that cannot even be had.
        let Err(err) = run(32, spec(32), 7, 0, || anyhow::bail!("no server")) else {
            panic!("a run with no fetch returned Ok")
        };
        assert!(err.to_string().contains("no server"), "{err:#}");
    }
}
