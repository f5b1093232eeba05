//! Verbs (libibverbs) bindings and safe wrappers.
//!
//! libibverbs is opened with `dlopen("libibverbs.so.1")` at run time
//! ([`Verbs::load`]), never linked, so a binary that uses this module starts
//! on a host without rdma-core and only fails when it asks for RDMA.
//!
//! The safe types follow rust-ibverbs: raw pointers live only in private
//! `*Inner` structs, public types wrap `Arc<Inner>`, and each child keeps its
//! parent alive (MR -> PD -> context -> library), so a context, PD, CQ, QP and
//! MR can sit together in one struct. Every object's `Drop` calls its destroy
//! verb and logs (never panics) when that fails.
//!
//! ```no_run
//! use rdma_transport::verbs::{AccessFlags, Context, QpCaps, Verbs};
//!
//! # fn main() -> Result<(), rdma_transport::verbs::VerbsError> {
//! let verbs = Verbs::load()?;
//! let ctx = Context::open(&verbs, None)?; // first device
//! let pd = ctx.alloc_pd()?;
//! let cq = ctx.create_cq(256, None, 0)?;
//! let qp = pd.create_rc_qp(&cq, &cq, &QpCaps::default())?;
//! qp.modify_to_init(1, AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ)?;
//! # Ok(())
//! # }
//! ```
//!
//! `generated` is bindgen output (rerun `scripts/gen-verbs-bindings.sh`, never
//! edit it); it is public so callers can reach fields this wrapper does not
//! expose, but the safe types are the supported API.

mod context;
mod cq;
mod device;
mod endpoint;
mod error;
mod gid;
mod loader;
mod mr;
mod mw;
mod pd;
mod qp;
mod wr;

/// bindgen output for `<infiniband/verbs.h>` (dynamic-loading mode).
#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    missing_debug_implementations,
    unsafe_op_in_unsafe_fn,
    unused_qualifications,
    clippy::all,
    clippy::pedantic,
    clippy::undocumented_unsafe_blocks,
    clippy::multiple_unsafe_ops_per_block,
    clippy::unwrap_used,
    clippy::expect_used
)]
pub mod generated;

pub use context::{Context, DeviceAttr, LinkLayer, PortAttr, PortState};
pub use cq::{CompletionChannel, CompletionQueue, WcOpcode, WcStatus, WorkCompletion};
pub use device::{list_devices, DeviceInfo};
pub use endpoint::QpEndpoint;
pub use error::{destroy_failures, VerbsError};
pub use gid::{find_roce_v2_ipv4_gid_index, find_roce_v2_ipv4_gid_index_sysfs, Gid, GidType};
pub use loader::{Verbs, LIBIBVERBS};
pub use mr::{AccessFlags, MemoryRegion};
pub use mw::MemoryWindow;
pub use pd::ProtectionDomain;
pub use qp::{Mtu, QpCaps, QpState, QueuePair, RtrParams, RtsParams};
pub use wr::{RecvWr, SendWr, Sge};
