//! RC queue pairs: creation, the INIT -> RTR -> RTS transitions, and posting
//! work requests without allocating.

use std::mem;
use std::ptr;
use std::sync::Arc;

use super::cq::{CompletionQueue, CqInner};
use super::endpoint::QpEndpoint;
use super::error::{check_ptr, check_rc, note_destroy_failure, rc_to_io, VerbsError};
use super::generated::{
    ibv_mtu, ibv_qp, ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_cap, ibv_qp_init_attr, ibv_qp_state,
    ibv_qp_type, ibv_recv_wr, ibv_send_wr,
};
use super::gid::Gid;
use super::mr::AccessFlags;
use super::pd::{PdInner, ProtectionDomain};
use super::wr::{RecvWr, SendWr};

/// Packet sequence numbers are 24 bits.
const PSN_MASK: u32 = 0x00ff_ffff;

/// Path MTU (`enum ibv_mtu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256,
    /// 512 bytes.
    Mtu512,
    /// 1024 bytes.
    Mtu1024,
    /// 2048 bytes.
    Mtu2048,
    /// 4096 bytes.
    Mtu4096,
}

impl Mtu {
    /// From the raw `enum ibv_mtu` value.
    pub fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            ibv_mtu::IBV_MTU_256 => Some(Self::Mtu256),
            ibv_mtu::IBV_MTU_512 => Some(Self::Mtu512),
            ibv_mtu::IBV_MTU_1024 => Some(Self::Mtu1024),
            ibv_mtu::IBV_MTU_2048 => Some(Self::Mtu2048),
            ibv_mtu::IBV_MTU_4096 => Some(Self::Mtu4096),
            _ => None,
        }
    }

    /// The raw `enum ibv_mtu` value (as carried in [`QpEndpoint::mtu`]).
    pub fn as_raw(self) -> u8 {
        match self {
            Self::Mtu256 => 1,
            Self::Mtu512 => 2,
            Self::Mtu1024 => 3,
            Self::Mtu2048 => 4,
            Self::Mtu4096 => 5,
        }
    }

    /// The MTU in bytes.
    pub fn bytes(self) -> u32 {
        128 << self.as_raw()
    }
}

/// QP state (`enum ibv_qp_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum QpState {
    /// Just created.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive.
    Rtr,
    /// Ready to send.
    Rts,
    /// Send queue drained.
    Sqd,
    /// Send queue error.
    Sqe,
    /// Error: every post fails or is flushed; destroy and recreate the QP.
    Error,
    /// Any other value, raw.
    Other(u32),
}

impl QpState {
    fn from_raw(raw: u32) -> Self {
        match raw {
            ibv_qp_state::IBV_QPS_RESET => Self::Reset,
            ibv_qp_state::IBV_QPS_INIT => Self::Init,
            ibv_qp_state::IBV_QPS_RTR => Self::Rtr,
            ibv_qp_state::IBV_QPS_RTS => Self::Rts,
            ibv_qp_state::IBV_QPS_SQD => Self::Sqd,
            ibv_qp_state::IBV_QPS_SQE => Self::Sqe,
            ibv_qp_state::IBV_QPS_ERR => Self::Error,
            other => Self::Other(other),
        }
    }
}

/// QP capacities asked for at creation (`struct ibv_qp_cap` plus signaling).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCaps {
    /// Send queue depth (signaled and unsignaled requests both hold slots).
    pub max_send_wr: u32,
    /// Receive queue depth.
    pub max_recv_wr: u32,
    /// Scatter/gather entries per send request.
    pub max_send_sge: u32,
    /// Scatter/gather entries per receive request.
    pub max_recv_sge: u32,
    /// Inline data bytes (useless for 4 KiB pages; keep 0).
    pub max_inline_data: u32,
    /// Signal every send request. `false` allows selective signaling with
    /// [`super::SendWr::signaled`].
    pub sq_sig_all: bool,
}

impl Default for QpCaps {
    fn default() -> Self {
        Self {
            max_send_wr: 128,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
        }
    }
}

/// Parameters of the INIT -> RTR transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtrParams {
    /// The peer's endpoint (QPN, PSN, GID, LID).
    pub remote: QpEndpoint,
    /// Path MTU: the smaller of the two ports' active MTUs.
    pub path_mtu: Mtu,
    /// Local port number (from 1).
    pub port: u8,
    /// Local GID index (RoCE v2: [`super::find_roce_v2_ipv4_gid_index`]).
    pub sgid_index: u8,
    /// RDMA READs the peer may have outstanding against this QP; raise to
    /// the device's `max_qp_rd_atom`, the default of 1 serialises reads.
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code; 0 means 655 ms, 12 is 0.64 ms.
    pub min_rnr_timer: u8,
    /// IP TTL / GRH hop limit.
    pub hop_limit: u8,
}

impl RtrParams {
    /// Defaults for a RoCE v2 connection: one outstanding read, RNR timer
    /// code 12, hop limit 64.
    pub fn new(remote: QpEndpoint, path_mtu: Mtu, port: u8, sgid_index: u8) -> Self {
        Self {
            remote,
            path_mtu,
            port,
            sgid_index,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            hop_limit: 64,
        }
    }
}

/// Parameters of the RTR -> RTS transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtsParams {
    /// Initial send PSN (24 bits): what this side published as its
    /// [`QpEndpoint::psn`].
    pub sq_psn: u32,
    /// Local ACK timeout code: 4.096 us * 2^timeout (14 = 67 ms; 0 = forever).
    pub timeout: u8,
    /// Transport retries before an error completion (max 7).
    pub retry_cnt: u8,
    /// RNR retries (7 = forever).
    pub rnr_retry: u8,
    /// RDMA READs this QP may have outstanding as initiator; raise to the
    /// device's `max_qp_init_rd_atom`.
    pub max_rd_atomic: u8,
}

impl RtsParams {
    /// Defaults: timeout 14 (67 ms), 7 retries, 7 RNR retries, one
    /// outstanding read.
    pub fn new(sq_psn: u32) -> Self {
        Self {
            sq_psn,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 1,
        }
    }
}

/// A reliable-connected queue pair.
#[derive(Debug, Clone)]
pub struct QueuePair {
    inner: Arc<QpInner>,
}

#[derive(Debug)]
struct QpInner {
    pd: Arc<PdInner>,
    // Held only to keep the CQs alive while the QP uses them.
    _send_cq: Arc<CqInner>,
    _recv_cq: Arc<CqInner>,
    qp: *mut ibv_qp,
    qpn: u32,
    caps: QpCaps,
}

// SAFETY: verbs are thread-safe (providers lock each queue for posting); the
// pointer is freed once, in Drop.
unsafe impl Send for QpInner {}
// SAFETY: as for Send.
unsafe impl Sync for QpInner {}

impl Drop for QpInner {
    fn drop(&mut self) {
        // SAFETY: `qp` came from `ibv_create_qp` and is destroyed once.
        let rc = unsafe { self.pd.ctx.verbs.lib().ibv_destroy_qp(self.qp) };
        if rc != 0 {
            note_destroy_failure();
            tracing::warn!(device = %self.pd.ctx.name, qpn = self.qpn, error = %rc_to_io(rc), "ibv_destroy_qp failed");
        }
    }
}

impl ProtectionDomain {
    /// Creates an RC QP (`ibv_create_qp`) in the RESET state.
    ///
    /// # Errors
    /// [`VerbsError::InvalidArgument`] when a CQ belongs to another device;
    /// [`VerbsError::Verb`] naming the verb (EINVAL: caps above the device's
    /// limits).
    pub fn create_rc_qp(
        &self,
        send_cq: &CompletionQueue,
        recv_cq: &CompletionQueue,
        caps: &QpCaps,
    ) -> Result<QueuePair, VerbsError> {
        let ctx = &self.inner.ctx;
        if !Arc::ptr_eq(&send_cq.inner.ctx, ctx) || !Arc::ptr_eq(&recv_cq.inner.ctx, ctx) {
            return Err(VerbsError::InvalidArgument(
                "completion queue belongs to another device context".into(),
            ));
        }
        let mut init = ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: send_cq.inner.cq,
            recv_cq: recv_cq.inner.cq,
            srq: ptr::null_mut(),
            cap: ibv_qp_cap {
                max_send_wr: caps.max_send_wr,
                max_recv_wr: caps.max_recv_wr,
                max_send_sge: caps.max_send_sge,
                max_recv_sge: caps.max_recv_sge,
                max_inline_data: caps.max_inline_data,
            },
            qp_type: ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: i32::from(caps.sq_sig_all),
        };
        // SAFETY: live PD and CQs of the same context (checked above), kept
        // alive by the `Arc`s stored in the QP; `init` is a valid in/out
        // pointer.
        let qp = check_ptr("ibv_create_qp", unsafe {
            ctx.verbs.lib().ibv_create_qp(self.inner.pd, &mut init)
        })?;
        // SAFETY: `qp` is a live QP just returned by the library.
        let qpn = unsafe { (*qp).qp_num };
        // The library writes the actual capacities back into `init.cap`.
        let actual = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
            sq_sig_all: caps.sq_sig_all,
        };
        Ok(QueuePair {
            inner: Arc::new(QpInner {
                pd: Arc::clone(&self.inner),
                _send_cq: Arc::clone(&send_cq.inner),
                _recv_cq: Arc::clone(&recv_cq.inner),
                qp,
                qpn,
                caps: actual,
            }),
        })
    }
}

impl QueuePair {
    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    /// The capacities the device granted (at least those asked for).
    pub fn caps(&self) -> QpCaps {
        self.inner.caps
    }

    /// This QP's endpoint to publish to the peer.
    pub fn endpoint(&self, psn: u32, gid: Gid, lid: u16, mtu: Mtu) -> QpEndpoint {
        QpEndpoint {
            qpn: self.inner.qpn,
            psn: psn & PSN_MASK,
            gid: gid.0,
            lid,
            mtu: mtu.as_raw(),
        }
    }

    fn modify(&self, attr: &mut ibv_qp_attr, mask: u32) -> Result<(), VerbsError> {
        let mask = i32::try_from(mask)
            .map_err(|_| VerbsError::InvalidArgument(format!("QP attribute mask {mask:#x}")))?;
        // SAFETY: live QP; `attr` is a valid pointer for the call and only
        // the fields named in `mask` are read.
        let rc = unsafe {
            self.inner
                .pd
                .ctx
                .verbs
                .lib()
                .ibv_modify_qp(self.inner.qp, attr, mask)
        };
        check_rc("ibv_modify_qp", rc)
    }

    /// RESET -> INIT on `port` with the remote access `access` (for a page
    /// server: `REMOTE_READ | REMOTE_WRITE | LOCAL_WRITE`).
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming `ibv_modify_qp`.
    pub fn modify_to_init(&self, port: u8, access: AccessFlags) -> Result<(), VerbsError> {
        let mut attr = ibv_qp_attr {
            qp_state: ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: port,
            qp_access_flags: access.bits(),
            ..ibv_qp_attr::default()
        };
        self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
                | ibv_qp_attr_mask::IBV_QP_PORT
                | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS,
        )
    }

    /// INIT -> RTR towards `params.remote`. Post receives (if any) before
    /// this. A non-zero remote GID makes the address global (GRH), as RoCE
    /// requires; otherwise the remote LID is used (InfiniBand).
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming `ibv_modify_qp` (on RoCE, EINVAL or
    /// ETIMEDOUT often mean a wrong GID index).
    pub fn modify_to_rtr(&self, params: &RtrParams) -> Result<(), VerbsError> {
        let remote_gid = Gid(params.remote.gid);
        let mut attr = ibv_qp_attr {
            qp_state: ibv_qp_state::IBV_QPS_RTR,
            path_mtu: u32::from(params.path_mtu.as_raw()),
            dest_qp_num: params.remote.qpn,
            rq_psn: params.remote.psn & PSN_MASK,
            max_dest_rd_atomic: params.max_dest_rd_atomic,
            min_rnr_timer: params.min_rnr_timer,
            ..ibv_qp_attr::default()
        };
        attr.ah_attr.dlid = params.remote.lid;
        attr.ah_attr.sl = 0;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = params.port;
        if !remote_gid.is_zero() {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = remote_gid.to_ibv();
            attr.ah_attr.grh.sgid_index = params.sgid_index;
            attr.ah_attr.grh.hop_limit = params.hop_limit;
            attr.ah_attr.grh.flow_label = 0;
            attr.ah_attr.grh.traffic_class = 0;
        }
        self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_AV
                | ibv_qp_attr_mask::IBV_QP_PATH_MTU
                | ibv_qp_attr_mask::IBV_QP_DEST_QPN
                | ibv_qp_attr_mask::IBV_QP_RQ_PSN
                | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER,
        )
    }

    /// RTR -> RTS.
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming `ibv_modify_qp` (EINVAL: e.g.
    /// `max_rd_atomic` above the device's `max_qp_init_rd_atom`).
    pub fn modify_to_rts(&self, params: &RtsParams) -> Result<(), VerbsError> {
        let mut attr = ibv_qp_attr {
            qp_state: ibv_qp_state::IBV_QPS_RTS,
            sq_psn: params.sq_psn & PSN_MASK,
            timeout: params.timeout,
            retry_cnt: params.retry_cnt,
            rnr_retry: params.rnr_retry,
            max_rd_atomic: params.max_rd_atomic,
            ..ibv_qp_attr::default()
        };
        self.modify(
            &mut attr,
            ibv_qp_attr_mask::IBV_QP_STATE
                | ibv_qp_attr_mask::IBV_QP_SQ_PSN
                | ibv_qp_attr_mask::IBV_QP_TIMEOUT
                | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC,
        )
    }

    /// Moves the QP to the error state: outstanding requests complete with
    /// [`super::WcStatus::WrFlush`].
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming `ibv_modify_qp`.
    pub fn modify_to_error(&self) -> Result<(), VerbsError> {
        let mut attr = ibv_qp_attr {
            qp_state: ibv_qp_state::IBV_QPS_ERR,
            ..ibv_qp_attr::default()
        };
        self.modify(&mut attr, ibv_qp_attr_mask::IBV_QP_STATE)
    }

    /// The current state (`ibv_query_qp`).
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming `ibv_query_qp`.
    pub fn state(&self) -> Result<QpState, VerbsError> {
        let mut attr = ibv_qp_attr::default();
        let mut init = ibv_qp_init_attr::default();
        let mask = i32::try_from(ibv_qp_attr_mask::IBV_QP_STATE).unwrap_or(1);
        // SAFETY: live QP; both out-pointers are valid locals.
        let rc = unsafe {
            self.inner
                .pd
                .ctx
                .verbs
                .lib()
                .ibv_query_qp(self.inner.qp, &mut attr, mask, &mut init)
        };
        check_rc("ibv_query_qp", rc)?;
        Ok(QpState::from_raw(attr.qp_state))
    }

    /// Posts `wrs` as one chain (`ibv_post_send` through
    /// `qp->context->ops.post_send`, as verbs.h's inline does). The slice's
    /// `next` links are rewritten in place; nothing is allocated.
    ///
    /// Memory safety rests on [`ProtectionDomain::register_raw`]'s contract:
    /// the device only touches memory inside registered regions, and checks
    /// every SGE's and remote range's key and bounds itself.
    ///
    /// # Errors
    /// [`VerbsError::Post`] with the index of the first request that was not
    /// posted (those before it were).
    pub fn post_send(&self, wrs: &mut [SendWr<'_>]) -> Result<(), VerbsError> {
        let n = wrs.len();
        if n == 0 {
            return Ok(());
        }
        let base = wrs.as_mut_ptr();
        for (i, wr) in wrs.iter_mut().enumerate() {
            wr.wr.next = if i + 1 < n {
                // `SendWr` is `repr(transparent)` over `ibv_send_wr`.
                base.wrapping_add(i + 1).cast::<ibv_send_wr>()
            } else {
                ptr::null_mut()
            };
        }
        let qp = self.inner.qp;
        // SAFETY: live QP; its context outlives it.
        let ctx = unsafe { (*qp).context };
        // SAFETY: live context; the ops table is filled at open and never
        // changed.
        let post = unsafe { (*ctx).ops.post_send };
        let Some(post) = post else {
            return Err(unsupported("ibv_post_send"));
        };
        let mut bad: *mut ibv_send_wr = ptr::null_mut();
        // SAFETY: live QP; the chain links `n` valid `ibv_send_wr`s in `wrs`
        // whose SGE arrays are borrowed for `'_` (the provider copies them
        // before returning); `bad` is a valid out-pointer.
        let rc = unsafe { post(qp, base.cast::<ibv_send_wr>(), &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        Err(VerbsError::Post {
            verb: "ibv_post_send",
            index: index_of(base.cast::<ibv_send_wr>(), bad, n),
            source: rc_to_io(rc),
        })
    }

    /// Posts receive requests (`ibv_post_recv` through
    /// `qp->context->ops.post_recv`). Only SEND and WRITE-with-immediate
    /// consume them; pure RDMA READ/WRITE traffic needs none.
    ///
    /// # Errors
    /// [`VerbsError::Post`] with the index of the first request not posted.
    pub fn post_recv(&self, wrs: &mut [RecvWr<'_>]) -> Result<(), VerbsError> {
        let n = wrs.len();
        if n == 0 {
            return Ok(());
        }
        let base = wrs.as_mut_ptr();
        for (i, wr) in wrs.iter_mut().enumerate() {
            wr.wr.next = if i + 1 < n {
                base.wrapping_add(i + 1).cast::<ibv_recv_wr>()
            } else {
                ptr::null_mut()
            };
        }
        let qp = self.inner.qp;
        // SAFETY: live QP; its context outlives it.
        let ctx = unsafe { (*qp).context };
        // SAFETY: live context; the ops table never changes after open.
        let post = unsafe { (*ctx).ops.post_recv };
        let Some(post) = post else {
            return Err(unsupported("ibv_post_recv"));
        };
        let mut bad: *mut ibv_recv_wr = ptr::null_mut();
        // SAFETY: as in `post_send`, for receive requests.
        let rc = unsafe { post(qp, base.cast::<ibv_recv_wr>(), &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        Err(VerbsError::Post {
            verb: "ibv_post_recv",
            index: index_of(base.cast::<ibv_recv_wr>(), bad, n),
            source: rc_to_io(rc),
        })
    }
}

fn unsupported(verb: &'static str) -> VerbsError {
    VerbsError::Verb {
        verb,
        source: std::io::Error::new(
            std::io::ErrorKind::Unsupported,
            "the provider does not implement this op",
        ),
    }
}

/// Index of `bad` in the array starting at `base` (0 when the provider gave
/// no usable pointer).
fn index_of<T>(base: *mut T, bad: *mut T, n: usize) -> usize {
    let size = mem::size_of::<T>();
    let offset = (bad as usize).wrapping_sub(base as usize);
    if bad.is_null() || size == 0 || offset % size != 0 || offset / size >= n {
        0
    } else {
        offset / size
    }
}
