//! A stand-in coordinator for the replica recovery and heartbeat tests:
//! plain HTTP/1.1 on std sockets, one range,
//! replicas with the states and rules of issue 9 (a new replica, or one
//! whose node registers a new epoch, is `stale`; `recovering` needs another
//! live replica and bumps `recovery_seq`; `live` needs the same seq and
//! epoch). Only the routes a page-server calls, without credentials. It
//! records when heartbeats came and can refuse some (503).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;
use rdma_transport::coordinator::api::{
    MapEntry, MapResponse, NodeInfo, NodeRegistration, RangeRequest, RangeState, RecoveryBegin,
    RecoveryDone, Replica, ReplicaChange, ReplicaState,
};
use serde::Serialize;

/// The coordinator's state, shared with the test.
#[derive(Debug, Default)]
pub struct FakeState {
    pub version: u64,
    pub nodes: Vec<NodeInfo>,
    pub entry: Option<MapEntry>,
    /// `(node, recovery_seq)` of every `live` request, answered or refused.
    pub finish_requests: Vec<(String, u64)>,
    /// When each heartbeat came, and whether it was answered 200.
    pub heartbeats: Vec<(Instant, bool)>,
    /// The next this many heartbeats are answered 503 (store unavailable).
    pub fail_heartbeats: u32,
}

impl FakeState {
    pub fn replica(&self, node: &str) -> Option<Replica> {
        self.entry
            .as_ref()?
            .replicas
            .iter()
            .find(|r| r.node_id == node)
            .cloned()
    }

    /// What a client does after a failed write: marks `node`'s replica stale.
    pub fn mark_stale(&mut self, node: &str) {
        self.change(node, |r, _| r.state = ReplicaState::Stale);
    }

    pub fn map(&self) -> MapResponse {
        MapResponse {
            version: self.version,
            generation: 0,
            entries: self.entry.iter().cloned().collect(),
            nodes: self.nodes.clone(),
        }
    }

    fn epoch(&self, node: &str) -> u64 {
        self.nodes
            .iter()
            .find(|n| n.id == node)
            .map_or(0, |n| n.epoch)
    }

    fn change(&mut self, node: &str, f: impl FnOnce(&mut Replica, u64)) {
        let epoch = self.epoch(node);
        if let Some(entry) = &mut self.entry {
            if let Some(r) = entry.replicas.iter_mut().find(|r| r.node_id == node) {
                f(r, epoch);
            }
            // The primary is the first live replica.
            if let Some(p) = entry
                .replicas
                .iter()
                .find(|r| r.state == ReplicaState::Live)
            {
                entry.node_id = p.node_id.clone();
                entry.remote_offset = p.remote_offset;
                entry.valid_epoch = p.valid_epoch;
                entry.state = RangeState::Live;
            } else {
                entry.state = RangeState::Lost;
            }
        }
        self.version += 1;
    }
}

pub struct FakeCoordinator {
    pub url: String,
    pub state: Arc<Mutex<FakeState>>,
}

impl FakeCoordinator {
    /// Serves on an ephemeral port until the test process ends.
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let state = Arc::new(Mutex::new(FakeState::default()));
        let served = Arc::clone(&state);
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let state = Arc::clone(&served);
                std::thread::spawn(move || serve(stream, &state));
            }
        });
        Self { url, state }
    }
}

/// One request per connection (the answer closes it).
fn serve(stream: TcpStream, state: &Mutex<FakeState>) {
    let mut reader = BufReader::new(&stream);
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (
        parts.next().unwrap_or("").to_owned(),
        parts.next().unwrap_or("").to_owned(),
    );
    let mut length = 0usize;
    loop {
        let mut header = String::new();
        if reader.read_line(&mut header).is_err() || header.trim().is_empty() {
            break;
        }
        if let Some((name, value)) = header.split_once(':') {
            if name.eq_ignore_ascii_case("content-length") {
                length = value.trim().parse().unwrap_or(0);
            }
        }
    }
    let mut body = vec![0u8; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let (status, answer) = route(&method, &path, &body, &mut state.lock());
    let reply = format!(
        "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        answer.len()
    );
    let mut stream = &stream;
    let _ = stream.write_all(reply.as_bytes());
    let _ = stream.write_all(&answer);
}

fn json<T: Serialize>(value: &T) -> (u16, Vec<u8>) {
    (200, serde_json::to_vec(value).expect("encode"))
}

fn error(status: u16, code: &str) -> (u16, Vec<u8>) {
    let body = format!(r#"{{"error":"{code}","message":"{code}"}}"#);
    (status, body.into_bytes())
}

fn route(method: &str, path: &str, body: &[u8], s: &mut FakeState) -> (u16, Vec<u8>) {
    // The query (e.g. a long poll's `?after=`) is ignored: answered at once.
    let path = path.split('?').next().unwrap_or_default();
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match (method, segments.as_slice()) {
        ("GET", ["v1", "map"]) => json(&s.map()),
        ("PUT", ["v1", "nodes", id]) => {
            let Ok(reg) = serde_json::from_slice::<NodeRegistration>(body) else {
                return error(400, "bad_request");
            };
            let info = NodeInfo {
                id: (*id).to_owned(),
                tcp_addr: reg.tcp_addr,
                rdma: None,
                alive: true,
                last_seen_ms_ago: 0,
                epoch: reg.epoch,
            };
            let new_epoch = s.epoch(id) != reg.epoch;
            s.nodes.retain(|n| n.id != *id);
            s.nodes.push(info.clone());
            if new_epoch && s.replica(id).is_some() {
                s.change(id, |r, _| r.state = ReplicaState::Stale);
            }
            s.version += 1;
            json(&info)
        }
        ("POST", ["v1", "nodes", id, "heartbeat"]) => {
            let refuse = s.fail_heartbeats > 0;
            s.heartbeats.push((Instant::now(), !refuse));
            if refuse {
                s.fail_heartbeats -= 1;
                return error(503, "unavailable");
            }
            match s.nodes.iter().find(|n| n.id == *id) {
                Some(n) => json(n),
                None => error(404, "not_found"),
            }
        }
        ("POST", ["v1", "map"]) => {
            let Ok(req) = serde_json::from_slice::<RangeRequest>(body) else {
                return error(400, "bad_request");
            };
            let epoch = s.epoch(&req.node_id);
            let entry = s.entry.get_or_insert_with(|| MapEntry {
                gpa_start: req.gpa_start,
                length_bytes: req.length_bytes,
                node_id: req.node_id.clone(),
                remote_offset: req.remote_offset,
                rdma: None,
                valid_epoch: epoch,
                state: RangeState::Live,
                replicas: Vec::new(),
            });
            if (entry.gpa_start, entry.length_bytes) != (req.gpa_start, req.length_bytes) {
                return error(409, "conflict");
            }
            if !entry.replicas.iter().any(|r| r.node_id == req.node_id) {
                let first = entry.replicas.is_empty();
                entry.replicas.push(Replica {
                    node_id: req.node_id.clone(),
                    remote_offset: req.remote_offset,
                    valid_epoch: if first { epoch } else { 0 },
                    state: if first {
                        ReplicaState::Live
                    } else {
                        ReplicaState::Stale
                    },
                    recovery_seq: 0,
                });
            }
            s.version += 1;
            json(s.entry.as_ref().expect("entry"))
        }
        ("POST", ["v1", "map", _, "replicas", id, "recovering"]) => {
            let Ok(begin) = serde_json::from_slice::<RecoveryBegin>(body) else {
                return error(400, "bad_request");
            };
            if begin.epoch != s.epoch(id) {
                return error(409, "conflict");
            }
            let other_live = s.entry.as_ref().is_some_and(|e| {
                e.replicas
                    .iter()
                    .any(|r| r.node_id != *id && r.state == ReplicaState::Live)
            });
            if !other_live || s.replica(id).is_none() {
                return error(409, "conflict");
            }
            s.change(id, |r, epoch| {
                r.state = ReplicaState::Recovering;
                r.valid_epoch = epoch;
                r.recovery_seq += 1;
            });
            changed(s)
        }
        ("POST", ["v1", "map", _, "replicas", id, "live"]) => {
            let Ok(done) = serde_json::from_slice::<RecoveryDone>(body) else {
                return error(400, "bad_request");
            };
            s.finish_requests
                .push(((*id).to_owned(), done.recovery_seq));
            let epoch = s.epoch(id);
            let ok = s.replica(id).is_some_and(|r| {
                r.state == ReplicaState::Recovering
                    && r.recovery_seq == done.recovery_seq
                    && r.valid_epoch == epoch
                    && done.epoch == epoch
            });
            if !ok {
                return error(409, "conflict");
            }
            s.change(id, |r, _| r.state = ReplicaState::Live);
            changed(s)
        }
        _ => error(404, "not_found"),
    }
}

fn changed(s: &FakeState) -> (u16, Vec<u8>) {
    json(&ReplicaChange {
        version: s.version,
        generation: 0,
        entry: s.entry.clone().expect("entry"),
    })
}
