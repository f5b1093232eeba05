//! The page-server's RDMA side: the device, the exported region, and one
//! passive QP per client with a remote key of that client's own.
//!
//! A client offers its QP endpoint in AUTH; once its proof is checked the
//! handshake creates a QP and CQ for it, brings the QP to RTR/RTS towards
//! the client, gives the connection its own rkey over the region
//! (`client_keys`: a type-2 memory window bound to that QP, or a per-client
//! MR) and answers with its own endpoint, the region's address and that
//! rkey. The client then reads and writes the region directly; this side
//! posts nothing but the window's bind. The QP and the key live as long as
//! the control connection they were set up on: when that ends, both are
//! destroyed, so a client can never go on using a QP or a key of a
//! connection (or a server) that is gone.

use std::sync::{Arc, Weak};
use std::time::Instant;

use parking_lot::Mutex;
use rdma_transport::coordinator::api::{RdmaEndpoint, RdmaRegion};
use rdma_transport::rdma::{
    connect_qp, random_psn, MessageChannel, PortInfo, QpTimeouts, CHANNEL_SLOTS,
};
use rdma_transport::region::MappedRegion;
use rdma_transport::verbs::{
    list_devices, AccessFlags, CompletionQueue, Context, MemoryRegion, ProtectionDomain, QpCaps,
    QueuePair, Verbs, VerbsError,
};
use rdma_transport::wire::{MessageRing, RdmaHello};

use crate::client_keys::{bind_window, ClientKey, ClientKeyKind, ClientKeys, CLIENT_ACCESS};

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
    /// How each client connection gets its own rkey.
    pub client_keys: ClientKeys,
}

/// The device with the exported region registered on it.
///
/// Field order is drop order: the MR goes before the PD and the context.
/// The region itself belongs to the caller and must outlive this value and
/// every [`ServerQp`] it made.
#[derive(Debug)]
pub(crate) struct RdmaExport {
    /// The region, LOCAL_WRITE only (plus MW_BIND in window mode): it grants
    /// no remote access itself.
    mr: MemoryRegion,
    pd: ProtectionDomain,
    ctx: Context,
    port: PortInfo,
    /// How connections get their keys (probed at start).
    keys: ClientKeyKind,
    /// The clients' QPs (for test hooks; the sessions own them).
    qps: Mutex<Vec<Weak<ServerQp>>>,
}

/// A client's QP and key. Field order is drop order: the key is revoked
/// first, then the QP and its CQ are destroyed.
#[derive(Debug)]
pub(crate) struct ServerQp {
    key: ClientKey,
    qp: QueuePair,
    _cq: CompletionQueue,
    /// A coherence connection's message channel (its QP is `qp`).
    channel: Option<Arc<MessageChannel>>,
    /// How long creating the key took (allocation and bind, or
    /// registration), microseconds.
    key_setup_us: u64,
}

impl ServerQp {
    /// The QP number, for logs.
    pub(crate) fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    /// The rkey this connection's client was given.
    pub(crate) fn rkey(&self) -> u32 {
        self.key.rkey()
    }

    /// The message channel of a coherence connection.
    pub(crate) fn channel(&self) -> Option<&Arc<MessageChannel>> {
        self.channel.as_ref()
    }
}

/// One live client connection's key, as a test sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientKeyInfo {
    /// The server QP's number.
    pub qpn: u32,
    /// The rkey the client was given.
    pub rkey: u32,
    /// Window or region.
    pub kind: ClientKeyKind,
    /// Time to create the key, microseconds.
    pub setup_us: u64,
}

impl RdmaExport {
    /// Opens the device, chooses how clients get their keys (type-2 memory
    /// windows when `options.client_keys` allows and the device has them,
    /// else per-client MRs) and registers `region` with LOCAL_WRITE (and
    /// MW_BIND for windows): no remote access but through a client's key.
    ///
    /// # Safety
    /// `region` must outlive the returned value (and so its MR): the device
    /// reads and writes it by DMA on the clients' behalf.
    ///
    /// # Errors
    /// Why RDMA cannot be served: no library, no device, an inactive port,
    /// no usable GID, a failed registration (often `ulimit -l`), or
    /// [`ClientKeys::MemoryWindow`] on a device without type-2 windows.
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
        let keys = probe_keys(&ctx, &pd, options.client_keys)?;
        let access = match keys {
            ClientKeyKind::MemoryWindow => AccessFlags::LOCAL_WRITE | AccessFlags::MW_BIND,
            ClientKeyKind::MemoryRegion => AccessFlags::LOCAL_WRITE,
        };
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
            keys,
            qps: Mutex::new(Vec::new()),
        })
    }

    /// How client connections get their keys.
    pub(crate) fn client_keys(&self) -> ClientKeyKind {
        self.keys
    }

    /// The device port as the coordinator publishes it.
    pub(crate) fn endpoint(&self) -> RdmaEndpoint {
        self.port.endpoint()
    }

    /// The exported region's address and its MR's rkey, as the coordinator
    /// publishes it. That MR grants no remote access: clients use the key
    /// of their own connection from HELLO_ACK.
    pub(crate) fn region(&self) -> RdmaRegion {
        RdmaRegion {
            addr: self.mr.addr() as u64,
            rkey: self.mr.rkey(),
        }
    }

    /// Creates a QP and a key of its own for a client that offered
    /// `client`, connects the QP, and returns both with the answer for
    /// HELLO_ACK. When binding a window fails, the client gets a per-client
    /// MR instead (logged).
    ///
    /// # Errors
    /// Verb failures (the caller answers without RDMA then).
    pub(crate) fn accept(
        &self,
        client: &RdmaHello,
    ) -> Result<(Arc<ServerQp>, RdmaHello), VerbsError> {
        let (qp, psn) = match self.keys {
            ClientKeyKind::MemoryWindow => match self.accept_window(client) {
                Ok(done) => done,
                Err(err) => {
                    tracing::warn!(%err, client_qpn = client.qpn, "binding a memory window failed; this connection gets a per-client MR");
                    self.accept_region(client)?
                }
            },
            ClientKeyKind::MemoryRegion => self.accept_region(client)?,
        };
        tracing::debug!(
            qpn = qp.qpn(),
            rkey = format_args!("{:#x}", qp.rkey()),
            kind = %qp.key.kind(),
            key_setup_us = qp.key_setup_us,
            "client key ready"
        );
        let answer = RdmaHello {
            region_addr: self.mr.addr() as u64,
            rkey: qp.rkey(),
            ..self.port.hello(&qp.qp, psn)
        };
        let qp = Arc::new(qp);
        let mut qps = self.qps.lock();
        qps.retain(|w| w.strong_count() > 0);
        qps.push(Arc::downgrade(&qp));
        Ok((qp, answer))
    }

    /// A coherence connection (docs/coherence.md, "Over RDMA"): a PD of
    /// its own with the region registered for REMOTE_READ only (the node
    /// reads granted pages; its write-backs come as messages, which the
    /// home checks before it stores them), and a message channel in that
    /// PD connected to the client's, whose ring `client.region_addr` and
    /// `client.rkey` name. Returns the channel's QP and the answer, ring
    /// included.
    pub(crate) fn accept_channel(
        &self,
        client: &RdmaHello,
    ) -> Result<(Arc<ServerQp>, RdmaHello, MessageRing), VerbsError> {
        let started = Instant::now();
        let pd = self.ctx.alloc_pd()?;
        // SAFETY: as in `accept_region`: the region outlives every session.
        let mr = unsafe {
            pd.register_raw(
                self.mr.addr(),
                self.mr.len(),
                AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ,
            )
        }?;
        let channel = MessageChannel::new(&pd, &self.port)?;
        let ring = MessageRing {
            addr: client.region_addr,
            rkey: client.rkey,
            slots: CHANNEL_SLOTS,
        };
        // This side reads nothing from the node.
        let remote = RdmaHello {
            region_addr: 0,
            rkey: 0,
            ..*client
        };
        channel.connect(&remote, ring, QpTimeouts::default())?;
        let answer = RdmaHello {
            region_addr: self.mr.addr() as u64,
            rkey: mr.rkey(),
            ..channel.hello()
        };
        let own_ring = channel.ring();
        let qp = Arc::new(ServerQp {
            key: ClientKey::Region(mr),
            qp: channel.qp().clone(),
            _cq: channel.send_cq().clone(),
            channel: Some(Arc::new(channel)),
            key_setup_us: elapsed_us(started),
        });
        tracing::debug!(qpn = qp.qpn(), "coherence channel ready");
        let mut qps = self.qps.lock();
        qps.retain(|w| w.strong_count() > 0);
        qps.push(Arc::downgrade(&qp));
        Ok((qp, answer, own_ring))
    }

    /// A QP in the shared PD, connected, with a window bound on it.
    fn accept_window(&self, client: &RdmaHello) -> Result<(ServerQp, u32), VerbsError> {
        let (qp, cq, psn) = self.connected_qp(&self.pd, client)?;
        let started = Instant::now();
        let mw = bind_window(&self.pd, &self.mr, &qp, &cq)?;
        Ok((
            ServerQp {
                key: ClientKey::Window(mw),
                qp,
                _cq: cq,
                channel: None,
                key_setup_us: elapsed_us(started),
            },
            psn,
        ))
    }

    /// A PD of the client's own with the region registered in it, and a QP
    /// in that PD, connected.
    fn accept_region(&self, client: &RdmaHello) -> Result<(ServerQp, u32), VerbsError> {
        let pd = self.ctx.alloc_pd()?;
        let started = Instant::now();
        // SAFETY: the region outlives this export (`open`'s contract), and
        // every ServerQp lives in a session that borrows the export, so it
        // outlives this MR too; it is accessed only through raw pointers
        // (see `open`).
        let mr = unsafe {
            pd.register_raw(
                self.mr.addr(),
                self.mr.len(),
                AccessFlags::LOCAL_WRITE | CLIENT_ACCESS,
            )
        }?;
        let key_setup_us = elapsed_us(started);
        let (qp, cq, psn) = self.connected_qp(&pd, client)?;
        Ok((
            ServerQp {
                key: ClientKey::Region(mr),
                qp,
                _cq: cq,
                channel: None,
                key_setup_us,
            },
            psn,
        ))
    }

    /// A QP (and CQ) in `pd`, in RTS towards `client`.
    fn connected_qp(
        &self,
        pd: &ProtectionDomain,
        client: &RdmaHello,
    ) -> Result<(QueuePair, CompletionQueue, u32), VerbsError> {
        let cq = self.ctx.create_cq(SERVER_CQ_DEPTH, None, 0)?;
        let caps = QpCaps {
            max_send_wr: 1,
            max_recv_wr: 1,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
            sq_sig_all: false,
        };
        let qp = pd.create_rc_qp(&cq, &cq, &caps)?;
        qp.modify_to_init(
            self.port.port,
            AccessFlags::LOCAL_WRITE | AccessFlags::REMOTE_READ | AccessFlags::REMOTE_WRITE,
        )?;
        let psn = random_psn();
        // The server's QP sends no request (a bind is local): its timeouts
        // do not matter.
        connect_qp(&qp, &self.port, psn, client, QpTimeouts::default())?;
        Ok((qp, cq, psn))
    }

    /// Test hook: every live client connection's key.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn client_keys_for_test(&self) -> Vec<ClientKeyInfo> {
        self.qps
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .map(|qp| ClientKeyInfo {
                qpn: qp.qpn(),
                rkey: qp.rkey(),
                kind: qp.key.kind(),
                setup_us: qp.key_setup_us,
            })
            .collect()
    }

    /// Test hook: moves every client's QP to the error state while their
    /// control connections stay up (a peer whose QP died silently). Returns
    /// how many QPs it broke.
    #[cfg(feature = "test-hooks")]
    pub(crate) fn break_qps(&self) -> usize {
        self.break_where(|_| true)
    }

    /// Moves every data session's QP to the error state at once: no
    /// client READ or WRITE of the region lands after this returns (the
    /// sessions' connections are to be closed too). Coherence channels
    /// are left (their nodes' copies and write-backs are the coherence
    /// home's business). Returns how many QPs it broke.
    pub(crate) fn break_data_qps(&self) -> usize {
        self.break_where(|qp| qp.channel.is_none())
    }

    fn break_where(&self, which: impl Fn(&ServerQp) -> bool) -> usize {
        let qps: Vec<_> = self
            .qps
            .lock()
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|qp| which(qp))
            .collect();
        for qp in &qps {
            if let Err(err) = qp.qp.modify_to_error() {
                tracing::warn!(qpn = qp.qpn(), %err, "cannot move a QP to the error state");
            }
        }
        qps.len()
    }
}

fn elapsed_us(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// Chooses how client connections get their keys: windows when allowed,
/// the device announces type-2 windows and one can be allocated.
fn probe_keys(
    ctx: &Context,
    pd: &ProtectionDomain,
    wanted: ClientKeys,
) -> Result<ClientKeyKind, VerbsError> {
    if wanted == ClientKeys::MemoryRegion {
        return Ok(ClientKeyKind::MemoryRegion);
    }
    let attr = ctx.query_device()?;
    let probed = if attr.supports_type2_mw() {
        pd.alloc_mw_type2().map(drop)
    } else {
        Err(VerbsError::InvalidArgument(format!(
            "device {} has no type-2 memory windows (max_mw {}, device_cap_flags {:#x})",
            ctx.name(),
            attr.max_mw,
            attr.device_cap_flags
        )))
    };
    match (probed, wanted) {
        (Ok(()), _) => Ok(ClientKeyKind::MemoryWindow),
        (Err(err), ClientKeys::MemoryWindow) => Err(err),
        (Err(err), _) => {
            tracing::info!(device = ctx.name(), reason = %err, "no type-2 memory windows: each client connection gets its own MR");
            Ok(ClientKeyKind::MemoryRegion)
        }
    }
}
