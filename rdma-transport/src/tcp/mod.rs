//! The TCP data path: client connections to page-servers, the reading of
//! answers (by waiting callers or pollers) and the poller threads.

#[cfg(test)]
mod broken_tests;
mod connection;
mod deferred;
mod free_slots;
mod inflight;
mod poller;
mod receive;
#[cfg(test)]
mod sigpipe_tests;
#[cfg(test)]
mod wait_tests;
mod wire_order;

pub(crate) use connection::{Request, TcpConnection, MAX_CHUNK};
pub(crate) use inflight::{ReadyHook, Waiter, CODE_CHECKSUM, CODE_CONN_LOST, CODE_PROTOCOL};
pub(crate) use poller::Pollers;
pub(crate) use receive::wait;

// The RDMA data path reuses the request table, the waiter and the HELLO.
pub(crate) use connection::{dial, handshake, ClientAuth, ConnectError};
pub(crate) use inflight::{Claim, Inflight, SLOTS};
