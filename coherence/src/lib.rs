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
//!
//! ```
//! use coherence::*;
//!
//! let (mut home_stats, mut node_stats) = (HomeStats::default(), NodeStats::default());
//! let mut home = HomePage::new(HomeConfig::default());
//! let mut page = NodePage::new(NodeConfig::new(100));
//! let node = NodeId::new(1).unwrap();
//!
//! // A write fault on node 1: one request to the home.
//! let Fault::Wait { send: Some(request) } = page.on_fault(Access::Write, &mut node_stats) else {
//!     panic!("a first fault sends a request");
//! };
//! // The home grants ownership at once (nobody else holds the page).
//! let answers = home.on_message(node, request, &mut home_stats);
//! let Some(HomeAction::Send { to, msg }) = answers.iter().next() else {
//!     panic!("one grant");
//! };
//! assert_eq!(to, node);
//! // The node fetches the page, maps it writable and wakes the fault.
//! let todo: Vec<_> = page.on_message(msg, 0, &mut node_stats).iter().collect();
//! assert_eq!(
//!     todo,
//!     [
//!         NodeAction::Fetch { data_version: 0 },
//!         NodeAction::Map(Mode::Exclusive),
//!         NodeAction::Wake(Access::Write),
//!     ]
//! );
//! assert_eq!(page.on_fault(Access::Write, &mut node_stats), Fault::Hit);
//! ```
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
pub use node::{
    Fault, LocalCopy, NodeAction, NodeActions, NodeConfig, NodePage, NodeStats, RETRY_FIRST_US,
    RETRY_MAX_US,
};
