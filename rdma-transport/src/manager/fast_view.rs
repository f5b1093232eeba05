//! What a one-page request needs, in one snapshot: the installed map, the
//! connection each of its nodes had, and the table of registered caller
//! memory. A one-page request loads this one `arc_swap` guard instead of
//! three (map, link, regions): under emulation each guard's load and drop
//! costs about 90 instructions, several percent of a SoftRoCE READ.
//!
//! The view is published again after every change of what it holds (a map
//! installed, a connection made or forgotten, memory registered or
//! unregistered), always from the values current under `view_lock`, so
//! the last publication reflects every change. A request that loads the
//! view between a change and its publication sees what a request that
//! loaded the three pieces just before the change saw: a link that broke
//! (it takes the general path), a region not yet there (a pool frame), or
//! one being unregistered (its registration stays valid while the view
//! holds it, as a request's own snapshot kept it before).

use std::sync::Arc;

use super::link::Link;
use super::map_state::MapState;
use super::Inner;
use crate::rdma::RegionTable;

/// One published snapshot (see the module comment).
#[derive(Debug, Default)]
pub(super) struct FastView {
    pub(super) state: Arc<MapState>,
    /// `links[i]`: the connection of `state.nodes[i]` when published.
    pub(super) links: Vec<Option<Arc<Link>>>,
    /// Registered caller memory (RDMA only).
    pub(super) regions: Option<Arc<RegionTable>>,
}

impl FastView {
    /// The connection of node `index`, when it had one.
    pub(super) fn link(&self, index: usize) -> Option<&Link> {
        self.links.get(index)?.as_deref()
    }
}

impl Inner {
    /// Publishes the view from the current map, links and regions. Call it
    /// after every change of any of them.
    pub(super) fn publish_view(&self) {
        let _publisher = self.view_lock.lock();
        let state = self.state.load_full();
        let links = state.nodes.iter().map(|n| n.conn.load_full()).collect();
        let regions = self
            .rdma
            .as_ref()
            .map(|rdma| rdma.device.registry.current_full());
        self.view.store(Arc::new(FastView {
            state,
            links,
            regions,
        }));
    }

    /// Drops the view's hold on every connection (the manager is closing).
    pub(super) fn clear_view(&self) {
        let _publisher = self.view_lock.lock();
        self.view.store(Arc::default());
    }
}
