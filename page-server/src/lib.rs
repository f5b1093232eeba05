//! The page-server: exports a region of this node's memory to the other
//! nodes over the page wire protocol (`rdma_transport::wire`), registers the
//! node and its GPA ranges (one or several, laid out one after the other in
//! the exported memory: `layout.rs`) with the coordinator and keeps its
//! lease alive.
//!
//! [`spawn`] runs one in-process (the bench and tests do); `main.rs` is the
//! daemon.

mod acceptor;
mod admission;
mod client_id_clashes;
mod client_keys;
mod coherence_channel;
mod coherence_home;
mod config;
mod connection;
mod conns;
mod duration_histogram;
mod handshake;
mod held_ranges;
mod layout;
mod limits;
mod listener;
mod metrics;
mod metrics_http;
mod node_exit;
mod other_processes;
mod outbound;
mod page_sums;
mod prefetch;
mod range_contents;
mod rdma;
mod readiness;
mod recovery;
mod recovery_guard;
mod registration;
mod restart_grace;
mod self_fence;
mod server;
mod spin;
mod stats;

pub use client_keys::{ClientKeyKind, ClientKeys};
pub use coherence_home::CoherenceStats;
pub use config::ServerConfig;
pub use held_ranges::StateDirError;
pub use layout::{ExportedRange, Layout, LayoutError, PlacedRange};
pub use rdma::{ClientKeyInfo, RdmaOptions};
pub use server::{spawn, RunningServer, ServerError};
pub use stats::ServerStats;
