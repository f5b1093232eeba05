//! The library's error type.

use crate::coordinator::CoordinatorError;
use crate::pool::PoolError;
use crate::verbs::WcStatus;
use crate::wire::Status;

/// Everything a [`crate::TransportManager`] call can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// No node owns this guest-physical address (even after a map refresh).
    #[error("GPA {gpa:#x} is not mapped to any node")]
    UnknownGpa {
        /// The address asked for.
        gpa: u64,
    },
    /// The address is not 4 KiB aligned.
    #[error("GPA {gpa:#x} is not page aligned")]
    Unaligned {
        /// The address asked for.
        gpa: u64,
    },
    /// The owner node cannot be reached or its connection was lost.
    #[error("node {node} is down: {reason}")]
    NodeDown {
        /// Owner node id.
        node: String,
        /// What happened.
        reason: String,
    },
    /// The request's deadline passed without an answer.
    #[error("request to node {node} timed out after {timeout_ms} ms")]
    Timeout {
        /// Owner node id.
        node: String,
        /// The deadline that passed.
        timeout_ms: u64,
    },
    /// The peer at the node's address could not prove the cluster key (a
    /// port squatter, another cluster, a server without a key), or did not
    /// accept this client's proof. Nothing is read from or written to it.
    #[error("node {node} failed authentication: {detail}")]
    AuthFailed {
        /// Node id the map gives for the address.
        node: String,
        /// What failed.
        detail: String,
    },
    /// The owner of `gpa` no longer holds the range's contents: it restarted
    /// (new epoch, empty memory) since the range was last valid. No page is
    /// read or written; an operator must re-initialise the range (which
    /// makes zeros its valid contents) before it is served again.
    #[error(
        "the contents of GPA {gpa:#x} were lost: node {node} restarted since they were written, and no live replica holds them"
    )]
    DataLost {
        /// The address asked for.
        gpa: u64,
        /// Owner node id.
        node: String,
    },
    /// Coherent memory: the latest writes of the page at `gpa` were lost
    /// with the hypervisor node that owned it (it died before writing them
    /// back to the page's home). The home refuses to serve an older
    /// version; the page stays lost until it is re-initialised.
    #[error(
        "the latest writes of GPA {gpa:#x} were lost with the node that owned them (home {node})"
    )]
    CoherentDataLost {
        /// The address asked for.
        gpa: u64,
        /// The page's home node.
        node: String,
    },
    /// A write reached a live replica of its range, but another replica
    /// missed it and could not be marked stale (the coordinator was not
    /// reachable, or refused): that replica may serve the older page, so
    /// the write is not reported done. Writing the page again is safe; the
    /// next write to the range marks that replica stale first, and fails
    /// the same way until the coordinator takes the mark (or answers that
    /// it is the range's only live replica by then).
    #[error("replica {node} of the range at {gpa:#x} missed a write and could not be marked stale: {reason}")]
    ReplicaMissedWrite {
        /// First address of the range.
        gpa: u64,
        /// The replica's node.
        node: String,
        /// Why it could not be marked stale.
        reason: String,
    },
    /// The node answered something that breaks the wire protocol.
    #[error("protocol error with node {node}: {detail}")]
    Protocol {
        /// Owner node id.
        node: String,
        /// What was wrong.
        detail: String,
    },
    /// A page failed its end-to-end checksum (on a TCP connection that
    /// negotiated checksums, see [`crate::ManagerConfig::page_checksums`]):
    /// a READ's page arrived corrupted and was not copied into the caller's
    /// buffer, or the node found a WRITE's page corrupted and did not apply
    /// it. Asking again may succeed.
    #[error("page at GPA {gpa:#x} failed its checksum on the way {direction} node {node}")]
    Checksum {
        /// Owner node id.
        node: String,
        /// The address of the page.
        gpa: u64,
        /// `"from"` (a READ) or `"to"` (a WRITE).
        direction: &'static str,
    },
    /// The node refused the request (e.g. offset out of its exported range).
    #[error("node {node} refused the request: {status}")]
    Refused {
        /// Owner node id.
        node: String,
        /// The status it answered.
        status: Status,
    },
    /// The coordinator could not be asked or refused.
    #[error("coordinator: {0}")]
    Coordinator(#[from] CoordinatorError),
    /// The page pool could not be set up.
    #[error("page pool: {0}")]
    Pool(#[from] PoolError),
    /// No free frame in the page pool.
    #[error("page pool exhausted ({capacity} frames in use)")]
    PoolExhausted {
        /// Frames in the pool.
        capacity: usize,
    },
    /// Bad configuration or arguments.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// An RDMA work request failed (bad rkey, peer gone, retry exceeded, or
    /// flushed because another request on the same QP failed). The node's
    /// QP was torn down; the next request builds a new one.
    #[error("RDMA request to node {node} failed: {status}")]
    RdmaCompletion {
        /// Owner node id.
        node: String,
        /// The work completion status.
        status: WcStatus,
    },
    /// The RDMA data path was required but cannot be used here.
    #[error("RDMA transport unavailable: {0}")]
    RdmaUnavailable(String),
}
