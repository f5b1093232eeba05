//! Errors of the coordinator client.

/// What can go wrong when talking to the coordinator.
///
/// Answers with an error status are folded into [`CoordinatorError::Http`];
/// use [`is_not_found`](Self::is_not_found), [`is_conflict`](Self::is_conflict)
/// and friends to tell them apart.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CoordinatorError {
    /// The base URL given to the client cannot be used.
    #[error("invalid coordinator URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// Why it was refused.
        reason: String,
    },
    /// A node id that the coordinator would refuse; not sent.
    #[error("invalid node id {0:?}: use 1 to 64 characters of [A-Za-z0-9_.-]")]
    InvalidNodeId(String),
    /// The HTTP client could not be built (e.g. no TLS backend, bad settings).
    #[error("cannot build the HTTP client")]
    Client(#[source] reqwest::Error),
    /// The coordinator could not be reached, or did not answer in time.
    #[error("coordinator unreachable at {url}")]
    Unreachable {
        /// The URL of the failed request.
        url: String,
        /// The transport error (connect refused, timeout, reset, ...).
        #[source]
        source: reqwest::Error,
    },
    /// The coordinator answered with an error status.
    #[error("coordinator answered {status} ({code}): {message}")]
    Http {
        /// HTTP status code.
        status: u16,
        /// Machine-readable code from the error body (e.g. `not_found`), or
        /// `http_<status>` when the body was not a JSON error body.
        code: String,
        /// Human-readable explanation from the error body.
        message: String,
    },
    /// A request body could not be serialised (not expected with the API types).
    #[error("cannot encode the request body")]
    Encode(#[source] serde_json::Error),
    /// The coordinator answered success with a body that is not the expected JSON.
    #[error("cannot decode the coordinator's answer from {url}")]
    Decode {
        /// The URL of the request.
        url: String,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
}

impl CoordinatorError {
    /// HTTP status of an error answer, if this is one.
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Http { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// True for a 404 answer (unknown node, unmapped address, no endpoint).
    pub fn is_not_found(&self) -> bool {
        self.status() == Some(404)
    }

    /// True for a 409 answer (the range overlaps another one).
    pub fn is_conflict(&self) -> bool {
        self.status() == Some(409)
    }

    /// True for a 409 `superseded` answer: a heartbeat named an epoch that
    /// is not the node's current one (another process of the node
    /// registered since).
    pub fn is_superseded(&self) -> bool {
        matches!(self, Self::Http { status: 409, code, .. } if code == "superseded")
    }

    /// True for a 401 answer (missing or wrong credential).
    pub fn is_unauthorized(&self) -> bool {
        self.status() == Some(401)
    }

    /// True for a 403 answer (a valid credential that may not do this, e.g.
    /// a node changing another node, or a read-only client writing).
    pub fn is_forbidden(&self) -> bool {
        self.status() == Some(403)
    }

    /// True for a 429 answer (a coordinator limit such as the node or range
    /// count is reached).
    pub fn is_limited(&self) -> bool {
        self.status() == Some(429)
    }

    /// True for a 400 answer (the request was refused as malformed).
    pub fn is_bad_request(&self) -> bool {
        self.status() == Some(400)
    }

    /// True when the coordinator could not be reached; retrying may help.
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Self::Unreachable { .. })
    }
}
