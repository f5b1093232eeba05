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

pub mod coordinator;
pub mod verbs;
