//! What both ends of a page connection need from their device port, and the
//! one function that brings an RC QP from INIT to RTS with this project's
//! parameters. Shared by the client (the manager) and the page-server, so
//! both sides always agree.

use crate::coordinator::api::RdmaEndpoint;
use crate::verbs::{
    find_roce_v2_ipv4_gid_index, Context, Gid, LinkLayer, Mtu, PortState, QpEndpoint, QueuePair,
    RtrParams, RtsParams, VerbsError,
};
use crate::wire::RdmaHello;

/// Local ACK timeout code of every QP: 4.096 us * 2^14 = ~67 ms. A fault
/// path cannot wait NCCL's 4.3 s (code 20) to learn that a peer is gone;
/// 67 ms is still far above any RoCE/IB round trip (and SoftRoCE's ~1 ms
/// worst case under emulation), so it never fires on a healthy link.
pub const QP_TIMEOUT: u8 = 14;
/// Transport retries before a request fails with "retry exceeded": with
/// [`QP_TIMEOUT`], a dead peer is reported after about 4 x 67 ms = 270 ms,
/// well inside the default 1 s request deadline.
pub const QP_RETRY_CNT: u8 = 3;
/// RNR retries. Only SEND and WRITE-with-immediate can meet an RNR NAK and
/// this data path uses neither; kept finite so a misuse cannot hang.
pub const QP_RNR_RETRY: u8 = 3;
/// RNR NAK timer code (12 = 0.64 ms; 0 would mean 655 ms).
pub const QP_MIN_RNR_TIMER: u8 = 12;
/// Most RDMA READs in flight per QP we ask for (the device may allow fewer).
pub const MAX_RD_ATOMIC: u32 = 16;

/// How many RDMA READs a QP may have outstanding: as the initiator
/// (`max_rd_atomic`) and as the responder (`max_dest_rd_atomic`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadDepths {
    /// READs the QP may initiate at once.
    pub max_rd_atomic: u8,
    /// READs the QP may serve at once.
    pub max_dest_rd_atomic: u8,
}

impl ReadDepths {
    /// The depths of a QP with these local limits whose peer announced
    /// `remote` (its own limits): it initiates no more than the peer serves
    /// and serves no more than the peer initiates. Both sides compute the
    /// same pair mirrored, so in each direction the initiator's
    /// `max_rd_atomic` is at most the responder's `max_dest_rd_atomic`.
    pub fn agree(self, remote: ReadDepths) -> ReadDepths {
        ReadDepths {
            max_rd_atomic: self.max_rd_atomic.min(remote.max_dest_rd_atomic),
            max_dest_rd_atomic: self.max_dest_rd_atomic.min(remote.max_rd_atomic),
        }
    }

    /// The limits a peer announced in its HELLO section.
    pub fn of_peer(remote: &RdmaHello) -> ReadDepths {
        ReadDepths {
            max_rd_atomic: remote.max_rd_atomic,
            max_dest_rd_atomic: remote.max_dest_rd_atomic,
        }
    }
}

/// How long a requester QP waits for an ACK before it retransmits, and how
/// many times, before the request fails with "retry exceeded".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpTimeouts {
    /// Local ACK timeout code: 4.096 us * 2^code (1..=31; 0, "forever", is
    /// refused).
    pub ack_timeout_code: u8,
    /// Transport retries (0..=7).
    pub retry_count: u8,
}

impl Default for QpTimeouts {
    /// [`QP_TIMEOUT`] and [`QP_RETRY_CNT`].
    fn default() -> Self {
        Self {
            ack_timeout_code: QP_TIMEOUT,
            retry_count: QP_RETRY_CNT,
        }
    }
}

impl QpTimeouts {
    /// Checks the ranges verbs accept (and refuses the infinite timeout).
    ///
    /// # Errors
    /// A message naming the bad value.
    pub fn validate(self) -> Result<Self, String> {
        if !(1..=31).contains(&self.ack_timeout_code) {
            return Err(format!(
                "RDMA ACK timeout code {} is not in 1..=31 (0 would wait forever)",
                self.ack_timeout_code
            ));
        }
        if self.retry_count > 7 {
            return Err(format!("RDMA retry count {} is above 7", self.retry_count));
        }
        Ok(self)
    }
}

/// The facts of one port that a QP needs: how to address it and what the
/// device allows.
#[derive(Debug, Clone)]
pub struct PortInfo {
    /// Device name, e.g. `rxe0`.
    pub device: String,
    /// Port number (from 1).
    pub port: u8,
    /// GID index used as the source GID (RoCE v2: the IPv4-mapped entry).
    pub gid_index: u8,
    /// The GID at `gid_index`.
    pub gid: Gid,
    /// LID (InfiniBand); 0 on RoCE.
    pub lid: u16,
    /// Active MTU.
    pub mtu: Mtu,
    /// Link layer.
    pub link_layer: LinkLayer,
    /// RDMA READs a QP may initiate at once: min(device limit, 16).
    pub max_rd_atomic: u8,
    /// RDMA READs a QP may serve at once: min(device limit, 16).
    pub max_dest_rd_atomic: u8,
    /// Most work requests per queue.
    pub max_qp_wr: u32,
}

impl PortInfo {
    /// Queries `port` of `ctx`: it must be active. The GID index is
    /// `gid_index` when given, else the IPv4-mapped RoCE v2 entry on
    /// Ethernet and 0 on InfiniBand.
    ///
    /// # Errors
    /// [`VerbsError::InvalidArgument`] when the port is not active or has
    /// no MTU; [`VerbsError::NoRoceV2Gid`]; the query verbs' errors.
    pub fn query(ctx: &Context, port: u8, gid_index: Option<u8>) -> Result<Self, VerbsError> {
        let attr = ctx.query_device()?;
        let port_attr = ctx.query_port(port)?;
        if port_attr.state != PortState::Active {
            return Err(VerbsError::InvalidArgument(format!(
                "{} port {port} is {:?}, not active",
                ctx.name(),
                port_attr.state
            )));
        }
        let mtu = port_attr.active_mtu.ok_or_else(|| {
            VerbsError::InvalidArgument(format!("{} port {port} reports no active MTU", ctx.name()))
        })?;
        let gid_index = match (gid_index, port_attr.link_layer) {
            (Some(i), _) => i,
            (None, LinkLayer::InfiniBand) => 0,
            (None, _) => find_roce_v2_ipv4_gid_index(ctx, port)?,
        };
        let gid = ctx.query_gid(port, gid_index)?;
        let limit = |v: u32| u8::try_from(v.clamp(1, MAX_RD_ATOMIC)).unwrap_or(1);
        Ok(Self {
            device: ctx.name().to_owned(),
            port,
            gid_index,
            gid,
            lid: port_attr.lid,
            mtu,
            link_layer: port_attr.link_layer,
            max_rd_atomic: limit(attr.max_qp_init_rd_atom),
            max_dest_rd_atomic: limit(attr.max_qp_rd_atom),
            max_qp_wr: attr.max_qp_wr,
        })
    }

    /// The GID to publish in a HELLO: all-zero on InfiniBand (the peer then
    /// addresses us by LID), the port GID otherwise.
    pub fn hello_gid(&self) -> [u8; 16] {
        if self.link_layer == LinkLayer::InfiniBand {
            [0; 16]
        } else {
            self.gid.0
        }
    }

    /// This port as the coordinator publishes it.
    pub fn endpoint(&self) -> RdmaEndpoint {
        RdmaEndpoint {
            device: self.device.clone(),
            port: self.port,
            gid: self.gid.to_string(),
            gid_index: self.gid_index,
            lid: self.lid,
        }
    }

    /// This port's READ limits (what a HELLO announces).
    pub fn read_depths(&self) -> ReadDepths {
        ReadDepths {
            max_rd_atomic: self.max_rd_atomic,
            max_dest_rd_atomic: self.max_dest_rd_atomic,
        }
    }

    /// The HELLO section describing `qp` (with send PSN `psn`) and this
    /// port's READ limits, without a region (the caller fills
    /// `region_addr`/`rkey` on the server side).
    pub fn hello(&self, qp: &QueuePair, psn: u32) -> RdmaHello {
        let ep = qp.endpoint(psn, Gid(self.hello_gid()), self.lid, self.mtu);
        RdmaHello {
            qpn: ep.qpn,
            psn: ep.psn,
            gid: ep.gid,
            lid: ep.lid,
            mtu: ep.mtu,
            max_rd_atomic: self.max_rd_atomic,
            max_dest_rd_atomic: self.max_dest_rd_atomic,
            region_addr: 0,
            rkey: 0,
        }
    }
}

/// Brings `qp` (in INIT) to RTR towards `remote` and then to RTS, with send
/// PSN `local_psn`, `timeouts` (see [`QpTimeouts::default`]) and the READ
/// depths agreed from the port's limits and the peer's
/// ([`ReadDepths::agree`]).
///
/// # Errors
/// [`VerbsError::InvalidArgument`] for a peer MTU this crate does not know
/// or a peer READ limit of 0; `ibv_modify_qp` errors (on RoCE often a wrong
/// GID index).
pub fn connect_qp(
    qp: &QueuePair,
    port: &PortInfo,
    local_psn: u32,
    remote: &RdmaHello,
    timeouts: QpTimeouts,
) -> Result<(), VerbsError> {
    let remote_mtu = Mtu::from_raw(u32::from(remote.mtu)).ok_or_else(|| {
        VerbsError::InvalidArgument(format!("peer announced unknown MTU code {}", remote.mtu))
    })?;
    let peer = ReadDepths::of_peer(remote);
    if peer.max_rd_atomic == 0 || peer.max_dest_rd_atomic == 0 {
        return Err(VerbsError::InvalidArgument(format!(
            "peer announced READ limits {peer:?}: each must be at least 1"
        )));
    }
    let depths = port.read_depths().agree(peer);
    let endpoint = QpEndpoint {
        qpn: remote.qpn,
        psn: remote.psn,
        gid: remote.gid,
        lid: remote.lid,
        mtu: remote.mtu,
    };
    let mut rtr = RtrParams::new(
        endpoint,
        port.mtu.min(remote_mtu),
        port.port,
        port.gid_index,
    );
    rtr.max_dest_rd_atomic = depths.max_dest_rd_atomic;
    rtr.min_rnr_timer = QP_MIN_RNR_TIMER;
    qp.modify_to_rtr(&rtr)?;
    let mut rts = RtsParams::new(local_psn);
    rts.timeout = timeouts.ack_timeout_code;
    rts.retry_cnt = timeouts.retry_count;
    rts.rnr_retry = QP_RNR_RETRY;
    rts.max_rd_atomic = depths.max_rd_atomic;
    qp.modify_to_rts(&rts)?;
    tracing::debug!(
        qpn = qp.qpn(),
        max_rd_atomic = depths.max_rd_atomic,
        max_dest_rd_atomic = depths.max_dest_rd_atomic,
        "QP connected with the agreed READ depths"
    );
    Ok(())
}

/// A random 24-bit initial packet sequence number.
pub fn random_psn() -> u32 {
    crate::ids::random_u64() as u32 & 0x00ff_ffff
}

#[cfg(test)]
mod tests {
    use super::*;

    fn depths(max_rd_atomic: u8, max_dest_rd_atomic: u8) -> ReadDepths {
        ReadDepths {
            max_rd_atomic,
            max_dest_rd_atomic,
        }
    }

    #[test]
    fn agreed_depths_never_let_an_initiator_exceed_its_responder() {
        for a_init in 1..=16 {
            for a_dest in 1..=16 {
                for b_init in [1, 2, 4, 15, 16] {
                    for b_dest in [1, 3, 8, 16] {
                        let (a, b) = (depths(a_init, a_dest), depths(b_init, b_dest));
                        let (on_a, on_b) = (a.agree(b), b.agree(a));
                        assert!(on_a.max_rd_atomic <= on_b.max_dest_rd_atomic, "{a:?} {b:?}");
                        assert!(on_b.max_rd_atomic <= on_a.max_dest_rd_atomic, "{a:?} {b:?}");
                        // Never above the side's own device limits.
                        assert!(on_a.max_rd_atomic <= a_init && on_a.max_dest_rd_atomic <= a_dest);
                        assert!(on_b.max_rd_atomic <= b_init && on_b.max_dest_rd_atomic <= b_dest);
                        // And as deep as both allow.
                        assert_eq!(on_a.max_rd_atomic, a_init.min(b_dest));
                        assert_eq!(on_b.max_rd_atomic, b_init.min(a_dest));
                    }
                }
            }
        }
    }

    #[test]
    fn a_client_deeper_than_the_server_is_lowered_to_the_server() {
        let client = depths(16, 16);
        let server = depths(16, 4);
        assert_eq!(client.agree(server), depths(4, 16));
        assert_eq!(server.agree(client), depths(16, 4));
    }

    #[test]
    fn the_peer_limits_come_from_its_hello_section() {
        let hello = RdmaHello {
            max_rd_atomic: 7,
            max_dest_rd_atomic: 3,
            ..RdmaHello::default()
        };
        assert_eq!(ReadDepths::of_peer(&hello), depths(7, 3));
    }
}
