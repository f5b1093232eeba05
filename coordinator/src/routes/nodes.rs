//! `/v1/nodes`: register, list, get, remove, heartbeat.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use rdma_transport::coordinator::api::{NodeInfo, NodeRegistration};
use serde::Deserialize;

use crate::clock::now_unix_ms;
use crate::error::ApiError;
use crate::extract::{ApiJson, ApiPath, ApiQuery};
use crate::state::AppState;
use crate::store::StoreError;
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

/// Query of `POST /v1/nodes/{id}/heartbeat`.
#[derive(Debug, Deserialize)]
pub(super) struct HeartbeatQuery {
    /// The epoch of the process that sends it; without it (older
    /// page-servers) the lease is renewed whichever process registered.
    epoch: Option<String>,
}

/// `POST /v1/nodes/{id}/heartbeat[?epoch=E]`: 409 `superseded`, renewing
/// nothing, when `E` is not the node's current epoch (another process of
/// the node registered since).
pub(super) async fn heartbeat(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(query): ApiQuery<HeartbeatQuery>,
) -> Result<Json<NodeInfo>, ApiError> {
    validate::node_id(&id)?;
    let epoch = query
        .epoch
        .map(|text| validate::u64_param("epoch", &text))
        .transpose()?;
    let now_ms = now_unix_ms();
    let beat = state.store().heartbeat(&id, epoch, now_ms).await;
    if let Err(error @ StoreError::NotCurrentProcess { .. }) = &beat {
        state.metrics().heartbeat_superseded();
        tracing::warn!(node = %id, %error, "heartbeat from a replaced process refused");
    }
    let updated = beat?;
    if updated.is_some() {
        state.metrics().lease_renewed();
    }
    updated
        .map(|record| Json(state.info(&record)))
        .ok_or_else(|| ApiError::NotFound(format!("node {id:?} is not registered")))
}
