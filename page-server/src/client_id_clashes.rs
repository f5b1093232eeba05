//! Spotting two live clients that share one client id.
//!
//! A client's new data connection ends its older ones (`conns.rs`,
//! `Recorded::supersede_older`). One client does that once per connection
//! it gave up on: at most about once per request deadline, and only while
//! its link or this server misbehaves. Two clients alive at once with one
//! id (an embedder that set `ManagerConfig::client_id` to a constant, or
//! started a VM's second manager before the first was gone) end each
//! other's connections every time either reconnects: many times a second
//! under load, each time failing the other's requests in flight. Nothing
//! is written wrong (each write is refused or applied in order), but both
//! clients keep failing; this says why.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How long the replacements of one client id are counted together.
pub(crate) const CLASH_WINDOW: Duration = Duration::from_secs(10);

/// Replacements of one client id's connections within [`CLASH_WINDOW`] that
/// make it a clash. One client with a request deadline of 1 s (the
/// default) replaces at most about one a second: 10 per window.
pub(crate) const CLASH_REPLACEMENTS: u32 = 20;

/// Client ids tracked at most (the oldest windows are dropped beyond it).
const TRACKED_IDS: usize = 1024;

/// The replacements of each client id in its current window.
#[derive(Debug, Default)]
pub(crate) struct ClientIdClashes {
    windows: Mutex<HashMap<u64, Window>>,
}

#[derive(Debug, Clone, Copy)]
struct Window {
    started: Instant,
    replacements: u32,
}

impl ClientIdClashes {
    /// Counts one new connection of `client_id` that ended older ones, at
    /// `now`. True the once per window its count reaches
    /// [`CLASH_REPLACEMENTS`]: two clients use that id.
    pub(crate) fn replaced(&self, client_id: u64, now: Instant) -> bool {
        let mut windows = self.windows.lock();
        if windows.len() >= TRACKED_IDS && !windows.contains_key(&client_id) {
            windows.retain(|_, w| now.saturating_duration_since(w.started) < CLASH_WINDOW);
            if windows.len() >= TRACKED_IDS {
                return false;
            }
        }
        let window = windows.entry(client_id).or_insert(Window {
            started: now,
            replacements: 0,
        });
        if now.saturating_duration_since(window.started) >= CLASH_WINDOW {
            *window = Window {
                started: now,
                replacements: 0,
            };
        }
        window.replacements += 1;
        window.replacements == CLASH_REPLACEMENTS
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The twentieth replacement within a window is a clash, once; the
    /// count starts again with the next window; ids are counted apart.
    #[test]
    fn twenty_replacements_of_one_id_within_a_window_are_one_clash() {
        let clashes = ClientIdClashes::default();
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        for i in 0..19 {
            assert!(!clashes.replaced(7, at(i * 100)), "replacement {i}");
            assert!(!clashes.replaced(8, at(i * 100)));
        }
        assert!(clashes.replaced(7, at(1950)), "the twentieth");
        assert!(!clashes.replaced(7, at(1960)), "reported once per window");
        // A new window: 19 more are not a clash, the twentieth is.
        for i in 0..19 {
            assert!(!clashes.replaced(7, at(10_000 + i)));
        }
        assert!(clashes.replaced(7, at(10_019)));
        // One replacement per second, as one client with a 1 s deadline at
        // worst: never.
        for s in 0..60 {
            assert!(!clashes.replaced(9, at(20_000 + s * 1000)));
        }
    }

    /// Beyond the ids tracked, expired windows make room; while every
    /// window is current, a new id is not tracked (no growth).
    #[test]
    fn the_ids_tracked_are_bounded() {
        let clashes = ClientIdClashes::default();
        let t0 = Instant::now();
        for id in 0..TRACKED_IDS as u64 {
            clashes.replaced(id, t0);
        }
        assert!(!clashes.replaced(u64::MAX, t0));
        assert_eq!(clashes.windows.lock().len(), TRACKED_IDS);
        assert!(!clashes.replaced(u64::MAX, t0 + CLASH_WINDOW));
        assert_eq!(clashes.windows.lock().len(), 1);
    }
}
