//! What the coordinator client presents in `Authorization: Bearer ...`.

use std::fmt;

use crate::auth::ClusterKey;

use super::api::{is_valid_node_id, NodeId};
use super::error::CoordinatorError;

/// Prefix of a node's bearer value: `node:<id>:<hex credential>`.
pub const NODE_BEARER_PREFIX: &str = "node:";

/// Who the client speaks as. The coordinator accepts:
///
/// * `Node`: `Bearer node:<id>:<hex>` with
///   [`ClusterKey::node_credential`]: reads, and changes to node `id` only;
/// * `Client`: `Bearer <hex>` with [`ClusterKey::client_credential`]: reads;
/// * `Admin`: `Bearer <hex>` with [`ClusterKey::admin_credential`]: all;
/// * `Token`: `Bearer <token>` as given (the coordinator's `--token`);
/// * `None`: no header (an insecure coordinator, or `GET /v1/health`).
///
/// `Debug` never shows a key or token.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum Credential {
    /// No `Authorization` header.
    #[default]
    None,
    /// A bearer token sent as given.
    Token(String),
    /// Node `id` of the cluster with `key`.
    Node {
        /// The node's id.
        id: NodeId,
        /// The cluster key.
        key: ClusterKey,
    },
    /// A read-only client of the cluster with `key`.
    Client {
        /// The cluster key.
        key: ClusterKey,
    },
    /// An operator of the cluster with `key`.
    Admin {
        /// The cluster key.
        key: ClusterKey,
    },
}

impl fmt::Debug for Credential {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::None => f.write_str("None"),
            Self::Token(_) => f.write_str("Token(..)"),
            Self::Node { id, .. } => f
                .debug_struct("Node")
                .field("id", id)
                .finish_non_exhaustive(),
            Self::Client { .. } => f.write_str("Client { .. }"),
            Self::Admin { .. } => f.write_str("Admin { .. }"),
        }
    }
}

impl Credential {
    /// The value after `Bearer `, if any.
    ///
    /// # Errors
    /// [`CoordinatorError::InvalidNodeId`] for a node id the coordinator
    /// would refuse.
    pub fn bearer(&self) -> Result<Option<String>, CoordinatorError> {
        Ok(match self {
            Self::None => None,
            Self::Token(token) => Some(token.clone()),
            Self::Node { id, key } => {
                if !is_valid_node_id(id) {
                    return Err(CoordinatorError::InvalidNodeId(id.clone()));
                }
                Some(format!(
                    "{NODE_BEARER_PREFIX}{id}:{}",
                    key.node_credential(id)
                ))
            }
            Self::Client { key } => Some(key.client_credential()),
            Self::Admin { key } => Some(key.admin_credential()),
        })
    }
}

/// A bearer value that `Debug` does not show.
#[derive(Clone)]
pub(super) struct Bearer(pub(super) String);

impl fmt::Debug for Bearer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Bearer(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_values_and_debug() {
        let key = ClusterKey::generate().expect("key");
        let node = Credential::Node {
            id: "n-1".into(),
            key: key.clone(),
        };
        let bearer = node.bearer().expect("valid").expect("some");
        assert_eq!(bearer, format!("node:n-1:{}", key.node_credential("n-1")));
        assert_eq!(
            Credential::Admin { key: key.clone() }.bearer().expect("ok"),
            Some(key.admin_credential())
        );
        assert_eq!(Credential::None.bearer().expect("ok"), None);
        let bad = Credential::Node {
            id: "a:b".into(),
            key: key.clone(),
        };
        assert!(matches!(
            bad.bearer(),
            Err(CoordinatorError::InvalidNodeId(_))
        ));
        let shown = format!("{node:?} {:?}", Credential::Token("s3cret".into()));
        assert!(!shown.contains("s3cret") && !shown.contains(&key.to_hex()[..8]));
        assert!(shown.contains("n-1"));
    }
}
