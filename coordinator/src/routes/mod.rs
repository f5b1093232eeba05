//! The route table, and the router built from it.
//!
//! [`route_table`] is the single list of routes: [`router`] registers exactly
//! these, and a test checks `docs/coordinator-openapi.yaml` against it.

mod fallback;
mod health;
mod map;
mod nodes;
mod rdma;
mod replicas;

use axum::extract::DefaultBodyLimit;
use axum::middleware;
use axum::routing::{on, MethodFilter, MethodRouter};
use axum::Router;

use crate::auth::{authorize, Access, RouteAuth};
use crate::body::read_body_in_time;
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

/// One served route: method, path template (axum/OpenAPI `{param}` syntax),
/// who may call it, and its handler.
#[derive(Debug)]
pub struct Route {
    /// HTTP method.
    pub method: HttpMethod,
    /// Path template, e.g. `/v1/nodes/{id}`.
    pub path: &'static str,
    /// Who may call it when the coordinator has a cluster key.
    pub access: Access,
    handler: fn(MethodFilter) -> MethodRouter<AppState>,
}

/// Every route the coordinator serves, in the order of the OpenAPI document.
pub fn route_table() -> &'static [Route] {
    ROUTES
}

static ROUTES: &[Route] = &[
    route(HttpMethod::Get, "/v1/health", Access::Public, |m| {
        on(m, health::health)
    }),
    route(HttpMethod::Get, "/metrics", Access::Read, |m| {
        on(m, crate::metrics::metrics)
    }),
    route(HttpMethod::Get, "/v1/nodes", Access::Read, |m| {
        on(m, nodes::list)
    }),
    route(HttpMethod::Get, "/v1/nodes/{id}", Access::Read, |m| {
        on(m, nodes::get)
    }),
    route(HttpMethod::Put, "/v1/nodes/{id}", Access::OwnNode, |m| {
        on(m, nodes::register)
    }),
    route(HttpMethod::Delete, "/v1/nodes/{id}", Access::Admin, |m| {
        on(m, nodes::remove)
    }),
    route(
        HttpMethod::Post,
        "/v1/nodes/{id}/heartbeat",
        Access::OwnNode,
        |m| on(m, nodes::heartbeat),
    ),
    route(
        HttpMethod::Get,
        "/v1/nodes/{id}/rdma/endpoint",
        Access::Read,
        |m| on(m, rdma::get_endpoint),
    ),
    route(
        HttpMethod::Post,
        "/v1/nodes/{id}/rdma/endpoint",
        Access::OwnNode,
        |m| on(m, rdma::set_endpoint),
    ),
    route(
        HttpMethod::Get,
        "/nodes/{id}/rdma/endpoint",
        Access::Read,
        |m| on(m, rdma::get_endpoint),
    ),
    route(
        HttpMethod::Post,
        "/nodes/{id}/rdma/endpoint",
        Access::OwnNode,
        |m| on(m, rdma::set_endpoint),
    ),
    route(HttpMethod::Get, "/v1/map", Access::Read, |m| {
        on(m, map::get_map)
    }),
    route(HttpMethod::Post, "/v1/map", Access::OwnRange, |m| {
        on(m, map::add_range)
    }),
    route(
        HttpMethod::Delete,
        "/v1/map/{gpa_start}",
        Access::OwnRange,
        |m| on(m, map::remove_range),
    ),
    route(
        HttpMethod::Post,
        "/v1/map/{gpa_start}/reinitialise",
        Access::Admin,
        |m| on(m, map::reinitialise_range),
    ),
    route(
        HttpMethod::Post,
        "/v1/map/{gpa_start}/replicas/{node_id}/stale",
        Access::Writer,
        |m| on(m, replicas::mark_stale),
    ),
    route(
        HttpMethod::Post,
        "/v1/map/{gpa_start}/replicas/{node_id}/recovering",
        Access::OwnReplica,
        |m| on(m, replicas::begin_recovery),
    ),
    route(
        HttpMethod::Post,
        "/v1/map/{gpa_start}/replicas/{node_id}/live",
        Access::OwnReplica,
        |m| on(m, replicas::finish_recovery),
    ),
    route(HttpMethod::Get, "/v1/resolve", Access::Read, |m| {
        on(m, map::resolve)
    }),
];

const fn route(
    method: HttpMethod,
    path: &'static str,
    access: Access,
    handler: fn(MethodFilter) -> MethodRouter<AppState>,
) -> Route {
    Route {
        method,
        path,
        access,
        handler,
    }
}

/// The full service: every route of [`route_table`] behind its access check
/// (run first) and the timed body read, JSON fallbacks for unknown paths and
/// methods, and the body-size cap.
pub(crate) fn router(state: AppState) -> Router {
    let mut router = Router::new();
    for route in ROUTES {
        let auth = RouteAuth {
            state: state.clone(),
            access: route.access,
        };
        // The layer added last runs first: nobody gets their body read
        // before they are known to be allowed.
        let method_router = (route.handler)(route.method.filter())
            .route_layer(middleware::from_fn_with_state(
                state.clone(),
                read_body_in_time,
            ))
            .route_layer(middleware::from_fn_with_state(auth, authorize));
        router = router.route(route.path, method_router);
    }
    router
        .method_not_allowed_fallback(fallback::method_not_allowed)
        .fallback(fallback::not_found)
        .layer(middleware::from_fn_with_state(
            state.clone(),
            crate::metrics::track,
        ))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}
