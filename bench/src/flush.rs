//! The flush measurement of `--op fault`: dirty N pages of guest memory,
//! time `GuestMemory::flush`, and read every written-back page from its
//! owner to check it.
//!
//! Per backing and address order: `seq` dirties every page of the region
//! (contiguous runs: one write-protect ioctl and one batch per 64 pages),
//! `random` a random half of them (short runs). Each round rewrites the
//! dirty set with a new seed (first writes to clean pages: write-protect
//! faults), then flushes; `--ops` bounds the pages written back in all.
//! In the table, `ops` is pages written back, `p50_us` the time of one
//! `flush()` call, `pages/s` pages written back per second of flushing.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rdma_transport::guest_memory::{DirtyTracking, GuestMemory, GuestMemoryConfig};
use rdma_transport::{Page, TransportManager, PAGE_SIZE};

use crate::matrix::Backing;
use crate::pattern;
use crate::report::{fmt_us, Record};
use crate::workload::{AccessPattern, Op, Outcome, Spec, WorkingSet};

const SEED: u64 = 0xf1a5;
/// What the pages of a huge page that the bench does not dirty hold (they
/// are written back with the huge page, and checked too).
const BASE_SEED: u64 = 0xba5e;
/// Flushes per run at most (each of up to the whole region).
const MAX_ROUNDS: u64 = 8;

/// The dirty-tracking methods to measure for `backing`: a memfd (4 KiB
/// shared memory) can use either, the others write-protect faults only.
fn trackings(backing: Backing) -> &'static [DirtyTracking] {
    match backing {
        Backing::Memfd => &[DirtyTracking::PagemapScan, DirtyTracking::WriteFaults],
        Backing::Anon | Backing::Hugetlbfs => &[DirtyTracking::WriteFaults],
    }
}

fn tracking_name(tracking: DirtyTracking) -> &'static str {
    match tracking {
        DirtyTracking::PagemapScan => "pagemap-scan",
        _ => "wp-faults",
    }
}

/// Runs the flush measurement; returns the table's records and summary lines.
pub fn run(
    mgr: &Arc<TransportManager>,
    set: &WorkingSet,
    ops: u64,
    backings: &[Backing],
    patterns: &[AccessPattern],
    handler_cpus: Option<Vec<usize>>,
    handler_slice_us: u64,
) -> anyhow::Result<(Vec<Record>, Vec<String>)> {
    let gpa_base = set.gpas[0];
    let pages = set.len();
    let mut records = Vec::new();
    let mut lines = Vec::new();
    for &backing in backings {
        for (&tracking, &pattern) in trackings(backing)
            .iter()
            .flat_map(|t| patterns.iter().map(move |p| (t, p)))
        {
            if backing.unit_pages() > 1 {
                set.fill(mgr, BASE_SEED).context("filling remote memory")?;
            }
            let ram = GuestMemory::new(
                Arc::clone(mgr),
                GuestMemoryConfig {
                    dirty_tracking: tracking,
                    ..crate::guest::config(
                        backing,
                        gpa_base,
                        pages * PAGE_SIZE,
                        handler_cpus.clone(),
                        handler_slice_us,
                    )?
                },
            )
            .context("mapping guest memory")?;
            let tracking = tracking_name(ram.dirty_tracking());
            let dirty = dirty_set(pages, pattern);
            // The writer is a vCPU: on CPU 0 with the handler, like the
            // fault runs' first toucher (left to the scheduler, each
            // write-protect fault can wake the handler on an idle CPU).
            let (outcome, per_write) = std::thread::scope(|s| {
                s.spawn(|| {
                    crate::fault::pin_toucher(0, &[0]);
                    flush_rounds(mgr, &ram, &dirty, ops, backing.unit_pages())
                })
                .join()
                .map_err(|_| anyhow::anyhow!("the flush thread panicked"))
            })??;
            let spec = Spec {
                op: Op::Write,
                ops,
                threads: 1,
                depth: 1,
                pattern,
            };
            let label = match (backing, tracking) {
                (Backing::Anon, _) => "flush",
                (Backing::Memfd, "pagemap-scan") => "flush+memfd/scan",
                (Backing::Memfd, _) => "flush+memfd",
                (Backing::Hugetlbfs, _) => "flush+huge",
            };
            let stats = ram.stats();
            let mut record = Record::new(label, spec, 0, &outcome);
            record.backing = Some(backing.name().into());
            record.dirty_tracking = Some(tracking.into());
            lines.push(format!(
                "flush ({}, {tracking}), {pattern:?}: {} dirty pages per flush, p50 {} us per flush, {:.0} pages/s, {} of {} pages sent in place; dirtying them (first writes to clean pages): {:.2} us per page, {} write-protect faults",
                backing.name(),
                dirty.len(),
                fmt_us(record.latency_us.p50),
                record.throughput.pages_per_s,
                stats.pages_written_in_place,
                stats.pages_written_back,
                per_write.as_secs_f64() * 1e6,
                stats.wp_faults,
            ));
            records.push(record);
        }
    }
    Ok((records, lines))
}

/// The pages to dirty: all of them (seq) or a random half (random), in
/// ascending order.
fn dirty_set(pages: usize, pattern: AccessPattern) -> Vec<usize> {
    match pattern {
        AccessPattern::Seq => (0..pages).collect(),
        AccessPattern::Random => {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(SEED);
            let mut all: Vec<usize> = (0..pages).collect();
            all.shuffle(&mut rng);
            all.truncate(pages.div_ceil(2));
            all.sort_unstable();
            all
        }
    }
}

/// Rounds of: write the dirty set with the round's seed, flush (timed),
/// read the pages back from their owners and check them. `unit_pages`: the
/// region tracks and writes back units of that many pages (huge pages).
/// Also returns the mean time of one write of the dirtying (the first round
/// includes fetching the pages).
fn flush_rounds(
    mgr: &TransportManager,
    ram: &GuestMemory,
    dirty: &[usize],
    ops: u64,
    unit_pages: usize,
) -> anyhow::Result<(Outcome, Duration)> {
    let mut units: Vec<usize> = dirty.iter().map(|&i| i / unit_pages).collect();
    units.dedup();
    let expected = (units.len() * unit_pages) as u64;
    // Every page written back: the dirty ones and the rest of their units.
    let sent: Vec<usize> = units
        .iter()
        .flat_map(|&u| u * unit_pages..(u + 1) * unit_pages)
        .collect();
    let mut total = Outcome::empty(Duration::ZERO);
    let rounds = ops.div_ceil(dirty.len().max(1) as u64).clamp(1, MAX_ROUNDS);
    let mut page: Page = [0u8; PAGE_SIZE];
    let mut back = vec![[0u8; PAGE_SIZE]; 64];
    let mut dirtying = Duration::ZERO;
    for round in 0..rounds {
        let seed = SEED + round;
        for &i in dirty {
            let gpa = ram.gpa_base() + (i * PAGE_SIZE) as u64;
            pattern::fill(&mut page, gpa, seed);
            // Timed: the first write to a clean page is what the tracking
            // method costs the guest (a fault, or none).
            let t0 = Instant::now();
            ram.write(gpa, &page)?;
            dirtying += t0.elapsed();
        }
        let t0 = Instant::now();
        let written = ram.flush();
        let took = t0.elapsed();
        total.elapsed += took;
        let _ = total.latency_ns.record((took.as_nanos() as u64).max(1));
        match written {
            Ok(n) => {
                total.ops_done += n;
                if n != expected {
                    total.errors += 1;
                    total
                        .first_error
                        .get_or_insert(format!("flush wrote {n} pages, {expected} were dirty"));
                }
            }
            Err(err) => {
                total.errors += 1;
                total.first_error.get_or_insert(err.to_string());
            }
        }
        for chunk in sent.chunks(back.len()) {
            let gpas: Vec<u64> = chunk
                .iter()
                .map(|&i| ram.gpa_base() + (i * PAGE_SIZE) as u64)
                .collect();
            mgr.read_pages(&gpas, &mut back[..chunk.len()])
                .context("reading written-back pages")?;
            for ((gpa, got), i) in gpas.iter().zip(&back).zip(chunk) {
                total.pages_checked += 1;
                let want = if dirty.binary_search(i).is_ok() {
                    seed
                } else {
                    BASE_SEED
                };
                if !pattern::check(got, *gpa, want) {
                    total.bad_pages += 1;
                }
            }
        }
    }
    let writes = (rounds as u32).saturating_mul(dirty.len().max(1) as u32);
    Ok((total, dirtying / writes.max(1)))
}
