//! Caller memory registered with the RDMA device, so that READs land in it
//! and WRITEs go out of it directly (no pool frame, no copy).
//!
//! The table is an immutable sorted snapshot behind an [`ArcSwap`]: the
//! data path takes one snapshot per request (an `arc_swap` guard), finds
//! each page by binary search, and keeps the snapshot until the request is
//! settled, so a region unregistered meanwhile keeps its memory region (and
//! its lkey) valid until no work request can refer to it any more.
//! Registering and unregistering copy the table under a mutex (rare).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use parking_lot::Mutex;

use crate::verbs::MemoryRegion;

/// One registered range of caller memory.
#[derive(Debug)]
pub(crate) struct Region {
    start: usize,
    len: usize,
    lkey: u32,
    id: u64,
    /// The registration; `None` only in unit tests of the table.
    _mr: Option<MemoryRegion>,
}

/// A snapshot of the registered regions, sorted by start address and
/// never overlapping.
#[derive(Debug, Default)]
pub(crate) struct RegionTable {
    regions: Vec<Arc<Region>>,
}

impl RegionTable {
    /// The lkey of the region holding all of `ptr..ptr+len`, if one does.
    pub(crate) fn lkey(&self, ptr: *const u8, len: usize) -> Option<u32> {
        if self.regions.is_empty() {
            return None;
        }
        let start = ptr as usize;
        let end = start.checked_add(len)?;
        // The last region starting at or before `start`.
        let i = self.regions.partition_point(|r| r.start <= start);
        let r = self.regions.get(i.checked_sub(1)?)?;
        (end <= r.start + r.len).then_some(r.lkey)
    }

    /// `Ok` when `start..start+len` is a valid range that overlaps no
    /// region of the table.
    ///
    /// # Errors
    /// [`RegisterError::InvalidRange`] or [`RegisterError::Overlap`].
    pub(crate) fn check_free(&self, start: usize, len: usize) -> Result<(), RegisterError> {
        let end = match start.checked_add(len) {
            Some(end) if start != 0 && len != 0 => end,
            _ => return Err(RegisterError::InvalidRange { start, len }),
        };
        let i = self.regions.partition_point(|r| r.start < start);
        let neighbours = [i.checked_sub(1), Some(i)];
        for r in neighbours
            .into_iter()
            .flatten()
            .filter_map(|k| self.regions.get(k))
        {
            if r.start < end && start < r.start + r.len {
                return Err(RegisterError::Overlap {
                    start,
                    len,
                    other_start: r.start,
                    other_len: r.len,
                });
            }
        }
        Ok(())
    }

    /// Whether no region is registered (the data path then skips lookups).
    pub(crate) fn is_empty(&self) -> bool {
        self.regions.is_empty()
    }
}

/// Why a range cannot be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// Null pointer, zero length, or a range that wraps around.
    #[error("invalid range: {len} bytes at {start:#x}")]
    InvalidRange { start: usize, len: usize },
    /// The range overlaps one registered before.
    #[error("{len} bytes at {start:#x} overlap the registered region of {other_len} bytes at {other_start:#x}")]
    Overlap {
        start: usize,
        len: usize,
        other_start: usize,
        other_len: usize,
    },
    /// The device refused the registration (`ibv_reg_mr`; ENOMEM often
    /// means `ulimit -l` is too low).
    #[error("registering {len} bytes at {start:#x}: {reason}")]
    Device {
        start: usize,
        len: usize,
        reason: String,
    },
}

/// The regions registered on one device, and how many pages moved with and
/// without a bounce frame.
#[derive(Debug, Default)]
pub(crate) struct MemoryRegistry {
    table: ArcSwap<RegionTable>,
    /// Serialises writers (each copies the table).
    write: Mutex<()>,
    next_id: AtomicU64,
    /// Pages moved by RDMA straight from or into registered caller memory.
    pub(crate) direct_pages: AtomicU64,
    /// Pages moved by RDMA through a pool frame (bounce, or `read_frame`).
    pub(crate) framed_pages: AtomicU64,
    /// Failed requests on caller memory whose QP was drained before the
    /// call returned, and those whose drain could not be confirmed.
    pub(crate) drains: AtomicU64,
    pub(crate) drain_failures: AtomicU64,
    /// Told after every change of the table.
    on_change: ChangeHook,
}

/// What the registry calls after each change of its table (the manager
/// publishes its one-page view again).
#[derive(Default)]
struct ChangeHook(OnceLock<Box<dyn Fn() + Send + Sync>>);

impl std::fmt::Debug for ChangeHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() {
            "ChangeHook(set)"
        } else {
            "ChangeHook(unset)"
        })
    }
}

impl MemoryRegistry {
    /// The current table, kept by a request until it is settled: one
    /// look at the `ArcSwap`, no increment while the thread holds few
    /// guards (`Guard::into_inner` turns it into an `Arc` to keep longer).
    pub(crate) fn current(&self) -> arc_swap::Guard<Arc<RegionTable>> {
        self.table.load()
    }

    /// The current table, to keep.
    pub(crate) fn current_full(&self) -> Arc<RegionTable> {
        self.table.load_full()
    }

    /// Sets what is called after every change of the table (once; a
    /// second hook is ignored). Called outside the registry's lock, after
    /// the new table is in place.
    pub(crate) fn on_change(&self, hook: Box<dyn Fn() + Send + Sync>) {
        if self.on_change.0.set(hook).is_err() {
            tracing::warn!("the registry already has a change hook; the new one is ignored");
        }
    }

    fn changed(&self) {
        if let Some(hook) = self.on_change.0.get() {
            hook();
        }
    }

    /// Adds `start..start+len` with `lkey`, keeping `mr` alive while the
    /// region (or a snapshot holding it) lives. Returns the region's id.
    ///
    /// # Errors
    /// [`RegisterError`] for an empty or wrapping range, or one that
    /// overlaps a registered region.
    pub(crate) fn insert(
        &self,
        start: usize,
        len: usize,
        lkey: u32,
        mr: Option<MemoryRegion>,
    ) -> Result<u64, RegisterError> {
        let writer = self.write.lock();
        let old = self.table.load_full();
        old.check_free(start, len)?;
        let i = old.regions.partition_point(|r| r.start < start);
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let mut regions = old.regions.clone();
        regions.insert(
            i,
            Arc::new(Region {
                start,
                len,
                lkey,
                id,
                _mr: mr,
            }),
        );
        self.table.store(Arc::new(RegionTable { regions }));
        drop(writer);
        self.changed();
        Ok(id)
    }

    /// Removes region `id`; its registration ends once no snapshot holds
    /// it. False when there is no such region.
    pub(crate) fn remove(&self, id: u64) -> bool {
        let writer = self.write.lock();
        let old = self.table.load_full();
        let Some(i) = old.regions.iter().position(|r| r.id == id) else {
            return false;
        };
        let mut regions = old.regions.clone();
        regions.remove(i);
        self.table.store(Arc::new(RegionTable { regions }));
        drop(writer);
        self.changed();
        true
    }

    /// Counts one drain (`RdmaConnection::fence`) by its result.
    pub(crate) fn count_drain(&self, fenced: bool) {
        let counter = if fenced {
            &self.drains
        } else {
            &self.drain_failures
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Regions registered now.
    pub(crate) fn len(&self) -> usize {
        self.table.load().regions.len()
    }
}

/// Caller memory registered with [`TransportManager::register_memory`]
/// (`crate::TransportManager`). Dropping it unregisters the memory; the
/// device registration itself ends once no request in flight refers to it.
#[derive(Debug)]
pub struct RegisteredMemory {
    /// `None` on a host without RDMA (nothing was registered).
    entry: Option<(Arc<MemoryRegistry>, u64)>,
    start: usize,
    len: usize,
}

impl RegisteredMemory {
    pub(crate) fn new(entry: Option<(Arc<MemoryRegistry>, u64)>, start: usize, len: usize) -> Self {
        Self { entry, start, len }
    }

    /// Whether the memory is registered with an RDMA device (false on a
    /// host without one: TCP reads into it and writes from it anyway).
    pub fn is_rdma(&self) -> bool {
        self.entry.is_some()
    }

    /// The registered range's start address.
    pub fn addr(&self) -> *const u8 {
        self.start as *const u8
    }

    /// The registered range's length in bytes.
    pub fn len_bytes(&self) -> usize {
        self.len
    }
}

impl Drop for RegisteredMemory {
    fn drop(&mut self) {
        if let Some((registry, id)) = self.entry.take() {
            if !registry.remove(id) {
                tracing::warn!(id, "registered memory was already gone from its table");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;

    #[test]
    fn lookup_finds_the_region_holding_the_whole_range() {
        let reg = MemoryRegistry::default();
        assert!(reg.current().is_empty());
        reg.insert(0x10000, 4 * PAGE, 7, None).unwrap();
        reg.insert(0x40000, PAGE, 9, None).unwrap();
        let t = reg.current();
        assert_eq!(t.lkey(0x10000 as *const u8, PAGE), Some(7));
        assert_eq!(t.lkey((0x10000 + 3 * PAGE) as *const u8, PAGE), Some(7));
        assert_eq!(t.lkey(0x40000 as *const u8, PAGE), Some(9));
        // Straddles the end of the first region, or lies outside any.
        assert_eq!(t.lkey((0x10000 + 3 * PAGE + 1) as *const u8, PAGE), None);
        assert_eq!(t.lkey(0xf000 as *const u8, PAGE), None);
        assert_eq!(t.lkey(0x30000 as *const u8, PAGE), None);
        assert_eq!(t.lkey(0x41000 as *const u8, PAGE), None);
        assert_eq!(t.lkey(usize::MAX as *const u8, PAGE), None);
    }

    #[test]
    fn overlapping_and_invalid_ranges_are_refused() {
        let reg = MemoryRegistry::default();
        reg.insert(0x10000, 4 * PAGE, 1, None).unwrap();
        for (start, len) in [
            (0x10000, PAGE),
            (0xf000, 2 * PAGE),
            (0x13000, 2 * PAGE),
            (0x8000, 0x20000),
        ] {
            assert_eq!(
                reg.insert(start, len, 2, None),
                Err(RegisterError::Overlap {
                    start,
                    len,
                    other_start: 0x10000,
                    other_len: 4 * PAGE
                }),
                "{start:#x}+{len:#x}"
            );
        }
        assert!(matches!(
            reg.insert(0x50000, 0, 2, None),
            Err(RegisterError::InvalidRange { .. })
        ));
        assert!(matches!(
            reg.insert(0, PAGE, 2, None),
            Err(RegisterError::InvalidRange { .. })
        ));
        assert!(matches!(
            reg.insert(usize::MAX - 10, PAGE, 2, None),
            Err(RegisterError::InvalidRange { .. })
        ));
        // Adjacent ranges on both sides are fine.
        reg.insert(0xf000, PAGE, 3, None).unwrap();
        reg.insert(0x14000, PAGE, 4, None).unwrap();
        assert_eq!(reg.len(), 3);
        let t = reg.current();
        assert_eq!(t.lkey(0xf000 as *const u8, PAGE), Some(3));
        assert_eq!(t.lkey(0x14000 as *const u8, PAGE), Some(4));
        // A page across the boundary of two adjacent regions is in neither.
        assert_eq!(t.lkey(0x13800 as *const u8, PAGE), None);
    }

    #[test]
    fn unregister_removes_only_that_region_and_snapshots_keep_theirs() {
        let registry = Arc::new(MemoryRegistry::default());
        let a = registry.insert(0x10000, PAGE, 1, None).unwrap();
        let b = registry.insert(0x20000, PAGE, 2, None).unwrap();
        let before = registry.current();
        let handle = RegisteredMemory::new(Some((Arc::clone(&registry), a)), 0x10000, PAGE);
        assert!(handle.is_rdma());
        drop(handle);
        let after = registry.current();
        assert_eq!(after.lkey(0x10000 as *const u8, PAGE), None);
        assert_eq!(after.lkey(0x20000 as *const u8, PAGE), Some(2));
        // A request that took its snapshot before still sees the region.
        assert_eq!(before.lkey(0x10000 as *const u8, PAGE), Some(1));
        assert!(!registry.remove(a), "removed twice");
        // The range can be registered again.
        registry.insert(0x10000, PAGE, 5, None).unwrap();
        assert!(registry.remove(b));
        assert_eq!(registry.len(), 1);
    }

    /// The manager's one-page view holds a copy of the table: the hook
    /// must run after every change, with the new table already in place,
    /// and never for a refused change.
    #[test]
    fn the_change_hook_sees_every_new_table_and_no_refused_change() {
        let registry = Arc::new(MemoryRegistry::default());
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let weak = Arc::downgrade(&registry);
        let log = Arc::clone(&seen);
        registry.on_change(Box::new(move || {
            if let Some(registry) = weak.upgrade() {
                let table = registry.current_full();
                log.lock().push(table.lkey(0x10000 as *const u8, PAGE));
            }
        }));
        let a = registry.insert(0x10000, PAGE, 1, None).unwrap();
        assert!(registry.insert(0x10000, PAGE, 2, None).is_err());
        let handle = RegisteredMemory::new(Some((Arc::clone(&registry), a)), 0x10000, PAGE);
        drop(handle);
        assert!(!registry.remove(a), "already removed");
        assert_eq!(*seen.lock(), vec![Some(1), None]);
        // A second hook is refused; the first stays.
        registry.on_change(Box::new(|| panic!("the second hook ran")));
        registry.insert(0x10000, PAGE, 3, None).unwrap();
        assert_eq!(*seen.lock(), vec![Some(1), None, Some(3)]);
    }
}
