//! Errors: [`ApiError`] becomes a JSON [`ErrorBody`] answer; [`ServeError`]
//! is what starting or running the service can fail with.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use rdma_transport::coordinator::api::ErrorBody;

use crate::store::StoreError;

/// A refused or failed request. Every variant answers with a JSON
/// [`ErrorBody`]; only [`ApiError::Unavailable`] (retry, perhaps through
/// another coordinator) and [`ApiError::Internal`] are 5xx.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("a valid `Authorization: Bearer <credential>` header is required")]
    Unauthorized,
    #[error("{0}")]
    Forbidden(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    MethodNotAllowed(String),
    #[error("{0}")]
    Conflict(String),
    /// A heartbeat from a process of a node that another one replaced.
    #[error("{0}")]
    Superseded(String),
    #[error("request body larger than {limit_bytes} bytes")]
    PayloadTooLarge { limit_bytes: usize },
    #[error("the request body did not arrive within {timeout_ms} ms")]
    BodyTimeout { timeout_ms: u64 },
    #[error("{0}")]
    LimitReached(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            Self::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            Self::Unauthorized => (StatusCode::UNAUTHORIZED, "unauthorized"),
            Self::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            Self::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            Self::MethodNotAllowed(_) => (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
            Self::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            Self::Superseded(_) => (StatusCode::CONFLICT, "superseded"),
            Self::PayloadTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large"),
            Self::BodyTimeout { .. } => (StatusCode::REQUEST_TIMEOUT, "request_timeout"),
            Self::LimitReached(_) => (StatusCode::TOO_MANY_REQUESTS, "limit_reached"),
            Self::Unavailable(_) => (StatusCode::SERVICE_UNAVAILABLE, "unavailable"),
            Self::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        if status.is_server_error() {
            tracing::error!(error = %self, "request failed");
        } else {
            tracing::debug!(%status, error = %self, "request refused");
        }
        let body = ErrorBody {
            error: code.to_owned(),
            message: self.to_string(),
        };
        (status, Json(body)).into_response()
    }
}

impl From<StoreError> for ApiError {
    fn from(error: StoreError) -> Self {
        match error {
            StoreError::UnknownNode(id) => Self::NotFound(format!("node {id:?} is not registered")),
            StoreError::Overlap { existing } => Self::Conflict(format!(
                "range overlaps the entry at gpa_start {:#x} (length_bytes {:#x}, node {:?})",
                existing.gpa_start, existing.length_bytes, existing.node_id
            )),
            StoreError::LimitReached { what, max } => Self::LimitReached(format!(
                "{what} limit reached: at most {max}; remove some first or raise the limit"
            )),
            StoreError::NoRange(gpa_start) => {
                Self::NotFound(format!("no range starts at {gpa_start:#x}"))
            }
            StoreError::NotOwner { gpa_start, owner } => Self::Forbidden(format!(
                "the range at {gpa_start:#x} belongs to node {owner:?}"
            )),
            StoreError::NoReplica { gpa_start, node_id } => Self::NotFound(format!(
                "node {node_id:?} holds no replica of the range at {gpa_start:#x}"
            )),
            error @ StoreError::ReplicaRefused { .. } => Self::Conflict(error.to_string()),
            error @ StoreError::NotCurrentProcess { .. } => Self::Superseded(error.to_string()),
            StoreError::Unavailable(why) => {
                Self::Unavailable(format!("the coordinator's store is unavailable: {why}"))
            }
            other => Self::Internal(format!("database: {other}")),
        }
    }
}

/// Why the coordinator could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServeError {
    /// The configuration cannot be used.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// The database could not be opened or prepared.
    #[error("cannot open database {path:?}")]
    OpenStore {
        /// Database file.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: StoreError,
    },
    /// The etcd cluster could not be reached or prepared.
    #[error("cannot connect to etcd at {endpoints}")]
    ConnectStore {
        /// The endpoints, comma-separated.
        endpoints: String,
        /// What went wrong.
        #[source]
        source: StoreError,
    },
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// The socket error.
        #[source]
        source: io::Error,
    },
    /// The tokio runtime or the server thread could not be started.
    #[error("cannot start the server runtime")]
    Runtime(#[source] io::Error),
    /// Accepting or serving connections failed.
    #[error("serving failed")]
    Serve(#[source] io::Error),
    /// The server thread panicked.
    #[error("the coordinator thread panicked")]
    ThreadPanicked,
}
