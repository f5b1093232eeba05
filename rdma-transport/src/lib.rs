//! Remote-memory paging transport for a distributed hypervisor.
//!
//! A [`TransportManager`] owns a pre-registered [`PagePool`] and one
//! connection per remote node. It resolves a guest-physical address (GPA) to
//! its owner through the coordinator's map (cached locally) and reads and
//! writes 4 KiB pages over RDMA or TCP behind one API.
//!
//! `lib.rs` only declares modules and re-exports; see `docs/architecture.md`.
#![cfg_attr(not(test), warn(clippy::unwrap_used, clippy::expect_used))]
#![deny(clippy::print_stdout, clippy::print_stderr)]

pub mod auth;
pub mod coherent;
mod config;
pub mod coordinator;
pub mod dead_peer;
mod error;
pub mod gpa_map;
pub mod guest_memory;
pub mod ids;
pub mod log_limit;
mod manager;

pub mod page;
mod parking;
pub mod pool;
pub mod rdma;
pub mod region;
pub mod size;
mod sys;
mod tcp;
#[cfg(test)]
mod testing;
pub mod uffd;
pub mod verbs;
pub mod wire;

pub use config::{DataPath, ManagerConfig, PollMode, TransportKind};
pub use error::TransportError;
pub use gpa_map::GpaMap;
pub use manager::{
    Completion, CompletionCallback, CompletionQueue, ManagerStats, Reap, TransportManager,
    ZeroCopyStats,
};
pub use page::{Page, PAGE_SIZE};
pub use pool::{PageFrame, PagePool};
pub use rdma::{RegisterError, RegisteredMemory};
