//! Writes a client gave up on, delivered late: a page-server stopped for a
//! while finds them in its sockets, a link that comes back delivers what
//! the client's TCP sent. A client that gave up a connection and opened a
//! new one may meanwhile have written the same page again over the new
//! one, and been told it was done: the older write must not land after it.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::stalling_link::StallingLink;
use common::*;
use rdma_transport::PAGE_SIZE;

/// The page both tests write.
const P: u64 = 3;
const GPA: u64 = P * PAGE_SIZE as u64;

/// One page-server, no replica, reached through a link. A write of page P
/// is held by the link (the client's deadline passes: it fails); the
/// client's connection then ends (what it sent stays in the link) and the
/// client writes P again over a new connection, successfully. When the
/// link delivers the first write, the page-server must not apply it: the
/// page is what the client was last told was written. (Until 2026-12-07
/// it applied it, and every later read returned the older page.)
#[test]
fn a_write_delivered_late_on_a_connection_the_client_replaced_does_not_overwrite_a_newer_one() {
    let gpa = GPA;
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let link = StallingLink::start();
    let server = ChildServer::start_with(&url, "n", 0, &["--advertise", &link.addr()]);
    link.set_target(&server.addr);
    let mgr = manager(&url);
    mgr.write_page(gpa, &page_indexed(P, 1))
        .expect("first write");

    link.hold_open();
    let older = page_indexed(P, 2);
    let given_up = mgr.write_page(gpa, &older);
    assert!(given_up.is_err(), "a write the link held succeeded");
    assert!(link.holds_something(), "the write never reached the link");

    link.end_held_clients();
    let newer = page_indexed(P, 3);
    // The first attempt may still find the connection that just ended.
    assert!(
        wait_until(Duration::from_secs(10), || mgr
            .write_page(gpa, &newer)
            .is_ok()),
        "the write over a new connection never succeeded"
    );

    link.release();
    assert!(
        wait_until(Duration::from_secs(10), || link.server_reacted()),
        "the page-server never took what the link delivered late"
    );
    let mut page = [0u8; PAGE_SIZE];
    mgr.read_page(gpa, &mut page).expect("read");
    assert!(
        page == newer,
        "page {P} is {} after the late delivery, not the last write the client was told was done",
        if page == older {
            "the write the client gave up on"
        } else {
            "neither write"
        }
    );
}

/// As above across a restart of the VMM: a VMM process gives a write up
/// (the link holds it) and is killed (SIGKILL); its successor, with the
/// same `client_id` (the embedder's stable identity of the VM), writes the
/// page again, successfully; then the link delivers the dead process's
/// write. It must not land. (With a random id per process, the default,
/// nothing tells the page-server that the new connection replaces the
/// dead one's: it applied the late write.)
#[test]
fn a_write_of_a_killed_vmm_delivered_late_does_not_overwrite_its_successors() {
    const VM_CLIENT_ID: u64 = 0x7e57_0000_0000_0001;
    let (_db, coord) = loopback_coordinator();
    let url = coord.url();
    let link = StallingLink::start();
    let server = ChildServer::start_with(&url, "n", 0, &["--advertise", &link.addr()]);
    link.set_target(&server.addr);

    let dir = tempfile::tempdir().unwrap();
    let (connected, go, gave_up) = (
        dir.path().join("connected"),
        dir.path().join("go"),
        dir.path().join("gave-up"),
    );
    let mut vmm = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_vmm_gives_a_write_up", "--ignored"])
        .env("LW_CHILD_URL", &url)
        .env("LW_CHILD_ID", VM_CLIENT_ID.to_string())
        .env("LW_CHILD_DIR", dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the VMM process");
    assert!(
        wait_until(Duration::from_secs(20), || connected.exists()),
        "the VMM process never wrote its first page"
    );
    // Its connection is open now: hold what it sends next.
    link.hold_open();
    std::fs::write(&go, b"").unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || gave_up.exists()),
        "the VMM process never finished its second write"
    );
    assert_eq!(
        std::fs::read_to_string(&gave_up).unwrap(),
        "failed",
        "a write the link held succeeded"
    );
    assert!(link.holds_something(), "the write never reached the link");
    vmm.kill().expect("SIGKILL the VMM process");
    vmm.wait().expect("reap the VMM process");

    let successor = manager_with_id(&url, VM_CLIENT_ID);
    let newer = page_indexed(P, 3);
    assert!(
        wait_until(Duration::from_secs(10), || successor
            .write_page(GPA, &newer)
            .is_ok()),
        "the restarted VMM's write never succeeded"
    );

    link.release();
    assert!(
        wait_until(Duration::from_secs(10), || link.server_reacted()),
        "the page-server never took what the link delivered late"
    );
    let mut page = [0u8; PAGE_SIZE];
    successor.read_page(GPA, &mut page).expect("read");
    assert!(
        page == newer,
        "page {P} is {} after the late delivery, not the restarted VMM's write",
        if page == page_indexed(P, 2) {
            "the killed VMM's write"
        } else {
            "neither write"
        }
    );
}

/// The VMM process of the test above (run by it, ignored otherwise):
/// writes page P once, says so, waits for "go", writes it again (held by
/// the link: it fails at its deadline), says how that went, and waits to
/// be killed (or for its stdin to end).
#[test]
#[ignore = "the VMM process of a_write_of_a_killed_vmm_delivered_late_does_not_overwrite_its_successors"]
fn child_vmm_gives_a_write_up() {
    let (Ok(url), Ok(id), Ok(dir)) = (
        std::env::var("LW_CHILD_URL"),
        std::env::var("LW_CHILD_ID"),
        std::env::var("LW_CHILD_DIR"),
    ) else {
        panic!("run by a_write_of_a_killed_vmm_delivered_late_does_not_overwrite_its_successors");
    };
    let dir = Path::new(&dir);
    let mgr = manager_with_id(&url, id.parse().expect("LW_CHILD_ID"));
    mgr.write_page(GPA, &page_indexed(P, 1))
        .expect("first write");
    std::fs::write(dir.join("connected"), b"").unwrap();
    assert!(
        wait_until(Duration::from_secs(20), || dir.join("go").exists()),
        "never told to go on"
    );
    let outcome = match mgr.write_page(GPA, &page_indexed(P, 2)) {
        Ok(()) => "succeeded",
        Err(_) => "failed",
    };
    // Written whole, then renamed: the test never reads it half-written.
    std::fs::write(dir.join("gave-up.tmp"), outcome).unwrap();
    std::fs::rename(dir.join("gave-up.tmp"), dir.join("gave-up")).unwrap();
    // Killed by the test; if the test dies first, its end of stdin closes.
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
}
