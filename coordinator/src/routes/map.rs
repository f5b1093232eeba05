//! `/v1/map` and `/v1/resolve`: the GPA ownership map.

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use rdma_transport::coordinator::api::{MapEntry, MapResponse, RangeRequest, ResolveResponse};
use serde::Deserialize;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::extract::{ApiJson, ApiPath, ApiQuery};
use crate::state::AppState;
use crate::store::AddOutcome;
use crate::validate::{self, parse_u64};

/// `GET /v1/map`.
pub(super) async fn get_map(State(state): State<AppState>) -> Result<Json<MapResponse>, ApiError> {
    let snapshot = state.db(|store| store.snapshot()).await?;
    Ok(Json(MapResponse {
        version: snapshot.version,
        entries: snapshot.entries,
        nodes: snapshot.nodes.iter().map(|r| state.info(r)).collect(),
    }))
}

/// `POST /v1/map`: 201 for a new range or a new replica of one, 200 when
/// the node's replica of the range was refreshed.
pub(super) async fn add_range(
    State(state): State<AppState>,
    caller: Caller,
    ApiJson(request): ApiJson<RangeRequest>,
) -> Result<(StatusCode, Json<MapEntry>), ApiError> {
    caller.check_may_change(&request.node_id)?;
    validate::range(&request)?;
    let (entry, outcome) = state.db(move |store| store.add_range(&request)).await?;
    tracing::info!(
        gpa_start = entry.gpa_start,
        length_bytes = entry.length_bytes,
        node = %entry.node_id,
        ?outcome,
        "range mapped"
    );
    let status = match outcome {
        AddOutcome::Created => StatusCode::CREATED,
        AddOutcome::Updated => StatusCode::OK,
    };
    Ok((status, Json(entry)))
}

/// `DELETE /v1/map/{gpa_start}` (decimal or `0x` hex). A node removes only
/// its replica (the range goes with its last one); admin the whole range.
pub(super) async fn remove_range(
    State(state): State<AppState>,
    caller: Caller,
    ApiPath(text): ApiPath<String>,
) -> Result<StatusCode, ApiError> {
    let gpa_start = validate::gpa_start(&text)?;
    let owner = caller.owner_scope().map(str::to_owned);
    let removed = state
        .db(move |store| store.remove_range(gpa_start, owner.as_deref()))
        .await?;
    if removed {
        tracing::info!(gpa_start, "range or replica unmapped");
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::NotFound(format!(
            "no range starts at {gpa_start:#x}"
        )))
    }
}

/// `POST /v1/map/{gpa_start}/reinitialise` (admin only): a `lost` range's
/// contents are its holders' memory as it is now (zeros after a restart),
/// so clients serve it again. The operator's answer to a `lost` range; a
/// range with a live replica is returned unchanged.
pub(super) async fn reinitialise_range(
    State(state): State<AppState>,
    ApiPath(text): ApiPath<String>,
) -> Result<Json<MapEntry>, ApiError> {
    let gpa_start = validate::gpa_start(&text)?;
    let entry = state
        .db(move |store| store.reinitialise_range(gpa_start))
        .await?;
    tracing::warn!(
        gpa_start,
        node = %entry.node_id,
        valid_epoch = entry.valid_epoch,
        "range re-initialised unless live: its contents are the holders' memory as it is now"
    );
    Ok(Json(entry))
}

/// Query of `GET /v1/resolve`.
#[derive(Debug, Deserialize)]
pub(super) struct ResolveQuery {
    gpa: Option<String>,
}

/// `GET /v1/resolve?gpa=N`.
pub(super) async fn resolve(
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<ResolveQuery>,
) -> Result<Json<ResolveResponse>, ApiError> {
    let text = query
        .gpa
        .ok_or_else(|| ApiError::BadRequest("missing query parameter gpa".to_owned()))?;
    let gpa = parse_u64(&text).ok_or_else(|| {
        ApiError::BadRequest(format!("gpa {text:?} is not a decimal or 0x-hex u64"))
    })?;
    let found = state.db(move |store| store.resolve(gpa)).await?;
    let (version, entry, node) =
        found.ok_or_else(|| ApiError::NotFound(format!("gpa {gpa:#x} is not mapped")))?;
    Ok(Json(ResolveResponse {
        gpa,
        version,
        entry,
        node: state.info(&node),
    }))
}
