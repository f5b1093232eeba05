//! The manager's side of coherent pages: where a page's home is, and a
//! handshaken connection to it (`crate::coherent`).

use std::net::TcpStream;
use std::sync::Arc;

use super::{Inner, TransportManager};
use crate::coherent::{CoherenceConfig, CoherenceHandler, CoherentNode, HomeRef, Resolve};
use crate::error::TransportError;
use crate::tcp::{dial, handshake, ClientAuth, ConnectError};

impl TransportManager {
    /// This process as a node of a coherent VM whose pages are homed at the
    /// page-servers of this manager's map; `handler` holds the local copies.
    /// Over TCP only (a manager configured for RDMA still uses TCP for
    /// coherence). See `docs/coherence.md`.
    pub fn coherent_node(
        &self,
        handler: Arc<dyn CoherenceHandler>,
        config: CoherenceConfig,
    ) -> CoherentNode {
        CoherentNode::new(Arc::new(Resolver(Arc::clone(&self.inner))), handler, config)
    }
}

#[derive(Debug)]
struct Resolver(Arc<Inner>);

impl Resolve for Resolver {
    fn home_of(&self, gpa: u64) -> Result<HomeRef, TransportError> {
        let state = self.0.state.load();
        let loc = state
            .map
            .lookup(gpa)
            .ok_or(TransportError::UnknownGpa { gpa })?;
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
        })
    }

    fn dial(&self, home: &HomeRef) -> Result<TcpStream, TransportError> {
        let inner = &self.0;
        let auth = ClientAuth {
            client_id: inner.client_id,
            node_id: &home.node,
            key: inner.config.cluster_key.as_ref(),
            checksums: false,
        };
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
        let mut stream = dial(&home.addr, inner.config.connect_timeout()).map_err(failed)?;
        handshake(&mut stream, &home.addr, &auth, None).map_err(failed)?;
        Ok(stream)
    }
}
