//! The connections a completion queue's active lanes have requests on,
//! each once, with how many of those lanes use it. A step reads each of
//! them once and the doorbell writes each once, instead of looking at
//! every active lane's round (at depth 32 on one connection that was 32
//! rounds and 31 searches of the connections already read, per step).
//!
//! A lane joins when its round goes on the wire and leaves when it stops
//! being active; it keeps the keys it was counted under (`Held`), since
//! settling its round forgets the round's connections before it leaves.
//! An entry holds its connection (an `Arc`) while any lane counts on it,
//! so a key names one live connection the whole time.

use std::sync::Arc;
use std::time::Duration;

use smallvec::SmallVec;

use crate::manager::round::Round;
use crate::rdma::RdmaConnection;
use crate::tcp::TcpConnection;

/// The keys (connection addresses) a lane was counted under.
pub(crate) type Held = SmallVec<[usize; 2]>;

/// Connections of the active lanes, each with its count of lanes.
#[derive(Default)]
pub(super) struct OnWire {
    tcp: Vec<(Arc<TcpConnection>, usize)>,
    rdma: Vec<(Arc<RdmaConnection>, usize)>,
}

fn key<T>(c: &Arc<T>) -> usize {
    Arc::as_ptr(c) as usize
}

/// Counts `c` once more in `list` (a new entry at 1), unless `held` has
/// it already; records it in `held`.
fn count<T>(list: &mut Vec<(Arc<T>, usize)>, c: &Arc<T>, held: &mut Held) {
    let k = key(c);
    if held.contains(&k) {
        return;
    }
    held.push(k);
    match list.iter_mut().find(|(o, _)| key(o) == k) {
        Some((_, n)) => *n += 1,
        None => list.push((Arc::clone(c), 1)),
    }
}

/// Counts key `k` once less in `list`, letting its connection go at 0;
/// false when `list` has no entry for it.
fn uncount<T>(list: &mut Vec<(Arc<T>, usize)>, k: usize) -> bool {
    let Some(i) = list.iter().position(|(o, _)| key(o) == k) else {
        return false;
    };
    list[i].1 -= 1;
    if list[i].1 == 0 {
        list.swap_remove(i);
    }
    true
}

impl OnWire {
    /// Counts the connections of `round` (on the wire) once each, and
    /// records them in `held`.
    pub(super) fn join(&mut self, round: &Round, held: &mut Held) {
        for c in round.tcp_conns() {
            count(&mut self.tcp, c, held);
        }
        for c in round.rdma_conns() {
            count(&mut self.rdma, c, held);
        }
    }

    /// Uncounts the connections in `held` (emptied); a connection no lane
    /// counts on any more is let go.
    pub(super) fn leave(&mut self, held: &mut Held) {
        for k in held.drain(..) {
            if !uncount(&mut self.tcp, k) {
                uncount(&mut self.rdma, k);
            }
        }
    }

    /// Reads what each connection has, without blocking.
    pub(super) fn progress(&self) {
        for (c, _) in &self.tcp {
            if let Some(mut rb) = c.recv.try_lock() {
                let _ = c.progress(&mut rb);
            }
        }
        for (c, _) in &self.rdma {
            c.progress();
        }
    }

    /// Writes the requests queued on each TCP connection (the doorbell).
    pub(super) fn flush(&self, timeout: Duration) {
        for (c, _) in &self.tcp {
            c.flush_deferred(timeout);
        }
    }

    /// Adds each TCP connection to `out`.
    pub(super) fn tcp_connections(&self, out: &mut Vec<Option<Arc<TcpConnection>>>) {
        out.extend(self.tcp.iter().map(|(c, _)| Some(Arc::clone(c))));
    }

    /// Lets every connection go (the queue is going away).
    pub(super) fn clear(&mut self) {
        self.tcp.clear();
        self.rdma.clear();
    }
}
