//! Extractors whose rejections are JSON [`ApiError`]s instead of axum's
//! plain-text ones: bad JSON, a wrong content type and missing fields all
//! answer 400, an oversized body 413.

use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::Json;
use serde::de::DeserializeOwned;

use crate::error::ApiError;
use crate::server::MAX_BODY_BYTES;

/// A JSON request body.
#[derive(Debug)]
pub(crate) struct ApiJson<T>(pub T);

/// Path parameters.
#[derive(Debug)]
pub(crate) struct ApiPath<T>(pub T);

/// Query parameters.
#[derive(Debug)]
pub(crate) struct ApiQuery<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(json_rejection(&rejection)),
        }
    }
}

impl<S, T> FromRequestParts<S> for ApiPath<T>
where
    T: DeserializeOwned + Send,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Path::<T>::from_request_parts(parts, state).await {
            Ok(Path(value)) => Ok(Self(value)),
            Err(rejection) => Err(path_rejection(&rejection)),
        }
    }
}

impl<S, T> FromRequestParts<S> for ApiQuery<T>
where
    T: DeserializeOwned,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(value)) => Ok(Self(value)),
            Err(rejection) => Err(query_rejection(&rejection)),
        }
    }
}

fn json_rejection(rejection: &JsonRejection) -> ApiError {
    from_status(rejection.status(), rejection.body_text())
}

fn path_rejection(rejection: &PathRejection) -> ApiError {
    from_status(rejection.status(), rejection.body_text())
}

fn query_rejection(rejection: &QueryRejection) -> ApiError {
    from_status(rejection.status(), rejection.body_text())
}

/// 413 stays 413, a server-side fault stays 5xx, every other refusal is 400.
fn from_status(status: StatusCode, text: String) -> ApiError {
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::PayloadTooLarge {
            limit_bytes: MAX_BODY_BYTES,
        }
    } else if status.is_server_error() {
        ApiError::Internal(text)
    } else {
        ApiError::BadRequest(text)
    }
}
