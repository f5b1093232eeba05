//! Which etcd members the coordinator sends its requests to.
//!
//! etcd-client balances requests over every endpoint it was given and never
//! checks them: after a member dies, a share of all requests still goes to
//! it and fails (or hangs until the request timeout, when its machine is
//! gone) for as long as it stays down. A heartbeat makes several etcd
//! requests, so during a failover one of them often lands on the dead
//! member and the heartbeat fails or answers late; with the default 3 s
//! lease and 1 s heartbeat, page-servers were reported dead while the
//! cluster was healthy (coordinator/tests/etcd_cluster.rs).
//!
//! A prober asks each member for its status, on a connection of its own,
//! every [`PROBE_INTERVAL`]. A member that does not answer within
//! [`PROBE_TIMEOUT`], or answers without knowing a leader, leaves the
//! balance; it comes back when it answers again. When no member answers,
//! every member is kept: requests then fail as they would anyway.

use std::collections::BTreeSet;
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

/// How often every member is asked for its status.
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

/// One member and the client that reaches it alone.
struct Member {
    key: String,
    client: Option<Client>,
}

impl Member {
    /// True when the member answers a status request within
    /// [`PROBE_TIMEOUT`] and knows a leader.
    async fn healthy(&mut self, options: &ConnectOptions) -> bool {
        if self.client.is_none() {
            let connect = Client::connect([self.key.as_str()], Some(options.clone()));
            self.client = tokio::time::timeout(PROBE_TIMEOUT, connect)
                .await
                .ok()
                .and_then(Result::ok);
        }
        let Some(client) = self.client.as_mut() else {
            return false;
        };
        match tokio::time::timeout(PROBE_TIMEOUT, client.status()).await {
            Ok(Ok(status)) => status.leader() != 0,
            Ok(Err(error)) => {
                tracing::debug!(member = %self.key, %error, "etcd member did not answer its status");
                false
            }
            Err(_) => {
                tracing::debug!(member = %self.key, "etcd member's status timed out");
                false
            }
        }
    }
}

/// Keeps `client`'s balance to the members of `endpoints` that answer,
/// until aborted.
pub(super) async fn keep_healthy_members(
    client: Client,
    endpoints: Vec<String>,
    options: ConnectOptions,
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
    let all: BTreeSet<String> = members.iter().map(|m| m.key.clone()).collect();
    let mut in_balance = all.clone();
    let mut ticks = tokio::time::interval(PROBE_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        // Every member at once, so that one that hangs delays no other.
        let mut probes = tokio::task::JoinSet::new();
        for mut member in members.drain(..) {
            let options = options.clone();
            probes.spawn(async move {
                let healthy = member.healthy(&options).await;
                (member, healthy)
            });
        }
        let mut healthy = BTreeSet::new();
        while let Some(probed) = probes.join_next().await {
            let Ok((member, answered)) = probed else {
                continue;
            };
            if answered {
                healthy.insert(member.key.clone());
            }
            members.push(member);
        }
        // A probe that failed to run gave its member back: start it anew.
        for key in &all {
            if !members.iter().any(|m| &m.key == key) {
                members.push(Member {
                    key: key.clone(),
                    client: None,
                });
            }
        }
        let wanted = if healthy.is_empty() {
            all.clone()
        } else {
            healthy
        };
        for key in in_balance.difference(&wanted) {
            tracing::warn!(member = %key, "etcd member does not answer; no requests go to it until it does");
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
        in_balance = wanted;
    }
}

#[cfg(test)]
mod tests {
    use super::balance_key;

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
