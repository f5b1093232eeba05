//! Writes a client gave up on, delivered late: a page-server stopped for a
//! while finds them in its sockets, a link that comes back delivers what
//! the client's TCP sent. A client that gave up a connection and opened a
//! new one may meanwhile have written the same page again over the new
//! one, and been told it was done: the older write must not land after it.

mod common;

use std::time::Duration;

use common::stalling_link::StallingLink;
use common::*;
use rdma_transport::PAGE_SIZE;

/// One page-server, no replica, reached through a link. A write of page P
/// is held by the link (the client's deadline passes: it fails); the
/// client's connection then ends (what it sent stays in the link) and the
/// client writes P again over a new connection, successfully. When the
/// link delivers the first write, the page-server must not apply it: the
/// page is what the client was last told was written. (Until 2026-12-07
/// it applied it, and every later read returned the older page.)
#[test]
fn a_write_delivered_late_on_a_connection_the_client_replaced_does_not_overwrite_a_newer_one() {
    const P: u64 = 3;
    let gpa = P * PAGE_SIZE as u64;
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
