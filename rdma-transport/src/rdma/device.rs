//! The client's RDMA device: opened once per manager, with the page pool
//! registered once as one memory region.

use std::sync::Arc;

use super::port::{PortInfo, QpTimeouts};
use super::registry::{MemoryRegistry, RegisterError};
use crate::config::ManagerConfig;
use crate::pool::PagePool;
use crate::verbs::{
    list_devices, AccessFlags, CompletionChannel, CompletionQueue, Context, MemoryRegion,
    ProtectionDomain, QpCaps, QueuePair, Verbs, VerbsError,
};

/// Send-queue depth of every client QP (work requests, signaled or not).
pub(crate) const SEND_QUEUE_DEPTH: u32 = 256;
/// CQ entries per connection: a failed QP flushes every outstanding work
/// request (unsignaled ones too on some providers), so room for all of them.
const CQ_DEPTH: u32 = 2 * SEND_QUEUE_DEPTH;

/// An open device with the page pool registered on it.
///
/// Field order is drop order: the MR is deregistered before the PD and the
/// context close, and `_pool` keeps the pool's mapping alive until after the
/// MR is gone.
#[derive(Debug)]
pub(crate) struct ClientDevice {
    pool_mr: MemoryRegion,
    pd: ProtectionDomain,
    ctx: Context,
    pub(crate) port: PortInfo,
    pub(crate) timeouts: QpTimeouts,
    /// Caller memory registered on `pd` (each region keeps its MR, and
    /// with it the PD, alive).
    pub(crate) registry: Arc<MemoryRegistry>,
    _pool: PagePool,
}

impl ClientDevice {
    /// Opens the configured device (first one when none is named) and
    /// registers `pool` with LOCAL_WRITE (RDMA READs land in its frames).
    ///
    /// # Errors
    /// A human-readable reason when the host has no usable device.
    pub(crate) fn open(config: &ManagerConfig, pool: &PagePool) -> Result<Arc<Self>, String> {
        let timeouts = QpTimeouts {
            ack_timeout_code: config.rdma_ack_timeout,
            retry_count: config.rdma_retry_count,
        }
        .validate()?;
        let verbs = Verbs::load().map_err(|e| e.to_string())?;
        let devices = list_devices(&verbs).map_err(|e| e.to_string())?;
        if devices.is_empty() {
            return Err(VerbsError::NoDevice.to_string());
        }
        let ctx =
            Context::open(&verbs, config.rdma_device.as_deref()).map_err(|e| e.to_string())?;
        let port = PortInfo::query(&ctx, config.rdma_port, config.rdma_gid_index)
            .map_err(|e| format!("{}: {e}", ctx.name()))?;
        let pd = ctx.alloc_pd().map_err(|e| format!("{}: {e}", ctx.name()))?;
        let (base, len) = pool.region();
        // SAFETY: the pool's mapping stays allocated while `_pool` (a clone
        // of the pool) lives, which is longer than the MR (field order). The
        // device writes a frame only while an RDMA READ into it is posted;
        // the frame is then owned by the request, and its bytes are read
        // (through raw pointers) only after the completion, or never again
        // (frames of failed requests are quarantined until their QP is gone).
        let pool_mr = unsafe { pd.register_raw(base.as_ptr(), len, AccessFlags::LOCAL_WRITE) }
            .map_err(|e| {
                format!(
                    "{}: registering the {len}-byte page pool: {e} (raise `ulimit -l`)",
                    ctx.name()
                )
            })?;
        tracing::info!(
            device = %port.device,
            port = port.port,
            gid = %port.gid,
            gid_index = port.gid_index,
            mtu = port.mtu.bytes(),
            max_rd_atomic = port.max_rd_atomic,
            pool_bytes = len,
            "RDMA device open; page pool registered"
        );
        Ok(Arc::new(Self {
            pool_mr,
            pd,
            ctx,
            port,
            timeouts,
            registry: Arc::new(MemoryRegistry::default()),
            _pool: pool.clone(),
        }))
    }

    /// The local key of the page pool.
    pub(crate) fn lkey(&self) -> u32 {
        self.pool_mr.lkey()
    }

    /// Registers `len` bytes at `ptr` (LOCAL_WRITE: RDMA READs land in
    /// it) and adds them to the registry. Returns the region's id.
    ///
    /// # Safety
    /// `ptr..ptr+len` stays mapped until the region is removed from the
    /// registry and no request in flight refers to it any more (requests
    /// hold a snapshot of the table); between requests the device does not
    /// touch it.
    ///
    /// # Errors
    /// [`RegisterError`] for a bad or overlapping range, or when the device
    /// refuses the registration.
    pub(crate) unsafe fn register(&self, ptr: *mut u8, len: usize) -> Result<u64, RegisterError> {
        let start = ptr as usize;
        // Checked before registering (cheap) and again when inserting
        // (authoritative: another thread may register meanwhile).
        self.registry.current().check_free(start, len)?;
        // SAFETY: the caller keeps the range mapped for as long as the MR
        // lives (this function's contract; the MR lives in the registry
        // entry and in request snapshots). The device writes the range only
        // while an RDMA READ into it is posted, and the data path hands the
        // caller's page back only after that READ completed or its QP was
        // drained (`RdmaConnection::fence`).
        let mr =
            unsafe { self.pd.register_raw(ptr, len, AccessFlags::LOCAL_WRITE) }.map_err(|e| {
                RegisterError::Device {
                    start,
                    len,
                    reason: format!("{}: {e}", self.ctx.name()),
                }
            })?;
        let lkey = mr.lkey();
        self.registry.insert(start, len, lkey, Some(mr))
    }

    /// A coherence message channel (`channel.rs`), in a PD of its own: its
    /// ring takes remote writes, which no data QP must be able to reach.
    pub(crate) fn message_channel(&self) -> Result<super::MessageChannel, VerbsError> {
        let pd = self.ctx.alloc_pd()?;
        super::MessageChannel::new(&pd, &self.port)
    }

    /// A completion channel for a poller thread.
    pub(crate) fn create_channel(&self) -> Result<CompletionChannel, VerbsError> {
        let channel = self.ctx.create_comp_channel()?;
        channel.set_nonblocking(true)?;
        Ok(channel)
    }

    /// A CQ (raising events on `channel`) and an RC QP in INIT on it.
    pub(crate) fn create_qp(
        &self,
        channel: &CompletionChannel,
    ) -> Result<(QueuePair, CompletionQueue), VerbsError> {
        let cq = self.ctx.create_cq(CQ_DEPTH, Some(channel), 0)?;
        let caps = QpCaps {
            max_send_wr: SEND_QUEUE_DEPTH.min(self.port.max_qp_wr),
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
        };
        let qp = self.pd.create_rc_qp(&cq, &cq, &caps)?;
        // The client's QP only initiates: nothing may reach its memory.
        qp.modify_to_init(self.port.port, AccessFlags::LOCAL_WRITE)?;
        Ok((qp, cq))
    }
}
