//! The handshake, server side: HELLO (client nonce) → CHALLENGE (server
//! nonce, epoch, proof of the cluster key) → AUTH (client proof, QP
//! endpoint) → HELLO_ACK (region, QP endpoint and rkey). Until the client's
//! proof is checked, nothing but the handshake is answered: no page, no QP,
//! no rkey. A failed proof closes the connection, is counted, and is logged
//! once per peer per interval.

use std::collections::HashMap;
use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdma_transport::auth::{self, ClusterKey, Nonce, Role, Transcript};
use rdma_transport::wire::{AuthRequest, Challenge, HelloAck, HelloRequest, VERSION};
use rdma_transport::PAGE_SIZE;

use crate::rdma::{RdmaExport, ServerQp};

/// Shortest time between two log lines about the same peer's failures.
const LOG_INTERVAL: Duration = Duration::from_secs(10);
/// Peers remembered for that; beyond it the table starts over.
const MAX_LOGGED_PEERS: usize = 4096;

/// Who this server is and how it checks its clients.
#[derive(Debug)]
pub(crate) struct ServerAuth {
    pub(crate) node_id: String,
    /// `None`: insecure (accepts clients without a key; keyed clients
    /// refuse it).
    pub(crate) key: Option<ClusterKey>,
    failures: AtomicU64,
    failures_logged: PeerLogLimit,
    /// Clients told that their node bound is too long.
    bounds_logged: PeerLogLimit,
}

/// When each peer was last logged about, to log each at most once per
/// [`LOG_INTERVAL`] (a client that retries cannot flood the log).
#[derive(Debug, Default)]
struct PeerLogLimit(Mutex<HashMap<Option<IpAddr>, Instant>>);

impl PeerLogLimit {
    /// Whether to log about `peer` now (and if so, notes that it was).
    fn allows(&self, peer: Option<IpAddr>) -> bool {
        let mut logged = self.0.lock();
        let now = Instant::now();
        if logged
            .get(&peer)
            .is_some_and(|t| now.duration_since(*t) < LOG_INTERVAL)
        {
            return false;
        }
        if logged.len() >= MAX_LOGGED_PEERS {
            logged.clear();
        }
        logged.insert(peer, now);
        true
    }
}

impl ServerAuth {
    pub(crate) fn new(node_id: String, key: Option<ClusterKey>) -> Self {
        Self {
            node_id,
            key,
            failures: AtomicU64::new(0),
            failures_logged: PeerLogLimit::default(),
            bounds_logged: PeerLogLimit::default(),
        }
    }

    /// Handshakes refused because the client's proof was missing or wrong.
    pub(crate) fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }

    fn refuse(&self, peer: Option<IpAddr>, client_id: u64, why: &str) {
        let total = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if !self.failures_logged.allows(peer) {
            return;
        }
        tracing::warn!(
            ?peer,
            client_id,
            total_failures = total,
            "refused a client that failed authentication: {why}"
        );
    }
}

/// Where one connection's handshake stands.
#[derive(Debug, Default)]
pub(crate) enum Stage {
    /// Nothing received yet.
    #[default]
    AwaitHello,
    /// CHALLENGE sent; waiting for the client's AUTH.
    Challenged {
        client_id: u64,
        client_nonce: Nonce,
        server_nonce: Nonce,
    },
    /// Authenticated: pages may flow.
    Ready,
}

/// One connection's handshake state and the QP made for it (destroyed when
/// the connection ends).
#[derive(Debug, Default)]
pub(crate) struct Session {
    pub(crate) stage: Stage,
    pub(crate) qp: Option<Arc<ServerQp>>,
    pub(crate) peer: Option<IpAddr>,
    /// Page checksums agreed in the HELLO_ACK: WRITEs are checked, READ
    /// answers carry one.
    pub(crate) checksums: bool,
    /// With `checksums`: the client asked for offset-bound WRITE checksums
    /// (`rdma_transport::wire::offset_bound_checksum`), and got them.
    pub(crate) bound_sums: bool,
    /// The client asked for RDMA and was answered without it: a replica
    /// recovery was running (see `Connections::fence`).
    pub(crate) rdma_withheld: bool,
    /// The bound on this server's silence the client declared as a
    /// coherence node (`AuthRequest::node_bound_ms`).
    pub(crate) node_bound: Option<Duration>,
    /// The id the client said HELLO with, once authenticated.
    pub(crate) client_id: Option<u64>,
}

impl Session {
    pub(crate) fn is_ready(&self) -> bool {
        matches!(self.stage, Stage::Ready)
    }
}

/// Why a connection is closed during its handshake.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Refusal {
    #[error("handshake message out of order")]
    OutOfOrder,
    #[error("a request before the handshake completed")]
    BeforeHandshake,
    #[error("client failed authentication")]
    AuthFailed,
    #[error("no random bytes for a nonce: {0}")]
    Random(std::io::Error),
}

/// HELLO: remembers the client's nonce and answers with a CHALLENGE
/// payload. `Ok(None)`: the HELLO payload is malformed (answered with a
/// refusal that keeps the framing).
pub(crate) fn on_hello(
    payload: &[u8],
    auth: &ServerAuth,
    epoch: u64,
    session: &mut Session,
) -> Result<Option<Vec<u8>>, Refusal> {
    if !matches!(session.stage, Stage::AwaitHello) {
        return Err(Refusal::OutOfOrder);
    }
    let Some(hello) = HelloRequest::decode(payload) else {
        return Ok(None);
    };
    let server_nonce = auth::nonce().map_err(Refusal::Random)?;
    let proof = auth.key.as_ref().map(|key| {
        Transcript {
            version: VERSION,
            client_id: hello.client_id,
            node_id: &auth.node_id,
            client_nonce: &hello.nonce,
            server_nonce: &server_nonce,
            epoch,
        }
        .prove(key, Role::Server)
    });
    tracing::debug!(client_id = hello.client_id, "client said HELLO");
    session.stage = Stage::Challenged {
        client_id: hello.client_id,
        client_nonce: hello.nonce,
        server_nonce,
    };
    Ok(Some(
        Challenge {
            epoch,
            nonce: server_nonce,
            proof,
        }
        .encode(),
    ))
}

/// What a handshake offers a client that asks for RDMA.
#[derive(Clone, Copy)]
pub(crate) enum RdmaOffer<'a> {
    /// No RDMA here.
    None,
    /// A replica recovery is running: every write must come over the
    /// socket (see `Connections::fence`).
    Paused,
    Offered(&'a RdmaExport),
}

impl<'a> RdmaOffer<'a> {
    pub(crate) fn of(export: Option<&'a RdmaExport>, paused: bool) -> Self {
        match export {
            None => Self::None,
            Some(_) if paused => Self::Paused,
            Some(e) => Self::Offered(e),
        }
    }
}

/// What a server agrees to besides RDMA.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Terms {
    /// Page checksums, to a client that asks.
    pub(crate) checksums: bool,
    /// The longest bound on its silence a coherence node may have
    /// (`ServerConfig::node_dead_home_timeout`), told to a client that
    /// declares one.
    pub(crate) node_bound_limit: Duration,
}

/// AUTH: checks the client's proof, sets up the client's QP if it asked
/// for RDMA and it is offered (see [`RdmaOffer`]), agrees to page checksums if it asked
/// and `terms` offer them, records the node bound it declared, and answers
/// with a HELLO_ACK payload (which then gives the longest bound accepted).
pub(crate) fn on_auth(
    payload: &[u8],
    auth: &ServerAuth,
    epoch: u64,
    region_size_bytes: u64,
    rdma: RdmaOffer<'_>,
    terms: Terms,
    session: &mut Session,
) -> Result<Vec<u8>, Refusal> {
    let Stage::Challenged {
        client_id,
        client_nonce,
        server_nonce,
    } = session.stage
    else {
        return Err(Refusal::OutOfOrder);
    };
    let Some(request) = AuthRequest::decode(payload) else {
        auth.refuse(session.peer, client_id, "malformed AUTH");
        return Err(Refusal::AuthFailed);
    };
    if let Some(key) = &auth.key {
        let transcript = Transcript {
            version: VERSION,
            client_id,
            node_id: &auth.node_id,
            client_nonce: &client_nonce,
            server_nonce: &server_nonce,
            epoch,
        };
        let proven = request
            .proof
            .is_some_and(|proof| transcript.verify(key, Role::Client, &proof));
        if !proven {
            let why = match request.proof {
                Some(_) => "wrong proof of the cluster key",
                None => "no cluster key",
            };
            auth.refuse(session.peer, client_id, why);
            return Err(Refusal::AuthFailed);
        }
    }
    session.stage = Stage::Ready;
    session.client_id = Some(client_id);
    session.checksums = request.checksums && terms.checksums;
    session.node_bound = request
        .node_bound_ms
        .map(|ms| Duration::from_millis(ms.get().into()));
    let limit_ms = u32::try_from(terms.node_bound_limit.as_millis()).unwrap_or(u32::MAX);
    if let Some(bound) = request
        .node_bound_ms
        .filter(|b| b.get() > limit_ms && auth.bounds_logged.allows(session.peer))
    {
        tracing::warn!(
            peer = ?session.peer,
            client_id,
            node_bound_ms = bound.get(),
            limit_ms,
            "a client declared a bound on this server's silence longer than it waits for a \
             silent node (--node-dead-home-timeout-ms): it will not be a coherence node"
        );
    }
    session.bound_sums = session.checksums && request.bound_sums;
    let mut coherence = None;
    let rdma = match (&request.rdma, rdma) {
        (Some(_), RdmaOffer::Paused) => {
            tracing::debug!(
                client_id,
                "replica recovery running: answering without RDMA until it ends"
            );
            session.rdma_withheld = true;
            None
        }
        (Some(client), RdmaOffer::Offered(export)) if request.coherence => {
            match export.accept_channel(client) {
                Ok((qp, answer, ring)) => {
                    tracing::debug!(
                        client_id,
                        qpn = qp.qpn(),
                        client_qpn = client.qpn,
                        "coherence channel ready for client"
                    );
                    session.qp = Some(qp);
                    coherence = Some(ring);
                    Some(answer)
                }
                Err(err) => {
                    tracing::warn!(client_id, %err, "cannot set up a coherence channel; answering without RDMA");
                    None
                }
            }
        }
        (Some(client), RdmaOffer::Offered(export)) => match export.accept(client) {
            Ok((qp, answer)) => {
                tracing::debug!(
                    client_id,
                    qpn = qp.qpn(),
                    client_qpn = client.qpn,
                    "RDMA QP ready for client"
                );
                session.qp = Some(qp);
                Some(answer)
            }
            Err(err) => {
                tracing::warn!(client_id, %err, "cannot set up a QP for the client; answering without RDMA");
                None
            }
        },
        _ => None,
    };
    Ok(HelloAck {
        region_size_bytes,
        epoch,
        page_size: PAGE_SIZE as u32,
        rdma,
        checksums: session.checksums,
        bound_sums: session.bound_sums,
        coherence,
        // At least 1 ms (`server::check_limits`).
        node_bound_limit_ms: request
            .node_bound_ms
            .map(|_| NonZeroU32::new(limit_ms).unwrap_or(NonZeroU32::MIN)),
    }
    .encode())
}
