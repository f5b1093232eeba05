//! Other processes of this node id, as the coordinator shows them: one
//! before this one (its nodes may still hold copies: `restart_grace.rs`),
//! one still alive when this one starts (this one waits: two processes of
//! one node would each serve its ranges, one of them empty), and one
//! registered after this one (this one stops serving: `server.rs`).
//! docs/operations.md, "One process per node id".

use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use rdma_transport::coordinator::api::{MapResponse, NodeInfo};

/// How long the probe of another process's address waits for it to
/// accept.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// Whether `epoch`, a node id's epoch as the coordinator has it, is
/// another process's than `mine` (0: an old coordinator's, not known).
pub(crate) fn is_another(epoch: u64, mine: u64) -> bool {
    epoch != 0 && epoch != mine
}

/// Whether `map` names another process of node `node_id` than the one in
/// epoch `mine`: one registered after it.
pub(crate) fn replaced_in(map: &MapResponse, node_id: &str, mine: u64) -> bool {
    map.nodes
        .iter()
        .any(|n| n.id == node_id && is_another(n.epoch, mine))
}

/// Whether `map` names node `node_id` (as a node, or as a holder of a
/// range): a process of it registered before.
pub(crate) fn named(map: &MapResponse, node_id: &str) -> bool {
    map.nodes.iter().any(|n| n.id == node_id)
        || map
            .entries
            .iter()
            .any(|e| e.node_id == node_id || e.replicas.iter().any(|r| r.node_id == node_id))
}

/// Another process of `node_id` that may still be serving, by `map`: its
/// registration is alive (its lease not lapsed), in another epoch than
/// `my_epoch`, at another address than `my_addr` (this process holds that
/// one), and something still accepts connections there (a process that
/// died left a refused port; one that cannot be reached, or stopped, may
/// still serve: its lease decides).
pub(crate) fn alive_other(
    map: &MapResponse,
    node_id: &str,
    my_epoch: u64,
    my_addr: &str,
) -> Option<NodeInfo> {
    let other = map.nodes.iter().find(|n| n.id == node_id)?;
    let someone_else =
        other.alive && is_another(other.epoch, my_epoch) && other.tcp_addr != my_addr;
    (someone_else && may_be_listening(&other.tcp_addr)).then(|| other.clone())
}

/// False only when every address `addr` names refused a connection.
fn may_be_listening(addr: &str) -> bool {
    let Ok(addrs) = addr.to_socket_addrs() else {
        return true;
    };
    let mut any = false;
    for a in addrs {
        any = true;
        match TcpStream::connect_timeout(&a, PROBE_TIMEOUT) {
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionRefused => {}
            _ => return true,
        }
    }
    !any
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdma_transport::coordinator::api::{MapEntry, RangeState, Replica, ReplicaState};

    fn node(id: &str, epoch: u64, addr: &str, alive: bool) -> NodeInfo {
        NodeInfo {
            id: id.into(),
            tcp_addr: addr.into(),
            rdma: None,
            alive,
            last_seen_ms_ago: 0,
            epoch,
        }
    }

    fn map(nodes: Vec<NodeInfo>) -> MapResponse {
        MapResponse {
            version: 1,
            generation: 0,
            entries: Vec::new(),
            nodes,
        }
    }

    #[test]
    fn a_node_is_named_as_a_node_or_as_a_holder() {
        assert!(named(&map(vec![node("a", 3, "x:1", false)]), "a"));
        assert!(!named(&map(vec![node("b", 3, "x:1", true)]), "a"));
        let mut held = map(Vec::new());
        held.entries.push(MapEntry {
            gpa_start: 0,
            length_bytes: 4096,
            node_id: "b".into(),
            remote_offset: 0,
            rdma: None,
            valid_epoch: 1,
            state: RangeState::Live,
            replicas: vec![Replica {
                node_id: "a".into(),
                remote_offset: 0,
                valid_epoch: 1,
                state: ReplicaState::Live,
                recovery_seq: 0,
            }],
        });
        assert!(named(&held, "a") && named(&held, "b") && !named(&held, "c"));
    }

    #[test]
    fn only_a_live_other_process_that_still_accepts_is_waited_for() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let listening = listener.local_addr().unwrap().to_string();
        let refused = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().to_string()
        };
        let mine = "127.0.0.1:1";
        let other = |epoch, addr: &str, alive| {
            alive_other(&map(vec![node("a", epoch, addr, alive)]), "a", 5, mine)
        };
        assert!(other(7, &listening, true).is_some());
        assert!(other(7, &refused, true).is_none(), "its port refuses: dead");
        assert!(other(7, &listening, false).is_none(), "its lease lapsed");
        assert!(other(5, &listening, true).is_none(), "this process itself");
        assert!(
            other(7, mine, true).is_none(),
            "this process holds the address"
        );
        assert!(
            other(0, &listening, true).is_none(),
            "no epoch: an old node"
        );
        assert!(
            other(7, "not an address", true).is_some(),
            "unknown: the lease decides"
        );
    }
}
