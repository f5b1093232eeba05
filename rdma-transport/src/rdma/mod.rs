//! The RDMA data path: one RC QP per page-server, RDMA READs into and
//! WRITEs from frames of the page pool (registered once as one MR), batches
//! posted as one chain with only the last request signaled, completions
//! matched by `wr_id`.
//!
//! QP endpoints are exchanged in the HELLO handshake of the page-server's
//! TCP connection, which then stays open as the control channel: its EOF
//! means the page-server is gone. A failed work request (bad rkey, peer
//! gone, retry exceeded) fails the requests it affects with a typed error and
//! tears the QP down on both sides; the next request builds a new one.
//!
//! Caller memory registered with `TransportManager::register_memory` is
//! read into and written from directly (`registry.rs`): no pool frame.
//!
//! [`PortInfo`] and [`connect_qp`] are public so that the page-server sets
//! its QPs up with exactly the same parameters.

mod channel;
mod connection;
mod credits;
mod deadline;
mod device;
mod poller;
mod port;
mod registry;

pub use channel::{
    ChannelError, ChannelStats, MessageChannel, Woken, CHANNEL_SLOTS, CHANNEL_SLOT_BYTES,
};
pub(crate) use connection::{
    code_status, dial_rdma, wait, DialError, Dialed, PageOp, RdmaConnection, MAX_BATCH,
};
pub(crate) use deadline::Deadline;
pub(crate) use device::ClientDevice;
pub(crate) use poller::RdmaPollers;
pub use port::{
    connect_qp, random_psn, PortInfo, QpTimeouts, ReadDepths, MAX_RD_ATOMIC, QP_MIN_RNR_TIMER,
    QP_RETRY_CNT, QP_RNR_RETRY, QP_TIMEOUT,
};
pub(crate) use registry::RegionTable;
pub use registry::{RegisterError, RegisteredMemory};
