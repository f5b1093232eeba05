//! Unit tests of the transitions, one scenario each.

mod home;
mod node;

use crate::messages::NodeId;

pub(crate) fn id(n: u8) -> NodeId {
    NodeId::new(n).expect("test node id below 64")
}
