//! A page-server's heartbeat against a stand-in coordinator
//! (`common::fake_coordinator`) that refuses some heartbeats with 503, as
//! a coordinator does while its store fails over: a failed heartbeat puts
//! the node's lease at risk, so the next one goes after the retry pause,
//! not a whole heartbeat period later, doubling with each further failure
//! up to the period; after a success the period is back.

mod common;

use std::time::Duration;

use common::fake_coordinator::FakeCoordinator;
use common::*;
use page_server::ServerConfig;

const PERIOD: Duration = Duration::from_secs(2);
const RETRY: Duration = Duration::from_millis(50);
const LIMIT: Duration = Duration::from_secs(20);

#[test]
fn a_failed_heartbeat_is_retried_at_once_then_the_period_resumes() {
    let fake = FakeCoordinator::start();
    fake.state.lock().fail_heartbeats = 2;
    let mut cfg = ServerConfig::new("a", NODE_BYTES);
    cfg.rdma.enabled = false;
    cfg.heartbeat_interval = PERIOD;
    cfg.register_retry = RETRY;
    let server = page_server_with(&fake.url, cfg);

    // Two refused, one answered, one more answered a period later.
    assert!(
        wait_until(LIMIT, || fake.state.lock().heartbeats.len() >= 4),
        "heartbeats: {:?}",
        fake.state.lock().heartbeats
    );
    drop(server);
    let beats = fake.state.lock().heartbeats.clone();
    let answered: Vec<bool> = beats.iter().map(|(_, ok)| *ok).collect();
    assert_eq!(answered[..4], [false, false, true, true]);
    let gaps: Vec<Duration> = beats.windows(2).map(|w| w[1].0 - w[0].0).collect();
    // After each refusal: the retry pause, then twice it (far below the
    // period even on a loaded host; a wait never ends early).
    assert!(gaps[0] >= RETRY && gaps[0] < PERIOD / 2, "{gaps:?}");
    assert!(gaps[1] >= 2 * RETRY && gaps[1] < PERIOD / 2, "{gaps:?}");
    // After the answer: a whole period.
    assert!(gaps[2] >= PERIOD, "{gaps:?}");
}
