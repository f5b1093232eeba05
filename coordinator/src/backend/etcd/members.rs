//! Which etcd members the coordinator sends its requests to.
//!
//! etcd-client balances requests over every endpoint it was given and never
//! checks them: after a member dies, a share of all requests still goes to
//! it and fails (or hangs until the request timeout, when its machine is
//! gone) for as long as it stays down. A heartbeat makes several etcd
//! requests, so during a failover one of them often lands on the dead
//! member and the heartbeat fails or answers late; with the default 3 s
//! lease and 1 s heartbeat, page-servers were reported dead while the
//! cluster kept its quorum (coordinator/tests/etcd_cluster.rs).
//!
//! A prober asks each member, on a connection of its own, every
//! [`PROBE_INTERVAL`], for its status and then for a linearizable read of
//! one key (which it can only serve through a leader that still has its
//! quorum). A member that does not answer within [`PROBE_TIMEOUT`], or
//! answers but cannot serve the read while others can, leaves the balance;
//! it comes back when it serves again. The read is what finds a member cut
//! off from its peers: it still answers its status, naming the leader it
//! lost, until an election timeout later, and requests sent to it wait for
//! the request timeout (coordinator/tests/etcd_partition.rs). During an
//! election the members that answer stay. When none answers, the balance
//! stays as it was: requests then fail as they would anyway, and a round
//! of probes that all timed out (the prober itself held up, say, on a
//! loaded host) puts no member it had found dead back.

use std::collections::BTreeSet;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions, GetOptions};

/// How often every member is probed.
pub(super) const PROBE_INTERVAL: Duration = Duration::from_millis(250);

/// A member that has not answered within this long is out of the balance.
pub(super) const PROBE_TIMEOUT: Duration = Duration::from_millis(500);

/// `endpoint` as the balance knows it (etcd-client adds `http://` to a bare
/// `host:port`, and removes by the URI it was given).
pub(super) fn balance_key(endpoint: &str) -> String {
    if endpoint.starts_with("http://") || endpoint.starts_with("https://") {
        endpoint.to_owned()
    } else {
        format!("http://{endpoint}")
    }
}

/// What a member's status request gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    /// No answer within [`PROBE_TIMEOUT`].
    Down,
    /// It answers, but cannot serve a linearizable read (an election, or
    /// it is cut off from the leader or the leader from its quorum).
    CannotRead,
    /// It serves a linearizable read.
    Up,
}

/// The members requests should go to: those that served the read; during
/// an election (none served it), those that answered. `None` when none
/// answered: the balance is left as it was.
fn wanted(probes: &[(String, Probe)]) -> Option<BTreeSet<String>> {
    let with = |good: &[Probe]| -> BTreeSet<String> {
        probes
            .iter()
            .filter(|(_, probe)| good.contains(probe))
            .map(|(key, _)| key.clone())
            .collect()
    };
    [with(&[Probe::Up]), with(&[Probe::Up, Probe::CannotRead])]
        .into_iter()
        .find(|set| !set.is_empty())
}

/// One member and the client that reaches it alone.
struct Member {
    key: String,
    client: Option<Client>,
}

impl Member {
    /// Asks the member for its status, then for a linearizable read of
    /// `key`.
    async fn probe(&mut self, options: &ConnectOptions, key: &str) -> Probe {
        if self.client.is_none() {
            let connect = Client::connect([self.key.as_str()], Some(options.clone()));
            self.client = tokio::time::timeout(PROBE_TIMEOUT, connect)
                .await
                .ok()
                .and_then(Result::ok);
        }
        let Some(client) = self.client.as_mut() else {
            return Probe::Down;
        };
        match tokio::time::timeout(PROBE_TIMEOUT, client.status()).await {
            Ok(Ok(status)) if status.leader() != 0 => {}
            Ok(Ok(_)) => return Probe::CannotRead,
            Ok(Err(error)) => {
                tracing::debug!(member = %self.key, %error, "etcd member did not answer its status");
                return Probe::Down;
            }
            Err(_) => {
                tracing::debug!(member = %self.key, "etcd member's status timed out");
                return Probe::Down;
            }
        }
        let read = client.get(key, Some(GetOptions::new().with_count_only()));
        match tokio::time::timeout(PROBE_TIMEOUT, read).await {
            Ok(Ok(_)) => Probe::Up,
            Ok(Err(error)) => {
                tracing::debug!(member = %self.key, %error, "etcd member cannot serve a read");
                Probe::CannotRead
            }
            Err(_) => {
                tracing::debug!(member = %self.key, "etcd member's read timed out");
                Probe::CannotRead
            }
        }
    }
}

/// Keeps `client`'s balance to the members of `endpoints` that serve a
/// linearizable read of `read_key`, until aborted; counts each change of
/// the balance in `changes`.
pub(super) async fn keep_healthy_members(
    client: Client,
    endpoints: Vec<String>,
    options: ConnectOptions,
    read_key: String,
    changes: tokio::sync::watch::Sender<u64>,
) {
    let options = options
        .with_timeout(PROBE_TIMEOUT)
        .with_connect_timeout(PROBE_TIMEOUT);
    let mut members: Vec<Member> = endpoints
        .iter()
        .map(|endpoint| Member {
            key: balance_key(endpoint),
            client: None,
        })
        .collect();
    let mut in_balance: BTreeSet<String> = members.iter().map(|m| m.key.clone()).collect();
    let mut ticks = tokio::time::interval(PROBE_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        // Every member at once, so that one that hangs delays no other.
        let probes = futures_util::future::join_all(
            members.iter_mut().map(|m| m.probe(&options, &read_key)),
        )
        .await;
        let answers: Vec<(String, Probe)> =
            members.iter().map(|m| m.key.clone()).zip(probes).collect();
        let Some(wanted) = wanted(&answers) else {
            tracing::debug!("no etcd member answered its probe; the balance stays as it was");
            continue;
        };
        for key in in_balance.difference(&wanted) {
            tracing::warn!(member = %key, "etcd member does not answer (or cannot serve reads while others can); no requests go to it until it does");
            if let Err(error) = client.remove_endpoint(key).await {
                tracing::warn!(member = %key, %error, "cannot take the etcd member out of the balance");
            }
        }
        for key in wanted.difference(&in_balance) {
            tracing::info!(member = %key, "etcd member answers again; requests go to it");
            if let Err(error) = client.add_endpoint(key).await {
                tracing::warn!(member = %key, %error, "cannot put the etcd member back in the balance");
            }
        }
        if in_balance != wanted {
            changes.send_modify(|count| *count += 1);
        }
        in_balance = wanted;
    }
}

#[cfg(test)]
mod tests {
    use super::{balance_key, wanted, Probe};

    fn probes(list: &[(&str, Probe)]) -> Vec<(String, Probe)> {
        list.iter().map(|(k, p)| ((*k).to_owned(), *p)).collect()
    }

    fn keys(list: &[&str]) -> Option<std::collections::BTreeSet<String>> {
        Some(list.iter().map(|k| (*k).to_owned()).collect())
    }

    #[test]
    fn requests_go_to_the_members_that_serve_reads() {
        use Probe::{CannotRead, Down, Up};
        // A dead follower, or one cut off from its peers, leaves.
        assert_eq!(
            wanted(&probes(&[("a", Up), ("b", Up), ("c", Down)])),
            keys(&["a", "b"])
        );
        assert_eq!(
            wanted(&probes(&[("a", Up), ("b", Up), ("c", CannotRead)])),
            keys(&["a", "b"])
        );
        // During an election the living members stay, the dead one leaves.
        assert_eq!(
            wanted(&probes(&[
                ("a", CannotRead),
                ("b", CannotRead),
                ("c", Down)
            ])),
            keys(&["a", "b"])
        );
        // Nobody answers: the balance stays as it was (a member found
        // dead before does not come back with the others).
        assert_eq!(
            wanted(&probes(&[("a", Down), ("b", Down), ("c", Down)])),
            None
        );
    }

    #[test]
    fn a_bare_endpoint_gets_the_scheme_etcd_client_gives_it() {
        assert_eq!(balance_key("127.0.0.1:2379"), "http://127.0.0.1:2379");
        assert_eq!(
            balance_key("http://127.0.0.2:2379"),
            "http://127.0.0.2:2379"
        );
        assert_eq!(balance_key("https://etcd:2379"), "https://etcd:2379");
    }
}
