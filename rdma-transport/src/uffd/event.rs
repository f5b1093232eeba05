//! Messages read from a userfaultfd (`struct uffd_msg`) and their decoded
//! form.

use std::fmt;

use super::abi::{
    uffd_msg, uffd_msg__bindgen_ty_1, uffd_msg__bindgen_ty_1__bindgen_ty_5, UFFD_EVENT_PAGEFAULT,
    UFFD_PAGEFAULT_FLAG_MINOR, UFFD_PAGEFAULT_FLAG_WP, UFFD_PAGEFAULT_FLAG_WRITE,
};

/// Why a page fault was raised.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The page is not present (register mode `missing`).
    Missing,
    /// A write to a write-protected page (register mode `write_protect`).
    WriteProtect,
    /// The page is in the page cache of the shared file but not mapped here
    /// (register mode `minor`): resolve it with [`super::Userfaultfd::continue_range`].
    Minor,
}

/// One page fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pagefault {
    /// The faulting address (not page aligned unless the kernel rounds it).
    pub addr: usize,
    /// Missing page or write-protect fault.
    pub kind: FaultKind,
    /// True for a write access.
    pub write: bool,
    /// Kernel thread id of the faulting thread; 0 unless the descriptor was
    /// enabled with [`super::feature::THREAD_ID`].
    pub thread_id: libc::pid_t,
}

/// One message of a userfaultfd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// A thread faulted and waits until the page is resolved and woken.
    Pagefault(Pagefault),
    /// Another event (fork, remap, remove, unmap), only sent when its
    /// feature was enabled; `code` is its `UFFD_EVENT_*` value.
    Other {
        /// The `UFFD_EVENT_*` code.
        code: u8,
    },
}

impl Event {
    fn decode(msg: &uffd_msg) -> Self {
        // Copies out of the packed struct: no reference to its fields.
        let (code, arg) = (msg.event, msg.arg);
        if u32::from(code) != UFFD_EVENT_PAGEFAULT {
            return Self::Other { code };
        }
        // SAFETY: the kernel wrote a pagefault message (checked above); every
        // field of the union is plain integers, so any bytes are valid.
        let fault = unsafe { arg.pagefault };
        // SAFETY: `feat` is a union of one `u32`, valid for any bytes.
        let ptid = unsafe { fault.feat.ptid };
        let flags = fault.flags;
        Self::Pagefault(Pagefault {
            addr: fault.address as usize,
            kind: if flags & u64::from(UFFD_PAGEFAULT_FLAG_WP) != 0 {
                FaultKind::WriteProtect
            } else if flags & u64::from(UFFD_PAGEFAULT_FLAG_MINOR) != 0 {
                FaultKind::Minor
            } else {
                FaultKind::Missing
            },
            write: flags & u64::from(UFFD_PAGEFAULT_FLAG_WRITE) != 0,
            thread_id: ptid as libc::pid_t,
        })
    }
}

/// Room for the messages of one `read(2)`, allocated once.
pub struct EventBuffer {
    pub(super) msgs: Box<[uffd_msg]>,
    pub(super) len: usize,
}

impl EventBuffer {
    /// A buffer for up to `capacity` messages (at least one).
    pub fn new(capacity: usize) -> Self {
        let empty = uffd_msg {
            event: 0,
            reserved1: 0,
            reserved2: 0,
            reserved3: 0,
            arg: uffd_msg__bindgen_ty_1 {
                reserved: uffd_msg__bindgen_ty_1__bindgen_ty_5 {
                    reserved1: 0,
                    reserved2: 0,
                    reserved3: 0,
                },
            },
        };
        Self {
            msgs: vec![empty; capacity.max(1)].into_boxed_slice(),
            len: 0,
        }
    }

    /// How many messages fit.
    pub fn capacity(&self) -> usize {
        self.msgs.len()
    }

    /// The messages of the last read, decoded.
    pub fn events(&self) -> impl ExactSizeIterator<Item = Event> + '_ {
        self.msgs[..self.len].iter().map(Event::decode)
    }
}

impl fmt::Debug for EventBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventBuffer")
            .field("capacity", &self.capacity())
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use linux_raw_sys::general::{
        uffd_msg__bindgen_ty_1__bindgen_ty_1, uffd_msg__bindgen_ty_1__bindgen_ty_1__bindgen_ty_1,
    };

    fn pagefault(flags: u32, address: u64, ptid: u32) -> uffd_msg {
        let mut msg = EventBuffer::new(1).msgs[0];
        msg.event = UFFD_EVENT_PAGEFAULT as u8;
        msg.arg = uffd_msg__bindgen_ty_1 {
            pagefault: uffd_msg__bindgen_ty_1__bindgen_ty_1 {
                flags: u64::from(flags),
                address,
                feat: uffd_msg__bindgen_ty_1__bindgen_ty_1__bindgen_ty_1 { ptid },
            },
        };
        msg
    }

    #[test]
    fn decodes_pagefault_kind_access_and_thread() {
        assert_eq!(
            Event::decode(&pagefault(UFFD_PAGEFAULT_FLAG_WRITE, 0x7000_1234, 42)),
            Event::Pagefault(Pagefault {
                addr: 0x7000_1234,
                kind: FaultKind::Missing,
                write: true,
                thread_id: 42,
            })
        );
        assert_eq!(
            Event::decode(&pagefault(
                UFFD_PAGEFAULT_FLAG_WRITE | UFFD_PAGEFAULT_FLAG_WP,
                0x2000,
                7
            )),
            Event::Pagefault(Pagefault {
                addr: 0x2000,
                kind: FaultKind::WriteProtect,
                write: true,
                thread_id: 7,
            })
        );
        let mut other = pagefault(0, 0, 0);
        other.event = 0x13; // UFFD_EVENT_FORK
        assert_eq!(Event::decode(&other), Event::Other { code: 0x13 });
    }
}
