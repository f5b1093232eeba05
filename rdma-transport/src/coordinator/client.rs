//! Blocking HTTP client of the coordinator service.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use reqwest::blocking::{Client, RequestBuilder};
use reqwest::header::CONTENT_TYPE;
use reqwest::{Method, StatusCode, Url};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::api::{
    is_valid_node_id, ErrorBody, HealthResponse, MapEntry, MapResponse, NodeId, NodeInfo,
    NodeRegistration, RangeRequest, RdmaEndpoint, RecoveryBegin, RecoveryDone, ReplicaChange,
    ResolveResponse,
};
use super::credential::{Bearer, Credential};
use super::error::CoordinatorError;

/// Longest piece of a non-JSON error body kept in [`CoordinatorError::Http`].
const MAX_ERROR_TEXT_BYTES: usize = 256;

/// How long an idle keep-alive connection to the coordinator is kept for
/// reuse: well under the coordinator's header timeout (10 s by default),
/// which also closes idle connections; a connection reused just as the
/// server closes it fails its request.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// Blocking client of the coordinator's `/v1` HTTP API.
///
/// Every call is one HTTP request bounded by the timeout given to
/// [`new`](Self::new); nothing is retried here, except on another
/// coordinator: given several base URLs separated by commas (coordinators
/// sharing one etcd store), a call that cannot reach one, or that it
/// answers 503, goes to the next, each at most once; the one that answered
/// is tried first next time. The [`Credential`] given to
/// [`with_credential`](Self::with_credential) (or the token given to `new`)
/// is sent as `Authorization: Bearer ...` on every request, reads included:
/// a coordinator with a cluster key answers only `GET /v1/health` without one.
///
/// # Panics
///
/// Built on `reqwest::blocking`, which runs its own runtime on a helper
/// thread: **do not create, use or drop this client on a thread that is
/// driving a tokio runtime** (inside `async` code or a `#[tokio::main]`
/// function); reqwest panics there. From async code, call it inside
/// `tokio::task::spawn_blocking`. Used from ordinary threads it never panics.
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use rdma_transport::coordinator::CoordinatorClient;
///
/// let client = CoordinatorClient::new("http://127.0.0.1:7070", None, Duration::from_secs(2))?;
/// let map = client.map()?;
/// println!("map version {} with {} entries", map.version, map.entries.len());
/// # Ok::<(), rdma_transport::coordinator::CoordinatorError>(())
/// ```
#[derive(Debug, Clone)]
pub struct CoordinatorClient {
    http: Client,
    /// Base URLs without a trailing `/`, e.g. `http://127.0.0.1:7070`: one
    /// coordinator, or several sharing one store (etcd), tried in turn.
    base_urls: Vec<String>,
    /// The index of the coordinator that answered last (shared by clones).
    preferred: Arc<AtomicUsize>,
    bearer: Option<Bearer>,
}

impl CoordinatorClient {
    /// Creates a client for the coordinator at `base_url` (e.g.
    /// `http://127.0.0.1:7070`, or several separated by commas) that sends `token`, if any, as its bearer
    /// ([`Credential::Token`]). `timeout` bounds each request, connecting
    /// included.
    ///
    /// # Errors
    ///
    /// As [`with_credential`](Self::with_credential).
    pub fn new(
        base_url: &str,
        token: Option<String>,
        timeout: Duration,
    ) -> Result<Self, CoordinatorError> {
        let credential = token.map_or(Credential::None, Credential::Token);
        Self::with_credential(base_url, &credential, timeout)
    }

    /// Creates a client for the coordinator at `base_url` that presents
    /// `credential` on every request. `timeout` bounds each request,
    /// connecting included.
    ///
    /// # Errors
    ///
    /// [`CoordinatorError::InvalidUrl`] when `base_url` is not an absolute
    /// `http`/`https` URL without query or fragment;
    /// [`CoordinatorError::InvalidNodeId`] for a node credential with an id
    /// the coordinator would refuse;
    /// [`CoordinatorError::Client`] when the HTTP client cannot be built.
    pub fn with_credential(
        base_url: &str,
        credential: &Credential,
        timeout: Duration,
    ) -> Result<Self, CoordinatorError> {
        let base_urls = base_url
            .split(',')
            .map(checked_base_url)
            .collect::<Result<Vec<_>, _>>()?;
        // The system's root certificates are read (~18 M instructions,
        // milliseconds per client) only for a coordinator spoken to over
        // https: a plain-http one (a redirect to https included) needs none.
        let tls = base_urls.iter().any(|u| u.starts_with("https:"));
        // `build` starts the client's runtime thread, which does all its
        // I/O and writes requests with `writev` (no `MSG_NOSIGNAL`): that
        // thread, and those it starts, are born with SIGPIPE blocked, so a
        // coordinator connection reset under a pooled request cannot end a
        // host that keeps SIGPIPE's default (a hypervisor in C).
        let builder = Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .pool_idle_timeout(POOL_IDLE_TIMEOUT)
            .tls_built_in_native_certs(tls);
        let http = crate::sys::with_sigpipe_blocked(|| builder.build())
            .map_err(CoordinatorError::Client)?;
        Ok(Self {
            http,
            base_urls,
            preferred: Arc::new(AtomicUsize::new(0)),
            bearer: credential.bearer()?.map(Bearer),
        })
    }

    /// Base URL of the coordinator (of the one that answered last, when
    /// several were given), without a trailing `/`.
    pub fn base_url(&self) -> &str {
        let index = self.preferred.load(Ordering::Relaxed) % self.base_urls.len();
        &self.base_urls[index]
    }

    /// `GET /v1/health`: checks that the coordinator answers.
    ///
    /// # Errors
    ///
    /// See [`CoordinatorError`]; [`CoordinatorError::Unreachable`] while it is down.
    pub fn health(&self) -> Result<HealthResponse, CoordinatorError> {
        self.call(Method::GET, "/v1/health", None)
    }

    /// `PUT /v1/nodes/{id}`: registers a node or replaces its registration,
    /// and refreshes its lease.
    ///
    /// # Errors
    ///
    /// See [`CoordinatorError`].
    pub fn register_node(
        &self,
        id: &NodeId,
        registration: &NodeRegistration,
    ) -> Result<NodeInfo, CoordinatorError> {
        let path = format!("/v1/nodes/{}", checked_id(id)?);
        self.call(Method::PUT, &path, Some(encode(registration)?))
    }

    /// `POST /v1/nodes/{id}/heartbeat`: refreshes the node's lease.
    ///
    /// # Errors
    ///
    /// Not found (see [`CoordinatorError::is_not_found`]) when the node is not
    /// registered; see [`CoordinatorError`].
    pub fn heartbeat(&self, id: &NodeId) -> Result<NodeInfo, CoordinatorError> {
        let path = format!("/v1/nodes/{}/heartbeat", checked_id(id)?);
        self.call(Method::POST, &path, None)
    }

    /// `POST /v1/nodes/{id}/heartbeat?epoch=E`: refreshes the lease of the
    /// node's process in `epoch` only. A process another one replaced
    /// renews nothing (a coordinator that does not know the parameter
    /// renews the lease whichever process registered: compare the
    /// answer's epoch too).
    ///
    /// # Errors
    ///
    /// Superseded (see [`CoordinatorError::is_superseded`]) when another
    /// process of the node registered since; not found when the node is
    /// not registered; see [`CoordinatorError`].
    pub fn heartbeat_in_epoch(
        &self,
        id: &NodeId,
        epoch: u64,
    ) -> Result<NodeInfo, CoordinatorError> {
        let path = format!("/v1/nodes/{}/heartbeat?epoch={epoch}", checked_id(id)?);
        self.call(Method::POST, &path, None)
    }

    /// `GET /v1/nodes`: every registered node.
    ///
    /// # Errors
    ///
    /// See [`CoordinatorError`].
    pub fn nodes(&self) -> Result<Vec<NodeInfo>, CoordinatorError> {
        self.call(Method::GET, "/v1/nodes", None)
    }

    /// `GET /v1/nodes/{id}`: one node.
    ///
    /// # Errors
    ///
    /// Not found when the node is not registered; see [`CoordinatorError`].
    pub fn node(&self, id: &NodeId) -> Result<NodeInfo, CoordinatorError> {
        let path = format!("/v1/nodes/{}", checked_id(id)?);
        self.call(Method::GET, &path, None)
    }

    /// `DELETE /v1/nodes/{id}`: forgets a node and every range it owns.
    ///
    /// # Errors
    ///
    /// Not found when the node is not registered; see [`CoordinatorError`].
    pub fn remove_node(&self, id: &NodeId) -> Result<(), CoordinatorError> {
        let path = format!("/v1/nodes/{}", checked_id(id)?);
        self.call_no_content(Method::DELETE, &path)
    }

    /// `POST /v1/map`: claims a GPA range for a node. Claiming exactly the same
    /// range for the same node again updates its `remote_offset` and `rdma`.
    ///
    /// # Errors
    ///
    /// Conflict (see [`CoordinatorError::is_conflict`]) when the range overlaps
    /// another one; not found when the node is unknown; bad request when the
    /// range is misaligned or overflows; see [`CoordinatorError`].
    pub fn add_range(&self, request: &RangeRequest) -> Result<MapEntry, CoordinatorError> {
        self.call(Method::POST, "/v1/map", Some(encode(request)?))
    }

    /// `DELETE /v1/map/{gpa_start}`: removes the range that starts at `gpa_start`.
    ///
    /// # Errors
    ///
    /// Not found when no range starts there; see [`CoordinatorError`].
    pub fn remove_range(&self, gpa_start: u64) -> Result<(), CoordinatorError> {
        self.call_no_content(Method::DELETE, &format!("/v1/map/{gpa_start}"))
    }

    /// `POST /v1/map/{gpa_start}/reinitialise` (admin credential only): the
    /// range's contents become its owner's memory as it is now (zeros after
    /// a restart), so clients serve it again instead of failing with
    /// `DataLost`. Returns the entry, now `live`.
    ///
    /// # Errors
    ///
    /// Not found when no range starts there; forbidden for a node or client
    /// credential; see [`CoordinatorError`].
    pub fn reinitialise_range(&self, gpa_start: u64) -> Result<MapEntry, CoordinatorError> {
        let path = format!("/v1/map/{gpa_start}/reinitialise");
        self.call(Method::POST, &path, None)
    }

    /// `POST /v1/map/{gpa_start}/replicas/{node_id}/stale` (client or admin
    /// credential): `node_id`'s replica of the range missed a write and must
    /// serve nothing until it has recovered, within `timeout`.
    ///
    /// # Errors
    ///
    /// Conflict when it is the range's last live replica (the coordinator
    /// never marks the last one stale); not found for an unknown range or
    /// replica; see [`CoordinatorError`].
    pub fn mark_replica_stale(
        &self,
        gpa_start: u64,
        node_id: &str,
        timeout: Duration,
    ) -> Result<ReplicaChange, CoordinatorError> {
        let id = checked_id(node_id)?;
        let path = format!("/v1/map/{gpa_start}/replicas/{id}/stale");
        let (url, body) = self.send_within(Method::POST, &path, None, Some(timeout))?;
        serde_json::from_slice(&body).map_err(|source| CoordinatorError::Decode { url, source })
    }

    /// `POST /v1/map/{gpa_start}/replicas/{node_id}/recovering` (that
    /// node's or the admin credential): the node starts copying the range
    /// into its memory from a live replica. `epoch` is the copying process's
    /// (its handshake epoch). The answer's replica carries the
    /// `recovery_seq` to finish with.
    ///
    /// # Errors
    ///
    /// Conflict when no replica of the range is live (nothing to copy
    /// from) or `epoch` is not the node's current one; see
    /// [`CoordinatorError`].
    pub fn begin_recovery(
        &self,
        gpa_start: u64,
        node_id: &str,
        epoch: u64,
    ) -> Result<ReplicaChange, CoordinatorError> {
        let id = checked_id(node_id)?;
        let path = format!("/v1/map/{gpa_start}/replicas/{id}/recovering");
        let body = encode(&RecoveryBegin { epoch })?;
        self.call(Method::POST, &path, Some(body))
    }

    /// `POST /v1/map/{gpa_start}/replicas/{node_id}/live` (that node's or the
    /// admin credential): the recovery numbered `recovery_seq` has copied
    /// the whole range into the memory of the process in `epoch`; the
    /// replica serves reads again.
    ///
    /// # Errors
    ///
    /// Conflict when the replica is no longer recovering under that number
    /// (it went stale meanwhile, or its node restarted), or was begun in
    /// another epoch; see [`CoordinatorError`].
    pub fn finish_recovery(
        &self,
        gpa_start: u64,
        node_id: &str,
        recovery_seq: u64,
        epoch: u64,
    ) -> Result<ReplicaChange, CoordinatorError> {
        let id = checked_id(node_id)?;
        let path = format!("/v1/map/{gpa_start}/replicas/{id}/live");
        let body = encode(&RecoveryDone {
            recovery_seq,
            epoch,
        })?;
        self.call(Method::POST, &path, Some(body))
    }

    /// `GET /v1/map`: the whole map, its version and every node.
    ///
    /// # Errors
    ///
    /// See [`CoordinatorError`].
    pub fn map(&self) -> Result<MapResponse, CoordinatorError> {
        self.call(Method::GET, "/v1/map", None)
    }

    /// `GET /v1/map` with a time limit of its own, shorter than the client's
    /// (a refresh made inside a request with a deadline).
    ///
    /// # Errors
    ///
    /// See [`CoordinatorError`]; [`CoordinatorError::Unreachable`] when no
    /// answer came within `timeout`.
    pub fn map_within(&self, timeout: Duration) -> Result<MapResponse, CoordinatorError> {
        let (url, body) = self.send_within(Method::GET, "/v1/map", None, Some(timeout))?;
        serde_json::from_slice(&body).map_err(|source| CoordinatorError::Decode { url, source })
    }

    /// `GET /v1/map?after=V&timeout_ms=W`, a long poll: the coordinator
    /// answers once the map version passes `after`, or after `wait` with
    /// the map as it read it then (its version may still be `after`; the
    /// coordinator caps `wait` at 60 s). A coordinator without long polls
    /// answers at once. `timeout` bounds the answer beyond `wait`.
    ///
    /// # Errors
    ///
    /// See [`CoordinatorError`].
    pub fn map_after(
        &self,
        after: u64,
        wait: Duration,
        timeout: Duration,
    ) -> Result<MapResponse, CoordinatorError> {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let path = format!("/v1/map?after={after}&timeout_ms={wait_ms}");
        let (url, body) =
            self.send_within(Method::GET, &path, None, Some(wait.saturating_add(timeout)))?;
        serde_json::from_slice(&body).map_err(|source| CoordinatorError::Decode { url, source })
    }

    /// `GET /v1/resolve?gpa=...`: the range that contains `gpa` and its owner.
    ///
    /// # Errors
    ///
    /// Not found when `gpa` is not mapped; see [`CoordinatorError`].
    pub fn resolve(&self, gpa: u64) -> Result<ResolveResponse, CoordinatorError> {
        self.call(Method::GET, &format!("/v1/resolve?gpa={gpa:#x}"), None)
    }

    /// `POST /v1/nodes/{id}/rdma/endpoint`: publishes the node's RDMA endpoint.
    ///
    /// # Errors
    ///
    /// Not found when the node is not registered; see [`CoordinatorError`].
    pub fn set_rdma_endpoint(
        &self,
        id: &NodeId,
        endpoint: &RdmaEndpoint,
    ) -> Result<NodeInfo, CoordinatorError> {
        let path = format!("/v1/nodes/{}/rdma/endpoint", checked_id(id)?);
        self.call(Method::POST, &path, Some(encode(endpoint)?))
    }

    /// `GET /v1/nodes/{id}/rdma/endpoint`: the node's RDMA endpoint.
    ///
    /// # Errors
    ///
    /// Not found when the node is unknown or has published no endpoint; see
    /// [`CoordinatorError`].
    pub fn rdma_endpoint(&self, id: &NodeId) -> Result<RdmaEndpoint, CoordinatorError> {
        let path = format!("/v1/nodes/{}/rdma/endpoint", checked_id(id)?);
        self.call(Method::GET, &path, None)
    }

    /// Sends a request and decodes a JSON success body.
    fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        json_body: Option<Vec<u8>>,
    ) -> Result<T, CoordinatorError> {
        let (url, body) = self.send_within(method, path, json_body, None)?;
        serde_json::from_slice(&body).map_err(|source| CoordinatorError::Decode { url, source })
    }

    /// Sends a request whose success answer has no body.
    fn call_no_content(&self, method: Method, path: &str) -> Result<(), CoordinatorError> {
        self.send_within(method, path, None, None).map(drop)
    }

    /// Sends `method path` (with `timeout` instead of the client's when
    /// given) to the coordinator that answered last; when it cannot be
    /// reached or answers 503 (its store is unavailable), to each other one
    /// in turn. Returns the URL that answered and the body of its 2xx
    /// answer, or the last error.
    fn send_within(
        &self,
        method: Method,
        path: &str,
        json_body: Option<Vec<u8>>,
        timeout: Option<Duration>,
    ) -> Result<(String, Vec<u8>), CoordinatorError> {
        let count = self.base_urls.len();
        let first = self.preferred.load(Ordering::Relaxed) % count;
        let mut tried = 0;
        loop {
            let index = (first + tried) % count;
            let url = format!("{}{path}", self.base_urls[index]);
            tried += 1;
            match self.send_to(method.clone(), &url, json_body.clone(), timeout) {
                Err(err) if tried < count && fails_over(&err) => {
                    tracing::debug!(%err, "coordinator unavailable; trying the next one");
                }
                outcome => {
                    if !outcome.as_ref().is_err_and(fails_over) {
                        self.preferred.store(index, Ordering::Relaxed);
                    }
                    return outcome.map(|body| (url, body));
                }
            }
        }
    }

    /// One request to `url`; the body of a 2xx answer, or the error.
    fn send_to(
        &self,
        method: Method,
        url: &str,
        json_body: Option<Vec<u8>>,
        timeout: Option<Duration>,
    ) -> Result<Vec<u8>, CoordinatorError> {
        tracing::debug!(%method, url, "coordinator request");
        let mut request: RequestBuilder = self.http.request(method, url);
        if let Some(timeout) = timeout {
            request = request.timeout(timeout);
        }
        if let Some(Bearer(bearer)) = &self.bearer {
            request = request.bearer_auth(bearer);
        }
        if let Some(body) = json_body {
            request = request.header(CONTENT_TYPE, "application/json").body(body);
        }
        let unreachable = |source| CoordinatorError::Unreachable {
            url: url.to_owned(),
            source,
        };
        let response = request.send().map_err(unreachable)?;
        let status = response.status();
        let body = response.bytes().map_err(unreachable)?;
        if status.is_success() {
            Ok(body.to_vec())
        } else {
            Err(http_error(status, &body))
        }
    }
}

/// Turns an error answer into [`CoordinatorError::Http`], whether or not its
/// body is an [`ErrorBody`].
fn http_error(status: StatusCode, body: &[u8]) -> CoordinatorError {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(error) => CoordinatorError::Http {
            status: status.as_u16(),
            code: error.error,
            message: error.message,
        },
        Err(_) => {
            let kept = body.get(..MAX_ERROR_TEXT_BYTES).unwrap_or(body);
            CoordinatorError::Http {
                status: status.as_u16(),
                code: format!("http_{}", status.as_u16()),
                message: String::from_utf8_lossy(kept).into_owned(),
            }
        }
    }
}

/// Refuses ids the coordinator would refuse, so that none can alter the URL path.
fn checked_id(id: &str) -> Result<&str, CoordinatorError> {
    if is_valid_node_id(id) {
        Ok(id)
    } else {
        Err(CoordinatorError::InvalidNodeId(id.to_owned()))
    }
}

/// Serialises a request body.
/// Whether another coordinator may answer where this one failed: it could
/// not be reached, or its store is unavailable (503).
fn fails_over(err: &CoordinatorError) -> bool {
    err.is_unreachable() || matches!(err, CoordinatorError::Http { status: 503, .. })
}

/// One base URL, checked, without a trailing `/`.
fn checked_base_url(base_url: &str) -> Result<String, CoordinatorError> {
    let base_url = base_url.trim();
    let invalid = |reason: &str| CoordinatorError::InvalidUrl {
        url: base_url.to_owned(),
        reason: reason.to_owned(),
    };
    let url = Url::parse(base_url).map_err(|e| invalid(&e.to_string()))?;
    if url.scheme() != "http" && url.scheme() != "https" {
        return Err(invalid("the scheme must be http or https"));
    }
    if url.host_str().is_none() {
        return Err(invalid("no host"));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(invalid("a query or fragment is not allowed"));
    }
    Ok(url.as_str().trim_end_matches('/').to_owned())
}

fn encode<T: Serialize>(value: &T) -> Result<Vec<u8>, CoordinatorError> {
    serde_json::to_vec(value).map_err(CoordinatorError::Encode)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ids of this process's threads named by reqwest's blocking client.
    fn client_threads() -> Vec<libc::pid_t> {
        let mut tids = Vec::new();
        for entry in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            // `comm` keeps 15 bytes of "reqwest-internal-sync-runtime".
            if comm.trim_end() == "reqwest-interna" {
                tids.extend(
                    entry
                        .file_name()
                        .to_str()
                        .and_then(|t| t.parse::<libc::pid_t>().ok()),
                );
            }
        }
        tids
    }

    /// Whether `signal` is pending on thread `tid` (its `SigPnd` line).
    fn pending_on(tid: libc::pid_t, signal: libc::c_int) -> Option<bool> {
        let status = std::fs::read_to_string(format!("/proc/self/task/{tid}/status")).ok()?;
        let line = status.lines().find_map(|l| l.strip_prefix("SigPnd:"))?;
        let mask = u64::from_str_radix(line.trim(), 16).ok()?;
        Some(mask & (1 << (signal - 1)) != 0)
    }

    /// A C host keeps SIGPIPE's default, which ends the process; hyper
    /// writes requests with `writev`, which raises it on a reset
    /// connection. The client's runtime thread must hold such a signal
    /// pending (blocked) instead of taking it. (Here SIGPIPE is ignored,
    /// as in every Rust program: an ignored signal that is not blocked is
    /// dropped at once, never pending.)
    #[test]
    fn the_clients_io_thread_holds_a_sigpipe_instead_of_taking_it() {
        let before = client_threads();
        let client = CoordinatorClient::new("http://127.0.0.1:9", None, Duration::from_secs(1))
            .expect("client");
        let ours: Vec<_> = client_threads()
            .into_iter()
            .filter(|t| !before.contains(t))
            .collect();
        assert!(!ours.is_empty(), "no reqwest runtime thread found");
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        let mut checked = 0;
        for tid in ours {
            // SAFETY: sends a signal to a thread of this process; SIGPIPE is
            // ignored here, so it can only be held pending or dropped.
            let ret = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, libc::SIGPIPE) };
            if ret != 0 {
                continue; // Another test's client thread, gone meanwhile.
            }
            if let Some(pending) = pending_on(tid, libc::SIGPIPE) {
                assert!(
                    pending,
                    "thread {tid} took a SIGPIPE: it would end a C host"
                );
                checked += 1;
            }
        }
        assert!(checked > 0, "no client thread could be signalled");
        // The caller's own mask is as it was: SIGPIPE not blocked.
        // SAFETY: all-zero bytes are a valid `sigset_t` to be written.
        let mut current: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: a null new set only reads the mask into `current`.
        unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut current) };
        // SAFETY: `current` was initialised by `pthread_sigmask`.
        assert_eq!(unsafe { libc::sigismember(&current, libc::SIGPIPE) }, 0);
        drop(client);
    }

    #[test]
    fn base_url_is_checked_and_trimmed() {
        let timeout = Duration::from_secs(1);
        let client = CoordinatorClient::new("http://127.0.0.1:7070/", None, timeout);
        assert_eq!(
            client.ok().map(|c| c.base_urls),
            Some(vec!["http://127.0.0.1:7070".to_owned()])
        );
        let several = CoordinatorClient::new("http://a:1/, http://b:2", None, timeout);
        assert_eq!(
            several.ok().map(|c| c.base_urls),
            Some(vec!["http://a:1".to_owned(), "http://b:2".to_owned()])
        );
        for bad in [
            "",
            "127.0.0.1:7070",
            "ftp://h",
            "http://h/?q=1",
            "http://h/#f",
            "http://h,",
        ] {
            let result = CoordinatorClient::new(bad, None, timeout);
            assert!(
                matches!(result, Err(CoordinatorError::InvalidUrl { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn https_urls_speak_tls() {
        use std::io::Read;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let server = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().expect("accept");
            let mut first = [0u8; 1];
            stream.read_exact(&mut first).ok().map(|()| first[0])
        });
        let url = format!("https://{addr}");
        let client = CoordinatorClient::new(&url, None, Duration::from_secs(5)).expect("client");
        // The listener is no TLS server: the call fails, after a ClientHello.
        assert!(client.health().is_err());
        // Unblocks the accept if the client never connected (no TLS backend).
        drop(std::net::TcpStream::connect(addr));
        // 0x16: a TLS handshake record, not plain-text HTTP ('G' of GET).
        assert_eq!(server.join().expect("server"), Some(0x16));
    }

    #[test]
    fn bad_node_id_is_not_sent() {
        let client = CoordinatorClient::new("http://127.0.0.1:9", None, Duration::from_secs(1));
        let Ok(client) = client else { panic!("client") };
        let result = client.heartbeat(&"../map".to_owned());
        assert!(matches!(result, Err(CoordinatorError::InvalidNodeId(_))));
    }

    #[test]
    fn error_bodies_are_decoded() {
        let body = br#"{"error":"conflict","message":"overlaps"}"#;
        let error = http_error(StatusCode::CONFLICT, body);
        assert!(error.is_conflict());
        assert!(matches!(error, CoordinatorError::Http { ref code, .. } if code == "conflict"));
        let error = http_error(StatusCode::BAD_GATEWAY, b"<html>proxy</html>");
        assert!(
            matches!(error, CoordinatorError::Http { status: 502, ref code, .. } if code == "http_502")
        );
    }
}
