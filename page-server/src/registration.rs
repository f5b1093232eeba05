//! Registering this node and its GPA ranges with the coordinator, retrying
//! while the coordinator is not up, then heartbeating to keep the lease.
//! A coordinator that forgot the node (it restarted on an empty database)
//! gets the node and every range again.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use rdma_transport::coordinator::api::{NodeInfo, NodeRegistration, RangeRequest, RdmaEndpoint};
use rdma_transport::coordinator::{CoordinatorClient, CoordinatorError, Credential};

use crate::config::ServerConfig;
use crate::layout::Layout;
use crate::other_processes;
use crate::range_contents::RangesSeen;
use crate::readiness::Standing;
use crate::restart_grace::RestartGrace;
use crate::self_fence::SelfFence;
use crate::server::ServerError;

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Pending,
    Registered,
    Refused(String),
    /// Another process registered as this node after this one.
    Superseded(String),
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<Option<State>>,
    changed: Condvar,
    stop: Mutex<Wake>,
    stop_cv: Condvar,
    /// Registrations put off because another process of the node was alive.
    waits_for_other: AtomicU64,
}

/// Why the registration thread's sleep ends early.
#[derive(Debug, Default)]
struct Wake {
    stop: bool,
    /// The process fenced itself (`self_fence.rs`): a heartbeat is to go
    /// at once.
    heartbeat_now: bool,
}

/// What a process does when another registered as its node after it.
pub(crate) type OnSuperseded = Box<dyn FnOnce() + Send>;

/// Who is told of this node's other processes (`other_processes.rs`).
pub(crate) struct OtherProcesses {
    /// Learns whether the coordinator knew of an earlier process of this
    /// node when this one registers.
    pub(crate) restart_grace: Arc<RestartGrace>,
    /// Called once if another process registers as this node after this
    /// one (its heartbeat is answered with another epoch); heartbeats stop.
    pub(crate) on_superseded: OnSuperseded,
    /// Armed once registered, and told of each heartbeat answered with
    /// this process's epoch (`self_fence.rs`).
    pub(crate) self_fence: Arc<SelfFence>,
}

/// How often the wait for another process of this node is warned about.
const OTHER_WARN_INTERVAL: Duration = Duration::from_secs(10);

/// The background registration and heartbeat thread.
#[derive(Debug)]
pub(crate) struct Registration {
    shared: Arc<Shared>,
    handle: Option<JoinHandle<()>>,
}

struct Plan {
    node_id: String,
    registration: NodeRegistration,
    /// Every exported range, each at its offset in the exported memory.
    ranges: Vec<RangeRequest>,
    /// What each claim says the memory holds (`range_contents.rs`).
    seen: Arc<RangesSeen>,
    /// Told when the map names this node before it registers.
    restart_grace: Arc<RestartGrace>,
    /// Called once, when another process registered as this node.
    on_superseded: Mutex<Option<OnSuperseded>>,
    self_fence: Arc<SelfFence>,
    heartbeat: Duration,
    retry: Duration,
}

impl Registration {
    /// Starts registering `config`'s node at `bound`, publishing its RDMA
    /// device endpoint when given (never a region key: each client gets its
    /// own in the handshake) and `epoch`, the handshake's: the coordinator
    /// tells from it whether this process holds its ranges' contents.
    /// `others` is told of this node's other processes.
    pub(crate) fn start(
        config: &ServerConfig,
        layout: &Layout,
        bound: SocketAddr,
        rdma: Option<RdmaEndpoint>,
        epoch: u64,
        seen: Arc<RangesSeen>,
        others: OtherProcesses,
    ) -> Self {
        let shared = Arc::new(Shared::default());
        *shared.state.lock() = Some(State::Pending);
        let plan = Plan {
            node_id: config.node_id.clone(),
            registration: NodeRegistration {
                tcp_addr: config
                    .advertise
                    .clone()
                    .unwrap_or_else(|| bound.to_string()),
                rdma,
                epoch,
            },
            ranges: layout
                .ranges()
                .iter()
                .map(|r| RangeRequest {
                    gpa_start: r.gpa_start,
                    length_bytes: r.length_bytes,
                    node_id: config.node_id.clone(),
                    remote_offset: r.remote_offset,
                    rdma: None,
                    contents: Default::default(),
                })
                .collect(),
            seen,
            restart_grace: others.restart_grace,
            on_superseded: Mutex::new(Some(others.on_superseded)),
            self_fence: others.self_fence,
            heartbeat: config.heartbeat_interval,
            retry: config.register_retry,
        };
        let url = config.coordinator_url.clone().unwrap_or_default();
        let credential = node_credential(config);
        let nudged = Arc::downgrade(&shared);
        plan.self_fence.on_fence(Box::new(move || {
            if let Some(shared) = nudged.upgrade() {
                shared.heartbeat_now();
            }
        }));
        let thread_shared = Arc::clone(&shared);
        let handle = std::thread::Builder::new()
            .name("page-server-register".into())
            .spawn(move || run(&thread_shared, &url, &credential, &plan))
            .map_err(|err| tracing::error!(%err, "cannot start the registration thread"))
            .ok();
        Self { shared, handle }
    }

    /// A handle that tells whether the registration has succeeded (for
    /// threads that must not start before it).
    pub(crate) fn watch(&self) -> RegisteredWatch {
        RegisteredWatch(Arc::clone(&self.shared))
    }

    pub(crate) fn wait(&self, timeout: Duration) -> Result<(), ServerError> {
        let deadline = Instant::now() + timeout;
        let mut state = self.shared.state.lock();
        loop {
            match state.clone() {
                Some(State::Registered) => return Ok(()),
                Some(State::Refused(why) | State::Superseded(why)) => {
                    return Err(ServerError::Registration(why))
                }
                _ => {}
            }
            if self
                .shared
                .changed
                .wait_until(&mut state, deadline)
                .timed_out()
            {
                return match state.clone() {
                    Some(State::Registered) => Ok(()),
                    _ => Err(ServerError::RegistrationTimeout(timeout)),
                };
            }
        }
    }

    pub(crate) fn stop(mut self) {
        self.shared.stop.lock().stop = true;
        self.shared.stop_cv.notify_all();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Whether a [`Registration`] has succeeded; see [`Registration::watch`].
#[derive(Debug, Clone)]
pub(crate) struct RegisteredWatch(Arc<Shared>);

impl RegisteredWatch {
    /// True once the node and all its ranges were registered.
    pub(crate) fn is_registered(&self) -> bool {
        self.standing() == Standing::Registered
    }

    /// Where this process stands with the coordinator.
    pub(crate) fn standing(&self) -> Standing {
        match *self.0.state.lock() {
            Some(State::Registered) => Standing::Registered,
            Some(State::Superseded(_)) => Standing::Superseded,
            _ => Standing::NotYet,
        }
    }

    /// Sets what the registration knows in `stats`: registrations put off
    /// for another process of this node, and whether one registered after
    /// this one.
    pub(crate) fn fill(&self, stats: &mut crate::stats::ServerStats) {
        stats.registrations_put_off = self.0.waits_for_other.load(Ordering::Relaxed);
        stats.superseded = self.standing() == Standing::Superseded;
    }
}

/// The credential this node speaks to the coordinator with. With a cluster
/// key, its own node credential, which lets it change nothing but its own
/// registration, ranges and replicas (and read the map).
pub(crate) fn node_credential(config: &ServerConfig) -> Credential {
    match (&config.cluster_key, &config.coordinator_token) {
        (Some(key), _) => Credential::Node {
            id: config.node_id.clone(),
            key: key.clone(),
        },
        (None, Some(token)) => Credential::Token(token.clone()),
        (None, None) => Credential::None,
    }
}

impl Shared {
    fn set(&self, state: State) {
        *self.state.lock() = Some(state);
        self.changed.notify_all();
    }

    /// Sleeps for `d` unless stopped or asked for a heartbeat first; true
    /// when stopped.
    fn sleep(&self, d: Duration) -> bool {
        let mut wake = self.stop.lock();
        if !wake.stop && !wake.heartbeat_now {
            let _ = self.stop_cv.wait_for(&mut wake, d);
        }
        wake.heartbeat_now = false;
        wake.stop
    }

    /// Ends the current sleep: a heartbeat goes now.
    fn heartbeat_now(&self) {
        self.stop.lock().heartbeat_now = true;
        self.stop_cv.notify_all();
    }
}

fn run(shared: &Shared, url: &str, credential: &Credential, plan: &Plan) {
    let client = match CoordinatorClient::with_credential(url, credential, Duration::from_secs(2)) {
        Ok(c) => c,
        Err(err) => {
            tracing::error!(%err, "bad coordinator URL or node id");
            shared.set(State::Refused(err.to_string()));
            return;
        }
    };
    let mut registered = false;
    // Heartbeats failed in a row: the lease is at risk, so the next one goes
    // after the retry pause rather than a whole heartbeat period, doubling
    // with each further failure up to the period (a coordinator that stays
    // unavailable gets no more than the heartbeat rate from every node).
    let mut beats_failed: u32 = 0;
    let mut other_warned: Option<Instant> = None;
    loop {
        if !registered {
            let sent_at = plan.self_fence.stamp();
            match register(&client, plan) {
                Ok(()) => {
                    tracing::info!(
                        node = %plan.node_id,
                        ranges = plan.ranges.len(),
                        "registered with the coordinator"
                    );
                    registered = true;
                    shared.set(State::Registered);
                    plan.self_fence.confirm(sent_at);
                    plan.self_fence.arm();
                }
                Err(RegisterError::Coordinator(err)) if err.is_unreachable() => {
                    tracing::debug!(%err, "coordinator not reachable yet; retrying");
                }
                Err(RegisterError::OtherProcessAlive(other)) => {
                    shared.waits_for_other.fetch_add(1, Ordering::Relaxed);
                    if !matches!(other_warned, Some(at) if at.elapsed() < OTHER_WARN_INTERVAL) {
                        other_warned = Some(Instant::now());
                        tracing::warn!(
                            node = %plan.node_id,
                            other_addr = %other.tcp_addr,
                            other_epoch = other.epoch,
                            "another process of this node is registered, its lease current and \
                             its address accepting connections: not registering until it is gone \
                             (two processes of one node would each serve its ranges)"
                        );
                    }
                }
                Err(RegisterError::Coordinator(err)) => {
                    tracing::error!(%err, "coordinator refused the registration");
                    shared.set(State::Refused(err.to_string()));
                    // Refusals (conflicting range, bad token) do not fix
                    // themselves quickly; try again at the heartbeat pace.
                    if shared.sleep(plan.heartbeat) {
                        return;
                    }
                    continue;
                }
            }
        }
        let pause = if !registered {
            plan.retry
        } else if beats_failed == 0 && plan.self_fence.is_fenced() {
            // The process fenced itself (a stall, or its lease fence) and
            // awaits the coordinator's word: the last heartbeat went before.
            Duration::ZERO
        } else if beats_failed == 0 {
            plan.heartbeat
        } else {
            heartbeat_retry_pause(plan.retry, plan.heartbeat, beats_failed)
        };
        if shared.sleep(pause) {
            return;
        }
        if registered {
            let sent_at = plan.self_fence.stamp();
            // In this process's epoch: once another process registered,
            // the coordinator renews nothing for this one (its lease is the
            // other's now).
            let beat = client.heartbeat_in_epoch(&plan.node_id, plan.registration.epoch);
            let replaced_by = match &beat {
                Err(err) if err.is_superseded() => Some(err.to_string()),
                // A coordinator that does not check the epoch renewed the
                // lease anyway; its answer names the other process.
                Ok(info) if other_processes::is_another(info.epoch, plan.registration.epoch) => {
                    Some(format!(
                        "node {} is registered in epoch {:#x} at {}",
                        plan.node_id, info.epoch, info.tcp_addr
                    ))
                }
                _ => None,
            };
            if let Some(other) = replaced_by {
                let why = format!(
                    "another process registered as node {} after this one (epoch {:#x}): this \
                     one serves no more ({other})",
                    plan.node_id, plan.registration.epoch
                );
                tracing::error!("{why}");
                shared.set(State::Superseded(why));
                plan.self_fence.end();
                if let Some(on_superseded) = plan.on_superseded.lock().take() {
                    on_superseded();
                }
                // No more heartbeats (to a coordinator that does not check
                // their epoch, they would keep the other's lease).
                return;
            }
            match beat {
                Ok(_) => {
                    beats_failed = 0;
                    plan.self_fence.confirm(sent_at);
                }
                Err(err) if err.is_not_found() => {
                    tracing::warn!("coordinator forgot this node; registering again");
                    registered = false;
                    beats_failed = 0;
                }
                Err(err) => {
                    beats_failed = beats_failed.saturating_add(1);
                    tracing::debug!(%err, beats_failed, "heartbeat failed; retrying soon");
                }
            }
        }
    }
}

/// The pause before the next heartbeat after `failed` (at least one) failed
/// in a row: `retry`, doubled for each further failure, at most `period`.
fn heartbeat_retry_pause(retry: Duration, period: Duration, failed: u32) -> Duration {
    let doublings = failed.saturating_sub(1).min(16);
    retry.saturating_mul(1 << doublings).min(period)
}

/// Why this process did not register (yet).
#[derive(Debug)]
enum RegisterError {
    Coordinator(CoordinatorError),
    /// Another process of this node id may still be serving.
    OtherProcessAlive(Box<NodeInfo>),
}

impl From<CoordinatorError> for RegisterError {
    fn from(err: CoordinatorError) -> Self {
        Self::Coordinator(err)
    }
}

fn register(client: &CoordinatorClient, plan: &Plan) -> Result<(), RegisterError> {
    // Before this process's registration: once it is in, an operator may
    // re-initialise the ranges in this epoch, and nodes of the process
    // before may still hold copies (`restart_grace.rs`).
    let map = client.map()?;
    if let Some(other) = other_processes::alive_other(
        &map,
        &plan.node_id,
        plan.registration.epoch,
        &plan.registration.tcp_addr,
    ) {
        return Err(RegisterError::OtherProcessAlive(Box::new(other)));
    }
    if other_processes::named(&map, &plan.node_id) {
        plan.restart_grace
            .had_predecessor("the coordinator knew this node before this process registered");
    }
    client.register_node(&plan.node_id, &plan.registration)?;
    if let Some(endpoint) = &plan.registration.rdma {
        // Also through the dedicated route, so coordinators that keep
        // endpoints apart from registrations have it too.
        client.set_rdma_endpoint(&plan.node_id, endpoint)?;
    }
    // Each claim is idempotent (a range the node holds keeps its state and
    // gets its offset refreshed), so a registration that failed half-way
    // is simply made again from the start.
    for (index, range) in plan.ranges.iter().enumerate() {
        let range = &RangeRequest {
            contents: plan.seen.contents(index),
            ..range.clone()
        };
        if let Err(err) = client.add_range(range) {
            if !err.is_unreachable() {
                tracing::warn!(
                    node = %plan.node_id,
                    gpa_start = format_args!("{:#x}", range.gpa_start),
                    length_bytes = range.length_bytes,
                    %err,
                    "the coordinator refused this range"
                );
            }
            return Err(err.into());
        }
        tracing::debug!(
            node = %plan.node_id,
            gpa_start = format_args!("{:#x}", range.gpa_start),
            length_bytes = range.length_bytes,
            remote_offset = format_args!("{:#x}", range.remote_offset),
            contents = ?range.contents,
            "range claimed"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_heartbeats_are_retried_soon_then_back_off_to_the_period() {
        let (retry, period) = (Duration::from_millis(200), Duration::from_secs(1));
        let pauses: Vec<u128> = (1..=6)
            .map(|failed| heartbeat_retry_pause(retry, period, failed).as_millis())
            .collect();
        assert_eq!(pauses, [200, 400, 800, 1000, 1000, 1000]);
        assert_eq!(heartbeat_retry_pause(retry, period, u32::MAX), period);
    }
}
