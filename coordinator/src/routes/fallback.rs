//! JSON answers for unknown paths and unsupported methods.

use axum::http::{Method, Uri};

use crate::error::ApiError;

/// Any path that matches no route.
pub(super) async fn not_found(method: Method, uri: Uri) -> ApiError {
    ApiError::NotFound(format!("no route for {method} {}", uri.path()))
}

/// A known path asked with a method it does not serve.
pub(super) async fn method_not_allowed(method: Method, uri: Uri) -> ApiError {
    ApiError::MethodNotAllowed(format!("{method} is not served on {}", uri.path()))
}
