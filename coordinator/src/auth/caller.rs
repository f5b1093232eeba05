//! Turning the `Authorization` header into a [`Caller`].
//!
//! With a cluster key, the bearer is one of the credentials derived from it
//! (see `rdma_transport::auth`): `node:<id>:<hex>` for node `id`, or the
//! client or admin credential's hex; the configured token, if any, is one
//! more admin credential. Without a key (insecure) the token alone decides,
//! and only for writes.

use axum::extract::FromRequestParts;
use axum::http::header::AUTHORIZATION;
use axum::http::request::Parts;
use axum::http::HeaderMap;
use rdma_transport::auth::{credentials_match, ClusterKey};
use rdma_transport::coordinator::api::is_valid_node_id;
use rdma_transport::coordinator::NODE_BEARER_PREFIX;

use crate::error::ApiError;

/// Who sent a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Caller {
    /// No authentication is configured: anything goes.
    Unchecked,
    /// Insecure coordinator with a token, request without it: reads only.
    Anonymous,
    /// Admin credential or token: anything goes.
    Admin,
    /// Client credential: reads only.
    Client,
    /// Node credential of this id: reads, and changes to itself.
    Node(String),
}

impl Caller {
    /// Whether this caller may change node `id` (its registration, its
    /// ranges).
    pub fn may_change(&self, id: &str) -> bool {
        match self {
            Self::Unchecked | Self::Admin => true,
            Self::Node(own) => own == id,
            Self::Anonymous | Self::Client => false,
        }
    }

    /// [`Self::may_change`] as a 403 (401 for an anonymous caller).
    pub fn check_may_change(&self, id: &str) -> Result<(), ApiError> {
        if self.may_change(id) {
            return Ok(());
        }
        Err(match self {
            Self::Anonymous => ApiError::Unauthorized,
            Self::Node(own) => ApiError::Forbidden(format!(
                "the credential of node {own:?} cannot change node {id:?}"
            )),
            _ => ApiError::Forbidden("the client credential only reads".to_owned()),
        })
    }

    /// The node whose ranges alone this caller may remove (`None`: any).
    pub fn owner_scope(&self) -> Option<&str> {
        match self {
            Self::Node(own) => Some(own),
            _ => None,
        }
    }
}

/// Put into every authorised request by the middleware; read by handlers
/// that check ownership themselves.
impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        parts
            .extensions
            .get::<Caller>()
            .cloned()
            .ok_or_else(|| ApiError::Internal("route served without authorization".to_owned()))
    }
}

/// The coordinator's credentials, precomputed where they do not depend on
/// the request.
#[derive(Debug)]
pub(crate) struct Authenticator {
    keyed: Option<Keyed>,
    token: Option<String>,
}

#[derive(Debug)]
struct Keyed {
    key: ClusterKey,
    admin: String,
    client: String,
}

impl Authenticator {
    pub fn new(key: Option<ClusterKey>, token: Option<String>) -> Self {
        Self {
            keyed: key.map(|key| Keyed {
                admin: key.admin_credential(),
                client: key.client_credential(),
                key,
            }),
            token,
        }
    }

    /// True when every route but health needs a credential.
    pub fn is_keyed(&self) -> bool {
        self.keyed.is_some()
    }

    /// Who sent a request with `headers`.
    ///
    /// # Errors
    /// [`ApiError::Unauthorized`] when a key is set and the header is
    /// missing or carries no valid credential.
    pub fn identify(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        let bearer = bearer(headers);
        let is_token = |b: &str| {
            self.token
                .as_deref()
                .is_some_and(|t| credentials_match(b, t))
        };
        let Some(keyed) = &self.keyed else {
            return Ok(match (&self.token, bearer) {
                (None, _) => Caller::Unchecked,
                (Some(_), Some(b)) if is_token(b) => Caller::Admin,
                (Some(_), _) => Caller::Anonymous,
            });
        };
        let bearer = bearer.ok_or(ApiError::Unauthorized)?;
        if let Some(rest) = bearer.strip_prefix(NODE_BEARER_PREFIX) {
            let (id, presented) = rest.rsplit_once(':').ok_or(ApiError::Unauthorized)?;
            if is_valid_node_id(id) && credentials_match(presented, &keyed.key.node_credential(id))
            {
                return Ok(Caller::Node(id.to_owned()));
            }
            return Err(ApiError::Unauthorized);
        }
        if credentials_match(bearer, &keyed.admin) || is_token(bearer) {
            Ok(Caller::Admin)
        } else if credentials_match(bearer, &keyed.client) {
            Ok(Caller::Client)
        } else {
            Err(ApiError::Unauthorized)
        }
    }
}

/// The value of `Authorization: Bearer <value>`, if present and well formed.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, presented) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| presented.trim())
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
    fn keyed_credentials() {
        let key = ClusterKey::generate().expect("key");
        let auth = Authenticator::new(Some(key.clone()), Some("t0k".into()));
        let who = |v: &str| auth.identify(&headers(v)).ok();
        let node = format!("Bearer node:n.1:{}", key.node_credential("n.1"));
        assert_eq!(who(&node), Some(Caller::Node("n.1".into())));
        let other = format!("bearer node:n.2:{}", key.node_credential("n.1"));
        assert_eq!(who(&other), None, "a's credential under b's name");
        assert_eq!(
            who(&format!("Bearer {}", key.admin_credential())),
            Some(Caller::Admin)
        );
        assert_eq!(
            who(&format!("Bearer {}", key.client_credential())),
            Some(Caller::Client)
        );
        assert_eq!(who("Bearer t0k"), Some(Caller::Admin));
        assert_eq!(who("Bearer t0"), None);
        assert_eq!(who(&format!("Basic {}", key.admin_credential())), None);
        assert_eq!(who(""), None);
        let wrong = ClusterKey::generate().expect("key");
        assert_eq!(who(&format!("Bearer {}", wrong.admin_credential())), None);
    }

    #[test]
    fn insecure_modes() {
        let open = Authenticator::new(None, None);
        assert_eq!(
            open.identify(&HeaderMap::new()).ok(),
            Some(Caller::Unchecked)
        );
        let token = Authenticator::new(None, Some("s3cret".into()));
        assert_eq!(
            token.identify(&HeaderMap::new()).ok(),
            Some(Caller::Anonymous)
        );
        assert_eq!(
            token.identify(&headers("Bearer s3cret")).ok(),
            Some(Caller::Admin)
        );
        assert_eq!(
            token.identify(&headers("Bearer s3cre")).ok(),
            Some(Caller::Anonymous)
        );
    }
}
