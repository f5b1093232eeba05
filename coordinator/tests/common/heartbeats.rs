//! A stand-in page-server that heartbeats as a real one does
//! (page-server/src/registration.rs, with its defaults): one heartbeat,
//! then the heartbeat period; after a failure 200 ms, doubling with each
//! further failure up to the period. It records what it saw.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rdma_transport::coordinator::CoordinatorClient;

/// A page-server's heartbeat period, first pause after a failed heartbeat,
/// and request timeout: its defaults (`ServerConfig`).
pub const HEARTBEAT_PERIOD: Duration = Duration::from_millis(1000);
pub const HEARTBEAT_RETRY: Duration = Duration::from_millis(200);
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);

/// What a stand-in saw.
#[derive(Debug, Default)]
pub struct Seen {
    answered: AtomicUsize,
    failed: AtomicUsize,
    slowest_us: AtomicU64,
    /// When a heartbeat's answer first said `alive: false` (ms since the
    /// start).
    reported_dead_ms: Mutex<Option<u128>>,
}

/// A stand-in page-server heartbeating on a thread of its own.
#[derive(Debug)]
pub struct Heartbeats {
    pub id: String,
    seen: Arc<Seen>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Heartbeats {
    /// Heartbeats of node `id` through `coordinators` (comma-separated, as
    /// a page-server's `--coordinator`) until dropped; `started` is the
    /// origin of the times it reports.
    pub fn start(coordinators: &str, id: &str, started: Instant) -> Self {
        let client = CoordinatorClient::new(coordinators, None, HEARTBEAT_TIMEOUT)
            .expect("client of the coordinators");
        let seen = Arc::new(Seen::default());
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (seen, stop, id) = (seen.clone(), stop.clone(), id.to_owned());
            std::thread::spawn(move || {
                let mut failed_in_a_row = 0;
                // Bounded by the test's length.
                for _ in 0..2000 {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let sent = Instant::now();
                    let answer = client.heartbeat(&id);
                    let took_us = u64::try_from(sent.elapsed().as_micros()).unwrap_or(u64::MAX);
                    seen.slowest_us.fetch_max(took_us, Ordering::Relaxed);
                    let pause = match answer {
                        Ok(beat) => {
                            if !beat.alive {
                                let mut dead = seen.reported_dead_ms.lock().expect("seen");
                                dead.get_or_insert(started.elapsed().as_millis());
                            }
                            seen.answered.fetch_add(1, Ordering::Relaxed);
                            failed_in_a_row = 0;
                            HEARTBEAT_PERIOD
                        }
                        Err(_) => {
                            seen.failed.fetch_add(1, Ordering::Relaxed);
                            failed_in_a_row += 1;
                            HEARTBEAT_RETRY
                                .saturating_mul(1 << (failed_in_a_row - 1).min(16))
                                .min(HEARTBEAT_PERIOD)
                        }
                    };
                    std::thread::sleep(pause);
                }
            })
        };
        Self {
            id: id.to_owned(),
            seen,
            stop,
            thread: Some(thread),
        }
    }

    /// Heartbeats answered so far.
    pub fn answered(&self) -> usize {
        self.seen.answered.load(Ordering::Relaxed)
    }

    /// Heartbeats that failed so far.
    pub fn failed(&self) -> usize {
        self.seen.failed.load(Ordering::Relaxed)
    }

    /// The longest a heartbeat took so far.
    pub fn slowest(&self) -> Duration {
        Duration::from_micros(self.seen.slowest_us.load(Ordering::Relaxed))
    }

    /// When (ms since the start) an answer first reported the node dead.
    pub fn reported_dead_ms(&self) -> Option<u128> {
        *self.seen.reported_dead_ms.lock().expect("seen")
    }
}

impl Drop for Heartbeats {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
