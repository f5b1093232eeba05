//! `serve`: a node the benchmark drives line by line on stdin, each access
//! timed from this node's side (faults included), for `bench --op
//! coherence`. Commands (GPAs 8-byte aligned, numbers in decimal):
//!
//! - `r GPA`: load the u64 at GPA; answers `ok NS VALUE`;
//! - `w GPA VALUE`: store VALUE there; `ok NS 0`;
//! - `e GPA`: hand the page back to its home; `ok 0 0`;
//! - `pp GPA N PARITY`: N times, wait until the u64 at GPA has this parity,
//!   then add one (two nodes of opposite parities pass the page back and
//!   forth); `ok NS FINAL` (NS: the whole loop, FINAL: the value at the end);
//! - `t`: how this node reaches its homes; `ok RDMA TCP` (connections
//!   over RDMA message channels, over TCP);
//! - `q`: hand every page back and exit.
//!
//! A command that cannot be carried out answers `err REASON`.

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use rdma_transport::guest_memory::CoherentMemory;
use rdma_transport::PAGE_SIZE;

/// Serves commands until `q` or the end of stdin.
pub fn serve(memory: &CoherentMemory, wait_limit: Duration) -> anyhow::Result<serde_json::Value> {
    let stdin = std::io::stdin();
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready")?;
    out.flush()?;
    let mut served = 0u64;
    for line in stdin.lock().lines() {
        let line = line.context("reading a command")?;
        if line.trim() == "q" {
            break;
        }
        let answer = match transports(memory, &line)
            .map_or_else(|| command(memory, &line, wait_limit), Ok)
        {
            Ok((ns, value)) => format!("ok {ns} {value}"),
            Err(err) => format!("err {err:#}"),
        };
        writeln!(out, "{answer}")?;
        out.flush()?;
        served += 1;
    }
    memory
        .evict(0, memory.size_bytes() as u64)
        .context("handing the pages back")?;
    Ok(serde_json::json!({ "role": "serve", "verified": true, "commands": served }))
}

/// The `t` command's answer (`None` for any other command).
fn transports(memory: &CoherentMemory, line: &str) -> Option<(u128, u64)> {
    if line.trim() != "t" {
        return None;
    }
    let homes = memory.connections();
    let rdma = homes.iter().filter(|(_, c)| c.is_some()).count() as u128;
    Some((rdma, (homes.len() as u64).saturating_sub(rdma as u64)))
}

fn command(
    memory: &CoherentMemory,
    line: &str,
    wait_limit: Duration,
) -> anyhow::Result<(u128, u64)> {
    let mut words = line.split_whitespace();
    let op = words.next().context("an empty command")?;
    let mut number = |what: &str| -> anyhow::Result<u64> {
        words
            .next()
            .with_context(|| format!("{op}: no {what}"))?
            .parse()
            .with_context(|| format!("{op}: a bad {what}"))
    };
    let gpa = number("GPA")?;
    let ptr = memory
        .host_addr(gpa)
        .filter(|_| gpa % 8 == 0)
        .with_context(|| format!("GPA {gpa:#x} is not an aligned u64 of the region"))?;
    // SAFETY: an aligned u64 inside the region, which outlives this call;
    // guest RAM is only accessed atomically here.
    let word = unsafe { &*ptr.cast::<AtomicU64>() };
    match op {
        "r" => {
            let started = Instant::now();
            let value = word.load(Ordering::Acquire);
            Ok((started.elapsed().as_nanos(), value))
        }
        "w" => {
            let value = number("VALUE")?;
            let started = Instant::now();
            word.store(value, Ordering::Release);
            Ok((started.elapsed().as_nanos(), 0))
        }
        "e" => {
            let page = gpa - gpa % PAGE_SIZE as u64;
            memory.evict(page, PAGE_SIZE as u64)?;
            Ok((0, 0))
        }
        "pp" => {
            let (n, parity) = (number("N")?, number("PARITY")?);
            let started = Instant::now();
            for _ in 0..n {
                let turn = Instant::now();
                while word.load(Ordering::Acquire) % 2 != parity {
                    anyhow::ensure!(
                        turn.elapsed() < wait_limit,
                        "the other writer never passed the page back"
                    );
                    // The page comes back through this node's own threads
                    // (fault handler, connection reader): leave them the CPU.
                    std::thread::yield_now();
                }
                word.fetch_add(1, Ordering::AcqRel);
            }
            Ok((started.elapsed().as_nanos(), word.load(Ordering::Acquire)))
        }
        other => anyhow::bail!("unknown command {other:?}"),
    }
}
