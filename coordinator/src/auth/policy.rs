//! What each route lets each [`Caller`] do, enforced by a middleware on
//! every route (before the body is read).

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::Caller;
use crate::error::ApiError;
use crate::state::AppState;

/// Who may call a route (with a cluster key; without one, reads are open
/// and writes need the token when one is set).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Access {
    /// Anyone, without a credential (`GET /v1/health`).
    Public,
    /// Any credential: admin, client or node.
    Read,
    /// Admin, or the node named by the path's `{id}`.
    OwnNode,
    /// Admin or any node; the handler lets a node touch only its own ranges.
    OwnRange,
    /// Admin or the client credential, not nodes (a client reports a
    /// replica that missed its write).
    Writer,
    /// Admin, or the node named by the path's `{node_id}` of
    /// `.../replicas/{node_id}/...`.
    OwnReplica,
    /// Admin only.
    Admin,
}

impl Access {
    /// True when a request without credentials is served even by a
    /// coordinator with a cluster key.
    pub fn is_public(self) -> bool {
        self == Self::Public
    }

    /// True for routes that change nothing.
    fn is_read(self) -> bool {
        matches!(self, Self::Public | Self::Read)
    }
}

/// State of the per-route middleware: the app and the route's rule.
#[derive(Debug, Clone)]
pub(crate) struct RouteAuth {
    pub state: AppState,
    pub access: Access,
}

/// Middleware: identifies the caller, refuses what the route's [`Access`]
/// does not allow (401 unknown, 403 not allowed), and hands the [`Caller`]
/// to the handler.
pub(crate) async fn authorize(
    State(route): State<RouteAuth>,
    mut request: Request,
    next: Next,
) -> Response {
    if route.access.is_public() {
        return next.run(request).await;
    }
    let caller = match route.state.auth().identify(request.headers()) {
        Ok(caller) => caller,
        Err(error) => return error.into_response(),
    };
    if let Err(error) = permit(route.access, &caller, request.uri().path()) {
        return error.into_response();
    }
    request.extensions_mut().insert(caller);
    next.run(request).await
}

fn permit(access: Access, caller: &Caller, path: &str) -> Result<(), ApiError> {
    match (access, caller) {
        (_, Caller::Unchecked | Caller::Admin) => Ok(()),
        (access, _) if access.is_read() => Ok(()),
        (_, Caller::Anonymous) => Err(ApiError::Unauthorized),
        (Access::OwnNode, caller) => caller.check_may_change(path_node_id(path).unwrap_or("")),
        (Access::OwnRange, Caller::Node(_)) => Ok(()),
        (Access::OwnReplica, caller) => {
            caller.check_may_change(path_replica_node_id(path).unwrap_or(""))
        }
        (Access::Writer, Caller::Client) => Ok(()),
        (_, Caller::Node(own)) => Err(ApiError::Forbidden(format!(
            "only the admin credential may do this, not node {own:?}'s"
        ))),
        (_, Caller::Client) => Err(ApiError::Forbidden(
            "the client credential only reads".to_owned(),
        )),
    }
}

/// The raw `{id}` of `.../nodes/{id}/...`. Compared byte for byte with the
/// caller's id: a percent-encoded spelling of it is refused, never let in.
fn path_node_id(path: &str) -> Option<&str> {
    path.split('/').skip_while(|s| *s != "nodes").nth(1)
}

/// The raw `{node_id}` of `.../replicas/{node_id}/...`, compared like
/// [`path_node_id`]'s.
fn path_replica_node_id(path: &str) -> Option<&str> {
    path.split('/').skip_while(|s| *s != "replicas").nth(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules() {
        let a = Caller::Node("a".into());
        assert!(permit(Access::Read, &Caller::Client, "/v1/map").is_ok());
        assert!(permit(Access::OwnNode, &a, "/v1/nodes/a/heartbeat").is_ok());
        assert!(permit(Access::OwnNode, &a, "/nodes/a/rdma/endpoint").is_ok());
        assert!(matches!(
            permit(Access::OwnNode, &a, "/v1/nodes/b"),
            Err(ApiError::Forbidden(_))
        ));
        assert!(permit(Access::OwnNode, &a, "/v1/nodes/%61").is_err());
        assert!(permit(Access::OwnRange, &a, "/v1/map").is_ok());
        assert!(permit(Access::Admin, &a, "/v1/nodes/a").is_err());
        assert!(permit(Access::OwnRange, &Caller::Client, "/v1/map").is_err());
        assert!(matches!(
            permit(Access::OwnNode, &Caller::Anonymous, "/v1/nodes/a"),
            Err(ApiError::Unauthorized)
        ));
        assert!(permit(Access::Admin, &Caller::Admin, "/v1/nodes/a").is_ok());
        assert!(permit(Access::Admin, &Caller::Unchecked, "/v1/nodes/a").is_ok());
        let stale = "/v1/map/0/replicas/b/stale";
        assert!(permit(Access::Writer, &Caller::Client, stale).is_ok());
        assert!(permit(Access::Writer, &Caller::Admin, stale).is_ok());
        assert!(permit(Access::Writer, &a, "/v1/map/0/replicas/a/stale").is_err());
        assert!(matches!(
            permit(Access::Writer, &Caller::Anonymous, stale),
            Err(ApiError::Unauthorized)
        ));
        let own = "/v1/map/0/replicas/a/recovering";
        assert!(permit(Access::OwnReplica, &a, own).is_ok());
        assert!(permit(Access::OwnReplica, &a, "/v1/map/0/replicas/b/live").is_err());
        assert!(permit(Access::OwnReplica, &a, "/v1/map/0/replicas/%61/live").is_err());
        assert!(permit(Access::OwnReplica, &Caller::Client, own).is_err());
        assert!(permit(Access::OwnReplica, &Caller::Admin, own).is_ok());
    }
}
