//! Reading a request body within the body timeout, so that a client that
//! sends its head and then trickles (or never sends) the body cannot hold a
//! connection and a handler for long.

use std::time::Duration;

use axum::body::{to_bytes, Body};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use http_body_util::LengthLimitError;

use crate::error::ApiError;
use crate::server::MAX_BODY_BYTES;
use crate::state::AppState;

/// Middleware: buffers the whole body (at most [`MAX_BODY_BYTES`]) within
/// the configured body timeout; 408 when it is late, 413 when it is too big.
pub(crate) async fn read_body_in_time(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let timeout_ms = state.body_timeout_ms();
    let (parts, body) = request.into_parts();
    let read = tokio::time::timeout(
        Duration::from_millis(timeout_ms),
        to_bytes(body, MAX_BODY_BYTES),
    );
    match read.await {
        Ok(Ok(bytes)) => {
            next.run(Request::from_parts(parts, Body::from(bytes)))
                .await
        }
        Ok(Err(error)) => {
            if error.into_inner().is::<LengthLimitError>() {
                ApiError::PayloadTooLarge {
                    limit_bytes: MAX_BODY_BYTES,
                }
                .into_response()
            } else {
                ApiError::BadRequest("the request body could not be read".to_owned())
                    .into_response()
            }
        }
        Err(_elapsed) => ApiError::BodyTimeout { timeout_ms }.into_response(),
    }
}
