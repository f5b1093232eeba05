//! `/v1/map/{gpa_start}/replicas/{node_id}/...`: a replica goes stale when
//! it missed a write, recovers (copies the range from a live replica) and
//! is live again.

use axum::extract::State;
use axum::Json;
use rdma_transport::coordinator::api::{MapEntry, RecoveryBegin, RecoveryDone, ReplicaChange};

use crate::backend::ReplicaOp;
use crate::error::ApiError;
use crate::extract::{ApiJson, ApiPath};
use crate::state::AppState;
use crate::validate;

/// Parses the path's `gpa_start` and `node_id`, then runs one replica
/// change on the store; returns the range start, the new map version and
/// the entry.
async fn change(
    state: &AppState,
    gpa_text: &str,
    node_id: &str,
    op: ReplicaOp,
) -> Result<(u64, u64, MapEntry), ApiError> {
    let gpa_start = validate::gpa_start(gpa_text)?;
    validate::node_id(node_id)?;
    let (version, entry) = state.store().change_replica(gpa_start, node_id, op).await?;
    Ok((gpa_start, version, entry))
}

/// `POST /v1/map/{gpa_start}/replicas/{node_id}/stale` (admin or client
/// credential): the replica missed a write. 409 when it is the range's
/// only live replica.
pub(super) async fn mark_stale(
    State(state): State<AppState>,
    ApiPath((gpa_text, node_id)): ApiPath<(String, String)>,
) -> Result<Json<ReplicaChange>, ApiError> {
    let (gpa_start, version, entry) =
        change(&state, &gpa_text, &node_id, ReplicaOp::MarkStale).await?;
    tracing::warn!(gpa_start, node = %node_id, version, "replica marked stale");
    Ok(Json(ReplicaChange {
        version,
        generation: state.store().generation(),
        entry,
    }))
}

/// `POST /v1/map/{gpa_start}/replicas/{node_id}/recovering` with a
/// [`RecoveryBegin`] (admin or that node): the node's process in that epoch
/// starts copying the range from a live replica. 409 when the replica is
/// live, no other one is, or the epoch is not the node's current one.
pub(super) async fn begin_recovery(
    State(state): State<AppState>,
    ApiPath((gpa_text, node_id)): ApiPath<(String, String)>,
    ApiJson(begin): ApiJson<RecoveryBegin>,
) -> Result<Json<ReplicaChange>, ApiError> {
    let (gpa_start, version, entry) = change(
        &state,
        &gpa_text,
        &node_id,
        ReplicaOp::BeginRecovery { epoch: begin.epoch },
    )
    .await?;
    tracing::info!(
        gpa_start,
        node = %node_id,
        epoch = format_args!("{:#x}", begin.epoch),
        version,
        "replica recovery begun"
    );
    Ok(Json(ReplicaChange {
        version,
        generation: state.store().generation(),
        entry,
    }))
}

/// `POST /v1/map/{gpa_start}/replicas/{node_id}/live` with a
/// [`RecoveryDone`] (admin or that node): the recovery finished. 409 when
/// it is not the recovery under way, begun by the node's current process.
pub(super) async fn finish_recovery(
    State(state): State<AppState>,
    ApiPath((gpa_text, node_id)): ApiPath<(String, String)>,
    ApiJson(done): ApiJson<RecoveryDone>,
) -> Result<Json<ReplicaChange>, ApiError> {
    let (gpa_start, version, entry) = change(
        &state,
        &gpa_text,
        &node_id,
        ReplicaOp::FinishRecovery {
            recovery_seq: done.recovery_seq,
            epoch: done.epoch,
        },
    )
    .await?;
    tracing::info!(
        gpa_start,
        node = %node_id,
        recovery_seq = done.recovery_seq,
        version,
        "replica recovered: live again"
    );
    Ok(Json(ReplicaChange {
        version,
        generation: state.store().generation(),
        entry,
    }))
}
