//! The coherence messages on the wire (version 4): the `coherence` crate's
//! [`ToHome`] and [`ToNode`] as `COH_TO_HOME` / `COH_TO_NODE` frames.
//!
//! A frame is a [`Header`] (offset: the page's offset in the home's exported
//! region; length: the payload's) and a payload of a 32-byte body, followed
//! by the page (4096 bytes) when the body's "page follows" flag is set: a
//! grant carries the home's data, a write-back or an ack that reports a
//! write-back carries the node's. The header's checksum field holds
//! [`coherence_checksum`]: on a connection that agreed to offset-bound sums
//! (`AuthRequest::bound_sums`) a CRC-32C of the page (when one follows),
//! the body and the offset, so a frame whose offset, body or page changed
//! on the way fails it, frames without a page included; otherwise a CRC-32C
//! of the page alone (and nothing checked without one). Body layout
//! (little-endian):
//!
//! | bytes | field |
//! |---|---|
//! | 0 | kind (see [`Kind`]) |
//! | 1 | flags: bit 0 a page follows; bit 1 `upgrade`; bit 2 `kept`; bit 3 the optional value (bytes 16..24) is present |
//! | 2 | mode of a grant: 0 shared, 1 exclusive; else 0 |
//! | 3 | zero |
//! | 4..8 | request id |
//! | 8..16 | sequence number |
//! | 16..24 | version / written-back version / grant sequence number |
//! | 24..32 | data version (grants) |
//!
//! Decoding checks every field and never panics; a frame that does not
//! decode is a [`CohDecodeError`].

use coherence::{Mode, ToHome, ToNode};

use super::header::crc32c_of;
use super::{page_checksum, Header, Opcode, Status, HEADER_LEN};
use crate::page::{Page, PAGE_SIZE};

/// Size of a coherence message's body.
pub const COH_BODY_LEN: usize = 32;

const FLAG_PAGE: u8 = 1 << 0;
const FLAG_UPGRADE: u8 = 1 << 1;
const FLAG_KEPT: u8 = 1 << 2;
const FLAG_VALUE: u8 = 1 << 3;

/// Message kinds (body byte 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Kind {
    ReadReq = 1,
    WriteReq = 2,
    InvalidateAck = 3,
    DowngradeAck = 4,
    WriteBack = 5,
    Grant = 16,
    Lost = 17,
    Retry = 18,
    Invalidate = 19,
    Downgrade = 20,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::ReadReq,
            2 => Self::WriteReq,
            3 => Self::InvalidateAck,
            4 => Self::DowngradeAck,
            5 => Self::WriteBack,
            16 => Self::Grant,
            17 => Self::Lost,
            18 => Self::Retry,
            19 => Self::Invalidate,
            20 => Self::Downgrade,
            _ => return None,
        })
    }

    /// The flags a message of this kind may carry.
    fn allowed_flags(self) -> u8 {
        match self {
            Self::ReadReq | Self::Lost | Self::Retry | Self::Downgrade => 0,
            Self::WriteReq => FLAG_UPGRADE,
            Self::InvalidateAck => FLAG_PAGE | FLAG_VALUE,
            Self::DowngradeAck => FLAG_PAGE | FLAG_VALUE | FLAG_KEPT,
            Self::WriteBack | Self::Grant => FLAG_PAGE,
            Self::Invalidate => FLAG_VALUE,
        }
    }
}

/// Why a coherence frame could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CohDecodeError {
    /// The frame's opcode is not the one this side receives.
    #[error("opcode {0:?} is not a coherence message for this side")]
    WrongOpcode(Opcode),
    /// The payload is neither a body nor a body and a page.
    #[error("coherence payload of {0} bytes (need a {COH_BODY_LEN}-byte body, and a page after it or nothing)")]
    BadLength(usize),
    /// Unknown message kind, or one that goes the other way.
    #[error("unknown coherence message kind {0}")]
    BadKind(u8),
    /// Flags this kind does not have, a reserved byte not zero, or a page
    /// flag that disagrees with the length.
    #[error("coherence message kind {kind} with invalid flags {flags:#04x}")]
    BadFlags {
        /// The kind.
        kind: u8,
        /// The flags byte.
        flags: u8,
    },
    /// A grant's mode is neither shared nor exclusive.
    #[error("unknown grant mode {0}")]
    BadMode(u8),
    /// The page does not match the header's checksum.
    #[error("coherence page fails its checksum")]
    Checksum,
    /// A refusal (status not OK) of something other than a node → home frame.
    #[error("status {0} on a frame that cannot carry one")]
    UnexpectedStatus(Status),
}

/// A decoded coherence message about the page at `offset`, with its page
/// when one travels with it (exactly [`PAGE_SIZE`] bytes, checksum verified).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CohFrame<'a, M> {
    /// The page's offset in the home's exported region (not checked here).
    pub offset: u64,
    /// The message.
    pub msg: M,
    /// The page that travels with it.
    pub page: Option<&'a [u8]>,
}

/// What a node receives: a message, or the home's refusal of a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToNodeFrame<'a> {
    /// A message.
    Msg(CohFrame<'a, ToNode>),
    /// The home refused a node → home message about the page at `offset`
    /// (out of range, unaligned, malformed, too many nodes): the node's
    /// request for that page fails with `status`.
    Refused {
        /// The page's offset.
        offset: u64,
        /// Why.
        status: Status,
    },
}

#[derive(Default)]
struct Body {
    kind: u8,
    flags: u8,
    mode: u8,
    req: u32,
    seq: u64,
    value: u64,
    data_version: u64,
}

impl Body {
    fn encode(&self) -> [u8; COH_BODY_LEN] {
        let mut out = [0u8; COH_BODY_LEN];
        out[0] = self.kind;
        out[1] = self.flags;
        out[2] = self.mode;
        out[4..8].copy_from_slice(&self.req.to_le_bytes());
        out[8..16].copy_from_slice(&self.seq.to_le_bytes());
        out[16..24].copy_from_slice(&self.value.to_le_bytes());
        out[24..32].copy_from_slice(&self.data_version.to_le_bytes());
        out
    }

    fn decode(bytes: &[u8; COH_BODY_LEN]) -> Self {
        let u64_at = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        Body {
            kind: bytes[0],
            flags: bytes[1],
            mode: bytes[2],
            req: u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]),
            seq: u64_at(8),
            value: u64_at(16),
            data_version: u64_at(24),
        }
    }

    fn optional(&self) -> Option<u64> {
        (self.flags & FLAG_VALUE != 0).then_some(self.value)
    }

    fn set_optional(&mut self, value: Option<u64>) {
        if let Some(v) = value {
            self.flags |= FLAG_VALUE;
            self.value = v;
        }
    }
}

fn to_home_body(msg: &ToHome) -> Body {
    let mut body = Body::default();
    match *msg {
        ToHome::ReadReq { req } => {
            body.kind = Kind::ReadReq as u8;
            body.req = req;
        }
        ToHome::WriteReq { req, upgrade } => {
            body.kind = Kind::WriteReq as u8;
            body.req = req;
            if upgrade {
                body.flags |= FLAG_UPGRADE;
            }
        }
        ToHome::InvalidateAck { seq, written_back } => {
            body.kind = Kind::InvalidateAck as u8;
            body.seq = seq;
            body.set_optional(written_back);
        }
        ToHome::DowngradeAck {
            seq,
            written_back,
            kept,
        } => {
            body.kind = Kind::DowngradeAck as u8;
            body.seq = seq;
            body.set_optional(written_back);
            if kept {
                body.flags |= FLAG_KEPT;
            }
        }
        ToHome::WriteBack { version } => {
            body.kind = Kind::WriteBack as u8;
            body.value = version;
        }
    }
    body
}

fn to_node_body(msg: &ToNode) -> Body {
    let mut body = Body::default();
    match *msg {
        ToNode::Grant {
            req,
            seq,
            mode,
            version,
            data_version,
        } => {
            body.kind = Kind::Grant as u8;
            body.req = req;
            body.seq = seq;
            body.mode = match mode {
                Mode::Shared => 0,
                Mode::Exclusive => 1,
            };
            body.value = version;
            body.data_version = data_version;
        }
        ToNode::Lost { req } => {
            body.kind = Kind::Lost as u8;
            body.req = req;
        }
        ToNode::Retry { req } => {
            body.kind = Kind::Retry as u8;
            body.req = req;
        }
        ToNode::Invalidate { seq, grant } => {
            body.kind = Kind::Invalidate as u8;
            body.seq = seq;
            body.set_optional(grant);
        }
        ToNode::Downgrade { seq, grant } => {
            body.kind = Kind::Downgrade as u8;
            body.seq = seq;
            body.value = grant;
        }
    }
    body
}

/// The checksum a coherence frame about the page at `offset` carries, with
/// `body` (its 32 bytes as sent) and `page` (when one follows). With
/// `bound_sums` (the connection agreed to offset-bound sums): CRC-32C of
/// the page, then the body, then the offset's 8 little-endian bytes.
/// Without: the page's CRC-32C, 0 when no page follows (such frames are
/// not checked then), as before offset-bound sums existed.
pub fn coherence_checksum(
    offset: u64,
    body: &[u8; COH_BODY_LEN],
    page: Option<&[u8]>,
    bound_sums: bool,
) -> u32 {
    if !bound_sums {
        return page.map_or(0, page_checksum);
    }
    crc32c_of(&[page.unwrap_or_default(), body, &offset.to_le_bytes()])
}

fn encode(
    opcode: Opcode,
    offset: u64,
    mut body: Body,
    page: Option<&Page>,
    bound_sums: bool,
) -> Vec<u8> {
    let mut length = COH_BODY_LEN;
    if page.is_some() {
        body.flags |= FLAG_PAGE;
        length += PAGE_SIZE;
    }
    let body = body.encode();
    let checksum = coherence_checksum(offset, &body, page.map(|p| &p[..]), bound_sums);
    let header = Header::request(opcode, 0, offset, length as u32).with_checksum(checksum);
    let mut out = Vec::with_capacity(HEADER_LEN + length);
    out.extend_from_slice(&header.encode());
    out.extend_from_slice(&body);
    if let Some(page) = page {
        out.extend_from_slice(page);
    }
    out
}

/// A node → home frame: `msg` about the page at `offset`, with the page
/// written back when there is one; `bound_sums`: the connection agreed to
/// offset-bound sums (see [`coherence_checksum`]).
pub fn encode_to_home(offset: u64, msg: &ToHome, page: Option<&Page>, bound_sums: bool) -> Vec<u8> {
    encode(
        Opcode::CohToHome,
        offset,
        to_home_body(msg),
        page,
        bound_sums,
    )
}

/// A home → node frame: `msg` about the page at `offset`, with the home's
/// page for a grant; `bound_sums` as in [`encode_to_home`].
pub fn encode_to_node(offset: u64, msg: &ToNode, page: Option<&Page>, bound_sums: bool) -> Vec<u8> {
    encode(
        Opcode::CohToNode,
        offset,
        to_node_body(msg),
        page,
        bound_sums,
    )
}

/// The checksum of the home's refusal of a frame about the page at
/// `offset`: with `bound_sums`, CRC-32C of the status's 2 little-endian
/// bytes and then the offset's 8 (a refusal has no body: a changed offset
/// would fail another page's request); without, 0 (not checked).
pub fn refusal_checksum(offset: u64, status: Status, bound_sums: bool) -> u32 {
    if !bound_sums {
        return 0;
    }
    crc32c_of(&[&(status as u16).to_le_bytes(), &offset.to_le_bytes()])
}

/// The home's refusal of a node → home frame about the page at `offset`;
/// `bound_sums` as in [`encode_to_home`].
pub fn encode_refusal(offset: u64, status: Status, bound_sums: bool) -> [u8; HEADER_LEN] {
    Header {
        status,
        ..Header::request(Opcode::CohToNode, 0, offset, 0)
    }
    .with_checksum(refusal_checksum(offset, status, bound_sums))
    .encode()
}

/// Splits and checks a payload: the body, and the page if the flags say so.
fn split<'a>(
    header: &Header,
    payload: &'a [u8],
    bound_sums: bool,
) -> Result<(Body, Kind, Option<&'a [u8]>), CohDecodeError> {
    let (body_bytes, page) = match payload.len() {
        COH_BODY_LEN => (payload, None),
        n if n == COH_BODY_LEN + PAGE_SIZE => {
            let (b, p) = payload.split_at(COH_BODY_LEN);
            (b, Some(p))
        }
        n => return Err(CohDecodeError::BadLength(n)),
    };
    let mut fixed = [0u8; COH_BODY_LEN];
    fixed.copy_from_slice(body_bytes);
    // First: a frame damaged on the way is a checksum failure, whatever
    // its damaged fields would say.
    if (bound_sums || page.is_some())
        && coherence_checksum(header.offset, &fixed, page, bound_sums) != header.checksum
    {
        return Err(CohDecodeError::Checksum);
    }
    let body = Body::decode(&fixed);
    let kind = Kind::from_u8(body.kind).ok_or(CohDecodeError::BadKind(body.kind))?;
    let bad_flags = CohDecodeError::BadFlags {
        kind: body.kind,
        flags: body.flags,
    };
    if body.flags & !kind.allowed_flags() != 0
        || fixed[3] != 0
        || (body.flags & FLAG_PAGE != 0) != page.is_some()
    {
        return Err(bad_flags);
    }
    Ok((body, kind, page))
}

/// Decodes a node → home frame (`header` already decoded, `payload` its
/// [`Header::payload_len`] bytes).
///
/// # Errors
/// Any field that does not check: see [`CohDecodeError`].
pub fn decode_to_home<'a>(
    header: &Header,
    payload: &'a [u8],
    bound_sums: bool,
) -> Result<CohFrame<'a, ToHome>, CohDecodeError> {
    if header.opcode != Opcode::CohToHome {
        return Err(CohDecodeError::WrongOpcode(header.opcode));
    }
    if header.status != Status::Ok {
        return Err(CohDecodeError::UnexpectedStatus(header.status));
    }
    let (body, kind, page) = split(header, payload, bound_sums)?;
    let msg = match kind {
        Kind::ReadReq => ToHome::ReadReq { req: body.req },
        Kind::WriteReq => ToHome::WriteReq {
            req: body.req,
            upgrade: body.flags & FLAG_UPGRADE != 0,
        },
        Kind::InvalidateAck => ToHome::InvalidateAck {
            seq: body.seq,
            written_back: body.optional(),
        },
        Kind::DowngradeAck => ToHome::DowngradeAck {
            seq: body.seq,
            written_back: body.optional(),
            kept: body.flags & FLAG_KEPT != 0,
        },
        Kind::WriteBack => ToHome::WriteBack {
            version: body.value,
        },
        _ => return Err(CohDecodeError::BadKind(body.kind)),
    };
    // A page travels only with what reports a write-back of it.
    if page.is_some()
        && matches!(
            msg,
            ToHome::InvalidateAck {
                written_back: None,
                ..
            } | ToHome::DowngradeAck {
                written_back: None,
                ..
            }
        )
    {
        return Err(CohDecodeError::BadFlags {
            kind: body.kind,
            flags: body.flags,
        });
    }
    Ok(CohFrame {
        offset: header.offset,
        msg,
        page,
    })
}

/// Decodes a home → node frame, or the home's refusal.
///
/// # Errors
/// Any field that does not check: see [`CohDecodeError`].
pub fn decode_to_node<'a>(
    header: &Header,
    payload: &'a [u8],
    bound_sums: bool,
) -> Result<ToNodeFrame<'a>, CohDecodeError> {
    if header.opcode != Opcode::CohToNode {
        return Err(CohDecodeError::WrongOpcode(header.opcode));
    }
    if header.status != Status::Ok {
        if !payload.is_empty() {
            return Err(CohDecodeError::BadLength(payload.len()));
        }
        if bound_sums && refusal_checksum(header.offset, header.status, true) != header.checksum {
            return Err(CohDecodeError::Checksum);
        }
        return Ok(ToNodeFrame::Refused {
            offset: header.offset,
            status: header.status,
        });
    }
    let (body, kind, page) = split(header, payload, bound_sums)?;
    let msg = match kind {
        Kind::Grant => ToNode::Grant {
            req: body.req,
            seq: body.seq,
            mode: match body.mode {
                0 => Mode::Shared,
                1 => Mode::Exclusive,
                m => return Err(CohDecodeError::BadMode(m)),
            },
            version: body.value,
            data_version: body.data_version,
        },
        Kind::Lost => ToNode::Lost { req: body.req },
        Kind::Retry => ToNode::Retry { req: body.req },
        Kind::Invalidate => ToNode::Invalidate {
            seq: body.seq,
            grant: body.optional(),
        },
        Kind::Downgrade => ToNode::Downgrade {
            seq: body.seq,
            grant: body.value,
        },
        _ => return Err(CohDecodeError::BadKind(body.kind)),
    };
    if kind != Kind::Grant && body.mode != 0 {
        return Err(CohDecodeError::BadMode(body.mode));
    }
    Ok(ToNodeFrame::Msg(CohFrame {
        offset: header.offset,
        msg,
        page,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{DecodeError, MAX_PAYLOAD_BYTES};

    fn page_of(byte: u8) -> Box<Page> {
        let mut p: Box<Page> = Box::new([0u8; PAGE_SIZE]);
        p.fill(byte);
        p[0] = byte.wrapping_add(1);
        p
    }

    fn parse(frame: &[u8]) -> (Header, &[u8]) {
        let header = Header::decode_prefix(frame).unwrap().unwrap();
        assert_eq!(frame.len(), HEADER_LEN + header.payload_len());
        (header, &frame[HEADER_LEN..])
    }

    fn all_to_home() -> Vec<ToHome> {
        vec![
            ToHome::ReadReq { req: 7 },
            ToHome::WriteReq {
                req: u32::MAX,
                upgrade: true,
            },
            ToHome::WriteReq {
                req: 1,
                upgrade: false,
            },
            ToHome::InvalidateAck {
                seq: 9,
                written_back: None,
            },
            ToHome::InvalidateAck {
                seq: u64::MAX,
                written_back: Some(3),
            },
            ToHome::DowngradeAck {
                seq: 4,
                written_back: Some(0),
                kept: true,
            },
            ToHome::DowngradeAck {
                seq: 4,
                written_back: None,
                kept: false,
            },
            ToHome::WriteBack { version: 12 },
        ]
    }

    fn all_to_node() -> Vec<ToNode> {
        vec![
            ToNode::Grant {
                req: 1,
                seq: 2,
                mode: Mode::Shared,
                version: 3,
                data_version: 3,
            },
            ToNode::Grant {
                req: 5,
                seq: 6,
                mode: Mode::Exclusive,
                version: 8,
                data_version: 7,
            },
            ToNode::Lost { req: 9 },
            ToNode::Retry { req: 10 },
            ToNode::Invalidate {
                seq: 11,
                grant: None,
            },
            ToNode::Invalidate {
                seq: 12,
                grant: Some(0),
            },
            ToNode::Downgrade { seq: 13, grant: 14 },
        ]
    }

    #[test]
    fn every_node_to_home_message_round_trips() {
        let page = page_of(0x5a);
        for msg in all_to_home() {
            let carries = msg.written_back().is_some();
            let with = carries.then_some(&*page);
            let frame = encode_to_home(0x3000, &msg, with, false);
            let (header, payload) = parse(&frame);
            assert_eq!(header.opcode, Opcode::CohToHome);
            let got = decode_to_home(&header, payload, false).unwrap();
            assert_eq!(got.offset, 0x3000);
            assert_eq!(got.msg, msg);
            assert_eq!(got.page, with.map(|p| &p[..]));
        }
    }

    #[test]
    fn every_home_to_node_message_round_trips() {
        let page = page_of(0xa5);
        for msg in all_to_node() {
            let with = matches!(msg, ToNode::Grant { .. }).then_some(&*page);
            let frame = encode_to_node(0x1000, &msg, with, false);
            let (header, payload) = parse(&frame);
            let got = decode_to_node(&header, payload, false).unwrap();
            assert_eq!(
                got,
                ToNodeFrame::Msg(CohFrame {
                    offset: 0x1000,
                    msg,
                    page: with.map(|p| &p[..]),
                })
            );
        }
        let refusal = encode_refusal(0x2000, Status::OutOfRange, false);
        let (header, payload) = parse(&refusal);
        assert_eq!(
            decode_to_node(&header, payload, false),
            Ok(ToNodeFrame::Refused {
                offset: 0x2000,
                status: Status::OutOfRange
            })
        );
    }

    /// Every message both ways, with and without the page it may carry.
    fn every_frame(bound_sums: bool) -> Vec<(Vec<u8>, bool)> {
        let page = page_of(0x3c);
        let mut frames = Vec::new();
        for msg in all_to_home() {
            let frame = encode_to_home(0x7000, &msg, None, bound_sums);
            frames.push((frame, true));
            if matches!(msg, ToHome::WriteBack { .. }) {
                frames.push((encode_to_home(0x7000, &msg, Some(&page), bound_sums), true));
            }
        }
        for msg in all_to_node() {
            let with = matches!(msg, ToNode::Grant { .. }).then_some(&*page);
            frames.push((encode_to_node(0x7000, &msg, with, bound_sums), false));
        }
        frames
    }

    fn decode_any(frame: &[u8], to_home: bool, bound_sums: bool) -> Result<u64, CohDecodeError> {
        let (header, payload) = parse(frame);
        if to_home {
            decode_to_home(&header, payload, bound_sums).map(|f| f.offset)
        } else {
            match decode_to_node(&header, payload, bound_sums)? {
                ToNodeFrame::Msg(f) => Ok(f.offset),
                ToNodeFrame::Refused { offset, .. } => Ok(offset),
            }
        }
    }

    #[test]
    fn every_message_round_trips_with_bound_sums() {
        for (frame, to_home) in every_frame(true) {
            assert_eq!(decode_any(&frame, to_home, true), Ok(0x7000));
        }
    }

    /// With offset-bound sums, a frame whose offset, body or page changed
    /// on the way is refused, pageless frames included. With page-only
    /// sums the same changes to the offset or a pageless body go through:
    /// what the binding closes (a write-back landing on another page, a
    /// callback answered with another sequence number).
    #[test]
    fn with_bound_sums_a_frame_changed_anywhere_on_the_way_fails_its_checksum() {
        for bound_sums in [true, false] {
            for (frame, to_home) in every_frame(bound_sums) {
                let (header, _) = parse(&frame);
                let has_page = frame.len() > HEADER_LEN + COH_BODY_LEN;
                // The offset, one bit at a time (page-aligned bits: the
                // offsets a home would take).
                for bit in 12..40 {
                    let mut damaged = frame.clone();
                    let moved = Header {
                        offset: header.offset ^ (1u64 << bit),
                        ..header
                    };
                    damaged[..HEADER_LEN].copy_from_slice(&moved.encode());
                    let got = decode_any(&damaged, to_home, bound_sums);
                    if bound_sums {
                        assert_eq!(got, Err(CohDecodeError::Checksum), "offset bit {bit}");
                    } else {
                        assert_eq!(
                            got,
                            Ok(moved.offset),
                            "page-only sums do not cover the offset"
                        );
                    }
                }
                // Every body byte.
                for at in HEADER_LEN..HEADER_LEN + COH_BODY_LEN {
                    let mut damaged = frame.clone();
                    damaged[at] ^= 0x01;
                    let got = decode_any(&damaged, to_home, bound_sums);
                    if bound_sums {
                        assert_eq!(got, Err(CohDecodeError::Checksum), "body byte {at}");
                    } else {
                        assert_ne!(
                            got,
                            Err(CohDecodeError::Checksum),
                            "page-only sums do not cover the body"
                        );
                    }
                }
                // The page, when there is one: refused either way.
                if has_page {
                    let mut damaged = frame.clone();
                    damaged[HEADER_LEN + COH_BODY_LEN + 100] ^= 0x80;
                    assert_eq!(
                        decode_any(&damaged, to_home, bound_sums),
                        Err(CohDecodeError::Checksum)
                    );
                }
            }
        }
    }

    /// A refusal has no body: with bound sums its checksum covers its
    /// status and offset, so a refusal moved to another page (or made
    /// another refusal) on the way is refused in turn instead of failing
    /// another page's request.
    #[test]
    fn with_bound_sums_a_refusal_changed_on_the_way_fails_its_checksum() {
        for bound_sums in [true, false] {
            let frame = encode_refusal(0x5000, Status::OutOfRange, bound_sums);
            let (header, payload) = parse(&frame);
            assert_eq!(
                decode_to_node(&header, payload, bound_sums),
                Ok(ToNodeFrame::Refused {
                    offset: 0x5000,
                    status: Status::OutOfRange
                })
            );
            for bit in 12..40 {
                let moved = Header {
                    offset: header.offset ^ (1u64 << bit),
                    ..header
                };
                let got = decode_to_node(&moved, payload, bound_sums);
                if bound_sums {
                    assert_eq!(got, Err(CohDecodeError::Checksum), "offset bit {bit}");
                } else {
                    assert!(
                        matches!(got, Ok(ToNodeFrame::Refused { offset, .. }) if offset == moved.offset)
                    );
                }
            }
            let other = Header {
                status: Status::Unaligned,
                ..header
            };
            let got = decode_to_node(&other, payload, bound_sums);
            if bound_sums {
                assert_eq!(got, Err(CohDecodeError::Checksum));
            } else {
                assert!(got.is_ok());
            }
        }
    }

    /// Both sides take the mode from one handshake; a frame sent in the
    /// other mode is refused whenever its sum is checked.
    #[test]
    fn a_page_only_frame_fails_on_a_bound_connection() {
        for (frame, to_home) in every_frame(false) {
            assert_eq!(
                decode_any(&frame, to_home, true),
                Err(CohDecodeError::Checksum)
            );
        }
    }

    #[test]
    fn a_corrupted_page_is_refused() {
        let page = page_of(1);
        let mut frame = encode_to_home(0, &ToHome::WriteBack { version: 1 }, Some(&page), false);
        let last = frame.len() - 1;
        frame[last] ^= 0x10;
        let (header, payload) = parse(&frame);
        assert_eq!(
            decode_to_home(&header, payload, false),
            Err(CohDecodeError::Checksum)
        );
    }

    #[test]
    fn malformed_bodies_are_refused() {
        let frame = encode_to_home(0, &ToHome::ReadReq { req: 1 }, None, false);
        let (header, payload) = parse(&frame);
        let mut body = payload.to_vec();
        body[0] = 99;
        assert_eq!(
            decode_to_home(&header, &body, false),
            Err(CohDecodeError::BadKind(99))
        );
        // A home → node kind sent to the home.
        body[0] = Kind::Grant as u8;
        assert_eq!(
            decode_to_home(&header, &body, false),
            Err(CohDecodeError::BadKind(16))
        );
        let mut body = payload.to_vec();
        body[1] = FLAG_KEPT;
        assert!(matches!(
            decode_to_home(&header, &body, false),
            Err(CohDecodeError::BadFlags { .. })
        ));
        let mut body = payload.to_vec();
        body[3] = 1;
        assert!(matches!(
            decode_to_home(&header, &body, false),
            Err(CohDecodeError::BadFlags { .. })
        ));
        // The page flag without a page, and a page without the flag.
        let mut body = payload.to_vec();
        body[0] = Kind::WriteBack as u8;
        body[1] = FLAG_PAGE;
        assert!(matches!(
            decode_to_home(&header, &body, false),
            Err(CohDecodeError::BadFlags { .. })
        ));
        let mut long = payload.to_vec();
        long[0] = Kind::WriteBack as u8;
        long.extend_from_slice(&[0u8; PAGE_SIZE]);
        // (Its page's sum right: the flags are what is wrong.)
        let summed = header.with_checksum(page_checksum(&[0u8; PAGE_SIZE]));
        assert!(matches!(
            decode_to_home(&summed, &long, false),
            Err(CohDecodeError::BadFlags { .. })
        ));
        // An ack carrying a page but reporting no write-back.
        let mut ack = encode_to_home(
            0,
            &ToHome::InvalidateAck {
                seq: 1,
                written_back: Some(1),
            },
            Some(&page_of(2)),
            false,
        );
        ack[HEADER_LEN + 1] &= !FLAG_VALUE;
        let (h, p) = parse(&ack);
        assert!(matches!(
            decode_to_home(&h, p, false),
            Err(CohDecodeError::BadFlags { .. })
        ));
        // Lengths that are neither a body nor a body and a page.
        for n in [
            0,
            1,
            COH_BODY_LEN - 1,
            COH_BODY_LEN + 1,
            COH_BODY_LEN + PAGE_SIZE - 1,
        ] {
            let bytes = vec![0u8; n];
            assert_eq!(
                decode_to_home(&header, &bytes, false),
                Err(CohDecodeError::BadLength(n))
            );
        }
        // The wrong direction.
        assert_eq!(
            decode_to_node(&header, payload, false),
            Err(CohDecodeError::WrongOpcode(Opcode::CohToHome))
        );
        // A bad grant mode.
        let grant = encode_to_node(
            0,
            &ToNode::Grant {
                req: 1,
                seq: 1,
                mode: Mode::Shared,
                version: 0,
                data_version: 0,
            },
            Some(&page_of(3)),
            false,
        );
        let mut bytes = grant.clone();
        bytes[HEADER_LEN + 2] = 7;
        let (h, p) = parse(&bytes);
        assert_eq!(
            decode_to_node(&h, p, false),
            Err(CohDecodeError::BadMode(7))
        );
        // A refusal with a payload.
        let (h, _) = parse(&grant);
        let refused = Header {
            status: Status::Internal,
            ..h
        };
        assert_eq!(
            decode_to_node(&refused, &grant[HEADER_LEN..], false),
            Err(CohDecodeError::BadLength(COH_BODY_LEN + PAGE_SIZE))
        );
    }

    #[test]
    fn an_oversized_coherence_frame_is_refused_by_the_header() {
        let mut h = Header::request(Opcode::CohToHome, 0, 0, MAX_PAYLOAD_BYTES + 1);
        assert!(matches!(
            Header::decode(&h.encode()),
            Err(DecodeError::PayloadTooLarge(_))
        ));
        h.length = MAX_PAYLOAD_BYTES;
        assert!(Header::decode(&h.encode()).is_ok());
    }

    #[test]
    fn arbitrary_payloads_never_panic() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for round in 0..20_000u32 {
            let len = match round % 4 {
                0 => COH_BODY_LEN,
                1 => COH_BODY_LEN + PAGE_SIZE,
                _ => (next() % (COH_BODY_LEN as u64 + 64)) as usize,
            };
            let mut bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            if let Some(b) = bytes.get_mut(0) {
                // Mostly valid kinds, to get past the first check.
                *b = [1, 2, 3, 4, 5, 16, 17, 18, 19, 20][(next() % 10) as usize];
            }
            let mut h = Header::request(Opcode::CohToHome, 0, next(), len as u32);
            h.checksum = next() as u32;
            let _ = decode_to_home(&h, &bytes, false);
            h.opcode = Opcode::CohToNode;
            let _ = decode_to_node(&h, &bytes, false);
        }
    }
}
