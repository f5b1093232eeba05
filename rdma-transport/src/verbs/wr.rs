//! Work requests and scatter/gather entries, built by the caller (on the
//! stack or in reused arrays) and posted without allocation.

use std::marker::PhantomData;
use std::ptr;

use super::generated::{
    ibv_mw_bind_info, ibv_recv_wr, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode,
};
use super::mr::{AccessFlags, MemoryRegion};
use super::mw::MemoryWindow;

/// A scatter/gather entry (`struct ibv_sge`): `length` bytes at `addr`
/// inside the MR with local key `lkey`.
#[derive(Debug, Clone, Copy, Default)]
#[repr(transparent)]
pub struct Sge(ibv_sge);

impl Sge {
    /// A scatter/gather entry. [`super::MemoryRegion::sge`] builds one with
    /// bounds checked.
    pub fn new(addr: u64, length: u32, lkey: u32) -> Self {
        Self(ibv_sge { addr, length, lkey })
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.0.addr
    }

    /// Length in bytes.
    pub fn length(&self) -> u32 {
        self.0.length
    }
}

/// A send work request (`struct ibv_send_wr`) that borrows its SGEs. Build an
/// array of these (on the stack, or reused) and pass it to
/// [`super::QueuePair::post_send`].
#[repr(transparent)]
pub struct SendWr<'a> {
    pub(crate) wr: ibv_send_wr,
    _sges: PhantomData<&'a [Sge]>,
}

impl<'a> SendWr<'a> {
    fn rdma(opcode: u32, wr_id: u64, local: &'a [Sge], remote_addr: u64, rkey: u32) -> Self {
        let mut wr = ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            // The provider only reads the SGE array.
            sg_list: local.as_ptr().cast::<ibv_sge>().cast_mut(),
            num_sge: i32::try_from(local.len()).unwrap_or(i32::MAX),
            opcode,
            send_flags: 0,
            ..ibv_send_wr::default()
        };
        wr.wr.rdma.remote_addr = remote_addr;
        wr.wr.rdma.rkey = rkey;
        Self {
            wr,
            _sges: PhantomData,
        }
    }

    /// RDMA READ of `remote_addr` (rkey `rkey`) into the local SGEs.
    pub fn rdma_read(wr_id: u64, local: &'a [Sge], remote_addr: u64, rkey: u32) -> Self {
        Self::rdma(
            ibv_wr_opcode::IBV_WR_RDMA_READ,
            wr_id,
            local,
            remote_addr,
            rkey,
        )
    }

    /// RDMA WRITE of the local SGEs to `remote_addr` (rkey `rkey`).
    pub fn rdma_write(wr_id: u64, local: &'a [Sge], remote_addr: u64, rkey: u32) -> Self {
        Self::rdma(
            ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            wr_id,
            local,
            remote_addr,
            rkey,
        )
    }

    /// RDMA WRITE of the local SGEs (none: a zero-length write) to
    /// `remote_addr` (rkey `rkey`) with the immediate `imm`: the peer gets a
    /// receive completion carrying `imm` (it consumes one of its posted
    /// receives) once the data is in place.
    pub fn rdma_write_with_imm(
        wr_id: u64,
        local: &'a [Sge],
        remote_addr: u64,
        rkey: u32,
        imm: u32,
    ) -> Self {
        let mut wr = Self::rdma(
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            wr_id,
            local,
            remote_addr,
            rkey,
        );
        // The immediate travels in network byte order (`__be32`).
        wr.wr.__bindgen_anon_1.imm_data = imm.to_be();
        wr
    }

    /// Binds the type-2 window `mw` over `len` bytes at `offset` into `mr`
    /// with remote access `access`, under the new rkey `rkey` (take
    /// [`MemoryWindow::next_rkey`]). Post it on the QP that is to use the
    /// window (in RTS, in the window's PD); once its completion is polled
    /// with success, record the key with [`MemoryWindow::set_bound_rkey`].
    /// Signaled. `None` when the range is not inside `mr` or is empty.
    ///
    /// The MR must have been registered with [`AccessFlags::MW_BIND`] (and
    /// `LOCAL_WRITE` for `REMOTE_WRITE` access), else the bind completes
    /// with [`super::WcStatus::MwBind`].
    pub fn bind_mw(
        wr_id: u64,
        mw: &'a MemoryWindow,
        rkey: u32,
        mr: &'a MemoryRegion,
        offset: usize,
        len: usize,
        access: AccessFlags,
    ) -> Option<Self> {
        let end = offset.checked_add(len)?;
        if len == 0 || end > mr.len() {
            return None;
        }
        let addr = (mr.addr() as usize).checked_add(offset)?;
        let mut wr = ibv_send_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: ptr::null_mut(),
            num_sge: 0,
            opcode: ibv_wr_opcode::IBV_WR_BIND_MW,
            send_flags: ibv_send_flags::IBV_SEND_SIGNALED,
            ..ibv_send_wr::default()
        };
        wr.__bindgen_anon_2.bind_mw.mw = mw.raw();
        wr.__bindgen_anon_2.bind_mw.rkey = rkey;
        wr.__bindgen_anon_2.bind_mw.bind_info = ibv_mw_bind_info {
            mr: mr.raw(),
            addr: addr as u64,
            length: len as u64,
            mw_access_flags: access.bits(),
        };
        Some(Self {
            wr,
            _sges: PhantomData,
        })
    }

    /// Requests a completion for this request (selective signaling: signal
    /// the last request of a batch; unsignaled ones still hold queue slots
    /// until a later signaled one completes).
    #[must_use]
    pub fn signaled(mut self) -> Self {
        self.set_signaled(true);
        self
    }

    /// Sets or clears `IBV_SEND_SIGNALED`.
    pub fn set_signaled(&mut self, signaled: bool) {
        if signaled {
            self.wr.send_flags |= ibv_send_flags::IBV_SEND_SIGNALED;
        } else {
            self.wr.send_flags &= !ibv_send_flags::IBV_SEND_SIGNALED;
        }
    }

    /// Fences this request behind earlier RDMA READs (`IBV_SEND_FENCE`).
    #[must_use]
    pub fn fenced(mut self) -> Self {
        self.wr.send_flags |= ibv_send_flags::IBV_SEND_FENCE;
        self
    }

    /// The request's `wr_id`.
    pub fn wr_id(&self) -> u64 {
        self.wr.wr_id
    }
}

impl std::fmt::Debug for SendWr<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendWr")
            .field("wr_id", &self.wr.wr_id)
            .field("opcode", &self.wr.opcode)
            .field("num_sge", &self.wr.num_sge)
            .field("send_flags", &self.wr.send_flags)
            .finish_non_exhaustive()
    }
}

/// A receive work request (`struct ibv_recv_wr`) that borrows its SGEs.
#[derive(Debug)]
#[repr(transparent)]
pub struct RecvWr<'a> {
    pub(crate) wr: ibv_recv_wr,
    _sges: PhantomData<&'a [Sge]>,
}

impl<'a> RecvWr<'a> {
    /// A receive into the local SGEs.
    pub fn new(wr_id: u64, local: &'a [Sge]) -> Self {
        Self {
            wr: ibv_recv_wr {
                wr_id,
                next: ptr::null_mut(),
                sg_list: local.as_ptr().cast::<ibv_sge>().cast_mut(),
                num_sge: i32::try_from(local.len()).unwrap_or(i32::MAX),
            },
            _sges: PhantomData,
        }
    }
}
