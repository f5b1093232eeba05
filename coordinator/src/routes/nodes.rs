//! `/v1/nodes`: register, list, get, remove, heartbeat.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use rdma_transport::coordinator::api::{NodeInfo, NodeRegistration};

use crate::clock::now_unix_ms;
use crate::error::ApiError;
use crate::extract::{ApiJson, ApiPath};
use crate::state::AppState;
use crate::validate;

/// `GET /v1/nodes`.
pub(super) async fn list(State(state): State<AppState>) -> Result<Json<Vec<NodeInfo>>, ApiError> {
    let records = state.store().nodes().await?;
    Ok(Json(records.iter().map(|r| state.info(r)).collect()))
}

/// `GET /v1/nodes/{id}`.
pub(super) async fn get(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<NodeInfo>, ApiError> {
    validate::node_id(&id)?;
    let found = state.store().node(&id).await?;
    found
        .map(|record| Json(state.info(&record)))
        .ok_or_else(|| ApiError::NotFound("node is not registered".to_owned()))
}

/// `PUT /v1/nodes/{id}`.
pub(super) async fn register(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(registration): ApiJson<NodeRegistration>,
) -> Result<Json<NodeInfo>, ApiError> {
    validate::node_id(&id)?;
    validate::registration(&registration)?;
    let now_ms = now_unix_ms();
    let record = state
        .store()
        .upsert_node(&id, &registration, now_ms)
        .await?;
    tracing::info!(node = %record.id, tcp_addr = %record.tcp_addr, "node registered");
    Ok(Json(state.info(&record)))
}

/// `DELETE /v1/nodes/{id}`.
pub(super) async fn remove(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    validate::node_id(&id)?;
    let removed = state.store().delete_node(&id).await?;
    if removed {
        tracing::info!(node = %id, "node removed with its ranges");
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound(format!("node {id:?} is not registered")))
    }
}

/// `POST /v1/nodes/{id}/heartbeat`.
pub(super) async fn heartbeat(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<NodeInfo>, ApiError> {
    validate::node_id(&id)?;
    let now_ms = now_unix_ms();
    let updated = state.store().heartbeat(&id, now_ms).await?;
    if updated.is_some() {
        state.metrics().lease_renewed();
    }
    updated
        .map(|record| Json(state.info(&record)))
        .ok_or_else(|| ApiError::NotFound(format!("node {id:?} is not registered")))
}
