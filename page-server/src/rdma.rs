//! The page-server's RDMA side: the device, the exported region registered
//! once for remote READ and WRITE, and one passive QP per client.
//!
//! A client offers its QP endpoint in HELLO; the HELLO handler creates a QP
//! and CQ for it, brings the QP to RTR/RTS towards the client and answers
//! with its own endpoint, the region's address and its rkey. The client then
//! reads and writes the region directly; this side posts nothing and polls
//! nothing. The QP lives as long as the control connection it was set up
//! on: when that ends, the QP is destroyed, so a client can never go on
//! using a QP of a connection (or a server) that is gone.

use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use rdma_transport::coordinator::api::{RdmaEndpoint, RdmaRegion};
use rdma_transport::rdma::{connect_qp, random_psn, PortInfo, QpTimeouts};
use rdma_transport::region::MappedRegion;
use rdma_transport::verbs::{
    list_devices, AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpCaps,
    QueuePair, Verbs, VerbsError,
};
use rdma_transport::wire::RdmaHello;

/// CQ entries of a server QP: it completes nothing of its own (the client
/// initiates every transfer), so the minimum.
const SERVER_CQ_DEPTH: u32 = 16;

/// Where the RDMA side comes from.
#[derive(Debug, Clone, Default)]
pub struct RdmaOptions {
    /// Serve RDMA at all (`--no-rdma` turns it off).
    pub enabled: bool,
    /// Device name; the first device when `None`.
    pub device: Option<String>,
    /// Port number (from 1); 1 when 0.
    pub port: u8,
    /// GID index; the IPv4-mapped RoCE v2 GID (or 0 on IB) when `None`.
    pub gid_index: Option<u8>,
}

/// The device with the exported region registered on it.
///
/// Field order is drop order: the MR goes before the PD and the context.
/// The region itself belongs to the caller and must outlive this value.
#[derive(Debug)]
pub(crate) struct RdmaExport {
    mr: MemoryRegion,
    pd: ProtectionDomain,
    ctx: Context,
    port: PortInfo,
    /// The clients' QPs (for a test hook; the sessions own them).
    qps: Mutex<Vec<Weak<ServerQp>>>,
}

/// A client's QP; destroyed (with its CQ) when dropped.
#[derive(Debug)]
pub(crate) struct ServerQp {
    qp: QueuePair,
    _cq: CompletionQueue,
}

impl ServerQp {
    /// The QP number, for logs.
    pub(crate) fn qpn(&self) -> u32 {
        self.qp.qpn()
    }
}

impl RdmaExport {
    /// Opens the device and registers `region` with LOCAL_WRITE,
    /// REMOTE_READ and REMOTE_WRITE.
    ///
    /// # Safety
    /// `region` must outlive the returned value (and so its MR): the device
    /// reads and writes it by DMA on the clients' behalf.
    ///
    /// # Errors
    /// Why RDMA cannot be served: no library, no device, an inactive port,
    /// no usable GID, or a failed registration (often `ulimit -l`).
    pub(crate) unsafe fn open(
        options: &RdmaOptions,
        region: &MappedRegion,
    ) -> Result<Self, VerbsError> {
        let verbs = Verbs::load()?;
        if list_devices(&verbs)?.is_empty() {
            return Err(VerbsError::NoDevice);
        }
        let ctx = Context::open(&verbs, options.device.as_deref())?;
        let port = PortInfo::query(&ctx, options.port.max(1), options.gid_index)?;
        let pd = ctx.alloc_pd()?;
        let access =
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE;
        // SAFETY: the caller keeps `region` mapped for longer than this value
        // (this fn's contract), and MappedRegion never hands out references
        // to its bytes: every access (here, over TCP, or by DMA) goes through
        // raw pointers and tolerates concurrent writes, as `register_raw`
        // requires.
        let mr = unsafe { pd.register_raw(region.as_ptr(), region.len_bytes(), access) }?;
        Ok(Self {
            mr,
            pd,
            ctx,
            port,
            qps: Mutex::new(Vec::new()),
        })
    }

    /// The device port as the coordinator publishes it.
    pub(crate) fn endpoint(&self) -> RdmaEndpoint {
        self.port.endpoint()
    }

    /// The exported region's address and rkey.
    pub(crate) fn region(&self) -> RdmaRegion {
        RdmaRegion {
            addr: self.mr.addr() as u64,
            rkey: self.mr.rkey(),
        }
    }

    /// Creates a QP for a client that offered `client`, connects it, and
    /// returns it with the answer for HELLO_ACK.
    ///
    /// # Errors
    /// Verb failures (the caller answers without RDMA then).
    pub(crate) fn accept(
        &self,
        client: &RdmaHello,
    ) -> Result<(Arc<ServerQp>, RdmaHello), VerbsError> {
        let cq = self.ctx.create_cq(SERVER_CQ_DEPTH, None, 0)?;
        let caps = QpCaps {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
        };
        let qp = self.pd.create_rc_qp(&cq, &cq, &caps)?;
        qp.modify_to_init(
            self.port.port,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
        )?;
        let psn = random_psn();
        // The server's QP never sends a request: its timeouts do not matter.
        connect_qp(&qp, &self.port, psn, client, QpTimeouts::default())?;
        let region = self.region();
        let answer = RdmaHello {
            region_addr: region.addr,
            rkey: region.rkey,
            ..self.port.hello(&qp, psn)
        };
        let qp = Arc::new(ServerQp { qp, _cq: cq });
        let mut qps = self.qps.lock();
        qps.retain(|w| w.strong_count() > 0);
        qps.push(Arc::downgrade(&qp));
        Ok((qp, answer))
    }

    /// Test hook: moves every client's QP to the error state while their
    /// control connections stay up (a peer whose QP died silently). Returns
    /// how many QPs it broke.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn break_qps(&self) -> usize {
        let qps: Vec<_> = self.qps.lock().iter().filter_map(Weak::upgrade).collect();
        for qp in &qps {
            if let Err(err) = qp.qp.modify_to_error() {
                tracing::warn!(qpn = qp.qpn(), %err, "cannot move a QP to the error state");
            }
        }
        qps.len()
    }
}
