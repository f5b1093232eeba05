//! The bare ping-pong with the pages spread over several servers the way
//! the bench's cluster spreads them over its nodes: one page in flight,
//! each asked of the server that holds it (`owners[page]`). Every server is
//! pinned to the layout's server CPU, as the local page-servers all run on
//! the CPUs the client leaves free; spinning servers share it and yield it
//! between tries, as the page-servers do. This is the same job as ours with
//! `--nodes N` on the same CPUs; the one-server ping-pong
//! ([`super::pingpong`]) stays the floor the line is drawn from.

use std::time::Instant;

use anyhow::bail;
use rdma_transport::PAGE_SIZE;

use super::conn::Conn;
use super::layout::Layout;
use super::page_order::PageOrder;
use super::pingpong::{warmup_ops, Threads, REQ_BYTES};
use crate::pattern;
use crate::workload::{new_histogram, Op, Outcome, Spec};

/// Runs `spec.ops` one-page operations (after a warm-up) from one client
/// thread on `client_cpu` against one server per distinct owner in
/// `owners` (page `i` is asked of server `owners[i]`), all on
/// `server_cpu`.
pub fn run(
    spec: Spec,
    owners: &[usize],
    seed: u64,
    layout: Layout,
    (client_cpu, server_cpu): (usize, usize),
) -> anyhow::Result<Outcome> {
    let servers = owners.iter().max().map_or(0, |&m| m + 1);
    if servers == 0 || spec.depth != 1 || !matches!(spec.op, Op::Read | Op::Write) {
        bail!("the spread baseline is one read or write in flight over one or more servers");
    }
    let spin = layout.spinning();
    let server_cpus = vec![server_cpu; servers];
    let threads = Threads {
        op: spec.op,
        pages: owners.len(),
        seed,
        spin,
        // Spinners that share a CPU yield it to each other.
        yield_servers: spin && servers > 1,
        client_cpu,
        server_cpus: &server_cpus,
    };
    threads.run(|conns| ping(conns, spec, owners, seed))
}

/// The client: each operation asks the page's owner, and waits for it.
fn ping(mut conns: Vec<Conn>, spec: Spec, owners: &[usize], seed: u64) -> anyhow::Result<Outcome> {
    let pages = owners.len();
    let warmup = warmup_ops(spec.ops);
    let mut order = PageOrder::new(spec.pattern, pages, seed);
    let mut hist = new_histogram();
    let mut out = vec![0u8; REQ_BYTES + PAGE_SIZE];
    let mut inbuf = vec![0u8; REQ_BYTES + PAGE_SIZE];
    let (req_len, resp_len) = if spec.op == Op::Write {
        (REQ_BYTES + PAGE_SIZE, REQ_BYTES)
    } else {
        (REQ_BYTES, REQ_BYTES + PAGE_SIZE)
    };
    let mut bad = 0u64;
    let mut start = Instant::now();
    for done in 0..warmup + spec.ops {
        if done == warmup {
            start = Instant::now();
        }
        let page = order.next_page();
        let off = (page * PAGE_SIZE) as u64;
        out[..REQ_BYTES].fill(0);
        out[16..24].copy_from_slice(&off.to_le_bytes());
        if spec.op == Op::Write {
            let dst: &mut [u8; PAGE_SIZE] = (&mut out[REQ_BYTES..]).try_into()?;
            pattern::fill(dst, off, seed);
        }
        let conn = &mut conns[owners[page]];
        let t0 = Instant::now();
        conn.write_all(&out[..req_len])?;
        conn.read_exact(&mut inbuf[..resp_len])?;
        let ns = t0.elapsed().as_nanos() as u64;
        if done >= warmup {
            let _ = hist.record(ns.max(1));
        }
        if spec.op == Op::Read {
            let got: &[u8; PAGE_SIZE] = (&inbuf[REQ_BYTES..]).try_into()?;
            if !pattern::check(got, off, seed) {
                bad += 1;
            }
        }
    }
    Ok(Outcome {
        latency_ns: hist,
        elapsed: start.elapsed(),
        ops_done: spec.ops,
        errors: 0,
        bad_pages: bad,
        // Warm-up pages are checked too; a bad one counts against the run.
        pages_checked: spec.ops,
        first_error: None,
    })
}

#[cfg(test)]
mod tests {
    use super::super::pingpong::{filled_pages, serve_conn};
    use super::*;
    use crate::workload::{AccessPattern, Spec};
    use std::net::{TcpListener, TcpStream};

    fn spec(op: Op) -> Spec {
        Spec {
            op,
            pattern: AccessPattern::Random,
            threads: 1,
            depth: 1,
            ops: 2000,
        }
    }

    #[test]
    fn reads_and_writes_over_two_servers_check_every_page() {
        // 64 pages, the first half on server 0, the rest on server 1.
        let owners: Vec<usize> = (0..64).map(|i| i / 32).collect();
        for op in [Op::Read, Op::Write] {
            let out = run(spec(op), &owners, 7, Layout::SameCpuBlocking, (0, 0))
                .unwrap_or_else(|e| panic!("{op:?}: {e:#}"));
            assert_eq!(out.bad_pages, 0, "{op:?}");
            assert_eq!(out.latency_ns.len(), 2000, "{op:?}");
        }
    }

    #[test]
    fn pages_of_other_contents_are_counted_bad() {
        // Two servers whose pages hold another seed's pattern.
        let owners: Vec<usize> = (0..64).map(|i| i % 2).collect();
        let servers: Vec<_> = (0..2)
            .map(|_| {
                let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
                let addr = listener.local_addr().expect("addr");
                let server = std::thread::spawn(move || {
                    let conn = Conn::new(listener.accept()?.0, false)?;
                    serve_conn(conn, Op::Read, filled_pages(64, 8)?, 8)
                });
                (addr, server)
            })
            .collect();
        let conns = servers
            .iter()
            .map(|(addr, _)| Conn::new(TcpStream::connect(addr).expect("connect"), false))
            .collect::<std::io::Result<Vec<_>>>()
            .expect("conns");
        let out = ping(conns, spec(Op::Read), &owners, 7).expect("ping");
        assert_eq!(out.bad_pages, 2000 + warmup_ops(2000));
        for (_, server) in servers {
            server.join().expect("server").expect("serve");
        }
    }

    #[test]
    fn refuses_more_than_one_in_flight() {
        let owners = [0, 1];
        let deep = Spec {
            depth: 2,
            ..spec(Op::Read)
        };
        assert!(run(deep, &owners, 7, Layout::SameCpuBlocking, (0, 0)).is_err());
        assert!(run(spec(Op::Read), &[], 7, Layout::SameCpuBlocking, (0, 0)).is_err());
    }
}
