//! `GET /v1/health`.

use axum::Json;
use rdma_transport::coordinator::api::HealthResponse;

/// Answers `{"status":"ok"}` while the service runs.
pub(super) async fn health() -> Json<HealthResponse> {
    Json(HealthResponse {
        status: "ok".to_owned(),
    })
}
