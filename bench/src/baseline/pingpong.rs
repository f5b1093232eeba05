//! The bare program: a TCP ping-pong of the same sizes with no library in
//! the way. A server thread answers 32-byte requests with 32 + 4096 bytes
//! (reads) or takes 32 + 4096 bytes and answers 32 (writes), from a plain
//! buffer; the client keeps `depth` requests in flight. Both threads are
//! pinned and wait as their [`Layout`] says. Every page is checked: reads by
//! the client, writes by the server as they arrive.
//!
//! With `servers` > 1 (writes only: the fan-out of a replicated write) the
//! client sends each batch to every server, all before it reads any answer,
//! and a batch is done when every server has answered. Blocking servers
//! share the server CPU; spinning ones get a CPU each.

use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use anyhow::Context;
use rdma_transport::PAGE_SIZE;

use super::conn::Conn;
use super::layout::{pin_current, Layout};
use super::page_order::PageOrder;
use crate::pattern;
use crate::workload::{new_histogram, Op, Outcome, Spec};

pub(super) const REQ_BYTES: usize = 32;

/// Round trips run before the measured ones (checked, not recorded): the
/// first ones pay for connection set-up and cold caches.
pub(super) fn warmup_ops(ops: u64) -> u64 {
    (ops / 10).min(1000)
}

/// Runs the ping-pong with `spec`'s op, ops, depth and pattern on one client
/// thread on CPU `client_cpu` and one server thread on each CPU of
/// `server_cpus`, over `pages` pages filled with `seed`'s pattern.
pub fn run(
    spec: Spec,
    pages: usize,
    seed: u64,
    layout: Layout,
    client_cpu: usize,
    server_cpus: &[usize],
) -> anyhow::Result<Outcome> {
    let servers = server_cpus.len();
    if servers == 0 || (servers > 1 && spec.op != Op::Write) {
        anyhow::bail!("the bare fan-out is for writes to one or more servers");
    }
    let threads = Threads {
        op: spec.op,
        pages,
        seed,
        spin: layout.spinning(),
        yield_servers: false,
        client_cpu,
        server_cpus,
    };
    threads.run(|conns| ping(conns, spec, pages, seed))
}

/// The threads of a bare ping-pong: one server per CPU of `server_cpus`
/// (each serving `pages` pages of `seed`'s pattern for `op`, spinning or
/// blocking as `spin` says, yielding its CPU between tries when
/// `yield_servers`), and one client on `client_cpu` with a connection to
/// each.
pub(super) struct Threads<'a> {
    pub op: Op,
    pub pages: usize,
    pub seed: u64,
    pub spin: bool,
    pub yield_servers: bool,
    pub client_cpu: usize,
    pub server_cpus: &'a [usize],
}

impl Threads<'_> {
    /// Starts the servers, then the client, which runs `client` on its
    /// connections (in `server_cpus` order); returns its outcome with the
    /// written pages the servers found wrong added.
    pub(super) fn run(
        &self,
        client: impl FnOnce(Vec<Conn>) -> anyhow::Result<Outcome> + Send,
    ) -> anyhow::Result<Outcome> {
        let listeners = self
            .server_cpus
            .iter()
            .map(|_| TcpListener::bind("127.0.0.1:0"))
            .collect::<std::io::Result<Vec<_>>>()?;
        let addrs = listeners
            .iter()
            .map(TcpListener::local_addr)
            .collect::<std::io::Result<Vec<_>>>()?;
        let (op, pages, seed, spin) = (self.op, self.pages, self.seed, self.spin);
        let (yield_servers, client_cpu) = (self.yield_servers, self.client_cpu);
        std::thread::scope(|s| {
            let server_threads: Vec<_> = listeners
                .into_iter()
                .zip(self.server_cpus.iter().copied())
                .map(|(listener, server_cpu)| {
                    s.spawn(move || -> anyhow::Result<u64> {
                        pin_current(server_cpu)?;
                        let mem = filled_pages(pages, seed)?;
                        let mut conn = Conn::new(listener.accept()?.0, spin)?;
                        if yield_servers {
                            conn = conn.yielding();
                        }
                        serve_conn(conn, op, mem, seed)
                    })
                })
                .collect();
            let client = s.spawn(move || -> anyhow::Result<Outcome> {
                // Connected before pinning: if pinning fails, dropping the
                // streams lets the servers' accepts return and the scope end.
                let streams = addrs
                    .iter()
                    .map(TcpStream::connect)
                    .collect::<std::io::Result<Vec<_>>>()?;
                pin_current(client_cpu)?;
                let conns = streams
                    .into_iter()
                    .map(|stream| Conn::new(stream, spin))
                    .collect::<std::io::Result<Vec<_>>>()?;
                client(conns)
            });
            let mut outcome = client
                .join()
                .map_err(|_| anyhow::anyhow!("baseline client panicked"))?
                .context("baseline client")?;
            // The client has closed its sockets: each server sees EOF and
            // returns.
            for server in server_threads {
                outcome.bad_pages += server
                    .join()
                    .map_err(|_| anyhow::anyhow!("baseline server panicked"))?
                    .context("baseline server")?;
            }
            Ok(outcome)
        })
    }
}

/// The server: answers until the client closes; returns the number of
/// written pages that arrived wrong. It reads whatever requests have
/// arrived (one `read` for many when they are pipelined) and sends all
/// their answers with one `write`.
pub(super) fn serve(
    listener: TcpListener,
    op: Op,
    pages: usize,
    seed: u64,
    spin: bool,
) -> anyhow::Result<u64> {
    let mem = filled_pages(pages, seed)?;
    serve_conn(Conn::new(listener.accept()?.0, spin)?, op, mem, seed)
}

/// `pages` pages, each filled with `seed`'s pattern for its offset.
pub(super) fn filled_pages(pages: usize, seed: u64) -> anyhow::Result<Vec<u8>> {
    let mut mem = vec![0u8; pages * PAGE_SIZE];
    for (i, page) in mem.chunks_exact_mut(PAGE_SIZE).enumerate() {
        let page: &mut [u8; PAGE_SIZE] = page.try_into()?;
        pattern::fill(page, (i * PAGE_SIZE) as u64, seed);
    }
    Ok(mem)
}

/// [`serve`] on a connection already accepted, from the pages `mem`.
pub(super) fn serve_conn(mut s: Conn, op: Op, mut mem: Vec<u8>, seed: u64) -> anyhow::Result<u64> {
    let pages = mem.len() / PAGE_SIZE;
    let (req_len, resp_len) = if op == Op::Write {
        (REQ_BYTES + PAGE_SIZE, REQ_BYTES)
    } else {
        (REQ_BYTES, REQ_BYTES + PAGE_SIZE)
    };
    const BATCH: usize = 64;
    let mut inbuf = vec![0u8; BATCH * (REQ_BYTES + PAGE_SIZE)];
    let mut out = Vec::with_capacity(BATCH * (REQ_BYTES + PAGE_SIZE));
    let (mut start, mut end) = (0usize, 0usize);
    let mut bad_writes = 0u64;
    loop {
        match s.read_some(&mut inbuf[end..]) {
            Ok(n) => end += n,
            Err(_) => return Ok(bad_writes),
        }
        out.clear();
        while end - start >= req_len {
            let req = &inbuf[start..start + req_len];
            let off = u64::from_le_bytes(req[16..24].try_into()?) as usize % (pages * PAGE_SIZE);
            out.extend_from_slice(&req[..REQ_BYTES]);
            if op == Op::Write {
                let page: &[u8; PAGE_SIZE] = (&req[REQ_BYTES..]).try_into()?;
                if !pattern::check(page, off as u64, seed) {
                    bad_writes += 1;
                }
                mem[off..off + PAGE_SIZE].copy_from_slice(page);
            } else {
                out.extend_from_slice(&mem[off..off + PAGE_SIZE]);
            }
            start += req_len;
        }
        debug_assert_eq!(out.len() % resp_len, 0);
        inbuf.copy_within(start..end, 0);
        end -= start;
        start = 0;
        if !out.is_empty() {
            s.write_all(&out)?;
        }
    }
}

/// The client: a warm-up, then `spec.ops` measured page operations, each
/// batch sent to every connection of `conns`.
fn ping(mut conns: Vec<Conn>, spec: Spec, pages: usize, seed: u64) -> anyhow::Result<Outcome> {
    let op = spec.op;
    let warmup = warmup_ops(spec.ops);
    let total_ops = warmup + spec.ops;
    let mut order = PageOrder::new(spec.pattern, pages, seed);
    let mut hist = new_histogram();
    let mut out = vec![0u8; spec.depth * (REQ_BYTES + PAGE_SIZE)];
    let mut inbuf = vec![0u8; spec.depth * (REQ_BYTES + PAGE_SIZE)];
    let mut offs = vec![0usize; spec.depth];
    let (mut done, mut bad) = (0u64, 0u64);
    let mut start = Instant::now();
    while done < total_ops {
        if done == warmup {
            start = Instant::now();
        }
        // A batch never straddles the end of the warm-up.
        let left = if done < warmup { warmup } else { total_ops } - done;
        let batch = spec.depth.min(left as usize);
        let mut out_len = 0;
        for off in offs.iter_mut().take(batch) {
            let page = order.next_page();
            *off = page * PAGE_SIZE;
            out[out_len..out_len + REQ_BYTES].fill(0);
            out[out_len + 16..out_len + 24].copy_from_slice(&(*off as u64).to_le_bytes());
            out_len += REQ_BYTES;
            if op == Op::Write {
                let dst: &mut [u8; PAGE_SIZE] =
                    (&mut out[out_len..out_len + PAGE_SIZE]).try_into()?;
                pattern::fill(dst, *off as u64, seed);
                out_len += PAGE_SIZE;
            }
        }
        let resp_len = batch
            * if op == Op::Write {
                REQ_BYTES
            } else {
                REQ_BYTES + PAGE_SIZE
            };
        let t0 = Instant::now();
        for c in &mut conns {
            c.write_all(&out[..out_len])?;
        }
        for c in &mut conns {
            c.read_exact(&mut inbuf[..resp_len])?;
        }
        let ns = t0.elapsed().as_nanos() as u64;
        if done >= warmup {
            let _ = hist.record_n(ns.max(1), batch as u64);
        }
        if op == Op::Read {
            for (i, &off) in offs.iter().take(batch).enumerate() {
                let at = i * (REQ_BYTES + PAGE_SIZE) + REQ_BYTES;
                let page: &[u8; PAGE_SIZE] = (&inbuf[at..at + PAGE_SIZE]).try_into()?;
                if !pattern::check(page, off as u64, seed) {
                    bad += 1;
                }
            }
        }
        done += batch as u64;
    }
    let elapsed = start.elapsed();
    Ok(Outcome {
        latency_ns: hist,
        elapsed,
        ops_done: spec.ops,
        errors: 0,
        bad_pages: bad,
        // Warm-up pages are checked too; a bad one counts against the run.
        pages_checked: spec.ops,
        first_error: None,
    })
}
