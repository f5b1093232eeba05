//! The credit rules of a message channel (`channel.rs`), apart from the
//! verbs so that they can be checked without a device (tests below).
//!
//! Each side counts the messages it wrote (`posted`), those whose WRITE
//! completed locally (`completed`: the send slot is free again), and the
//! peer's count of messages taken, from the immediates (`peer_taken`). The
//! k-th message goes to the peer's slot `k % slots`. A message may be
//! written while fewer than `slots - 1` are unreported (the last credit is
//! for a credit-only message) and fewer than `slots` are uncompleted.

/// One side's send bookkeeping.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Credits {
    /// Messages written (credit-only ones included).
    posted: u32,
    /// Of those, completed locally.
    completed: u32,
    /// Messages the peer reported taken.
    peer_taken: u32,
    /// The count of messages taken that this side reported last.
    reported: u32,
}

impl Credits {
    /// Whether a message (`credit_only`: a credit-only one) may be
    /// written now, with `slots` slots per ring.
    pub(crate) fn can_post(&self, slots: u32, credit_only: bool) -> bool {
        let unreported = self.posted.wrapping_sub(self.peer_taken);
        let limit = if credit_only { slots } else { slots - 1 };
        unreported < limit && self.posted.wrapping_sub(self.completed) < slots
    }

    /// The slot (in the peer's ring, and this side's send slot) of the next
    /// message.
    pub(crate) fn next_slot(&self, slots: u32) -> u32 {
        self.posted % slots
    }

    /// A message was written, reporting `taken` in its immediate.
    pub(crate) fn posted(&mut self, taken: u32) {
        self.posted = self.posted.wrapping_add(1);
        self.reported = taken;
    }

    /// A message's WRITE completed.
    pub(crate) fn completed(&mut self) {
        self.completed = self.completed.wrapping_add(1);
    }

    /// Whether every message written has completed.
    pub(crate) fn all_completed(&self) -> bool {
        self.completed == self.posted
    }

    /// The peer reports `peer_taken` (the immediate of a message from it).
    /// False when it claims more than this side wrote: a broken peer.
    pub(crate) fn peer_reports(&mut self, peer_taken: u32, slots: u32) -> bool {
        if self.posted.wrapping_sub(peer_taken) > slots {
            return false;
        }
        self.peer_taken = peer_taken;
        true
    }

    /// Whether to send a credit-only message now: `taken` messages are
    /// taken, a quarter of the ring of them not yet reported, and the last
    /// credit is free. Call it after writing what waits and may go (each
    /// message carries the report): what still waits then has no credit,
    /// and when both sides are in that state only credit-only messages,
    /// on the last credit, get them going again.
    pub(crate) fn wants_credit_message(&self, taken: u32, slots: u32) -> bool {
        taken.wrapping_sub(self.reported) >= (slots / 4).max(1) && self.can_post(slots, true)
    }
}

#[cfg(test)]
mod tests {
    //! Two sides exchanging messages through rings, with every interleaving
    //! of sends, deliveries (in order per direction, as on an RC QP) and
    //! takes a seeded generator picks; answers to messages, bursts, and
    //! sides that stop taking for a while. Checked: a slot is never written
    //! while it holds a message not yet taken; a receive is always posted
    //! for a message; once both sides go on taking, every message arrives,
    //! in order, and nothing stays waiting (no deadlock).

    use std::collections::VecDeque;

    use super::Credits;

    const SLOTS: u32 = 8;

    /// A message on the wire: its slot, immediate, and id (0: credit-only).
    type Wire = (u32, u32, u64);

    #[derive(Default)]
    struct Side {
        credits: Credits,
        waiting: VecDeque<u64>,
        /// This side's ring: the id in each slot until taken.
        ring: Vec<Option<u64>>,
        receives: u32,
        taken: u32,
        next_id: u64,
        received: Vec<u64>,
        sent: Vec<u64>,
    }

    impl Side {
        fn new(tag: u64) -> Self {
            Self {
                ring: vec![None; SLOTS as usize],
                receives: SLOTS,
                next_id: tag << 32,
                ..Self::default()
            }
        }

        /// Queues a new message (as `send` does) and sends what it can.
        fn enqueue(&mut self, wire: &mut VecDeque<Wire>) {
            self.next_id += 1;
            self.waiting.push_back(self.next_id);
            self.pump(wire);
        }

        fn pump(&mut self, wire: &mut VecDeque<Wire>) {
            while !self.waiting.is_empty() && self.credits.can_post(SLOTS, false) {
                let id = self.waiting.pop_front().unwrap();
                self.post(id, wire);
            }
            if self.credits.wants_credit_message(self.taken, SLOTS) {
                self.post(0, wire);
            }
        }

        fn post(&mut self, id: u64, wire: &mut VecDeque<Wire>) {
            let slot = self.credits.next_slot(SLOTS);
            wire.push_back((slot, self.taken, id));
            self.credits.posted(self.taken);
            if id != 0 {
                self.sent.push(id);
            }
        }

        /// The peer's WRITE lands in this side's ring.
        fn land(&mut self, (slot, imm, id): Wire) -> (u32, u64) {
            assert!(self.receives > 0, "a message without a posted receive");
            self.receives -= 1;
            let cell = &mut self.ring[slot as usize];
            assert!(
                cell.is_none(),
                "slot {slot} overwritten before it was taken"
            );
            *cell = Some(id);
            (imm, id)
        }
    }

    struct Sim {
        sides: [Side; 2],
        /// Messages in flight, per direction: 0 → 1 and 1 → 0.
        wires: [VecDeque<Wire>; 2],
        /// Landed, not yet taken (their immediates), per receiver.
        landed: [VecDeque<u32>; 2],
        rng: u64,
    }

    impl Sim {
        fn random(&mut self, n: u64) -> u64 {
            // xorshift64*
            self.rng ^= self.rng >> 12;
            self.rng ^= self.rng << 25;
            self.rng ^= self.rng >> 27;
            self.rng.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
        }

        /// Delivers the oldest message from side `from`, if any.
        fn deliver(&mut self, from: usize) -> bool {
            let Some(msg) = self.wires[from].pop_front() else {
                return false;
            };
            let to = 1 - from;
            let (imm, _) = self.sides[to].land(msg);
            self.landed[to].push_back(imm);
            // RC: the WRITE completes at the sender once it landed.
            self.sides[from].credits.completed();
            true
        }

        /// Side `at` takes its oldest landed message; a real message gets
        /// an answer when `answer`.
        fn take(&mut self, at: usize, answer: bool) -> bool {
            let Some(imm) = self.landed[at].pop_front() else {
                return false;
            };
            let side = &mut self.sides[at];
            let wire = &mut self.wires[at];
            // As `MessageChannel::poll`: the report first, then the message
            // (an answer reports the count without it), then the slot is
            // free, its receive posted again and the count raised.
            assert!(
                side.credits.peer_reports(imm, SLOTS),
                "a report beyond what was sent"
            );
            let slot = (side.taken % SLOTS) as usize;
            let id = side.ring[slot].expect("the slot holds the message");
            if id != 0 {
                side.received.push(id);
                if answer {
                    side.enqueue(wire);
                }
            }
            side.ring[slot] = None;
            side.receives += 1;
            side.taken = side.taken.wrapping_add(1);
            side.pump(wire);
            true
        }

        fn quiesce(&mut self) {
            for _ in 0..1_000_000 {
                let progressed =
                    self.deliver(0) | self.deliver(1) | self.take(0, false) | self.take(1, false);
                if !progressed {
                    return;
                }
            }
            panic!("no quiescence");
        }
    }

    #[test]
    fn credits_never_overwrite_a_slot_and_every_message_arrives() {
        for seed in 1..=300u64 {
            let mut sim = Sim {
                sides: [Side::new(1), Side::new(2)],
                wires: [VecDeque::new(), VecDeque::new()],
                landed: [VecDeque::new(), VecDeque::new()],
                rng: seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1,
            };
            // A side that stops taking for a while (as a home held by the
            // test hook, or a busy reader).
            let mut paused = [false, false];
            for _ in 0..2_000 {
                let side = sim.random(2) as usize;
                match sim.random(10) {
                    0..=2 => {
                        let burst = 1 + sim.random(3 * u64::from(SLOTS));
                        for _ in 0..burst {
                            let wire = &mut sim.wires[side];
                            sim.sides[side].enqueue(wire);
                        }
                    }
                    3..=5 => {
                        sim.deliver(side);
                    }
                    6..=8 if !paused[side] => {
                        let answer = sim.random(2) == 0;
                        sim.take(side, answer);
                    }
                    _ => paused[side] = !paused[side],
                }
            }
            sim.quiesce();
            for (i, side) in sim.sides.iter().enumerate() {
                assert!(side.waiting.is_empty(), "seed {seed}: side {i} still waits");
                assert!(side.credits.all_completed(), "seed {seed}");
                let peer = &sim.sides[1 - i];
                assert_eq!(
                    peer.received, side.sent,
                    "seed {seed}: in order, all of them"
                );
            }
        }
    }

    #[test]
    fn a_report_of_messages_never_sent_is_refused() {
        let mut c = Credits::default();
        c.posted(0);
        c.posted(0);
        assert!(c.peer_reports(2, SLOTS));
        assert!(!c.peer_reports(3, SLOTS));
        assert!(c.peer_reports(1, SLOTS));
    }

    #[test]
    fn the_last_credit_is_kept_for_a_credit_only_message() {
        let mut c = Credits::default();
        for _ in 0..SLOTS - 1 {
            assert!(c.can_post(SLOTS, false));
            c.posted(0);
            c.completed();
        }
        assert!(!c.can_post(SLOTS, false));
        assert!(c.can_post(SLOTS, true));
        assert!(c.wants_credit_message(SLOTS / 4, SLOTS));
        c.posted(SLOTS / 4);
        assert!(!c.can_post(SLOTS, true));
        assert!(c.peer_reports(SLOTS, SLOTS));
        assert!(c.can_post(SLOTS, false));
    }
}
