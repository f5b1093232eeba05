//! Epoch fencing. A page-server's memory belongs to its epoch (random at
//! every start, sent in its handshake); a range is valid in one epoch of its
//! owner (`valid_epoch` in the map). A connection to an owner in another
//! epoch reaches a process whose memory no longer holds the range: serving
//! it would hand the guest zeros as its pages, or take writes that the next
//! read of an older page would contradict. Such requests fail with
//! [`TransportError::DataLost`] instead, after one map refresh (an operator
//! may have re-initialised the range meanwhile).

use std::time::Instant;

use super::{Inner, Node};
use crate::error::TransportError;

/// One request of a node's group: its address, the remote offset it was
/// resolved to, and the epoch its range is valid in.
#[derive(Debug, Clone, Copy)]
pub(super) struct Fenced {
    pub(super) gpa: u64,
    pub(super) remote_offset: u64,
    pub(super) valid_epoch: u64,
}

/// Whether a connection whose server is in `server_epoch` may serve a range
/// valid in `valid_epoch` (0: a coordinator that records no epochs).
pub(super) fn serves(valid_epoch: u64, server_epoch: u64) -> bool {
    valid_epoch == 0 || valid_epoch == server_epoch
}

impl Inner {
    /// Checks that `node`'s connection, whose server is in `server_epoch`,
    /// may serve every request of `group`. On a mismatch the map is
    /// refreshed once (within `deadline`) and the requests are checked
    /// against it; the first one still fenced off fails the group.
    ///
    /// # Errors
    /// [`TransportError::DataLost`] for the first request whose range is
    /// valid in another epoch of its owner.
    pub(super) fn check_epochs(
        &self,
        node: &Node,
        server_epoch: u64,
        group: &[Fenced],
        deadline: Instant,
    ) -> Result<(), TransportError> {
        if group.iter().all(|r| serves(r.valid_epoch, server_epoch)) {
            return Ok(());
        }
        self.refresh_on_miss(deadline);
        let state = self.state.load();
        for request in group {
            if serves(request.valid_epoch, server_epoch) {
                continue;
            }
            // Trusted only when the refreshed map still has a replica of
            // the address on the same node and offset: anything else is not
            // the range this request was resolved to.
            let now_valid = state
                .map
                .replica_on(request.gpa, &node.id)
                .filter(|l| l.remote_offset == request.remote_offset)
                .filter(|l| l.state.serves_reads() || l.state.takes_writes())
                .map(|l| l.valid_epoch);
            if !now_valid.is_some_and(|valid| serves(valid, server_epoch)) {
                tracing::debug!(
                    gpa = request.gpa,
                    node = %node.id,
                    server_epoch,
                    valid_epoch = request.valid_epoch,
                    "range's contents were lost with a page-server restart; not served"
                );
                return Err(TransportError::DataLost {
                    gpa: request.gpa,
                    node: node.id.clone(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::serves;

    #[test]
    fn only_the_valid_epoch_serves() {
        assert!(serves(7, 7));
        assert!(!serves(7, 9));
        // A coordinator without epochs: nothing is checked.
        assert!(serves(0, 9));
    }
}
