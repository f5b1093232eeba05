//! Completion channels, completion queues and work completions.

use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::ptr;
use std::sync::Arc;

use super::context::{Context, ContextInner};
use super::error::{check_ptr, check_rc, last_errno, note_destroy_failure, rc_to_io, VerbsError};
use super::generated::{ibv_comp_channel, ibv_cq, ibv_wc, ibv_wc_opcode, ibv_wc_status};

/// A completion channel: an fd that becomes readable when an armed CQ
/// attached to it gets a completion (event mode).
#[derive(Debug, Clone)]
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

#[derive(Debug)]
struct ChannelInner {
    ctx: Arc<ContextInner>,
    chan: *mut ibv_comp_channel,
}

// SAFETY: verbs are thread-safe; the pointer is freed once, in Drop.
unsafe impl Send for ChannelInner {}
// SAFETY: as for Send.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: `chan` came from `ibv_create_comp_channel`; every CQ using
        // it holds an `Arc<ChannelInner>`, so none is left.
        let rc = unsafe { self.ctx.verbs.lib().ibv_destroy_comp_channel(self.chan) };
        if rc != 0 {
            note_destroy_failure();
            tracing::warn!(device = %self.ctx.name, error = %rc_to_io(rc), "ibv_destroy_comp_channel failed");
        }
    }
}

/// A completion queue. Polling needs no allocation: the caller owns the
/// [`WorkCompletion`] array.
#[derive(Debug, Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

#[derive(Debug)]
pub(crate) struct CqInner {
    pub(crate) ctx: Arc<ContextInner>,
    channel: Option<Arc<ChannelInner>>,
    pub(crate) cq: *mut ibv_cq,
}

// SAFETY: verbs are thread-safe (providers lock the CQ for polling); the
// pointer is freed once, in Drop.
unsafe impl Send for CqInner {}
// SAFETY: as for Send.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: `cq` came from `ibv_create_cq`; QPs using it hold an
        // `Arc<CqInner>`, so none is left. Events are acknowledged as soon
        // as they are read (`get_cq_event`), so destroy cannot wait on
        // unacknowledged events.
        let rc = unsafe { self.ctx.verbs.lib().ibv_destroy_cq(self.cq) };
        if rc != 0 {
            note_destroy_failure();
            tracing::warn!(device = %self.ctx.name, error = %rc_to_io(rc), "ibv_destroy_cq failed");
        }
    }
}

impl Context {
    /// `ibv_create_comp_channel`.
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming the verb.
    pub fn create_comp_channel(&self) -> Result<CompletionChannel, VerbsError> {
        // SAFETY: live context.
        let chan = check_ptr("ibv_create_comp_channel", unsafe {
            self.inner
                .verbs
                .lib()
                .ibv_create_comp_channel(self.inner.ctx)
        })?;
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                ctx: Arc::clone(&self.inner),
                chan,
            }),
        })
    }

    /// `ibv_create_cq` with at least `min_cqe` entries, optionally attached
    /// to `channel` for event mode, on completion vector `comp_vector`.
    ///
    /// # Errors
    /// [`VerbsError::InvalidArgument`] for `min_cqe` above `i32::MAX` or a
    /// channel of another device; [`VerbsError::Verb`] naming the verb.
    pub fn create_cq(
        &self,
        min_cqe: u32,
        channel: Option<&CompletionChannel>,
        comp_vector: i32,
    ) -> Result<CompletionQueue, VerbsError> {
        let cqe = i32::try_from(min_cqe)
            .map_err(|_| VerbsError::InvalidArgument(format!("CQ size {min_cqe}")))?;
        if let Some(ch) = channel {
            if !Arc::ptr_eq(&ch.inner.ctx, &self.inner) {
                return Err(VerbsError::InvalidArgument(
                    "completion channel belongs to another device context".into(),
                ));
            }
        }
        let chan_ptr = channel.map_or(ptr::null_mut(), |ch| ch.inner.chan);
        // SAFETY: live context; `chan_ptr` is NULL or a live channel of the
        // same context, kept alive by the CQ's `Arc` below.
        let cq = check_ptr("ibv_create_cq", unsafe {
            self.inner.verbs.lib().ibv_create_cq(
                self.inner.ctx,
                cqe,
                ptr::null_mut(),
                chan_ptr,
                comp_vector,
            )
        })?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                ctx: Arc::clone(&self.inner),
                channel: channel.map(|ch| Arc::clone(&ch.inner)),
                cq,
            }),
        })
    }
}

impl CompletionChannel {
    /// The channel's fd, for poll/epoll. Readable when an event is pending.
    pub fn fd(&self) -> RawFd {
        // SAFETY: live channel; `fd` is set at creation and never changed.
        unsafe { (*self.inner.chan).fd }
    }

    /// Makes [`CompletionChannel::get_cq_event`] without timeout return
    /// `WouldBlock` instead of blocking when no event is pending.
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming `fcntl`.
    pub fn set_nonblocking(&self, nonblocking: bool) -> Result<(), VerbsError> {
        let fd = self.fd();
        // SAFETY: F_GETFL on an fd we own has no memory effects.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        if flags < 0 {
            return Err(VerbsError::Verb {
                verb: "fcntl",
                source: last_errno(),
            });
        }
        let flags = if nonblocking {
            flags | libc::O_NONBLOCK
        } else {
            flags & !libc::O_NONBLOCK
        };
        // SAFETY: F_SETFL with flags derived from F_GETFL; no memory effects.
        let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, flags) };
        check_rc("fcntl", rc)
    }

    /// Waits for the next CQ event (`ibv_get_cq_event`), acknowledges it at
    /// once (`ibv_ack_cq_events`) and returns the [`CompletionQueue::handle`]
    /// of the CQ it is for. The CQ must be re-armed with
    /// [`CompletionQueue::req_notify`] and polled by the caller.
    ///
    /// `timeout_ms`: `None` blocks; `Some(t)` polls the fd for up to `t` ms
    /// and returns `Ok(None)` when no event came.
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming `poll` or `ibv_get_cq_event` (`WouldBlock`
    /// on a non-blocking channel with no event).
    pub fn get_cq_event(&self, timeout_ms: Option<u32>) -> Result<Option<u32>, VerbsError> {
        if let Some(timeout_ms) = timeout_ms {
            let mut pfd = libc::pollfd {
                fd: self.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            let timeout = i32::try_from(timeout_ms).unwrap_or(i32::MAX);
            // SAFETY: `pfd` is one valid pollfd for the call's duration.
            let n = unsafe { libc::poll(&mut pfd, 1, timeout) };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    return Ok(None);
                }
                return Err(VerbsError::Verb {
                    verb: "poll",
                    source: err,
                });
            }
            if n == 0 {
                return Ok(None);
            }
        }
        let mut cq: *mut ibv_cq = ptr::null_mut();
        let mut cq_context: *mut libc::c_void = ptr::null_mut();
        // SAFETY: live channel; both out-pointers are valid locals.
        let rc = unsafe {
            self.inner
                .ctx
                .verbs
                .lib()
                .ibv_get_cq_event(self.inner.chan, &mut cq, &mut cq_context)
        };
        check_rc("ibv_get_cq_event", rc)?;
        // SAFETY: the library returned a live CQ: a CQ with an unacknowledged
        // event cannot finish `ibv_destroy_cq`, so it is valid until the ack
        // below, which we issue exactly once for this one event.
        let handle = unsafe { (*cq).handle };
        // SAFETY: `cq` is still live (see above); this is the one ack for the
        // one event just read.
        unsafe { self.inner.ctx.verbs.lib().ibv_ack_cq_events(cq, 1) };
        Ok(Some(handle))
    }
}

impl AsRawFd for CompletionChannel {
    fn as_raw_fd(&self) -> RawFd {
        self.fd()
    }
}

impl CompletionQueue {
    /// Polls up to `wcs.len()` completions into `wcs` (`ibv_poll_cq`, called
    /// through `cq->context->ops.poll_cq` as verbs.h's inline does) and
    /// returns how many were written. Never allocates.
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming `ibv_poll_cq`.
    pub fn poll(&self, wcs: &mut [WorkCompletion]) -> Result<usize, VerbsError> {
        let max = i32::try_from(wcs.len()).unwrap_or(i32::MAX);
        let cq = self.inner.cq;
        // SAFETY: live CQ.
        let ctx = unsafe { (*cq).context };
        // SAFETY: the CQ's context outlives it; the ops table is filled by
        // the provider at open and never changed.
        let poll_cq = unsafe { (*ctx).ops.poll_cq };
        let Some(poll_cq) = poll_cq else {
            return Err(no_op("ibv_poll_cq"));
        };
        // SAFETY: `WorkCompletion` is `repr(transparent)` over `ibv_wc`, and
        // `wcs` has room for `max` entries.
        let n = unsafe { poll_cq(cq, max, wcs.as_mut_ptr().cast::<ibv_wc>()) };
        if n < 0 {
            return Err(VerbsError::Verb {
                verb: "ibv_poll_cq",
                source: rc_to_io(n),
            });
        }
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Arms the CQ (`ibv_req_notify_cq` through `cq->context->ops`): the
    /// next completion (only solicited ones if `solicited_only`) raises an
    /// event on the CQ's channel. Re-arm after every event, then poll the CQ
    /// empty, to not miss completions that raced with the arming.
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming `ibv_req_notify_cq`.
    pub fn req_notify(&self, solicited_only: bool) -> Result<(), VerbsError> {
        let cq = self.inner.cq;
        // SAFETY: live CQ.
        let ctx = unsafe { (*cq).context };
        // SAFETY: as in `poll`.
        let notify = unsafe { (*ctx).ops.req_notify_cq };
        let Some(notify) = notify else {
            return Err(no_op("ibv_req_notify_cq"));
        };
        // SAFETY: live CQ.
        let rc = unsafe { notify(cq, i32::from(solicited_only)) };
        check_rc("ibv_req_notify_cq", rc)
    }

    /// The CQ's kernel handle, as returned by
    /// [`CompletionChannel::get_cq_event`].
    pub fn handle(&self) -> u32 {
        // SAFETY: live CQ; `handle` is set at creation and never changed.
        unsafe { (*self.inner.cq).handle }
    }

    /// Actual number of entries (at least what was asked for).
    pub fn capacity(&self) -> u32 {
        // SAFETY: live CQ; `cqe` only changes with `ibv_resize_cq`, which
        // this wrapper never calls.
        let cqe = unsafe { (*self.inner.cq).cqe };
        u32::try_from(cqe).unwrap_or(0)
    }

    /// The channel the CQ raises events on, if any.
    pub fn channel(&self) -> Option<CompletionChannel> {
        self.inner.channel.as_ref().map(|inner| CompletionChannel {
            inner: Arc::clone(inner),
        })
    }
}

fn no_op(verb: &'static str) -> VerbsError {
    VerbsError::Verb {
        verb,
        source: io::Error::new(
            io::ErrorKind::Unsupported,
            "the provider does not implement this op",
        ),
    }
}

/// One work completion (`struct ibv_wc`), filled by
/// [`CompletionQueue::poll`]. `Default` is all-zero, ready to poll into.
#[derive(Clone, Copy, Default)]
#[repr(transparent)]
pub struct WorkCompletion(ibv_wc);

impl WorkCompletion {
    /// The `wr_id` the request was posted with.
    pub fn wr_id(&self) -> u64 {
        self.0.wr_id
    }

    /// Completion status.
    pub fn status(&self) -> WcStatus {
        WcStatus::from_raw(self.0.status)
    }

    /// Whether the request succeeded.
    pub fn is_success(&self) -> bool {
        self.0.status == ibv_wc_status::IBV_WC_SUCCESS
    }

    /// `Ok` for a successful completion, else the typed error (the QP is
    /// then in the error state).
    ///
    /// # Errors
    /// [`VerbsError::WorkCompletion`] with the status and vendor error.
    pub fn result(&self) -> Result<(), VerbsError> {
        if self.is_success() {
            Ok(())
        } else {
            Err(VerbsError::WorkCompletion {
                wr_id: self.0.wr_id,
                status: self.status(),
                vendor_err: self.0.vendor_err,
            })
        }
    }

    /// What completed. Only meaningful for successful completions.
    pub fn opcode(&self) -> WcOpcode {
        WcOpcode::from_raw(self.0.opcode)
    }

    /// Bytes transferred (for receives and RDMA READs).
    pub fn byte_len(&self) -> u32 {
        self.0.byte_len
    }

    /// The immediate data of a receive completion for a SEND or RDMA WRITE
    /// with immediate (`None` without one).
    pub fn imm_data(&self) -> Option<u32> {
        if self.0.wc_flags & super::generated::ibv_wc_flags::IBV_WC_WITH_IMM == 0 {
            return None;
        }
        // SAFETY: with IBV_WC_WITH_IMM set, the union holds `imm_data`
        // (both members are plain u32s, so any bit pattern is valid).
        Some(u32::from_be(unsafe { self.0.__bindgen_anon_1.imm_data }))
    }

    /// Number of the local QP the request was posted on.
    pub fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    /// Provider-specific error detail.
    pub fn vendor_err(&self) -> u32 {
        self.0.vendor_err
    }
}

impl fmt::Debug for WorkCompletion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkCompletion")
            .field("wr_id", &self.wr_id())
            .field("status", &self.status())
            .field("opcode", &self.opcode())
            .field("byte_len", &self.byte_len())
            .field("qp_num", &self.qp_num())
            .field("vendor_err", &self.vendor_err())
            .finish()
    }
}

macro_rules! wc_status {
    ($($variant:ident = $raw:ident, $text:literal;)*) => {
        /// Work completion status (`enum ibv_wc_status`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[non_exhaustive]
        pub enum WcStatus {
            $(
                #[doc = $text]
                $variant,
            )*
            /// A value this crate does not know, raw.
            Other(u32),
        }

        impl WcStatus {
            /// Maps the raw `ibv_wc_status` value.
            pub fn from_raw(raw: u32) -> Self {
                match raw {
                    $(ibv_wc_status::$raw => Self::$variant,)*
                    other => Self::Other(other),
                }
            }

            /// The raw `ibv_wc_status` value.
            pub fn to_raw(self) -> u32 {
                match self {
                    $(Self::$variant => ibv_wc_status::$raw,)*
                    Self::Other(raw) => raw,
                }
            }
        }

        impl fmt::Display for WcStatus {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self {
                    $(Self::$variant => write!(f, "{} ({})", $text, stringify!($raw)),)*
                    Self::Other(raw) => write!(f, "unknown work completion status {raw}"),
                }
            }
        }
    };
}

wc_status! {
    Success = IBV_WC_SUCCESS, "success";
    LocalLength = IBV_WC_LOC_LEN_ERR, "local length error";
    LocalQpOperation = IBV_WC_LOC_QP_OP_ERR, "local QP operation error";
    LocalEecOperation = IBV_WC_LOC_EEC_OP_ERR, "local EE context operation error";
    LocalProtection = IBV_WC_LOC_PROT_ERR, "local protection error";
    WrFlush = IBV_WC_WR_FLUSH_ERR, "work request flushed (QP in error state)";
    MwBind = IBV_WC_MW_BIND_ERR, "memory window bind error";
    BadResponse = IBV_WC_BAD_RESP_ERR, "bad response error";
    LocalAccess = IBV_WC_LOC_ACCESS_ERR, "local access error";
    RemoteInvalidRequest = IBV_WC_REM_INV_REQ_ERR, "remote invalid request error";
    RemoteAccess = IBV_WC_REM_ACCESS_ERR, "remote access error";
    RemoteOperation = IBV_WC_REM_OP_ERR, "remote operation error";
    RetryExceeded = IBV_WC_RETRY_EXC_ERR, "transport retry counter exceeded";
    RnrRetryExceeded = IBV_WC_RNR_RETRY_EXC_ERR, "RNR retry counter exceeded";
    LocalRddViolation = IBV_WC_LOC_RDD_VIOL_ERR, "local RDD violation error";
    RemoteInvalidRdRequest = IBV_WC_REM_INV_RD_REQ_ERR, "remote invalid RD request";
    RemoteAborted = IBV_WC_REM_ABORT_ERR, "remote aborted error";
    InvalidEecn = IBV_WC_INV_EECN_ERR, "invalid EE context number";
    InvalidEecState = IBV_WC_INV_EEC_STATE_ERR, "invalid EE context state";
    Fatal = IBV_WC_FATAL_ERR, "fatal error";
    ResponseTimeout = IBV_WC_RESP_TIMEOUT_ERR, "response timeout error";
    General = IBV_WC_GENERAL_ERR, "general error";
}

/// What a work completion is for (`enum ibv_wc_opcode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WcOpcode {
    /// SEND.
    Send,
    /// RDMA WRITE.
    RdmaWrite,
    /// RDMA READ.
    RdmaRead,
    /// Atomic compare and swap.
    CompSwap,
    /// Atomic fetch and add.
    FetchAdd,
    /// Receive.
    Recv,
    /// Receive of an RDMA WRITE with immediate.
    RecvRdmaWithImm,
    /// Any other value, raw.
    Other(u32),
}

impl WcOpcode {
    fn from_raw(raw: u32) -> Self {
        match raw {
            ibv_wc_opcode::IBV_WC_SEND => Self::Send,
            ibv_wc_opcode::IBV_WC_RDMA_WRITE => Self::RdmaWrite,
            ibv_wc_opcode::IBV_WC_RDMA_READ => Self::RdmaRead,
            ibv_wc_opcode::IBV_WC_COMP_SWAP => Self::CompSwap,
            ibv_wc_opcode::IBV_WC_FETCH_ADD => Self::FetchAdd,
            ibv_wc_opcode::IBV_WC_RECV => Self::Recv,
            ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => Self::RecvRdmaWithImm,
            other => Self::Other(other),
        }
    }
}
