//! Settings of one coordinator instance.

use std::net::SocketAddr;
use std::path::PathBuf;

/// How to run a coordinator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoordinatorConfig {
    /// Address to listen on; port 0 picks a free port.
    pub listen: SocketAddr,
    /// SQLite database file; created when missing.
    pub db_path: PathBuf,
    /// When set, every write (PUT, POST, DELETE) needs
    /// `Authorization: Bearer <token>`. Must not be empty.
    pub token: Option<String>,
    /// A node is alive while its last heartbeat is younger than this.
    pub lease_ms: u64,
}

impl CoordinatorConfig {
    /// Lease used when none is given.
    pub const DEFAULT_LEASE_MS: u64 = 3000;

    /// A configuration without token and with [`Self::DEFAULT_LEASE_MS`].
    pub fn new(listen: SocketAddr, db_path: impl Into<PathBuf>) -> Self {
        Self {
            listen,
            db_path: db_path.into(),
            token: None,
            lease_ms: Self::DEFAULT_LEASE_MS,
        }
    }
}
