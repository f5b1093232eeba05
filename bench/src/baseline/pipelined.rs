//! The bare pipelined client: one thread, one TCP connection to the same
//! bare server as the ping-pong ([`super::pingpong::serve`]), `depth`
//! requests in flight at all times. Each answer that arrives is checked
//! (reads: its page against the pattern; writes: by the server) and
//! replaced at once by a new request; all the requests that the answers of
//! one `read` free are sent with one `write`. A request's latency is from
//! the `write` that sent it to the `read` that completed its answer.

use std::collections::VecDeque;
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use anyhow::{bail, Context};
use rdma_transport::PAGE_SIZE;

use super::conn::Conn;
use super::layout::{pin_current, Layout};
use super::page_order::PageOrder;
use super::pingpong::{serve, warmup_ops, REQ_BYTES};
use crate::pattern;
use crate::workload::{new_histogram, Op, Outcome, Spec};

/// Runs `spec` (op, ops, pattern; its depth and threads are ignored) with
/// `depth` requests in flight, the client on `client_cpu` and the server on
/// `server_cpu`, waiting as `layout` says.
pub fn run(
    spec: Spec,
    pages: usize,
    seed: u64,
    depth: usize,
    layout: Layout,
    (client_cpu, server_cpu): (usize, usize),
) -> anyhow::Result<Outcome> {
    if depth == 0 || pages == 0 {
        bail!("the pipelined baseline needs a depth and pages");
    }
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let spin = layout.spinning();
    std::thread::scope(|s| {
        let server = s.spawn(move || -> anyhow::Result<u64> {
            pin_current(server_cpu)?;
            serve(listener, spec.op, pages, seed, spin)
        });
        let client = s.spawn(move || -> anyhow::Result<Outcome> {
            // Connected before pinning: if pinning fails, dropping the
            // stream lets the server's accept return and the scope end.
            let stream = TcpStream::connect(addr)?;
            pin_current(client_cpu)?;
            let conn = Conn::new(stream, spin)?;
            Pipeline::new(spec, pages, seed, depth).run(conn)
        });
        let mut outcome = client
            .join()
            .map_err(|_| anyhow::anyhow!("pipelined baseline client panicked"))?
            .context("pipelined baseline client")?;
        outcome.bad_pages += server
            .join()
            .map_err(|_| anyhow::anyhow!("baseline server panicked"))?
            .context("baseline server")?;
        Ok(outcome)
    })
}

/// The client's state.
struct Pipeline {
    spec: Spec,
    seed: u64,
    depth: usize,
    order: PageOrder,
}

impl Pipeline {
    fn new(spec: Spec, pages: usize, seed: u64, depth: usize) -> Self {
        Self {
            spec,
            seed,
            depth,
            order: PageOrder::new(spec.pattern, pages, seed),
        }
    }

    fn next_offset(&mut self) -> usize {
        self.order.next_page() * PAGE_SIZE
    }

    /// Appends one request for a fresh page to `out`; its offset.
    fn push_request(&mut self, out: &mut Vec<u8>) -> usize {
        let off = self.next_offset();
        let at = out.len();
        out.resize(at + REQ_BYTES, 0);
        out[at + 16..at + 24].copy_from_slice(&(off as u64).to_le_bytes());
        if self.spec.op == Op::Write {
            let mut page = [0u8; PAGE_SIZE];
            pattern::fill(&mut page, off as u64, self.seed);
            out.extend_from_slice(&page);
        }
        off
    }

    fn run(mut self, mut conn: Conn) -> anyhow::Result<Outcome> {
        let op = self.spec.op;
        let warmup = warmup_ops(self.spec.ops);
        let total = warmup + self.spec.ops;
        let resp_len = if op == Op::Write {
            REQ_BYTES
        } else {
            REQ_BYTES + PAGE_SIZE
        };
        let mut hist = new_histogram();
        // Offsets and send times of the requests in flight, oldest first:
        // one server thread answers in order.
        let mut inflight: VecDeque<(usize, Instant)> = VecDeque::with_capacity(self.depth);
        let mut out = Vec::with_capacity(self.depth * (REQ_BYTES + PAGE_SIZE));
        let mut inbuf = vec![0u8; self.depth * resp_len + resp_len];
        let (mut start, mut end) = (0usize, 0usize);
        let (mut sent, mut done, mut bad) = (0u64, 0u64, 0u64);
        let mut offs = Vec::with_capacity(self.depth);
        let mut t_start = Instant::now();
        while sent < total.min(self.depth as u64) {
            offs.push(self.push_request(&mut out));
            sent += 1;
        }
        let now = Instant::now();
        conn.write_all(&out)?;
        inflight.extend(offs.drain(..).map(|off| (off, now)));
        while done < total {
            end += conn.read_some(&mut inbuf[end..])?;
            let now = Instant::now();
            out.clear();
            while end - start >= resp_len {
                let Some((off, t_sent)) = inflight.pop_front() else {
                    bail!("the bare server answered a request never sent");
                };
                let resp = &inbuf[start..start + resp_len];
                let echoed = u64::from_le_bytes(resp[16..24].try_into()?) as usize;
                if echoed != off {
                    bad += 1;
                } else if op == Op::Read {
                    let page: &[u8; PAGE_SIZE] = (&resp[REQ_BYTES..]).try_into()?;
                    if !pattern::check(page, off as u64, self.seed) {
                        bad += 1;
                    }
                }
                if done >= warmup {
                    let ns = now.duration_since(t_sent).as_nanos() as u64;
                    let _ = hist.record(ns.max(1));
                }
                done += 1;
                if done == warmup {
                    t_start = now;
                }
                start += resp_len;
                if sent < total {
                    offs.push(self.push_request(&mut out));
                    sent += 1;
                }
            }
            inbuf.copy_within(start..end, 0);
            end -= start;
            start = 0;
            if !out.is_empty() {
                let now = Instant::now();
                conn.write_all(&out)?;
                inflight.extend(offs.drain(..).map(|off| (off, now)));
            }
        }
        Ok(Outcome {
            latency_ns: hist,
            elapsed: t_start.elapsed(),
            ops_done: self.spec.ops,
            errors: 0,
            bad_pages: bad,
            // Warm-up pages are checked too; a bad one counts against the run.
            pages_checked: self.spec.ops,
            first_error: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::baseline::layout::allowed_cpus;
    use crate::workload::AccessPattern;

    #[test]
    fn every_page_comes_back_checked_in_both_directions() -> anyhow::Result<()> {
        let cpu = allowed_cpus()[0];
        for op in [Op::Read, Op::Write] {
            let spec = Spec {
                op,
                ops: 2000,
                threads: 1,
                depth: 1,
                pattern: AccessPattern::Random,
            };
            // More in flight than the server reads at once (64).
            let out = run(spec, 256, 7, 100, Layout::SameCpuBlocking, (cpu, cpu))?;
            assert!(out.verified(), "{op:?}: {} bad pages", out.bad_pages);
            assert_eq!(out.latency_ns.len(), 2000, "{op:?}: one sample per page");
        }
        Ok(())
    }
}
