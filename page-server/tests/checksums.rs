//! Page checksums at the page-server: negotiated in the handshake, a WRITE
//! whose page fails its checksum is refused (BadChecksum) and not applied
//! while the connection keeps serving, READ answers carry the checksum of
//! the bytes they send; and managers round-trip pages with checksums on or
//! off against servers that offer them or not.

mod common;

use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use common::raw::{self, read_framed};
use common::*;
use page_server::ServerConfig;
use rdma_transport::wire::{offset_bound_checksum, page_checksum, Header, Opcode, Status};
use rdma_transport::{ManagerConfig, TransportManager, PAGE_SIZE};

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

fn write(s: &mut TcpStream, id: u64, offset: u64, page: &[u8], checksum: u32) -> Status {
    let header =
        Header::request(Opcode::Write, id, offset, PAGE_SIZE as u32).with_checksum(checksum);
    let mut msg = header.encode().to_vec();
    msg.extend_from_slice(page);
    s.write_all(&msg).unwrap();
    let (h, _) = read_framed(s);
    assert_eq!((h.opcode, h.request_id), (Opcode::WriteResp, id));
    h.status
}

/// READ at `offset`: the answer's header and page.
fn read(s: &mut TcpStream, id: u64, offset: u64) -> (Header, Vec<u8>) {
    let header = Header::request(Opcode::Read, id, offset, PAGE_SIZE as u32);
    s.write_all(&header.encode()).unwrap();
    let (h, page) = read_framed(s);
    assert_eq!(
        (h.opcode, h.status, h.request_id),
        (Opcode::ReadResp, Status::Ok, id)
    );
    (h, page)
}

#[test]
fn a_write_with_a_wrong_checksum_is_refused_and_not_applied() {
    let server = page_server::spawn(ServerConfig::new("c", NODE_BYTES)).unwrap();
    let mut s = connect(server.addr());
    let ack = raw::handshake_asking(&mut s, 1, "c", None, true).expect("handshake");
    assert!(
        ack.checksums,
        "a page-server agrees to checksums by default"
    );

    let good = page_for(0x3000, 1);
    assert_eq!(
        write(&mut s, 10, 0x3000, &good, page_checksum(&good)),
        Status::Ok
    );
    let (h, page) = read(&mut s, 11, 0x3000);
    assert_eq!(page, good);
    assert_eq!(
        h.checksum,
        page_checksum(&good),
        "READ answers carry the checksum"
    );

    // The same header checksum, one bit of the page flipped on the way.
    let mut corrupted = page_for(0x3000, 2);
    let claimed = page_checksum(&corrupted);
    corrupted[100] ^= 1;
    assert_eq!(
        write(&mut s, 12, 0x3000, &corrupted, claimed),
        Status::BadChecksum
    );
    // A zero checksum is not "no checksum" once negotiated.
    assert_eq!(
        write(&mut s, 13, 0x3000, &corrupted, 0),
        Status::BadChecksum
    );
    // The connection keeps serving, and the page is unchanged.
    let (_, page) = read(&mut s, 14, 0x3000);
    assert_eq!(page, good, "a WRITE that failed its checksum was applied");
    // Both counted as damaged on the way (a warning is logged too).
    assert_eq!(server.stats().checksum_failures, 2);
}

/// A WRITE whose offset is damaged on the way, its page and the page's
/// sum intact: with offset-bound sums it fails its checksum and no page
/// changes; with page-only sums (a client from before them) it lands on
/// the other page. READ answers carry the page's own sum either way.
#[test]
fn a_write_whose_offset_changed_on_the_way_is_refused_with_bound_sums() {
    let server = page_server::spawn(ServerConfig::new("c", NODE_BYTES)).unwrap();
    let mut s = connect(server.addr());
    let ack = raw::handshake_bound_sums(&mut s, 1, "c", None).expect("handshake");
    assert!(ack.checksums && ack.bound_sums, "agreed by default");

    let (meant, hit) = (0x3000u64, 0x2000u64);
    let before = page_for(hit, 1);
    let bound = |page: &[u8], off| offset_bound_checksum(page_checksum(page), off);
    assert_eq!(
        write(&mut s, 10, hit, &before, bound(&before, hit)),
        Status::Ok
    );
    // The page-only sum is no longer enough on this connection.
    assert_eq!(
        write(&mut s, 11, hit, &before, page_checksum(&before)),
        Status::BadChecksum
    );
    // Meant for 0x3000, summed for 0x3000, bit 12 of the offset lost.
    let page = page_for(meant, 2);
    assert_eq!(
        write(&mut s, 12, hit, &page, bound(&page, meant)),
        Status::BadChecksum
    );
    let (h, got) = read(&mut s, 13, hit);
    assert_eq!(got, before, "the damaged WRITE changed another page");
    assert_eq!(
        h.checksum,
        page_checksum(&before),
        "READ answers: the page's sum"
    );
    // Sent where it belongs, it is applied.
    assert_eq!(
        write(&mut s, 14, meant, &page, bound(&page, meant)),
        Status::Ok
    );
    assert_eq!(read(&mut s, 15, meant).1, page);

    // The same damage from a client with page-only sums is not caught:
    // what offset-bound sums are for.
    let mut old = connect(server.addr());
    let ack = raw::handshake_asking(&mut old, 2, "c", None, true).expect("handshake");
    assert!(ack.checksums && !ack.bound_sums, "only what was asked");
    let other = page_for(meant, 3);
    assert_eq!(
        write(&mut old, 20, hit, &other, page_checksum(&other)),
        Status::Ok
    );
    assert_eq!(read(&mut old, 21, hit).1, other);
}

#[test]
fn without_an_agreement_bytes_28_to_32_are_ignored() {
    for (offered, asked) in [(false, true), (true, false)] {
        let mut cfg = ServerConfig::new("c", NODE_BYTES);
        cfg.page_checksums = offered;
        let server = page_server::spawn(cfg).unwrap();
        let mut s = connect(server.addr());
        let ack = raw::handshake_asking(&mut s, 1, "c", None, asked).expect("handshake");
        assert!(!ack.checksums, "offered {offered}, asked {asked}");
        let page = page_for(0x5000, 3);
        assert_eq!(write(&mut s, 20, 0x5000, &page, 0xdead_beef), Status::Ok);
        let (h, back) = read(&mut s, 21, 0x5000);
        assert_eq!(back, page);
        assert_eq!(h.checksum, 0, "no checksum without an agreement");
    }
}

#[test]
fn pages_round_trip_with_checksums_on_and_off() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator_on(&db.path().join("coord.db"), "127.0.0.1:0".parse().unwrap());
    let _a = page_server(&coord.url(), "a", 0);
    let mut cfg = ServerConfig::new("b", NODE_BYTES);
    cfg.gpa_base = NODE_BYTES as u64;
    cfg.page_checksums = false;
    let _b = page_server_with(&coord.url(), cfg);
    for page_checksums in [true, false] {
        let mgr = TransportManager::connect(ManagerConfig {
            coordinator_url: coord.url(),
            request_timeout_ms: 2000,
            connect_timeout_ms: 2000,
            poller_cpus: Some(vec![]),
            page_checksums,
            ..ManagerConfig::default()
        })
        .expect("manager connects");
        round_trip_all_pages(&mgr, 2, 7, 3);
    }
}

/// A checksummed READ of a page whose sum the server kept since its
/// checksummed WRITE is sent without a copy (`reads_with_kept_sums`); a
/// write without a checksum, from another connection, drops the kept sum,
/// so the next READ carries the sum of the new bytes, not the old one.
#[test]
fn a_kept_sum_answers_reads_until_any_write_of_the_page() {
    let server = page_server::spawn(ServerConfig::new("k", NODE_BYTES)).unwrap();
    let mut summed = connect(server.addr());
    assert!(
        raw::handshake_asking(&mut summed, 1, "k", None, true)
            .unwrap()
            .checksums
    );
    let mut plain = connect(server.addr());
    assert!(
        !raw::handshake_asking(&mut plain, 2, "k", None, false)
            .unwrap()
            .checksums
    );
    let off = 0x7000;
    let kept = || server.stats().reads_with_kept_sums;

    let first = page_for(off, 1);
    assert_eq!(
        write(&mut summed, 1, off, &first, page_checksum(&first)),
        Status::Ok
    );
    for id in 2..4 {
        let (h, page) = read(&mut summed, id, off);
        assert_eq!(
            (page.as_slice(), h.checksum),
            (&first[..], page_checksum(&first))
        );
    }
    assert_eq!(
        kept(),
        2,
        "both reads were answered with the sum kept by the write"
    );

    let second = page_for(off, 2);
    assert_eq!(write(&mut plain, 3, off, &second, 0), Status::Ok);
    let (h, page) = read(&mut summed, 4, off);
    assert_eq!(page, second);
    assert_eq!(
        h.checksum,
        page_checksum(&second),
        "a stale kept sum was sent"
    );
    assert_eq!(
        kept(),
        2,
        "a write without a sum leaves none: the read copied the page"
    );
    // That read summed its copy, no write ran meanwhile: the sum is kept now.
    let (h, page) = read(&mut summed, 5, off);
    assert_eq!(
        (page, h.checksum),
        (second.to_vec(), page_checksum(&second))
    );
    assert_eq!(kept(), 3);

    // A WRITE refused for its checksum changes nothing: the kept sum stays.
    let third = page_for(off, 3);
    assert_eq!(write(&mut summed, 6, off, &third, 1), Status::BadChecksum);
    let (h, page) = read(&mut summed, 7, off);
    assert_eq!(
        (page, h.checksum),
        (second.to_vec(), page_checksum(&second))
    );
    assert_eq!(kept(), 4);
}

/// Writers with and without checksums and checksummed readers race on the
/// same pages, each on its own connection. While they race, an answer may
/// carry a sum that does not cover its bytes (a write landed between the
/// sum and the send; the client reports it as a checksum error, which the
/// fault path retries). Once the writers are done, no page may be left
/// with a wrong kept sum: every page reads back as last written, with its
/// own sum, over and over.
#[test]
fn racing_writes_leave_no_wrong_kept_sum() {
    const PAGES: u64 = 8;
    const WRITES: u64 = 1500;
    let server = page_server::spawn(ServerConfig::new("r", NODE_BYTES)).unwrap();
    let addr = server.addr();
    let open = |id: u64, checksums: bool| {
        let mut s = connect(addr);
        let ack = raw::handshake_asking(&mut s, id, "r", None, checksums).unwrap();
        assert_eq!(ack.checksums, checksums);
        s
    };
    let writers: Vec<_> = [(10, true), (11, false)]
        .into_iter()
        .map(|(id, checksums)| {
            let mut s = open(id, checksums);
            std::thread::spawn(move || {
                for i in 0..WRITES {
                    let off = (i % PAGES) * PAGE_SIZE as u64;
                    let page = vec![(i as u8) | if checksums { 0x80 } else { 0 }; PAGE_SIZE];
                    let sum = if checksums { page_checksum(&page) } else { 0 };
                    assert_eq!(write(&mut s, i, off, &page, sum), Status::Ok);
                }
            })
        })
        .collect();
    let readers: Vec<_> = (0..2u64)
        .map(|r| {
            let mut s = open(20 + r, true);
            std::thread::spawn(move || {
                let mut mismatched = 0u64;
                for i in 0..WRITES {
                    let off = ((i * 3 + r) % PAGES) * PAGE_SIZE as u64;
                    let (h, page) = read(&mut s, i, off);
                    if h.checksum != page_checksum(&page) {
                        mismatched += 1;
                    }
                }
                mismatched
            })
        })
        .collect();
    for w in writers {
        w.join().expect("writer");
    }
    let mismatched: u64 = readers.into_iter().map(|r| r.join().expect("reader")).sum();

    // No write runs any more: every answer's sum covers its bytes (a page
    // two writes hit at once may hold bytes of both; its sum is still its own).
    let mut summed = open(30, true);
    for round in 0..2 {
        for p in 0..PAGES {
            let (h, page) = read(&mut summed, 50 + round, p * PAGE_SIZE as u64);
            assert_eq!(h.checksum, page_checksum(&page), "page {p} after the race");
        }
    }

    // Settle: each page written once more, alone, half of them with a sum.
    let mut plain = open(31, false);
    let mut last = Vec::new();
    for p in 0..PAGES {
        let off = p * PAGE_SIZE as u64;
        let page = page_for(off, 40 + p as u8);
        let status = if p % 2 == 0 {
            write(&mut summed, p, off, &page, page_checksum(&page))
        } else {
            write(&mut plain, p, off, &page, 0)
        };
        assert_eq!(status, Status::Ok);
        last.push(page);
    }
    let before = server.stats().reads_with_kept_sums;
    for round in 0..3 {
        for (p, expected) in last.iter().enumerate() {
            let (h, page) = read(&mut summed, 100 + round, p as u64 * PAGE_SIZE as u64);
            assert_eq!(&page[..], &expected[..], "page {p} round {round}");
            assert_eq!(
                h.checksum,
                page_checksum(expected),
                "page {p} round {round}: wrong sum"
            );
        }
    }
    // Pages written with a sum are answered from it from the first read;
    // the others from the second (the first read's sum is kept).
    assert_eq!(
        server.stats().reads_with_kept_sums - before,
        3 * PAGES - PAGES / 2,
        "{mismatched} answers of the race carried a sum that did not cover them"
    );
}

/// Hundreds of seeded rounds against one page-server, each on a fresh
/// connection with offset-bound sums: a WRITE of one of 16 pages is sent
/// damaged (a flipped bit anywhere, a mangled header byte, cut short, or
/// behind junk), then mostly intact, then the stream ends. After each
/// round the written page holds its old or its new content and nothing
/// else; at the end every other page of the region is as it was. A
/// network that mangles WRITEs can make them fail, never put a page where
/// it does not belong.
#[test]
fn damaged_writes_never_change_a_page_they_were_not_meant_for() {
    use rand::{Rng, SeedableRng};
    use std::io::Read;
    let server = page_server::spawn(ServerConfig::new("c", NODE_BYTES)).unwrap();
    let pages = NODE_BYTES / PAGE_SIZE;
    let bound = |page: &[u8], off| offset_bound_checksum(page_checksum(page), off);
    // What every page holds: 16 written ones, the rest as the server
    // started (zeros).
    let mut expected: Vec<Vec<u8>> = vec![vec![0u8; PAGE_SIZE]; pages];
    let mut s = connect(server.addr());
    raw::handshake_bound_sums(&mut s, 1, "c", None).expect("handshake");
    for (p, want) in expected.iter_mut().enumerate().take(16) {
        let off = (p * PAGE_SIZE) as u64;
        let page = page_for(off, 1);
        assert_eq!(
            write(&mut s, p as u64, off, &page, bound(&page, off)),
            Status::Ok
        );
        *want = page.to_vec();
    }
    let mut rng = rand::rngs::SmallRng::seed_from_u64(0x3a17e);
    let (mut applied, mut refused) = (0u32, 0u32);
    for round in 0..400u64 {
        let p = (round % 16) as usize;
        let off = (p * PAGE_SIZE) as u64;
        let page = page_for(off, 2 + (round % 200) as u8);
        let header = Header::request(Opcode::Write, 1000 + round, off, PAGE_SIZE as u32)
            .with_checksum(bound(&page, off));
        let mut good = header.encode().to_vec();
        good.extend_from_slice(&page);
        let mut bytes = match rng.gen_range(0..4) {
            0 => {
                let mut b = good.clone();
                let bit = rng.gen_range(0..b.len() * 8);
                b[bit / 8] ^= 1 << (bit % 8);
                b
            }
            1 => {
                let mut b = good.clone();
                b[rng.gen_range(0..32)] = rng.gen();
                b
            }
            2 => good[..rng.gen_range(1..good.len())].to_vec(),
            _ => {
                let mut b: Vec<u8> = (0..rng.gen_range(1..64)).map(|_| rng.gen()).collect();
                b.extend(&good);
                b
            }
        };
        if rng.gen_bool(0.8) {
            bytes.extend(&good);
        }
        let mut c = connect(server.addr());
        raw::handshake_bound_sums(&mut c, 2 + round, "c", None).expect("handshake");
        c.write_all(&bytes).unwrap();
        c.shutdown(std::net::Shutdown::Write).unwrap();
        // Whatever the answers, until the server ends the stream too.
        let mut sink = Vec::new();
        c.read_to_end(&mut sink)
            .expect("the server closes within 5 s");
        let (_, now) = read(&mut s, 100_000 + round, off);
        if now == page {
            applied += 1;
            expected[p] = now;
        } else {
            assert!(
                now == expected[p],
                "round {round}: page {p} holds neither its old nor its new content"
            );
            refused += 1;
        }
    }
    for (p, want) in expected.iter().enumerate() {
        let (_, got) = read(&mut s, 200_000 + p as u64, (p * PAGE_SIZE) as u64);
        assert!(
            got == *want,
            "page {p} changed without a WRITE meant for it"
        );
    }
    // Both ends were reached: damaged WRITEs refused, and intact ones after
    // them applied.
    assert!(
        applied > 0 && refused > 0,
        "applied {applied}, refused {refused}"
    );
}
