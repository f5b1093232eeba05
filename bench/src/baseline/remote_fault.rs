//! The bare remote fault: a userfaultfd fault ([`super::uffd_fault`]) whose
//! handler gets the page from the bare ping-pong server over TCP (32-byte
//! request, 32 + 4096-byte answer) and copies it in, both waiting as the
//! [`Layout`] says. What a whole remote page fault costs a program with no
//! library on this machine, as one program rather than the sum of a local
//! fault and a ping-pong measured apart.

use std::net::{TcpListener, TcpStream};

use anyhow::Context;
use rdma_transport::{Page, PAGE_SIZE};

use super::conn::Conn;
use super::layout::{pin_current, Layout};
use super::pingpong::{self, REQ_BYTES};
use super::uffd_fault::{self, Fetch};
use crate::workload::{Op, Outcome, Spec};

/// Runs `spec.ops` remote faults over `pages` pages of `seed`'s pattern:
/// toucher and handler on `handler_cpu`, the server on `server_cpu`.
pub(super) fn run(
    spec: Spec,
    pages: usize,
    seed: u64,
    layout: Layout,
    (handler_cpu, server_cpu): (usize, usize),
) -> anyhow::Result<Outcome> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    // Connected here, before any thread is pinned: if the handler cannot
    // be, dropping this stream lets the server's accept return.
    let stream = TcpStream::connect(listener.local_addr()?)?;
    let spin = layout.spinning();
    std::thread::scope(|s| {
        let server = s.spawn(move || -> anyhow::Result<u64> {
            pin_current(server_cpu)?;
            pingpong::serve(listener, Op::Read, pages, seed, spin)
        });
        let outcome = uffd_fault::run(pages, spec, seed, handler_cpu, move || {
            let mut conn = Conn::new(stream, spin)?;
            let mut request = [0u8; REQ_BYTES];
            let mut answer = vec![0u8; REQ_BYTES + PAGE_SIZE];
            let fetch: Fetch = Box::new(move |off: u64, page: &mut Page| {
                request[16..24].copy_from_slice(&off.to_le_bytes());
                conn.write_all(&request)
                    .context("bare remote fault: request")?;
                conn.read_exact(&mut answer)
                    .context("bare remote fault: answer")?;
                page.copy_from_slice(&answer[REQ_BYTES..]);
                Ok(())
            });
            Ok(fetch)
        });
        // The fetch, and with it the connection, went with the handler:
        // the server has seen EOF.
        let served = server
            .join()
            .map_err(|_| anyhow::anyhow!("bare remote fault server panicked"))?
            .context("bare remote fault server");
        let outcome = outcome?;
        served?;
        Ok(outcome)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::AccessPattern;

    #[test]
    fn every_layout_serves_checked_pages_from_the_bare_server() -> anyhow::Result<()> {
        let spec = Spec {
            op: Op::Fault,
            ops: 200,
            threads: 1,
            depth: 1,
            pattern: AccessPattern::Random,
        };
        let best = super::super::run_remote_fault(spec, 64, 3)?;
        assert!(
            best.all_verified,
            "a layout's pages were wrong or unchecked"
        );
        assert!(!best.tried.is_empty());
        assert_eq!(
            (best.outcome.pages_checked, best.outcome.bad_pages),
            (200, 0)
        );
        Ok(())
    }
}
