//! One chunk's requests to TCP nodes: where each went, the guard that
//! cancels them if the caller unwinds, and what each completion code means.

use std::sync::Arc;

use smallvec::SmallVec;

use super::link::Link;
use super::{Inner, Node};
use crate::error::TransportError;
use crate::tcp::{TcpConnection, CODE_CHECKSUM, CODE_CONN_LOST, CODE_PROTOCOL, MAX_CHUNK};
use crate::wire::Status;

/// `NodeDown`'s reason when a connection died before answering.
pub(super) const CONNECTION_LOST: &str = "connection lost";

/// Where one request of a batch went.
#[derive(Clone, Copy)]
pub(super) struct Sent {
    pub(super) group: usize,
    pub(super) id: u64,
    /// The page's guest-physical address (for errors about it).
    pub(super) gpa: u64,
    /// Index of the request among the round's targets.
    pub(super) target: usize,
}

/// The TCP side of one chunk: per node group its connection, and every
/// request on the wire. Requests still listed when it drops (the caller
/// unwound between submit and completion) are cancelled, so no poller
/// writes into the caller's pages or signals its waiter after it is gone.
pub(super) struct TcpChunk {
    pub(super) groups: [Option<Arc<TcpConnection>>; MAX_CHUNK],
    /// Filled as requests go out, never zeroed whole: clearing 64 of them
    /// with the groups (2.5 KiB, a `rep stosb` in glibc's memset) cost
    /// ~4 us per round under the SoftRoCE VM's emulation.
    pub(super) sent: SmallVec<[Sent; MAX_CHUNK]>,
}

impl TcpChunk {
    pub(super) fn new() -> Self {
        Self {
            groups: [const { None }; MAX_CHUNK],
            sent: SmallVec::new(),
        }
    }
}

impl Drop for TcpChunk {
    fn drop(&mut self) {
        for s in &self.sent {
            if let Some(conn) = &self.groups[s.group] {
                // Returns once the slot is free: a poller that had claimed
                // it has finished with it.
                let _ = conn.inflight.cancel(s.id);
            }
        }
    }
}

impl Inner {
    /// What request `sent`'s completion `code` means; `write`: it was a WRITE.
    pub(super) fn code_to_error(
        &self,
        code: Option<u32>,
        conn: &Arc<TcpConnection>,
        node: &Node,
        sent: Sent,
        write: bool,
    ) -> Option<TransportError> {
        let checksum = || TransportError::Checksum {
            node: conn.node_id.clone(),
            gpa: sent.gpa,
            direction: if write { "to" } else { "from" },
        };
        let node_name = || conn.node_id.clone();
        match code {
            Some(0) => None,
            None => Some(TransportError::Timeout {
                node: node_name(),
                timeout_ms: self.config.request_timeout_ms,
            }),
            Some(CODE_CONN_LOST) => {
                self.forget(node, &Link::Tcp(Arc::clone(conn)));
                Some(TransportError::NodeDown {
                    node: node_name(),
                    reason: CONNECTION_LOST.into(),
                })
            }
            // The connection's framing held: it stays in use.
            Some(CODE_CHECKSUM) => Some(checksum()),
            Some(code) if code == u32::from(Status::BadChecksum as u16) => Some(checksum()),
            Some(CODE_PROTOCOL) => {
                self.forget(node, &Link::Tcp(Arc::clone(conn)));
                Some(TransportError::Protocol {
                    node: node_name(),
                    detail: "malformed answer".into(),
                })
            }
            Some(other) => {
                let status = u16::try_from(other)
                    .ok()
                    .and_then(Status::from_u16)
                    .unwrap_or(Status::Internal);
                Some(TransportError::Refused {
                    node: node_name(),
                    status,
                })
            }
        }
    }
}
