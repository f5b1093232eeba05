//! Bearer-token check on writes.

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::AppState;

/// Middleware: when a token is configured, every request other than GET,
/// HEAD and OPTIONS needs `Authorization: Bearer <token>`; reads are open.
pub(crate) async fn require_token_for_writes(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let is_read = matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    );
    match state.token() {
        Some(token) if !is_read && !bearer_matches(request.headers(), token) => {
            ApiError::Unauthorized.into_response()
        }
        _ => next.run(request).await,
    }
}

/// True when the `Authorization` header carries `Bearer <token>`.
fn bearer_matches(headers: &HeaderMap, token: &str) -> bool {
    let Some(value) = headers.get(AUTHORIZATION).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let Some((scheme, presented)) = value.trim().split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer") && constant_time_eq(presented.trim(), token)
}

/// Compares without stopping at the first difference, so the answer time
/// does not tell how much of a guessed token was right.
fn constant_time_eq(a: &str, b: &str) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.bytes()
        .zip(b.bytes())
        .fold(0u8, |acc, (x, y)| acc | (x ^ y))
        == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Ok(value) = HeaderValue::from_str(value) {
            headers.insert(AUTHORIZATION, value);
        }
        headers
    }

    #[test]
    fn bearer_tokens() {
        assert!(bearer_matches(&headers("Bearer s3cret"), "s3cret"));
        assert!(bearer_matches(&headers("bearer s3cret"), "s3cret"));
        assert!(!bearer_matches(&headers("Bearer s3cre"), "s3cret"));
        assert!(!bearer_matches(&headers("Basic s3cret"), "s3cret"));
        assert!(!bearer_matches(&headers("s3cret"), "s3cret"));
        assert!(!bearer_matches(&HeaderMap::new(), "s3cret"));
    }
}
