//! Following the map version of an etcd cluster: a watch on the `version`
//! key, re-established after any failure and whenever the members the
//! client balances over change, feeds the channel long polls wait on.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Client, WatchOptions};
use tokio::sync::watch;

/// Pause before watching again after the watch failed.
const REWATCH_PAUSE: Duration = Duration::from_millis(200);

/// Raises the announced version to `version` (never lowers it).
pub(super) fn publish(versions: &watch::Sender<u64>, version: u64) {
    versions.send_if_modified(|current| {
        let newer = version > *current;
        if newer {
            *current = version;
        }
        newer
    });
}

/// Announces every change of `key`'s mod revision until aborted. Each
/// round reads the key (so that nothing between two watches is missed),
/// then watches from the revision after that read.
///
/// A round also ends when `balance` changes (members.rs took a member out
/// of the client's balance, or put one back): the watch may be on a member
/// cut off from its peers, which still answers but hears of no change, and
/// the next round goes through the balance as it is now. (Taking a member
/// out also breaks the streams on it, but only seconds later:
/// coordinator/tests/etcd_partition.rs.)
pub(super) async fn follow_versions(
    client: Client,
    key: String,
    versions: Arc<watch::Sender<u64>>,
    mut balance: watch::Receiver<u64>,
) {
    loop {
        tokio::select! {
            outcome = follow_once(&client, &key, &versions) => {
                if let Err(error) = outcome {
                    tracing::debug!(%error, "etcd version watch ended; watching again");
                }
                tokio::time::sleep(REWATCH_PAUSE).await;
            }
            () = changed(&mut balance) => {
                tracing::debug!("etcd members in the balance changed; watching again");
            }
        }
    }
}

/// Returns when `balance` changes; never when nothing can change it (a
/// single endpoint has no prober).
pub(super) async fn changed(balance: &mut watch::Receiver<u64>) {
    if balance.changed().await.is_err() {
        std::future::pending::<()>().await;
    }
}

async fn follow_once(
    client: &Client,
    key: &str,
    versions: &watch::Sender<u64>,
) -> Result<(), etcd_client::Error> {
    let mut kv = client.kv_client();
    let current = kv.get(key, None).await?;
    if let Some(found) = current.kvs().first() {
        publish(versions, u64::try_from(found.mod_revision()).unwrap_or(0));
    }
    let read_at = current.header().map_or(0, |h| h.revision());
    let mut watcher = client.watch_client();
    let options = WatchOptions::new().with_start_revision(read_at + 1);
    let mut stream = watcher.watch(key, Some(options)).await?;
    while let Some(response) = stream.message().await? {
        if response.canceled() {
            return Ok(());
        }
        for event in response.events() {
            if let Some(kv) = event.kv() {
                publish(versions, u64::try_from(kv.mod_revision()).unwrap_or(0));
            }
        }
    }
    Ok(())
}
