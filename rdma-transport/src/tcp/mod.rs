//! The TCP data path: client connections to page-servers and the pollers
//! that complete their requests.

mod connection;
mod inflight;
mod poller;

pub(crate) use connection::{Request, TcpConnection, MAX_CHUNK};
pub(crate) use inflight::{Waiter, CODE_CONN_LOST, CODE_PROTOCOL};
pub(crate) use poller::Pollers;
