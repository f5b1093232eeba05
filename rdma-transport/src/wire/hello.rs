//! Payloads of the handshake: HELLO (client nonce), CHALLENGE (server
//! nonce, epoch, server proof), AUTH (client proof, client QP endpoint),
//! HELLO_ACK (region, server QP endpoint and rkey). The RDMA section carries
//! the queue-pair endpoint exchange (QPN, PSN, GID/LID, MTU, READ depths)
//! and the exported region's address and rkey.

use std::num::NonZeroU32;

use crate::auth::{Nonce, Proof, PROOF_LEN};

/// Flag bit: an [`RdmaHello`] section follows the fixed part.
const FLAG_RDMA: u32 = 1;
/// Flag bit (CHALLENGE, AUTH): the sender holds no cluster key (insecure).
const FLAG_NO_KEY: u32 = 2;
/// Flag bit (AUTH): the client asks for page checksums.
const FLAG_AUTH_CHECKSUMS: u32 = 4;
/// Flag bit (HELLO_ACK): the server agrees to page checksums.
const FLAG_ACK_CHECKSUMS: u32 = 2;
/// Flag bit (AUTH, with [`FLAG_AUTH_CHECKSUMS`]): the client asks that a
/// WRITE's checksum cover its offset too ([`crate::wire::offset_bound_checksum`]).
const FLAG_AUTH_BOUND_SUMS: u32 = 16;
/// Flag bit (HELLO_ACK, with [`FLAG_ACK_CHECKSUMS`]): the server agrees to
/// offset-bound WRITE checksums.
const FLAG_ACK_BOUND_SUMS: u32 = 8;
/// Flag bit (AUTH, with [`FLAG_RDMA`]): the connection is a coherence
/// channel; the RDMA section's address and key are the client's message
/// ring ([`MessageRing`]).
const FLAG_AUTH_COHERENCE: u32 = 8;
/// Flag bit (HELLO_ACK, with [`FLAG_RDMA`]): the server's message ring
/// follows the RDMA section.
const FLAG_ACK_COHERENCE: u32 = 4;
/// Flag bit (AUTH): the client declares its bound on this server's silence
/// as a coherence node, in the word after the flags.
const FLAG_AUTH_NODE_BOUND: u32 = 32;
/// Flag bit (HELLO_ACK, answering [`FLAG_AUTH_NODE_BOUND`]): the longest
/// such bound the server accepts follows the fixed part.
const FLAG_ACK_NODE_BOUND: u32 = 16;
/// Bytes of a HELLO_ACK's node-bound section.
const NODE_BOUND_LEN: usize = 4;
/// Bytes of a [`MessageRing`] section.
const RING_LEN: usize = 16;
const ACK_FIXED_LEN: usize = 24;
const AUTH_FIXED_LEN: usize = 40;
const RDMA_LEN: usize = 48;

/// Length of a HELLO payload.
pub const HELLO_LEN: usize = 48;
/// Length of a CHALLENGE payload.
pub const CHALLENGE_LEN: usize = 80;
/// A side's message ring for a coherence channel over RDMA
/// (`crate::rdma::MessageChannel`): `slots` slots of
/// [`crate::rdma::CHANNEL_SLOT_BYTES`] at `addr`, written by the peer with
/// RDMA WRITE with immediate under key `rkey`. On the wire (HELLO_ACK), 16
/// bytes: addr u64, rkey u32, slots u32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MessageRing {
    /// Address of slot 0.
    pub addr: u64,
    /// Remote key (REMOTE_WRITE) of the ring.
    pub rkey: u32,
    /// Number of slots.
    pub slots: u32,
}

/// Largest AUTH payload.
pub const AUTH_MAX_LEN: usize = AUTH_FIXED_LEN + RDMA_LEN;
/// Length of a HELLO_ACK payload without its RDMA section.
pub const HELLO_ACK_LEN: usize = ACK_FIXED_LEN;

/// One side's RDMA endpoint. On the wire, 48 bytes: qpn u32, psn u32,
/// gid [16], lid u16, mtu u8, max_rd_atomic u8, max_dest_rd_atomic u8,
/// 3 bytes zero, addr u64, rkey u32, 4 bytes zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RdmaHello {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number.
    pub psn: u32,
    /// Port GID (RoCE) in network byte order.
    pub gid: [u8; 16],
    /// Port LID (InfiniBand), 0 on RoCE.
    pub lid: u16,
    /// Path MTU as the verbs enum value (1 = 256 ... 5 = 4096).
    pub mtu: u8,
    /// RDMA READs this side's QP can have outstanding as the initiator
    /// (at least 1 on the wire).
    pub max_rd_atomic: u8,
    /// RDMA READs this side's QP can serve at once as the responder (at
    /// least 1 on the wire). The peer initiates no more than this.
    pub max_dest_rd_atomic: u8,
    /// Address of the exported region (server side; 0 from clients).
    pub region_addr: u64,
    /// Remote key of the exported region (server side; 0 from clients).
    pub rkey: u32,
}

impl RdmaHello {
    fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.qpn.to_le_bytes());
        out.extend_from_slice(&self.psn.to_le_bytes());
        out.extend_from_slice(&self.gid);
        out.extend_from_slice(&self.lid.to_le_bytes());
        out.push(self.mtu);
        out.push(self.max_rd_atomic);
        out.push(self.max_dest_rd_atomic);
        out.extend_from_slice(&[0u8; 3]);
        out.extend_from_slice(&self.region_addr.to_le_bytes());
        out.extend_from_slice(&self.rkey.to_le_bytes());
        out.extend_from_slice(&[0u8; 4]);
    }

    /// `None` unless `b` is exactly one section whose READ depths are at
    /// least 1 (a QP that can take no READ cannot serve this protocol).
    fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != RDMA_LEN || b[27] == 0 || b[28] == 0 {
            return None;
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[8..24]);
        Some(Self {
            qpn: u32_at(b, 0),
            psn: u32_at(b, 4),
            gid,
            lid: u16::from_le_bytes([b[24], b[25]]),
            mtu: b[26],
            max_rd_atomic: b[27],
            max_dest_rd_atomic: b[28],
            region_addr: u64_at(b, 32),
            rkey: u32_at(b, 40),
        })
    }
}

/// HELLO payload, 48 bytes: flags u32 (0), reserved u32, client id u64,
/// client nonce [32].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HelloRequest {
    /// Random per-client identifier, for the server's logs.
    pub client_id: u64,
    /// Fresh random bytes: the server's proof covers them.
    pub nonce: Nonce,
}

impl HelloRequest {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HELLO_LEN);
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.client_id.to_le_bytes());
        out.extend_from_slice(&self.nonce);
        out
    }

    /// Decodes a payload; `None` when its length or flags do not match.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != HELLO_LEN || u32_at(b, 0) != 0 {
            return None;
        }
        Some(Self {
            client_id: u64_at(b, 8),
            nonce: array_at(b, 16),
        })
    }
}

/// CHALLENGE payload, 80 bytes: flags u32 (bit 0: the server holds no
/// cluster key), reserved u32, epoch u64, server nonce [32], server proof
/// [32] (zero without a key).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Challenge {
    /// The server's epoch (as in HELLO_ACK), covered by both proofs.
    pub epoch: u64,
    /// Fresh random bytes: the client's proof covers them.
    pub nonce: Nonce,
    /// The server's proof of the key; `None` from a server without one.
    pub proof: Option<Proof>,
}

impl Challenge {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(CHALLENGE_LEN);
        let flags = if self.proof.is_none() { FLAG_NO_KEY } else { 0 };
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.nonce);
        out.extend_from_slice(&self.proof.unwrap_or([0u8; PROOF_LEN]));
        out
    }

    /// Decodes a payload; `None` when its length or flags do not match.
    pub fn decode(b: &[u8]) -> Option<Self> {
        if b.len() != CHALLENGE_LEN || u32_at(b, 0) & !FLAG_NO_KEY != 0 {
            return None;
        }
        Some(Self {
            epoch: u64_at(b, 8),
            nonce: array_at(b, 16),
            proof: (u32_at(b, 0) & FLAG_NO_KEY == 0).then(|| array_at(b, 48)),
        })
    }
}

/// AUTH payload: fixed 40 bytes (flags u32: bit 0 RDMA section follows,
/// bit 1 no key, bit 2 checksums asked, bit 3 coherence channel, bit 4
/// offset-bound WRITE checksums asked (only with bit 2), bit 5 a node bound
/// declared; node bound u32 (milliseconds, not 0, with bit 5; else
/// reserved); client proof [32],
/// zero without a key), then the optional RDMA section (the client's QP
/// endpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AuthRequest {
    /// The client's proof of the key; `None` from a client without one.
    pub proof: Option<Proof>,
    /// The client's QP endpoint when it wants the RDMA data path.
    pub rdma: Option<RdmaHello>,
    /// The client asks for page checksums on this connection (TCP data
    /// path only; see [`crate::wire::Header::checksum`]).
    pub checksums: bool,
    /// With `checksums`: the client asks that each WRITE's checksum cover
    /// the WRITE's offset as well as its page
    /// ([`crate::wire::offset_bound_checksum`]), so that a WRITE whose
    /// offset is damaged on the way is refused instead of applied to
    /// another page.
    pub bound_sums: bool,
    /// The connection is a coherence channel (only with `rdma`, whose
    /// `region_addr` and `rkey` are then the client's message ring).
    pub coherence: bool,
    /// The client, as a coherence node, drops its copies of this server's
    /// pages within this many milliseconds of the server's silence
    /// (`CoherenceConfig::dead_home_timeout_ms`). A server makes only a
    /// client that declared a bound no longer than its limit
    /// ([`HelloAck::node_bound_limit_ms`]) a coherence node.
    pub node_bound_ms: Option<NonZeroU32>,
}

impl AuthRequest {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(AUTH_FIXED_LEN + RDMA_LEN);
        let mut flags = if self.rdma.is_some() { FLAG_RDMA } else { 0 };
        if self.proof.is_none() {
            flags |= FLAG_NO_KEY;
        }
        if self.checksums {
            flags |= FLAG_AUTH_CHECKSUMS;
            if self.bound_sums {
                flags |= FLAG_AUTH_BOUND_SUMS;
            }
        }
        if self.coherence && self.rdma.is_some() {
            flags |= FLAG_AUTH_COHERENCE;
        }
        if self.node_bound_ms.is_some() {
            flags |= FLAG_AUTH_NODE_BOUND;
        }
        out.extend_from_slice(&flags.to_le_bytes());
        out.extend_from_slice(&self.node_bound_ms.map_or(0, NonZeroU32::get).to_le_bytes());
        out.extend_from_slice(&self.proof.unwrap_or([0u8; PROOF_LEN]));
        if let Some(r) = &self.rdma {
            r.encode_into(&mut out);
        }
        out
    }

    /// Decodes a payload; `None` when its length or flags do not match.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let fixed = b.get(..AUTH_FIXED_LEN)?;
        let flags = u32_at(fixed, 0);
        let known = FLAG_RDMA
            | FLAG_NO_KEY
            | FLAG_AUTH_CHECKSUMS
            | FLAG_AUTH_COHERENCE
            | FLAG_AUTH_BOUND_SUMS
            | FLAG_AUTH_NODE_BOUND;
        if flags & !known != 0 {
            return None;
        }
        // The word is reserved without the flag (clients before it sent 0,
        // and it is not checked); with it, a bound of 0 is malformed.
        let node_bound_ms = if flags & FLAG_AUTH_NODE_BOUND != 0 {
            Some(NonZeroU32::new(u32_at(fixed, 4))?)
        } else {
            None
        };
        let checksums = flags & FLAG_AUTH_CHECKSUMS != 0;
        let bound_sums = flags & FLAG_AUTH_BOUND_SUMS != 0;
        if bound_sums && !checksums {
            return None;
        }
        let coherence = flags & FLAG_AUTH_COHERENCE != 0;
        if coherence && flags & FLAG_RDMA == 0 {
            return None;
        }
        let rest = &b[AUTH_FIXED_LEN..];
        let rdma = match (flags & FLAG_RDMA != 0, rest.is_empty()) {
            (true, false) => Some(RdmaHello::decode(rest)?),
            (false, true) => None,
            _ => return None,
        };
        Some(Self {
            proof: (flags & FLAG_NO_KEY == 0).then(|| array_at(fixed, 8)),
            rdma,
            checksums,
            bound_sums,
            coherence,
            node_bound_ms,
        })
    }
}

/// HELLO_ACK payload: fixed 24 bytes (region size u64, server epoch u64,
/// page size u32, flags u32: bit 0 RDMA section follows, bit 1 checksums
/// agreed, bit 2 message ring follows, bit 3 offset-bound WRITE checksums
/// agreed (only with bit 1), bit 4 node-bound limit follows), then the
/// optional node-bound limit (u32 milliseconds, not 0), the optional RDMA
/// section and the optional message ring, in that order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HelloAck {
    /// Size of the exported region in bytes.
    pub region_size_bytes: u64,
    /// Changes each time the server starts: a client that sees a new epoch
    /// knows every earlier connection state (and QP) is stale.
    pub epoch: u64,
    /// Page size the server serves.
    pub page_size: u32,
    /// The server's QP endpoint and region key when it accepted RDMA.
    pub rdma: Option<RdmaHello>,
    /// The server agrees to page checksums (only ever set when the
    /// client's AUTH asked for them).
    pub checksums: bool,
    /// With `checksums`: the server agrees to offset-bound WRITE checksums
    /// (only ever set when the client's AUTH asked for them).
    pub bound_sums: bool,
    /// The server's message ring, when the client asked for a coherence
    /// channel and got RDMA (only with `rdma`).
    pub coherence: Option<MessageRing>,
    /// Answering an AUTH that declared a node bound: the longest bound the
    /// server accepts from a coherence node (its
    /// `--node-dead-home-timeout-ms`).
    pub node_bound_limit_ms: Option<NonZeroU32>,
}

impl HelloAck {
    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(ACK_FIXED_LEN + RDMA_LEN);
        out.extend_from_slice(&self.region_size_bytes.to_le_bytes());
        out.extend_from_slice(&self.epoch.to_le_bytes());
        out.extend_from_slice(&self.page_size.to_le_bytes());
        let mut flags = if self.rdma.is_some() { FLAG_RDMA } else { 0 };
        if self.checksums {
            flags |= FLAG_ACK_CHECKSUMS;
            if self.bound_sums {
                flags |= FLAG_ACK_BOUND_SUMS;
            }
        }
        let ring = self.coherence.filter(|_| self.rdma.is_some());
        if ring.is_some() {
            flags |= FLAG_ACK_COHERENCE;
        }
        if self.node_bound_limit_ms.is_some() {
            flags |= FLAG_ACK_NODE_BOUND;
        }
        out.extend_from_slice(&flags.to_le_bytes());
        if let Some(limit) = self.node_bound_limit_ms {
            out.extend_from_slice(&limit.get().to_le_bytes());
        }
        if let Some(r) = &self.rdma {
            r.encode_into(&mut out);
        }
        if let Some(ring) = ring {
            out.extend_from_slice(&ring.addr.to_le_bytes());
            out.extend_from_slice(&ring.rkey.to_le_bytes());
            out.extend_from_slice(&ring.slots.to_le_bytes());
        }
        out
    }

    /// Decodes a payload; `None` when its length or flags do not match.
    pub fn decode(b: &[u8]) -> Option<Self> {
        let fixed = b.get(..ACK_FIXED_LEN)?;
        let flags = u32_at(fixed, 20);
        let mut rest = &b[ACK_FIXED_LEN..];
        let mut node_bound_limit_ms = None;
        if flags & FLAG_ACK_NODE_BOUND != 0 {
            let section = rest.get(..NODE_BOUND_LEN)?;
            node_bound_limit_ms = Some(NonZeroU32::new(u32_at(section, 0))?);
            rest = &rest[NODE_BOUND_LEN..];
        }
        let mut coherence = None;
        if flags & FLAG_ACK_COHERENCE != 0 {
            if flags & FLAG_RDMA == 0 || rest.len() < RING_LEN {
                return None;
            }
            let (section, ring) = rest.split_at(rest.len() - RING_LEN);
            coherence = Some(MessageRing {
                addr: u64_at(ring, 0),
                rkey: u32_at(ring, 8),
                slots: u32_at(ring, 12),
            });
            rest = section;
        }
        let rdma = match (flags & FLAG_RDMA != 0, rest.is_empty()) {
            (true, false) => Some(RdmaHello::decode(rest)?),
            (false, true) => None,
            _ => return None,
        };
        Some(Self {
            region_size_bytes: u64_at(fixed, 0),
            epoch: u64_at(fixed, 8),
            page_size: u32_at(fixed, 16),
            rdma,
            checksums: flags & FLAG_ACK_CHECKSUMS != 0,
            bound_sums: flags & FLAG_ACK_CHECKSUMS != 0 && flags & FLAG_ACK_BOUND_SUMS != 0,
            coherence,
            node_bound_limit_ms,
        })
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn array_at<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut x = [0u8; N];
    x.copy_from_slice(&b[at..at + N]);
    x
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rdma() -> RdmaHello {
        RdmaHello {
            qpn: 0x11,
            psn: 0x22,
            gid: [7; 16],
            lid: 3,
            mtu: 5,
            max_rd_atomic: 16,
            max_dest_rd_atomic: 8,
            region_addr: 0x7f00_0000,
            rkey: 0xabcd,
        }
    }

    #[test]
    fn handshake_payloads_round_trip() {
        let h = HelloRequest {
            client_id: 42,
            nonce: [5; 32],
        };
        assert_eq!(h.encode().len(), HELLO_LEN);
        assert_eq!(HelloRequest::decode(&h.encode()), Some(h));
        for proof in [None, Some([6u8; 32])] {
            let c = Challenge {
                epoch: 9,
                nonce: [7; 32],
                proof,
            };
            assert_eq!(c.encode().len(), CHALLENGE_LEN);
            assert_eq!(Challenge::decode(&c.encode()), Some(c));
            for (r, checksums) in [None, Some(rdma())].into_iter().zip([false, true]) {
                let a = AuthRequest {
                    proof,
                    rdma: r,
                    checksums,
                    bound_sums: checksums,
                    coherence: r.is_some() && checksums,
                    node_bound_ms: None,
                };
                assert_eq!(AuthRequest::decode(&a.encode()), Some(a));
                let a = AuthRequest {
                    checksums: !checksums,
                    bound_sums: false,
                    ..a
                };
                assert_eq!(AuthRequest::decode(&a.encode()), Some(a));
            }
        }
        for r in [None, Some(rdma())] {
            for checksums in [false, true] {
                let a = HelloAck {
                    region_size_bytes: 1 << 30,
                    epoch: 9,
                    page_size: 4096,
                    rdma: r,
                    checksums,
                    bound_sums: checksums,
                    coherence: None,
                    node_bound_limit_ms: None,
                };
                assert_eq!(HelloAck::decode(&a.encode()), Some(a));
                let plain = HelloAck {
                    bound_sums: false,
                    ..a
                };
                assert_eq!(HelloAck::decode(&plain.encode()), Some(plain));
                if r.is_some() {
                    let ring = MessageRing {
                        addr: 0x7f12_3400_0000,
                        rkey: 0x55aa,
                        slots: 64,
                    };
                    let c = HelloAck {
                        coherence: Some(ring),
                        ..a
                    };
                    let bytes = c.encode();
                    assert_eq!(bytes.len(), ACK_FIXED_LEN + RDMA_LEN + RING_LEN);
                    assert_eq!(HelloAck::decode(&bytes), Some(c));
                    for cut in ACK_FIXED_LEN..bytes.len() {
                        assert_eq!(HelloAck::decode(&bytes[..cut]), None, "cut at {cut}");
                    }
                }
            }
        }
    }

    #[test]
    fn truncated_or_inconsistent_payloads_are_refused() {
        let hello = HelloRequest {
            client_id: 1,
            nonce: [1; 32],
        }
        .encode();
        let challenge = Challenge {
            epoch: 1,
            nonce: [2; 32],
            proof: Some([3; 32]),
        }
        .encode();
        let auth = AuthRequest {
            proof: Some([4; 32]),
            rdma: Some(rdma()),
            checksums: true,
            bound_sums: true,
            coherence: true,
            node_bound_ms: None,
        }
        .encode();
        for cut in 0..hello.len() {
            assert_eq!(HelloRequest::decode(&hello[..cut]), None, "cut at {cut}");
        }
        for cut in 0..challenge.len() {
            assert_eq!(Challenge::decode(&challenge[..cut]), None, "cut at {cut}");
        }
        for cut in 0..auth.len() {
            assert_eq!(AuthRequest::decode(&auth[..cut]), None, "cut at {cut}");
        }
        // Unknown flags are refused.
        let mut odd = challenge.clone();
        odd[0] |= 0x10;
        assert_eq!(Challenge::decode(&odd), None);
        // AUTH's flag says RDMA but nothing follows.
        let mut lying = AuthRequest {
            proof: Some([4; 32]),
            rdma: None,
            checksums: false,
            bound_sums: false,
            coherence: false,
            node_bound_ms: None,
        }
        .encode();
        lying[0] |= FLAG_RDMA as u8;
        assert_eq!(AuthRequest::decode(&lying), None);
        // A coherence channel without RDMA does not exist.
        let mut no_rdma = AuthRequest::default().encode();
        no_rdma[0] |= FLAG_AUTH_COHERENCE as u8;
        assert_eq!(AuthRequest::decode(&no_rdma), None);
        let ack = HelloAck {
            region_size_bytes: 1,
            epoch: 2,
            page_size: 4096,
            rdma: None,
            checksums: true,
            bound_sums: false,
            coherence: None,
            node_bound_limit_ms: None,
        }
        .encode();
        assert_eq!(HelloAck::decode(&ack[..ACK_FIXED_LEN - 1]), None);
        // A ring without RDMA is refused.
        let mut ring_only = ack.clone();
        ring_only[20] |= FLAG_ACK_COHERENCE as u8;
        ring_only.extend_from_slice(&[0u8; RING_LEN]);
        assert_eq!(HelloAck::decode(&ring_only), None);
        // An AUTH flag bit beyond the node-bound bit is still refused, and
        // the offset-bound sums bit without checksums.
        let mut unknown = AuthRequest::default().encode();
        unknown[0] |= 64;
        assert_eq!(AuthRequest::decode(&unknown), None);
        let mut bound_alone = AuthRequest::default().encode();
        bound_alone[0] |= FLAG_AUTH_BOUND_SUMS as u8;
        assert_eq!(AuthRequest::decode(&bound_alone), None);
    }

    #[test]
    fn a_node_bound_and_its_limit_sit_at_their_bits_and_round_trip() {
        let ms = |v| NonZeroU32::new(v);
        let plain = AuthRequest::default().encode();
        for rdma in [None, Some(rdma())] {
            let a = AuthRequest {
                rdma,
                coherence: rdma.is_some(),
                node_bound_ms: ms(10_000),
                ..AuthRequest::default()
            };
            let bytes = a.encode();
            assert_eq!(u32_at(&bytes, 0) & 32, 32, "AUTH bit 5");
            assert_eq!(u32_at(&bytes, 4), 10_000, "the bound after the flags");
            assert_eq!(AuthRequest::decode(&bytes), Some(a));
        }
        // Declared with a bound of 0: malformed. Not declared: the word is
        // not read (as from clients before the flag).
        let mut zero = plain.clone();
        zero[0] |= FLAG_AUTH_NODE_BOUND as u8;
        assert_eq!(AuthRequest::decode(&zero), None);
        let mut old = plain.clone();
        old[4] = 7;
        assert_eq!(
            AuthRequest::decode(&old).map(|a| a.node_bound_ms),
            Some(None)
        );
        for rdma in [None, Some(rdma())] {
            let ack = HelloAck {
                region_size_bytes: 1 << 20,
                epoch: 3,
                page_size: 4096,
                rdma,
                checksums: true,
                bound_sums: true,
                coherence: rdma.map(|_| MessageRing {
                    addr: 0x7f00_1000,
                    rkey: 9,
                    slots: 64,
                }),
                node_bound_limit_ms: ms(u32::MAX),
            };
            let bytes = ack.encode();
            assert_eq!(u32_at(&bytes, 20) & 16, 16, "HELLO_ACK bit 4");
            assert_eq!(u32_at(&bytes, ACK_FIXED_LEN), u32::MAX, "the limit first");
            assert_eq!(HelloAck::decode(&bytes), Some(ack));
            for cut in ACK_FIXED_LEN..bytes.len() {
                assert_eq!(HelloAck::decode(&bytes[..cut]), None, "cut at {cut}");
            }
            let mut zero = bytes.clone();
            zero[ACK_FIXED_LEN..ACK_FIXED_LEN + NODE_BOUND_LEN].fill(0);
            assert_eq!(HelloAck::decode(&zero), None, "a limit of 0");
        }
    }

    #[test]
    fn checksum_flags_sit_at_their_bits() {
        let plain = AuthRequest::default().encode();
        let asked = AuthRequest {
            checksums: true,
            bound_sums: false,
            ..AuthRequest::default()
        }
        .encode();
        assert_eq!(u32_at(&asked, 0), u32_at(&plain, 0) | 4, "AUTH bit 2");
        assert_eq!(&asked[4..], &plain[4..]);
        let ack = |checksums| HelloAck {
            region_size_bytes: 1 << 20,
            epoch: 3,
            page_size: 4096,
            rdma: None,
            checksums,
            bound_sums: false,
            coherence: None,
            node_bound_limit_ms: None,
        };
        let (off, on) = (ack(false).encode(), ack(true).encode());
        assert_eq!(u32_at(&off, 20), 0);
        assert_eq!(u32_at(&on, 20), 2, "HELLO_ACK bit 1");
        assert_eq!(&on[..20], &off[..20]);
        assert_eq!(on.len(), HELLO_ACK_LEN);
        let bound = AuthRequest {
            checksums: true,
            bound_sums: true,
            ..AuthRequest::default()
        }
        .encode();
        assert_eq!(u32_at(&bound, 0), u32_at(&plain, 0) | 4 | 16, "AUTH bit 4");
        let bound_ack = HelloAck {
            bound_sums: true,
            ..ack(true)
        }
        .encode();
        assert_eq!(u32_at(&bound_ack, 20), 2 | 8, "HELLO_ACK bit 3");
        // Without checksums the bit is not sent.
        let unbound = AuthRequest {
            bound_sums: true,
            ..AuthRequest::default()
        }
        .encode();
        assert_eq!(unbound, plain);
    }

    #[test]
    fn rdma_section_layout_carries_the_read_depths() {
        let bytes = AuthRequest {
            proof: None,
            rdma: Some(rdma()),
            checksums: false,
            bound_sums: false,
            coherence: false,
            node_bound_ms: None,
        }
        .encode();
        let section = &bytes[AUTH_FIXED_LEN..];
        assert_eq!(section.len(), RDMA_LEN);
        assert_eq!(&section[0..4], &0x11u32.to_le_bytes());
        assert_eq!(&section[24..26], &3u16.to_le_bytes());
        assert_eq!(section[26], 5, "mtu");
        assert_eq!(section[27], 16, "max_rd_atomic");
        assert_eq!(section[28], 8, "max_dest_rd_atomic");
        assert_eq!(&section[29..32], &[0, 0, 0]);
        assert_eq!(&section[32..40], &0x7f00_0000u64.to_le_bytes());
        assert_eq!(&section[40..44], &0xabcdu32.to_le_bytes());
        assert_eq!(&section[44..48], &[0, 0, 0, 0]);
    }

    #[test]
    fn a_section_without_a_read_depth_is_refused() {
        for at in [27, 28] {
            let mut bytes = AuthRequest {
                proof: None,
                rdma: Some(rdma()),
                checksums: false,
                bound_sums: false,
                coherence: false,
                node_bound_ms: None,
            }
            .encode();
            bytes[AUTH_FIXED_LEN + at] = 0;
            assert_eq!(AuthRequest::decode(&bytes), None, "byte {at}");
            let mut ack = HelloAck {
                region_size_bytes: 1,
                epoch: 2,
                page_size: 4096,
                rdma: Some(rdma()),
                checksums: false,
                bound_sums: false,
                coherence: None,
                node_bound_limit_ms: None,
            }
            .encode();
            ack[ACK_FIXED_LEN + at] = 0;
            assert_eq!(HelloAck::decode(&ack), None, "byte {at}");
        }
    }
}
