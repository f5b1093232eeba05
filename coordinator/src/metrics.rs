//! Prometheus metrics, served as OpenMetrics text on `GET /metrics`:
//!
//! | metric | type | labels |
//! | --- | --- | --- |
//! | `coordinator_http_requests_total` | counter | `method`, `route`, `status` |
//! | `coordinator_http_errors_total` | counter | `method`, `route`, `kind` (`client`: 4xx, `server`: 5xx) |
//! | `coordinator_http_request_duration_seconds` | histogram | `method`, `route` |
//! | `coordinator_lease_renewals_total` | counter | |
//! | `coordinator_superseded_heartbeats_total` | counter | (heartbeats refused: their process was replaced) |
//! | `coordinator_map_version` | gauge | |
//! | `coordinator_map_long_polls_waiting` | gauge | (`GET /v1/map?after=V` waiting for a newer map) |
//!
//! `route` is the route's template (`/v1/nodes/{id}`), so node ids and
//! addresses never become labels; `GET /v1/map` long polls are counted as
//! `/v1/map?after` (their duration is mostly waiting); unknown paths as
//! `unmatched`.

use std::fmt;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::error::ApiError;
use crate::state::AppState;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    method: String,
    route: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StatusLabels {
    method: String,
    route: String,
    status: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    method: String,
    route: String,
    kind: &'static str,
}

/// Request durations from 0.5 ms to about 8 s, doubling.
fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.0005, 2.0, 15))
}

/// The coordinator's metrics and the registry that encodes them.
pub(crate) struct Metrics {
    registry: Registry,
    requests: Family<StatusLabels, Counter>,
    errors: Family<ErrorLabels, Counter>,
    durations: Family<RouteLabels, Histogram, fn() -> Histogram>,
    lease_renewals: Counter,
    superseded_heartbeats: Counter,
    map_version: Gauge,
    long_polls_waiting: Gauge,
}

/// One long poll counted as waiting until it is dropped (answered, or
/// its client gone).
pub(crate) struct WaitingLongPoll(Gauge);

impl Drop for WaitingLongPoll {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("coordinator");
        let requests = Family::<StatusLabels, Counter>::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let durations = Family::<RouteLabels, Histogram, fn() -> Histogram>::new_with_constructor(
            duration_histogram,
        );
        let lease_renewals = Counter::default();
        let superseded_heartbeats = Counter::default();
        let map_version = Gauge::default();
        let long_polls_waiting = Gauge::default();
        registry.register(
            "http_requests",
            "HTTP requests answered, by route and status",
            requests.clone(),
        );
        registry.register(
            "http_errors",
            "HTTP requests answered with an error (client: 4xx, server: 5xx)",
            errors.clone(),
        );
        registry.register(
            "http_request_duration_seconds",
            "Time from a request's head to its answer, by route",
            durations.clone(),
        );
        registry.register(
            "lease_renewals",
            "Heartbeats that renewed a node's lease",
            lease_renewals.clone(),
        );
        registry.register(
            "superseded_heartbeats",
            "Heartbeats refused because another process of the node registered since",
            superseded_heartbeats.clone(),
        );
        registry.register(
            "map_version",
            "The map version this coordinator last saw",
            map_version.clone(),
        );
        registry.register(
            "map_long_polls_waiting",
            "Long polls of the map waiting for a newer version",
            long_polls_waiting.clone(),
        );
        Self {
            registry,
            requests,
            errors,
            durations,
            lease_renewals,
            superseded_heartbeats,
            map_version,
            long_polls_waiting,
        }
    }

    /// Counts a long poll as waiting until the returned guard is dropped.
    pub fn long_poll_waiting(&self) -> WaitingLongPoll {
        self.long_polls_waiting.inc();
        WaitingLongPoll(self.long_polls_waiting.clone())
    }

    /// Counts one answered request.
    fn observe(&self, method: &str, route: &str, status: u16, seconds: f64) {
        let route_labels = RouteLabels {
            method: method.to_owned(),
            route: route.to_owned(),
        };
        self.durations.get_or_create(&route_labels).observe(seconds);
        self.requests
            .get_or_create(&StatusLabels {
                method: method.to_owned(),
                route: route.to_owned(),
                status: status.to_string(),
            })
            .inc();
        let kind = match status {
            400..=499 => "client",
            500..=599 => "server",
            _ => return,
        };
        self.errors
            .get_or_create(&ErrorLabels {
                method: route_labels.method,
                route: route_labels.route,
                kind,
            })
            .inc();
    }

    /// Counts a heartbeat that renewed a lease.
    pub fn lease_renewed(&self) {
        self.lease_renewals.inc();
    }

    /// Counts a heartbeat refused: it named an epoch not the node's current one.
    pub fn heartbeat_superseded(&self) {
        self.superseded_heartbeats.inc();
    }

    /// The OpenMetrics text of every metric, with the map version `version`.
    fn render(&self, version: u64) -> Result<String, fmt::Error> {
        self.map_version
            .set(i64::try_from(version).unwrap_or(i64::MAX));
        let mut text = String::new();
        encode(&mut text, &self.registry)?;
        Ok(text)
    }
}

/// Middleware: times and counts every request (the route template comes
/// from the router's match).
pub(crate) async fn track(
    State(state): State<AppState>,
    matched: Option<MatchedPath>,
    request: Request,
    next: Next,
) -> Response {
    let method = request.method().as_str().to_owned();
    let route = match &matched {
        Some(path) if path.as_str() == "/v1/map" && is_long_poll(request.uri().query()) => {
            "/v1/map?after"
        }
        Some(path) => path.as_str(),
        None => "unmatched",
    }
    .to_owned();
    let started = Instant::now();
    let response = next.run(request).await;
    state.metrics().observe(
        &method,
        &route,
        response.status().as_u16(),
        started.elapsed().as_secs_f64(),
    );
    response
}

fn is_long_poll(query: Option<&str>) -> bool {
    query.is_some_and(|q| q.split('&').any(|pair| pair.starts_with("after=")))
}

/// `GET /metrics`.
pub(crate) async fn metrics(State(state): State<AppState>) -> Result<Response, ApiError> {
    let version = *state.store().versions().borrow();
    let text = state
        .metrics()
        .render(version)
        .map_err(|_| ApiError::Internal("cannot encode the metrics".to_owned()))?;
    Ok((
        [(
            CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}
