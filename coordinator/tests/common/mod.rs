//! Helpers shared by the integration tests: an in-process coordinator on an
//! ephemeral 127.0.0.1 port with a temporary database, and raw HTTP calls.

// Each test binary uses a different subset of these helpers.
#![allow(dead_code)]

#[cfg(feature = "etcd")]
pub mod coordinator_process;
#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "etcd")]
pub mod heartbeats;
#[cfg(feature = "etcd")]
pub mod netns;

use std::time::{Duration, Instant};

use coordinator::{spawn, CoordinatorConfig, Limits, RunningCoordinator};
use rdma_transport::auth::ClusterKey;
use rdma_transport::coordinator::CoordinatorClient;
use reqwest::blocking::Client;
use reqwest::Method;
use serde_json::Value;

/// Timeout of every test request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest any bounded wait in the tests may take.
pub const WAIT_LIMIT: Duration = Duration::from_secs(20);

/// Pause between two polls of a bounded wait (not a synchronisation: the
/// loop checks the condition each time).
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// A running in-process coordinator and its database directory.
pub struct Harness {
    pub coordinator: RunningCoordinator,
    pub http: Client,
    /// The bearer `call`, `raw` and `client` send: the token, or the admin
    /// credential of `key`.
    pub token: Option<String>,
    /// The cluster key of a keyed harness.
    pub key: Option<ClusterKey>,
    /// The etcd the coordinator keeps its state in (see [`backend`]);
    /// stopped after the coordinator.
    _store: Option<StoreProcess>,
    _dir: tempfile::TempDir,
}

#[cfg(feature = "etcd")]
type StoreProcess = etcd::EtcdCluster;
#[cfg(not(feature = "etcd"))]
type StoreProcess = std::convert::Infallible;

/// Which backend the harness coordinators use: `COORDINATOR_TEST_STORE`
/// (`sqlite`, the default, or `etcd`: the same tests against a real
/// one-member etcd cluster, which needs `--features etcd`).
pub fn backend() -> &'static str {
    match std::env::var("COORDINATOR_TEST_STORE").as_deref() {
        Ok("etcd") => "etcd",
        Ok("sqlite") | Err(_) => "sqlite",
        Ok(other) => panic!("COORDINATOR_TEST_STORE={other:?}: use sqlite or etcd"),
    }
}

/// Points `config` at the backend [`backend`] names; returns the process
/// to keep running.
fn use_backend(config: &mut CoordinatorConfig) -> Option<StoreProcess> {
    if backend() == "sqlite" {
        return None;
    }
    #[cfg(feature = "etcd")]
    {
        let cluster = etcd::EtcdCluster::start(1);
        config.store =
            coordinator::StoreConfig::Etcd(coordinator::EtcdConfig::new(cluster.endpoints()));
        Some(cluster)
    }
    #[cfg(not(feature = "etcd"))]
    {
        let _ = config;
        panic!("COORDINATOR_TEST_STORE=etcd needs `--features etcd`")
    }
}

/// An answer: status and JSON body (`Value::Null` when empty or not JSON).
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub content_type: String,
    pub body: Value,
}

impl Answer {
    /// The `error` code of an `ErrorBody`, checking that the body is one.
    pub fn error_code(&self) -> &str {
        assert!(
            self.content_type.starts_with("application/json"),
            "error answers are JSON: {self:?}"
        );
        assert!(
            self.body["message"].is_string(),
            "ErrorBody has a message: {self:?}"
        );
        self.body["error"]
            .as_str()
            .expect("ErrorBody has an error code")
    }
}

/// Starts an insecure coordinator (no key) with `token` and `lease_ms`.
pub fn start(token: Option<&str>, lease_ms: u64) -> Harness {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut config = CoordinatorConfig::new(
        "127.0.0.1:0".parse().expect("addr"),
        dir.path().join("coordinator.db"),
    );
    config.token = token.map(str::to_owned);
    config.lease_ms = lease_ms;
    harness(config, dir, token.map(str::to_owned))
}

/// Starts a coordinator with a fresh cluster key and `limits`; the harness
/// calls with the admin credential.
pub fn start_keyed(limits: Limits) -> Harness {
    let dir = tempfile::tempdir().expect("tempdir");
    let key = ClusterKey::generate().expect("key");
    let mut config = CoordinatorConfig::new(
        "127.0.0.1:0".parse().expect("addr"),
        dir.path().join("coordinator.db"),
    );
    config.cluster_key = Some(key.clone());
    config.limits = limits;
    let admin = key.admin_credential();
    let mut h = harness(config, dir, Some(admin));
    h.key = Some(key);
    h
}

fn harness(
    mut config: CoordinatorConfig,
    dir: tempfile::TempDir,
    token: Option<String>,
) -> Harness {
    let store = use_backend(&mut config);
    let coordinator = spawn(config).expect("coordinator starts");
    // No idle connection is kept: the limits tests run the coordinator
    // with header timeouts of a few hundred ms, which also close idle
    // keep-alive connections, and reusing one as it closes fails the
    // request (IncompleteMessage).
    let http = Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .pool_max_idle_per_host(0)
        .build()
        .expect("http client");
    Harness {
        coordinator,
        http,
        token,
        key: None,
        _store: store,
        _dir: dir,
    }
}

impl Harness {
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.coordinator.url())
    }

    /// A typed client with this harness's token.
    pub fn client(&self) -> CoordinatorClient {
        CoordinatorClient::new(&self.coordinator.url(), self.token.clone(), REQUEST_TIMEOUT)
            .expect("client")
    }

    /// Sends `method path` with an optional JSON body and the harness token.
    pub fn call(&self, method: Method, path: &str, body: Option<Value>) -> Answer {
        self.call_as(self.token.as_deref(), method, path, body)
    }

    /// As `call`, with `bearer` (or no `Authorization` header).
    pub fn call_as(
        &self,
        bearer: Option<&str>,
        method: Method,
        path: &str,
        body: Option<Value>,
    ) -> Answer {
        let mut request = self.http.request(method, self.url(path));
        if let Some(bearer) = bearer {
            request = request.bearer_auth(bearer);
        }
        if let Some(body) = body {
            request = request
                .header("content-type", "application/json")
                .body(body.to_string());
        }
        answer(request.send().expect("request sent"))
    }

    /// Sends raw bytes with a given content type (and the harness token).
    pub fn raw(
        &self,
        method: Method,
        path: &str,
        content_type: Option<&str>,
        body: Vec<u8>,
    ) -> Answer {
        let mut request = self.http.request(method, self.url(path)).body(body);
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(content_type) = content_type {
            request = request.header("content-type", content_type);
        }
        answer(request.send().expect("request sent"))
    }

    pub fn get(&self, path: &str) -> Answer {
        self.call(Method::GET, path, None)
    }

    /// Registers node `id` at `tcp_addr`; asserts 200.
    pub fn register(&self, id: &str, tcp_addr: &str) -> Value {
        let answer = self.call(
            Method::PUT,
            &format!("/v1/nodes/{id}"),
            Some(serde_json::json!({ "tcp_addr": tcp_addr })),
        );
        assert_eq!(answer.status, 200, "{answer:?}");
        answer.body
    }

    /// Posts a range; returns the answer.
    pub fn add_range(
        &self,
        gpa_start: u64,
        length_bytes: u64,
        node_id: &str,
        remote_offset: u64,
    ) -> Answer {
        self.call(
            Method::POST,
            "/v1/map",
            Some(serde_json::json!({
                "gpa_start": gpa_start,
                "length_bytes": length_bytes,
                "node_id": node_id,
                "remote_offset": remote_offset,
            })),
        )
    }

    /// Current map version.
    pub fn version(&self) -> u64 {
        let answer = self.get("/v1/map");
        assert_eq!(answer.status, 200, "{answer:?}");
        answer.body["version"].as_u64().expect("version")
    }
}

fn answer(response: reqwest::blocking::Response) -> Answer {
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let bytes = response.bytes().expect("body");
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    Answer {
        status,
        content_type,
        body,
    }
}

/// Polls `condition` until it holds or [`WAIT_LIMIT`] passes; panics then.
pub fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT_LIMIT;
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(POLL_INTERVAL);
    }
}
