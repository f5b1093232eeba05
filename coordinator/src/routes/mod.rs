//! The route table, and the router built from it.
//!
//! [`route_table`] is the single list of routes: [`router`] registers exactly
//! these, and a test checks `docs/coordinator-openapi.yaml` against it.

mod fallback;
mod health;
mod map;
mod nodes;
mod rdma;

use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::routing::{on, MethodFilter, MethodRouter};
use axum::Router;

use crate::auth::require_token_for_writes;
use crate::server::MAX_BODY_BYTES;
use crate::state::AppState;

/// HTTP methods the coordinator serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum HttpMethod {
    /// `GET` (and `HEAD`, which axum answers from the same handler).
    Get,
    /// `PUT`.
    Put,
    /// `POST`.
    Post,
    /// `DELETE`.
    Delete,
}

impl HttpMethod {
    /// Upper-case method name, e.g. `"GET"`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Get => "GET",
            Self::Put => "PUT",
            Self::Post => "POST",
            Self::Delete => "DELETE",
        }
    }

    fn filter(self) -> MethodFilter {
        match self {
            Self::Get => MethodFilter::GET,
            Self::Put => MethodFilter::PUT,
            Self::Post => MethodFilter::POST,
            Self::Delete => MethodFilter::DELETE,
        }
    }
}

/// One served route: method, path template (axum/OpenAPI `{param}` syntax)
/// and its handler.
#[derive(Debug)]
pub struct Route {
    /// HTTP method.
    pub method: HttpMethod,
    /// Path template, e.g. `/v1/nodes/{id}`.
    pub path: &'static str,
    handler: fn(MethodFilter) -> MethodRouter<AppState>,
}

/// Every route the coordinator serves, in the order of the OpenAPI document.
pub fn route_table() -> &'static [Route] {
    ROUTES
}

static ROUTES: &[Route] = &[
    route(HttpMethod::Get, "/v1/health", |m| on(m, health::health)),
    route(HttpMethod::Get, "/v1/nodes", |m| on(m, nodes::list)),
    route(HttpMethod::Get, "/v1/nodes/{id}", |m| on(m, nodes::get)),
    route(HttpMethod::Put, "/v1/nodes/{id}", |m| {
        on(m, nodes::register)
    }),
    route(HttpMethod::Delete, "/v1/nodes/{id}", |m| {
        on(m, nodes::remove)
    }),
    route(HttpMethod::Post, "/v1/nodes/{id}/heartbeat", |m| {
        on(m, nodes::heartbeat)
    }),
    route(HttpMethod::Get, "/v1/nodes/{id}/rdma/endpoint", |m| {
        on(m, rdma::get_endpoint)
    }),
    route(HttpMethod::Post, "/v1/nodes/{id}/rdma/endpoint", |m| {
        on(m, rdma::set_endpoint)
    }),
    route(HttpMethod::Get, "/nodes/{id}/rdma/endpoint", |m| {
        on(m, rdma::get_endpoint)
    }),
    route(HttpMethod::Post, "/nodes/{id}/rdma/endpoint", |m| {
        on(m, rdma::set_endpoint)
    }),
    route(HttpMethod::Get, "/v1/map", |m| on(m, map::get_map)),
    route(HttpMethod::Post, "/v1/map", |m| on(m, map::add_range)),
    route(HttpMethod::Delete, "/v1/map/{gpa_start}", |m| {
        on(m, map::remove_range)
    }),
    route(HttpMethod::Get, "/v1/resolve", |m| on(m, map::resolve)),
];

const fn route(
    method: HttpMethod,
    path: &'static str,
    handler: fn(MethodFilter) -> MethodRouter<AppState>,
) -> Route {
    Route {
        method,
        path,
        handler,
    }
}

/// The full service: every route of [`route_table`], JSON fallbacks for
/// unknown paths and methods, the body-size cap and the token check.
pub(crate) fn router(state: AppState) -> Router {
    let mut router = Router::new();
    for route in ROUTES {
        router = router.route(route.path, (route.handler)(route.method.filter()));
    }
    router
        .method_not_allowed_fallback(fallback::method_not_allowed)
        .fallback(fallback::not_found)
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            require_token_for_writes,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}
