//! The baseline: a bare TCP ping-pong of the same sizes with no library in
//! the way. A server thread answers 32-byte requests with 32 + 4096 bytes
//! (reads) or takes 32 + 4096 bytes and answers 32 (writes), from a plain
//! buffer; the client keeps `depth` requests in flight with blocking I/O.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use rdma_transport::PAGE_SIZE;

use crate::pattern;
use crate::workload::{new_histogram, AccessPattern, Op, Outcome, Spec};

const REQ: usize = 32;

/// Runs the bare ping-pong with `spec`'s op, ops and depth on one thread,
/// over `pages` pages filled with `seed`'s pattern, checking every page read.
pub fn run(spec: Spec, pages: usize, seed: u64) -> anyhow::Result<Outcome> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let op = spec.op;
    let server = std::thread::spawn(move || -> std::io::Result<u64> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut mem = vec![0u8; pages * PAGE_SIZE];
        for (i, page) in mem.chunks_exact_mut(PAGE_SIZE).enumerate() {
            let page: &mut [u8; PAGE_SIZE] = page.try_into().map_err(std::io::Error::other)?;
            pattern::fill(page, (i * PAGE_SIZE) as u64, seed);
        }
        let mut req = [0u8; REQ + PAGE_SIZE];
        let mut resp = vec![0u8; REQ + PAGE_SIZE];
        let mut bad_writes = 0u64;
        loop {
            let req_len = if op == Op::Write {
                REQ + PAGE_SIZE
            } else {
                REQ
            };
            if s.read_exact(&mut req[..req_len]).is_err() {
                return Ok(bad_writes);
            }
            let off = u64::from_le_bytes(req[16..24].try_into().unwrap_or_default()) as usize
                % (pages * PAGE_SIZE);
            resp[..REQ].copy_from_slice(&req[..REQ]);
            if op == Op::Write {
                let page: &[u8; PAGE_SIZE] =
                    (&req[REQ..]).try_into().map_err(std::io::Error::other)?;
                if !pattern::check(page, off as u64, seed) {
                    bad_writes += 1;
                }
                mem[off..off + PAGE_SIZE].copy_from_slice(page);
                s.write_all(&resp[..REQ])?;
            } else {
                resp[REQ..].copy_from_slice(&mem[off..off + PAGE_SIZE]);
                s.write_all(&resp)?;
            }
        }
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    let mut rng_state = seed | 1;
    let mut next_seq = 0usize;
    let mut hist = new_histogram();
    let mut out = vec![0u8; spec.depth * (REQ + PAGE_SIZE)];
    let mut inbuf = vec![0u8; spec.depth * (REQ + PAGE_SIZE)];
    let mut offs = vec![0usize; spec.depth];
    let (mut done, mut bad) = (0u64, 0u64);
    let start = Instant::now();
    while done < spec.ops {
        let batch = spec.depth.min((spec.ops - done) as usize);
        let mut out_len = 0;
        for off in offs.iter_mut().take(batch) {
            let page = match spec.pattern {
                AccessPattern::Random => {
                    rng_state ^= rng_state << 13;
                    rng_state ^= rng_state >> 7;
                    rng_state ^= rng_state << 17;
                    (rng_state % pages as u64) as usize
                }
                AccessPattern::Seq => {
                    next_seq = (next_seq + 1) % pages;
                    next_seq
                }
            };
            *off = page * PAGE_SIZE;
            out[out_len..out_len + REQ].fill(0);
            out[out_len + 16..out_len + 24].copy_from_slice(&(*off as u64).to_le_bytes());
            out_len += REQ;
            if op == Op::Write {
                let dst: &mut [u8; PAGE_SIZE] =
                    (&mut out[out_len..out_len + PAGE_SIZE]).try_into()?;
                pattern::fill(dst, *off as u64, seed);
                out_len += PAGE_SIZE;
            }
        }
        let resp_len = batch
            * if op == Op::Write {
                REQ
            } else {
                REQ + PAGE_SIZE
            };
        let t0 = Instant::now();
        c.write_all(&out[..out_len])?;
        c.read_exact(&mut inbuf[..resp_len])?;
        let ns = t0.elapsed().as_nanos() as u64;
        let _ = hist.record_n(ns.max(1), batch as u64);
        if op == Op::Read {
            for (i, &off) in offs.iter().take(batch).enumerate() {
                let at = i * (REQ + PAGE_SIZE) + REQ;
                let page: &[u8; PAGE_SIZE] = (&inbuf[at..at + PAGE_SIZE]).try_into()?;
                if !pattern::check(page, off as u64, seed) {
                    bad += 1;
                }
            }
        }
        done += batch as u64;
    }
    let elapsed = start.elapsed();
    drop(c);
    // Written pages are checked by the server as they arrive.
    bad += server
        .join()
        .map_err(|_| anyhow::anyhow!("baseline server panicked"))??;
    Ok(Outcome {
        latency_ns: hist,
        elapsed,
        ops_done: done,
        errors: 0,
        bad_pages: bad,
        pages_checked: done,
        first_error: None,
    })
}
