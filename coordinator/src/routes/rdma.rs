//! `/v1/nodes/{id}/rdma/endpoint` (also served without `/v1`, as in the
//! seed plan): publish and read a node's RDMA endpoint.

use axum::extract::State;
use axum::Json;
use rdma_transport::coordinator::api::{NodeInfo, RdmaEndpoint};

use crate::error::ApiError;
use crate::extract::{ApiJson, ApiPath};
use crate::state::AppState;
use crate::validate;

/// `POST .../nodes/{id}/rdma/endpoint`: sets the endpoint; answers the node.
pub(super) async fn set_endpoint(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiJson(endpoint): ApiJson<RdmaEndpoint>,
) -> Result<Json<NodeInfo>, ApiError> {
    validate::node_id(&id)?;
    validate::rdma_endpoint(&endpoint)?;
    let updated = state.store().set_rdma_endpoint(&id, &endpoint).await?;
    let record =
        updated.ok_or_else(|| ApiError::NotFound(format!("node {id:?} is not registered")))?;
    tracing::info!(node = %record.id, "RDMA endpoint published");
    Ok(Json(state.info(&record)))
}

/// `GET .../nodes/{id}/rdma/endpoint`.
pub(super) async fn get_endpoint(
    State(state): State<AppState>,
    ApiPath(id): ApiPath<String>,
) -> Result<Json<RdmaEndpoint>, ApiError> {
    validate::node_id(&id)?;
    let found = state.store().node(&id).await?;
    match found {
        None => Err(ApiError::NotFound(format!("node {id:?} is not registered"))),
        Some(record) => record.rdma.map(Json).ok_or_else(|| {
            ApiError::NotFound(format!("node {id:?} has published no RDMA endpoint"))
        }),
    }
}
