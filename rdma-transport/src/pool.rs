//! `PagePool`: one pre-allocated, page-aligned region of 4 KiB frames.
//!
//! The region is mapped once (2 MiB huge pages when the host has them, normal
//! pages otherwise), never grown, and owned by the pool: it is unmapped when
//! the last handle goes away. Frames are handed out from a free list and come
//! back when their [`PageFrame`] guard drops. The list is a stack: the frame
//! given out next is the one that came back last, still in the cache (a
//! queue handed out the frame idle longest, one of thousands). The RDMA
//! data path registers [`PagePool::region`] once as one memory region.

use std::io;
use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::page::{Page, PAGE_SIZE};
pub use crate::region::Backing;
use crate::region::{MapOptions, MappedRegion};

/// Errors of [`PagePool::new`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The requested size holds no frame or is too large to map.
    #[error("pool size of {0} bytes is not a positive multiple of 4096 below 2^40")]
    BadSize(usize),
    /// `mmap` failed.
    #[error("mmap of {size_bytes} bytes for the page pool failed")]
    Map {
        /// Requested mapping size.
        size_bytes: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// A pool of page frames. Cheap to clone (shared handle).
#[derive(Debug, Clone)]
pub struct PagePool {
    inner: Arc<PoolInner>,
}

#[derive(Debug)]
struct PoolInner {
    region: MappedRegion,
    frames: usize,
    /// Free frame indices; the last one pushed is popped first.
    free: Mutex<Vec<u32>>,
}

impl PagePool {
    /// Maps a pool of `size_bytes / 4096` frames, trying huge pages first.
    ///
    /// # Errors
    /// [`PoolError::BadSize`] for a size that holds no frame or exceeds 1 TiB,
    /// [`PoolError::Map`] when no mapping can be had.
    pub fn new(size_bytes: usize) -> Result<Self, PoolError> {
        if size_bytes < PAGE_SIZE || size_bytes % PAGE_SIZE != 0 || size_bytes >= 1 << 40 {
            return Err(PoolError::BadSize(size_bytes));
        }
        let frames = size_bytes / PAGE_SIZE;
        let region = MappedRegion::new(
            size_bytes,
            MapOptions {
                try_huge_pages: true,
                populate: true,
            },
        )
        .map_err(|source| PoolError::Map { size_bytes, source })?;
        // Frame 0 on top. Room for every frame: a push never allocates.
        let free = Mutex::new((0..frames as u32).rev().collect());
        tracing::debug!(frames, backing = ?region.backing(), "page pool mapped");
        Ok(Self {
            inner: Arc::new(PoolInner {
                region,
                frames,
                free,
            }),
        })
    }

    /// Takes a free frame (the one freed last), or `None` when all are in
    /// use. Never allocates; waits only for another thread's push or pop.
    pub fn alloc(&self) -> Option<PageFrame> {
        let index = self.inner.free.lock().pop()?;
        Some(PageFrame {
            pool: Arc::clone(&self.inner),
            index,
        })
    }

    /// Number of frames in the pool.
    pub fn capacity(&self) -> usize {
        self.inner.frames
    }

    /// Number of frames not handed out.
    pub fn available(&self) -> usize {
        self.inner.free.lock().len()
    }

    /// What backs the region.
    pub fn backing(&self) -> Backing {
        self.inner.region.backing()
    }

    /// Start and length (bytes) of the whole region, for registering it once
    /// as an RDMA memory region. Valid for as long as any clone of this pool
    /// or any of its frames is alive.
    pub fn region(&self) -> (NonNull<u8>, usize) {
        // A successful mmap never returns null.
        let base = NonNull::new(self.inner.region.as_ptr()).unwrap_or(NonNull::dangling());
        (base, self.inner.frames * PAGE_SIZE)
    }
}

/// One frame of a [`PagePool`], exclusively owned until dropped, when it goes
/// back to the free list.
#[derive(Debug)]
pub struct PageFrame {
    pool: Arc<PoolInner>,
    index: u32,
}

impl PageFrame {
    /// Index of the frame in its pool.
    pub fn index(&self) -> usize {
        self.index as usize
    }

    /// Byte offset of the frame from the start of the pool's region.
    pub fn offset_bytes(&self) -> usize {
        self.index as usize * PAGE_SIZE
    }

    /// Raw pointer to the frame's first byte (for RDMA scatter entries).
    pub fn as_ptr(&self) -> *mut u8 {
        // SAFETY: index < frames, so the offset stays inside the mapping.
        unsafe { self.pool.region.as_ptr().add(self.offset_bytes()) }
    }
}

impl std::ops::Deref for PageFrame {
    type Target = Page;
    fn deref(&self) -> &Page {
        // SAFETY: the frame lies inside the live mapping, is PAGE_SIZE long and
        // page aligned, and this guard is its only owner.
        unsafe { &*self.as_ptr().cast::<Page>() }
    }
}

impl std::ops::DerefMut for PageFrame {
    fn deref_mut(&mut self) -> &mut Page {
        // SAFETY: as in `deref`, and `&mut self` makes the access exclusive.
        unsafe { &mut *self.as_ptr().cast::<Page>() }
    }
}

impl Drop for PageFrame {
    fn drop(&mut self) {
        // A frame index is only ever in the list or in one guard, so the
        // list (made with room for every frame) never grows here.
        self.pool.free.lock().push(self.index);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn frames_are_distinct_aligned_and_returned_on_drop() {
        let pool = PagePool::new(16 * PAGE_SIZE).unwrap();
        assert_eq!(pool.capacity(), 16);
        let mut frames: Vec<_> = (0..16).map(|_| pool.alloc().unwrap()).collect();
        assert!(pool.alloc().is_none(), "pool must not grow");
        let (base, len) = pool.region();
        assert_eq!(len, 16 * PAGE_SIZE);
        let offsets: HashSet<_> = frames.iter().map(|f| f.offset_bytes()).collect();
        assert_eq!(offsets.len(), 16);
        for f in &mut frames {
            assert_eq!(f.as_ptr() as usize % PAGE_SIZE, 0);
            assert_eq!(
                f.as_ptr() as usize - base.as_ptr() as usize,
                f.offset_bytes()
            );
            let v = f.index() as u8;
            f.fill(v);
        }
        for f in &frames {
            assert!(
                f.iter().all(|&b| b == f.index() as u8),
                "frames must not overlap"
            );
        }
        frames.truncate(10);
        assert_eq!(pool.available(), 6);
        drop(frames);
        assert_eq!(pool.available(), 16);
    }

    #[test]
    fn the_frame_freed_last_is_handed_out_next() {
        let pool = PagePool::new(8 * PAGE_SIZE).unwrap();
        let a = pool.alloc().unwrap();
        let b = pool.alloc().unwrap();
        let (ia, ib) = (a.index(), b.index());
        drop(b);
        drop(a);
        // A frame just used is still in the cache: it goes out first, then
        // the one freed before it.
        let first = pool.alloc().unwrap();
        let second = pool.alloc().unwrap();
        assert_eq!((first.index(), second.index()), (ia, ib));
        drop(first);
        assert_eq!(pool.alloc().unwrap().index(), ia, "a drop goes back on top");
        drop(second);
        assert_eq!(pool.available(), 8);
    }

    #[test]
    fn bad_sizes_are_refused() {
        for size in [0, 100, PAGE_SIZE + 1, 1 << 41] {
            assert!(
                matches!(PagePool::new(size), Err(PoolError::BadSize(_))),
                "{size}"
            );
        }
    }

    #[test]
    fn frames_keep_the_region_alive_and_work_across_threads() {
        let pool = PagePool::new(64 * PAGE_SIZE).unwrap();
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let pool = pool.clone();
                std::thread::spawn(move || {
                    for i in 0..1000u32 {
                        let mut f = pool.alloc().unwrap();
                        f[0] = t;
                        f[PAGE_SIZE - 1] = i as u8;
                        assert_eq!((f[0], f[PAGE_SIZE - 1]), (t, i as u8));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let frame = pool.alloc().unwrap();
        drop(pool);
        assert_eq!(frame.len(), PAGE_SIZE); // mapping still alive through the frame
        assert!(PagePool::new(PAGE_SIZE).is_ok());
    }
}
