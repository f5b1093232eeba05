//! The coherence protocol for guest memory shared by several hypervisor
//! nodes: single writer / many readers per page, with the page's home
//! (the page-server that owns its range) as the directory.
//!
//! Pure state machines, no I/O, no threads, no allocation: [`HomePage`] is
//! one page's directory entry at its home, [`NodePage`] one page's state on
//! a node. Each transition takes a message (or a fault, a timer, a node
//! loss) and returns a short list of things to do, which the caller carries
//! out in order. The protocol, its reasoning and what is model-checked are in
//! `docs/coherence.md`; the model (stateright) is in `src/model/` and runs
//! with `cargo test -p coherence`.
#![forbid(unsafe_code)]

pub mod home;
pub mod list;
pub mod messages;
pub mod node;

#[cfg(test)]
mod model;
#[cfg(test)]
mod tests;

pub use home::{Directory, HomeAction, HomeActions, HomeConfig, HomePage, HomeStats};
pub use list::List;
pub use messages::{Access, Mode, NodeId, NodeSet, ReqId, Seq, ToHome, ToNode, Version};
pub use node::{Fault, LocalCopy, NodeAction, NodeActions, NodeConfig, NodePage, NodeStats};
