//! The manager's side of coherent pages: where a page's home is, and a
//! handshaken connection to it (`crate::coherent`).

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Instant;

use super::epoch::Fenced;
use super::{Inner, TransportManager};
use crate::coherent::{CoherenceConfig, CoherenceHandler, CoherentNode, Dialed, HomeRef, Resolve};
use crate::error::TransportError;
use crate::tcp::{dial, handshake, ClientAuth, ConnectError};
use crate::wire::RdmaHello;

impl TransportManager {
    /// This process as a node of a coherent VM whose pages are homed at the
    /// page-servers of this manager's map; `handler` holds the local copies.
    /// Over RDMA when this manager's data path is (a message channel per
    /// home, `crate::rdma::MessageChannel`), else TCP. See
    /// `docs/coherence.md`.
    pub fn coherent_node(
        &self,
        handler: Arc<dyn CoherenceHandler>,
        config: CoherenceConfig,
    ) -> CoherentNode {
        let node = CoherentNode::new(Arc::new(Resolver(Arc::clone(&self.inner))), handler, config);
        let mut nodes = self.inner.coherent_nodes.lock();
        nodes.retain(|n| n.strong_count() > 0);
        nodes.push(node.watch());
        node
    }
}

impl Inner {
    /// A map was installed: each coherent node leaves every home process
    /// that the map no longer names as that home (another process
    /// registered as it: the one the node talks to was stopped or cut off
    /// past its lease, and the node's copies must go before the new one
    /// grants the pages to others).
    pub(super) fn leave_replaced_homes(&self, map: &crate::gpa_map::GpaMap) {
        let nodes: Vec<_> = self
            .coherent_nodes
            .lock()
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .collect();
        for node in nodes {
            node.leave_replaced_homes(|id| {
                map.nodes().iter().find(|n| n.id == id).map(|n| n.epoch)
            });
        }
    }
}

#[derive(Debug)]
struct Resolver(Arc<Inner>);

impl Resolve for Resolver {
    fn home_of(&self, gpa: u64) -> Result<HomeRef, TransportError> {
        let mut state = self.0.state.load();
        let loc = match state.map.lookup(gpa) {
            Some(loc) => loc,
            None => {
                // A map older than the range (a page-server that claimed
                // it since): refreshed once, as the data path does, rather
                // than failing the fault.
                self.0
                    .refresh_on_miss(Instant::now() + self.0.config.request_timeout());
                state = self.0.state.load();
                state
                    .map
                    .lookup(gpa)
                    .ok_or(TransportError::UnknownGpa { gpa })?
            }
        };
        if loc.replicated {
            // The home keeps write-backs in its own memory only: another
            // replica would serve an older page after a failover.
            return Err(TransportError::Config(format!(
                "GPA {gpa:#x} is in a replicated range: coherent guest memory is not supported \
                 on replicated ranges (write-backs would reach one replica only)"
            )));
        }
        let node = state
            .nodes
            .get(loc.node_index)
            .ok_or(TransportError::UnknownGpa { gpa })?;
        Ok(HomeRef {
            node: node.id.clone(),
            addr: node.addr.clone(),
            offset: loc.remote_offset,
            valid_epoch: loc.valid_epoch,
        })
    }

    fn confirm_epoch(
        &self,
        gpa: u64,
        home: &HomeRef,
        server_epoch: u64,
    ) -> Result<(), TransportError> {
        if super::epoch::serves(home.valid_epoch, server_epoch) {
            return Ok(());
        }
        // The data path's check, with its one map refresh (an operator may
        // have re-initialised the range since this map).
        let state = self.0.state.load();
        let node = state
            .nodes
            .iter()
            .find(|n| n.id == home.node)
            .ok_or(TransportError::UnknownGpa { gpa })?;
        let request = Fenced {
            gpa,
            remote_offset: home.offset,
            valid_epoch: home.valid_epoch,
        };
        let deadline = Instant::now() + self.0.config.request_timeout();
        self.0
            .check_epochs(node, server_epoch, &[request], deadline)
    }

    fn dial(&self, home: &HomeRef, node_bound_ms: NonZeroU32) -> Result<Dialed, TransportError> {
        let inner = &self.0;
        let failed = |err: ConnectError| match err {
            ConnectError::AuthFailed { addr, detail } => TransportError::AuthFailed {
                node: home.node.clone(),
                detail: format!("{addr}: {detail}"),
            },
            other => TransportError::NodeDown {
                node: home.node.clone(),
                reason: other.to_string(),
            },
        };
        // Over RDMA when the data path is: a channel of its own, offered in
        // AUTH with its ring; a home without RDMA answers without it.
        let channel = inner.rdma.as_ref().and_then(|rdma| {
            match rdma.device.message_channel() {
                Ok(ch) => Some((ch, rdma.device.timeouts)),
                Err(err) => {
                    tracing::warn!(node = %home.node, %err, "no RDMA channel for coherence; using TCP");
                    None
                }
            }
        });
        let offer = channel.as_ref().map(|(ch, _)| {
            let ring = ch.ring();
            RdmaHello {
                region_addr: ring.addr,
                rkey: ring.rkey,
                ..ch.hello()
            }
        });
        let auth = ClientAuth {
            client_id: inner.client_id,
            node_id: &home.node,
            key: inner.config.cluster_key.as_ref(),
            // Coherence frames always carry a page's CRC-32C; asking for
            // checksums also asks for offset-bound sums, which bind each
            // frame's sum to its offset and body too (a home that agrees
            // says so in its HELLO_ACK). Off (to reach page-servers from
            // before checksums), frames keep page-only sums.
            checksums: inner.config.page_checksums,
            coherence: offer.is_some(),
            node_bound_ms: Some(node_bound_ms),
            landed_pages: None,
        };
        let mut stream = dial(&home.addr, inner.config.connect_timeout()).map_err(failed)?;
        let ack = handshake(&mut stream, &home.addr, &auth, offer).map_err(failed)?;
        let channel = match (channel, ack.rdma, ack.coherence) {
            (Some((ch, timeouts)), Some(remote), Some(ring)) => {
                ch.connect(&remote, ring, timeouts)
                    .map_err(|err| TransportError::NodeDown {
                        node: home.node.clone(),
                        reason: format!("coherence channel set-up: {err}"),
                    })?;
                Some(Arc::new(ch))
            }
            _ => None,
        };
        Ok(Dialed {
            stream,
            channel,
            bound_sums: ack.bound_sums,
            node_bound_limit_ms: ack.node_bound_limit_ms,
            epoch: ack.epoch,
        })
    }
}
