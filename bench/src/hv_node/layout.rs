//! Where the workload's data lives in guest RAM (4 KiB page indexes from
//! GPA 0). The rings and the victim's pages sit past 32 MiB, so with two
//! page-servers of 32 MiB each both homes take part.

use rdma_transport::PAGE_SIZE;

/// Start barrier: vCPUs (and the victim) arrived, a u64 at offset 0.
pub const START: usize = 0;
/// End barrier: vCPUs done, a u64 at offset 0.
pub const DONE: usize = 1;
/// Shared counters, two per page (offsets 0 and 2048: false sharing).
pub const COUNTERS: usize = 16;
const COUNTER_PAGE: usize = 16;
/// The spinlock's word (offset 0); its holder's id + 1, 0 when free.
pub const LOCK: usize = 32;
/// The structure the lock guards: every u64 of these pages holds the
/// number of times it was updated.
pub const STRUCT_FIRST: usize = 33;
pub const STRUCT_PAGES: usize = 4;
/// Ring r: head (messages written, offset 0) on page `ring_page(r)`, tail
/// (messages read) on the next one, then `RING_SLOT_PAGES` pages of slots.
const RING_FIRST: usize = 8192;
const RING_STRIDE: usize = 16;
pub const RING_SLOTS: u64 = 64;
const RING_SLOT_PAGES: usize = 8;
/// The victim's pages: one it writes and hands back, one it keeps.
const VICTIM_FIRST: usize = 8192 + 1024;

/// Pages the layout spans for `nodes` nodes.
pub fn pages_needed(nodes: usize) -> usize {
    VICTIM_FIRST + 2 * nodes.max(1)
}

pub fn gpa(page: usize) -> u64 {
    (page * PAGE_SIZE) as u64
}

/// GPA of counter `i`.
pub fn counter(i: usize) -> u64 {
    gpa(COUNTER_PAGE + i / 2) + (i % 2 * 2048) as u64
}

/// The counters' pages.
pub fn counter_pages() -> std::ops::Range<usize> {
    COUNTER_PAGE..COUNTER_PAGE + COUNTERS / 2
}

pub fn ring_head(ring: usize) -> u64 {
    gpa(RING_FIRST + ring * RING_STRIDE)
}

pub fn ring_tail(ring: usize) -> u64 {
    gpa(RING_FIRST + ring * RING_STRIDE + 1)
}

/// GPA of slot `seq % RING_SLOTS` of ring `ring`: 16 bytes (the message's
/// sequence number, then its check word), slots spread over the ring's
/// slot pages.
pub fn ring_slot(ring: usize, seq: u64) -> u64 {
    let slot = (seq % RING_SLOTS) as usize;
    let page = RING_FIRST + ring * RING_STRIDE + 2 + slot % RING_SLOT_PAGES;
    gpa(page) + (slot / RING_SLOT_PAGES * 16) as u64
}

/// The ring `node` produces into or consumes from, with its role (true:
/// producer): nodes 2r and 2r+1 share ring r; a last odd node has none.
pub fn ring_of(node: usize, nodes: usize) -> Option<(usize, bool)> {
    let ring = node / 2;
    (2 * ring + 1 < nodes).then_some((ring, node % 2 == 0))
}

/// The check word of message `seq`.
pub fn message_check(seq: u64) -> u64 {
    seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5555
}

/// The victim's page it writes once and hands back.
pub fn victim_handed_back(node: usize) -> u64 {
    gpa(VICTIM_FIRST + 2 * node)
}

/// The victim's page it keeps owning until it dies.
pub fn victim_owned(node: usize) -> u64 {
    gpa(VICTIM_FIRST + 2 * node + 1)
}

/// What the victim writes in its handed-back page.
pub fn victim_pattern(node: usize) -> u64 {
    0xdead_0000 + node as u64
}
