//! `/v1/map` and `/v1/resolve`: the GPA ownership map.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use rdma_transport::coordinator::api::{MapEntry, MapResponse, RangeRequest, ResolveResponse};
use serde::Deserialize;

use crate::auth::Caller;
use crate::backend::{AddOutcome, Snapshot};
use crate::error::ApiError;
use crate::extract::{ApiJson, ApiPath, ApiQuery};
use crate::state::AppState;
use crate::validate::{self, u64_param};

/// A long poll waits this long when the request names no `timeout_ms`.
pub(crate) const DEFAULT_LONG_POLL_MS: u64 = 30_000;
/// A long poll waits at most this long, whatever it asks.
pub(crate) const MAX_LONG_POLL_MS: u64 = 60_000;

/// Query of `GET /v1/map`.
#[derive(Debug, Deserialize)]
pub(super) struct MapQuery {
    after: Option<String>,
    timeout_ms: Option<String>,
}

/// `GET /v1/map`; with `after=V`, a long poll: answers once the version
/// passes `V`, or with the unchanged map after `timeout_ms` (default
/// [`DEFAULT_LONG_POLL_MS`], capped at [`MAX_LONG_POLL_MS`]).
pub(super) async fn get_map(
    State(state): State<AppState>,
    ApiQuery(query): ApiQuery<MapQuery>,
) -> Result<Json<MapResponse>, ApiError> {
    let wait = long_poll(&query)?;
    let mut versions = state.store().versions();
    let mut snapshot = state.store().snapshot().await?;
    if let Some((after, timeout_ms)) = wait {
        let _waiting = state.metrics().long_poll_waiting();
        let deadline = tokio::time::Instant::now() + Duration::from_millis(timeout_ms);
        // Each turn waits for a newer announced version, then reads the
        // map; the deadline bounds the turns. An answer whose version has
        // not passed `after` is read at or after the deadline, so a client
        // knows its map was current at least `timeout_ms` after it asked.
        while snapshot.version <= after && tokio::time::Instant::now() < deadline {
            // Whether the store stopped announcing versions. (The version's
            // borrow is dropped inside: it must not live across an await.)
            let newer = async {
                let outcome =
                    tokio::time::timeout_at(deadline, versions.wait_for(|v| *v > after)).await;
                matches!(outcome, Ok(Err(_)))
            };
            let (closed, stopping) = tokio::select! {
                closed = newer => (closed, false),
                () = state.stopping() => (false, true),
            };
            if stopping {
                // The server stops: answer now rather than hold up its
                // shutdown (an early answer confirms nothing beyond the time
                // of the request).
                snapshot = state.store().snapshot().await?;
                break;
            }
            if closed {
                // The store announces no more versions: answer at the
                // deadline, as a quiet map would.
                tokio::time::sleep_until(deadline).await;
            }
            snapshot = state.store().snapshot().await?;
        }
    }
    Ok(Json(map_response(&state, snapshot)))
}

fn map_response(state: &AppState, snapshot: Snapshot) -> MapResponse {
    MapResponse {
        version: snapshot.version,
        generation: state.store().generation(),
        entries: snapshot.entries,
        nodes: snapshot.nodes.iter().map(|r| state.info(r)).collect(),
    }
}

/// The `(after, timeout_ms)` of a long poll, `None` for a plain read.
fn long_poll(query: &MapQuery) -> Result<Option<(u64, u64)>, ApiError> {
    let timeout_ms = match &query.timeout_ms {
        None => DEFAULT_LONG_POLL_MS,
        Some(text) => u64_param("timeout_ms", text)?,
    };
    let Some(text) = &query.after else {
        return Ok(None);
    };
    let after = u64_param("after", text)?;
    Ok(Some((after, timeout_ms.min(MAX_LONG_POLL_MS))))
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
    let (entry, outcome) = state.store().add_range(&request).await?;
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
        .store()
        .remove_range(gpa_start, owner.as_deref())
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
    let entry = state.store().reinitialise_range(gpa_start).await?;
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
    let gpa = u64_param("gpa", &text)?;
    let found = state.store().resolve(gpa).await?;
    let (version, entry, node) =
        found.ok_or_else(|| ApiError::NotFound(format!("gpa {gpa:#x} is not mapped")))?;
    Ok(Json(ResolveResponse {
        gpa,
        version,
        entry,
        node: state.info(&node),
    }))
}
