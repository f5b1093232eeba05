//! A second try alongside a slow one. A request already on its way to an
//! etcd member that stopped answering (its machine gone, or cut off from
//! its peers) waits for the whole request timeout, even once the prober
//! (members.rs) has taken that member out of the balance; the same request
//! sent again after that goes to a member that answers.
//! coordinator/tests/etcd_partition.rs measures it.

use std::future::Future;

/// Runs `attempt`; when it has not finished once `again` is ready (a
/// delay, or a member left the balance), runs it once more alongside and
/// returns the first success, or the later failure. Only for attempts that
/// may run twice: reads, heartbeats (which renew a lease and rewrite a key
/// to the same value) and lease grants (a lease nothing uses expires).
pub(super) async fn hedged<T, E, F, Fut>(
    attempt: &mut F,
    again: impl Future<Output = ()>,
) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let first = attempt();
    tokio::pin!(first);
    tokio::select! {
        outcome = &mut first => return outcome,
        () = again => {}
    }
    tracing::debug!("etcd request slow; trying it again alongside");
    let second = attempt();
    tokio::pin!(second);
    tokio::select! {
        outcome = &mut first => match outcome {
            Ok(value) => Ok(value),
            Err(_) => second.await,
        },
        outcome = &mut second => match outcome {
            Ok(value) => Ok(value),
            Err(_) => first.await,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::hedged;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    /// The first try hangs (`hang`), fails (`fail`) or answers; each later
    /// one answers with its number.
    async fn tries(first: &str, delay: Duration) -> (Result<u32, &'static str>, u32) {
        let count = AtomicU32::new(0);
        let mut attempt = || {
            let n = count.fetch_add(1, Ordering::Relaxed) + 1;
            let first = first.to_owned();
            async move {
                match (n, first.as_str()) {
                    (1, "hang") => std::future::pending().await,
                    (1, "fail") => Err("failed"),
                    _ => Ok(n),
                }
            }
        };
        let outcome = hedged(&mut attempt, tokio::time::sleep(delay)).await;
        (outcome, count.load(Ordering::Relaxed))
    }

    #[tokio::test]
    async fn a_try_that_hangs_is_overtaken_by_a_second() {
        assert_eq!(tries("hang", Duration::from_millis(5)).await, (Ok(2), 2));
    }

    #[tokio::test]
    async fn a_quick_answer_or_failure_is_not_tried_twice() {
        assert_eq!(tries("answer", Duration::from_secs(60)).await, (Ok(1), 1));
        assert_eq!(
            tries("fail", Duration::from_secs(60)).await,
            (Err("failed"), 1)
        );
    }
}
