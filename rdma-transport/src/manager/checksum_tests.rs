//! Page checksums against a scripted peer: a READ answer whose page does
//! not match its checksum is a typed error and never reaches the caller's
//! buffer; a WRITE carries its page's checksum only when it was negotiated.

use std::io::{Read, Write};
use std::net::TcpStream;

use super::TransportManager;
use crate::config::{ManagerConfig, PollMode, TransportKind};
use crate::error::TransportError;
use crate::page::PAGE_SIZE;
use crate::testing::{
    answer_read, answer_read_corrupted, fake_bound_sums_node, fake_checksum_node, fake_node,
    map_of, read_header,
};
use crate::wire::{offset_bound_checksum, page_checksum, Header, Opcode};

fn config(page_checksums: bool) -> ManagerConfig {
    ManagerConfig {
        transport: TransportKind::Tcp,
        pool_size_bytes: 1 << 20,
        poller_cpus: Some(vec![]),
        poll_mode: PollMode::Event,
        request_timeout_ms: 5000,
        connect_timeout_ms: 10_000,
        map_refresh_ms: 0,
        page_checksums,
        ..ManagerConfig::default()
    }
}

/// Reads the client's next WRITE and answers it OK; its header and page.
fn take_write(stream: &mut TcpStream) -> (Header, Vec<u8>) {
    let request = read_header(stream);
    assert_eq!(request.opcode, Opcode::Write);
    let mut page = vec![0u8; PAGE_SIZE];
    stream.read_exact(&mut page).expect("write payload");
    let answer = Header::request(Opcode::WriteResp, request.request_id, request.offset, 4096);
    stream.write_all(&answer.encode()).expect("write answer");
    (request, page)
}

#[test]
fn a_corrupted_read_answer_is_a_checksum_error_and_leaves_the_page_alone() {
    let (addr, node) = fake_checksum_node(|mut stream| {
        // `read_page` reads a page that failed its checksum once more:
        // corrupted twice, it is an error.
        for _ in 0..2 {
            let read = read_header(&mut stream);
            assert_eq!(read.offset, 0, "the same page, read again");
            answer_read_corrupted(&mut stream, &read, 0xab);
        }
        // The connection stays usable: the next answer is delivered.
        let second = read_header(&mut stream);
        answer_read(&mut stream, &second, 0xcd);
    });
    let mgr = TransportManager::from_map(config(true), map_of(1, &[("a", addr)])).expect("manager");
    let mut page = [0x11u8; PAGE_SIZE];
    let result = mgr.read_page(0, &mut page);
    assert!(
        matches!(
            &result,
            Err(TransportError::Checksum { node, gpa: 0, direction: "from" }) if node == "a"
        ),
        "{result:?}"
    );
    assert!(
        page.iter().all(|&b| b == 0x11),
        "a page that failed its checksum was copied into the caller's buffer"
    );
    mgr.read_page(PAGE_SIZE as u64, &mut page)
        .expect("the next read on the same connection");
    assert!(page.iter().all(|&b| b == 0xcd));
    drop(mgr);
    node.join().expect("node");
}

/// Log lines of this test process (every test's), for the flood test.
static LOG: parking_lot::Mutex<Vec<u8>> = parking_lot::Mutex::new(Vec::new());

struct Capture;

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG.lock().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A node that answers every READ with a damaged page (a bad link, or a
/// forger in the path) fails every read with a checksum error, and the
/// client warns about it once, not once per answer: the flood stays out of
/// the VMM's log. The connection keeps working for the good answer after.
#[test]
fn a_flood_of_damaged_read_answers_is_warned_about_once() {
    const READS: usize = 50;
    // Warnings and up: what a VMM's log would show. (Global: the poller
    // threads log too; other tests' lines are told apart by node name.)
    let _ = tracing_subscriber::fmt()
        .with_writer(|| Capture)
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .try_init();
    let (addr, node) = fake_checksum_node(|mut stream| {
        // Each `read_page` reads a damaged page once more.
        for _ in 0..2 * READS {
            let read = read_header(&mut stream);
            answer_read_corrupted(&mut stream, &read, 0x5a);
        }
        let good = read_header(&mut stream);
        answer_read(&mut stream, &good, 0x3c);
    });
    let mgr =
        TransportManager::from_map(config(true), map_of(1, &[("flooder", addr)])).expect("manager");
    let mut page = [0u8; PAGE_SIZE];
    for i in 0..READS {
        let result = mgr.read_page(0, &mut page);
        assert!(
            matches!(&result, Err(TransportError::Checksum { .. })),
            "read {i}: {result:?}"
        );
    }
    mgr.read_page(0, &mut page)
        .expect("a good answer after the flood");
    assert!(page.iter().all(|&b| b == 0x3c));
    drop(mgr);
    node.join().expect("node");
    let log = String::from_utf8_lossy(&LOG.lock()).into_owned();
    let warned = log
        .lines()
        .filter(|l| l.contains("fails its page checksum") && l.contains("flooder"))
        .count();
    assert_eq!(warned, 1, "{log}");
}

/// A page that fails its checksum once (torn by a concurrent write, or
/// corrupted on the way) is read again by the blocking calls: the caller
/// gets the good page, never the bad one.
#[test]
fn a_blocking_read_reads_a_page_that_failed_its_checksum_once_more() {
    let (addr, node) = fake_checksum_node(|mut stream| {
        let first = read_header(&mut stream);
        answer_read_corrupted(&mut stream, &first, 0xab);
        let again = read_header(&mut stream);
        assert_eq!(again.offset, first.offset);
        answer_read(&mut stream, &again, 0xcd);
        // A batch whose second page fails once: the whole batch again.
        let (a, b) = (read_header(&mut stream), read_header(&mut stream));
        answer_read(&mut stream, &a, 0x01);
        answer_read_corrupted(&mut stream, &b, 0x02);
        let (a, b) = (read_header(&mut stream), read_header(&mut stream));
        answer_read(&mut stream, &a, 0x03);
        answer_read(&mut stream, &b, 0x04);
    });
    let mgr = TransportManager::from_map(config(true), map_of(1, &[("a", addr)])).expect("manager");
    let mut page = [0x11u8; PAGE_SIZE];
    mgr.read_page(0, &mut page)
        .expect("the second answer is good");
    assert!(page.iter().all(|&b| b == 0xcd));
    let mut pages = [[0u8; PAGE_SIZE]; 2];
    mgr.read_pages(&[0, PAGE_SIZE as u64], &mut pages)
        .expect("the batch read again is good");
    assert!(pages[0].iter().all(|&b| b == 0x03));
    assert!(pages[1].iter().all(|&b| b == 0x04));
    drop(mgr);
    node.join().expect("node");
}

#[test]
fn a_write_carries_its_pages_checksum_only_when_negotiated() {
    let page = [0x5au8; PAGE_SIZE];
    // (checksums agreed, offset-bound sums agreed, checksums asked)
    for (agreed, bound, asked) in [
        (true, true, true),
        (true, false, true),
        (false, false, true),
        (false, false, false),
    ] {
        let script = |mut stream: TcpStream| take_write(&mut stream);
        let (addr, node) = match (agreed, bound) {
            (true, true) => fake_bound_sums_node(script),
            (true, false) => fake_checksum_node(script),
            _ => fake_node(script),
        };
        let mgr =
            TransportManager::from_map(config(asked), map_of(1, &[("a", addr)])).expect("manager");
        mgr.write_page(PAGE_SIZE as u64, &page).expect("write");
        let (header, sent) = node.join().expect("node");
        assert_eq!(sent, page);
        let expected = match (agreed, bound) {
            (true, true) => offset_bound_checksum(page_checksum(&page), header.offset),
            (true, false) => page_checksum(&page),
            _ => 0,
        };
        assert_eq!(
            header.checksum, expected,
            "agreed {agreed}, bound {bound}, asked {asked}"
        );
        drop(mgr);
    }
}

#[test]
fn without_an_agreement_a_read_answer_is_not_checked() {
    // The server declined: bytes 28..32 mean nothing, so a page whose
    // "checksum" does not match is still the page.
    let (addr, node) = fake_node(|mut stream| {
        let request = read_header(&mut stream);
        answer_read_corrupted(&mut stream, &request, 0xab);
    });
    let mgr = TransportManager::from_map(config(true), map_of(1, &[("a", addr)])).expect("manager");
    let mut page = [0u8; PAGE_SIZE];
    mgr.read_page(0, &mut page).expect("read");
    assert_eq!(page[0], 0xab);
    drop(mgr);
    node.join().expect("node");
}
