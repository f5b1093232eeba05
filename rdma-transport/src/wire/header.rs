//! The fixed 32-byte message header and its codec.

use super::Status;
use crate::page::PAGE_SIZE;

/// First four bytes of every message (`"PGTP"` read as a little-endian u32).
pub const MAGIC: u32 = u32::from_le_bytes(*b"PGTP");
/// Protocol version this library speaks. 2: the HELLO RDMA section carries
/// each side's READ depths (version 1 sent zeros there). 3: authenticated
/// handshake. 4: the coherence messages (`COH_TO_HOME`, `COH_TO_NODE`).
pub const VERSION: u8 = 4;
/// Size of [`Header`] on the wire.
pub const HEADER_LEN: usize = 32;
/// Largest payload any message may carry: a coherence message's body and
/// one page (every other message carries at most one page).
pub const MAX_PAYLOAD_BYTES: u32 = (super::coherence::COH_BODY_LEN + PAGE_SIZE) as u32;

/// Message type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// Client → server handshake; payload is a `HelloRequest`.
    Hello = 1,
    /// Server → client handshake answer; payload is a `HelloAck`.
    HelloAck = 2,
    /// Read `length` bytes at `offset`; no payload.
    Read = 3,
    /// Answer to `Read`; payload is the page when `status` is `Ok`.
    ReadResp = 4,
    /// Write the payload (`length` bytes) at `offset`.
    Write = 5,
    /// Answer to `Write`; no payload.
    WriteResp = 6,
    /// Server → client, answering `Hello`: the server's nonce, epoch and
    /// proof of the cluster key; payload is a `Challenge`.
    Challenge = 7,
    /// Client → server, answering `Challenge`: the client's proof (and QP
    /// endpoint); payload is an `AuthRequest`. Answered with `HelloAck`.
    Auth = 8,
    /// Node (client) → home (page-server): a coherence message about the
    /// page at `offset`; payload is its body and, for a write-back, the page
    /// (`wire::coherence`).
    CohToHome = 9,
    /// Home → node: a coherence message (grant, callback, ...) about the page
    /// at `offset`, sent unasked for callbacks; payload as for `CohToHome`
    /// (a grant carries the page). A refusal has a status and no payload.
    CohToNode = 10,
    /// Error answer to a message whose type could not be trusted; no payload.
    Error = 0x7f,
}

impl Opcode {
    /// Decodes a wire value; unknown values are `None`.
    pub const fn from_u8(value: u8) -> Option<Self> {
        Some(match value {
            1 => Self::Hello,
            2 => Self::HelloAck,
            3 => Self::Read,
            4 => Self::ReadResp,
            5 => Self::Write,
            6 => Self::WriteResp,
            7 => Self::Challenge,
            8 => Self::Auth,
            9 => Self::CohToHome,
            10 => Self::CohToNode,
            0x7f => Self::Error,
            _ => return None,
        })
    }

    /// The answer's opcode for a request opcode (`Error` for the others).
    pub const fn response(self) -> Self {
        match self {
            Self::Hello => Self::Challenge,
            Self::Auth => Self::HelloAck,
            Self::Read => Self::ReadResp,
            Self::Write => Self::WriteResp,
            _ => Self::Error,
        }
    }
}

/// Why a header could not be decoded. The connection's framing can no longer
/// be trusted after any of these.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The first four bytes were not [`MAGIC`].
    #[error("bad magic {0:#010x}")]
    BadMagic(u32),
    /// Unsupported protocol version.
    #[error("unsupported protocol version {0}")]
    BadVersion(u8),
    /// Unknown opcode.
    #[error("unknown opcode {0}")]
    BadOpcode(u8),
    /// Unknown status code.
    #[error("unknown status {0}")]
    BadStatus(u16),
    /// The payload would exceed [`MAX_PAYLOAD_BYTES`].
    #[error("payload of {0} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte limit")]
    PayloadTooLarge(u32),
}

impl DecodeError {
    /// The status a server answers this error with.
    pub const fn status(self) -> Status {
        match self {
            Self::BadMagic(_) => Status::BadMagic,
            Self::BadVersion(_) => Status::BadVersion,
            Self::BadOpcode(_) | Self::BadStatus(_) => Status::BadOpcode,
            Self::PayloadTooLarge(_) => Status::BadLength,
        }
    }
}

/// The fixed header that starts every message. All fields little-endian:
///
/// | bytes | field |
/// |---|---|
/// | 0..4 | magic |
/// | 4 | version |
/// | 5 | opcode |
/// | 6..8 | status |
/// | 8..16 | request id |
/// | 16..24 | offset in the exported region |
/// | 24..28 | length in bytes |
/// | 28..32 | page checksum: CRC-32C of the payload of a WRITE or an OK READ_RESP when the connection negotiated checksums; zero otherwise, and ignored by receivers that did not negotiate them |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Message type.
    pub opcode: Opcode,
    /// Outcome (responses); `Ok` in requests.
    pub status: Status,
    /// Chosen by the client, echoed in the answer.
    pub request_id: u64,
    /// Byte offset in the server's exported region.
    pub offset: u64,
    /// Bytes the request is about (a page for READ/WRITE) or the payload length.
    pub length: u32,
    /// CRC-32C ([`page_checksum`]) of a page payload when the connection
    /// negotiated checksums; 0 otherwise.
    pub checksum: u32,
}

/// The checksum a page's sender puts in [`Header::checksum`]: CRC-32C
/// (Castagnoli, also named CRC-32/ISCSI), with the fastest instructions the
/// CPU has (on x86_64: CRC32 with PCLMULQDQ folding, VPCLMULQDQ with
/// AVX-512), picked at run time. A 32-bit CRC fits in a `u64`'s low half.
pub fn page_checksum(page: &[u8]) -> u32 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, page) as u32
}

/// CRC-32C of `parts` one after the other, as of their concatenation.
pub(crate) fn crc32c_of(parts: &[&[u8]]) -> u32 {
    let mut digest = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    for part in parts {
        digest.update(part);
    }
    digest.finalize() as u32
}

/// The checksum of a WRITE on a connection that agreed to offset-bound sums
/// (see [`crate::wire::AuthRequest::bound_sums`]): CRC-32C of the page
/// followed by the 8 little-endian bytes of `offset`, from `page_sum` (the
/// page's [`page_checksum`]) without reading the page again. A WRITE whose
/// offset changed on the way then fails its checksum like one whose page
/// did, instead of landing on another page.
pub fn offset_bound_checksum(page_sum: u32, offset: u64) -> u32 {
    // CRC-32C's register starts at !0 and the result is the register
    // inverted: going on from a finished sum starts from its inverse. Eight
    // bytes a table step each: a quarter of the instructions of a general
    // digest's set-up, on every WRITE at both ends.
    let mut register = !page_sum;
    for byte in offset.to_le_bytes() {
        register = CRC32C_TABLE[((register ^ u32::from(byte)) & 0xff) as usize] ^ (register >> 8);
    }
    !register
}

/// CRC-32C's byte table (reflected polynomial 0x82F6_3B78).
const CRC32C_TABLE: [u32; 256] = {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut value = i as u32;
        let mut bit = 0;
        while bit < 8 {
            value = if value & 1 == 1 {
                (value >> 1) ^ 0x82F6_3B78
            } else {
                value >> 1
            };
            bit += 1;
        }
        table[i] = value;
        i += 1;
    }
    table
};

/// The checksum a WRITE of `offset` carries, for a page whose own sum is
/// `page_sum`: that sum, or [`offset_bound_checksum`] on a connection that
/// agreed to offset-bound sums. The sender and the page-server both use it.
pub fn write_checksum(page_sum: u32, offset: u64, bound_sums: bool) -> u32 {
    if bound_sums {
        offset_bound_checksum(page_sum, offset)
    } else {
        page_sum
    }
}

impl Header {
    /// A request header.
    pub const fn request(opcode: Opcode, request_id: u64, offset: u64, length: u32) -> Self {
        Self {
            opcode,
            status: Status::Ok,
            request_id,
            offset,
            length,
            checksum: 0,
        }
    }

    /// This header carrying `checksum` in bytes 28..32.
    pub const fn with_checksum(mut self, checksum: u32) -> Self {
        self.checksum = checksum;
        self
    }

    /// Number of payload bytes that follow this header on the wire.
    pub const fn payload_len(&self) -> usize {
        match self.opcode {
            Opcode::Hello
            | Opcode::HelloAck
            | Opcode::Challenge
            | Opcode::Auth
            | Opcode::Write
            | Opcode::CohToHome
            | Opcode::CohToNode => self.length as usize,
            Opcode::ReadResp if matches!(self.status, Status::Ok) => self.length as usize,
            _ => 0,
        }
    }

    /// Encodes the header into its 32 wire bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        out[4] = VERSION;
        out[5] = self.opcode as u8;
        out[6..8].copy_from_slice(&(self.status as u16).to_le_bytes());
        out[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        out[16..24].copy_from_slice(&self.offset.to_le_bytes());
        out[24..28].copy_from_slice(&self.length.to_le_bytes());
        out[28..32].copy_from_slice(&self.checksum.to_le_bytes());
        out
    }

    /// Decodes and checks the 32 header bytes.
    ///
    /// # Errors
    /// Any field that cannot be trusted: see [`DecodeError`].
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Self, DecodeError> {
        let magic = u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
        if magic != MAGIC {
            return Err(DecodeError::BadMagic(magic));
        }
        if bytes[4] != VERSION {
            return Err(DecodeError::BadVersion(bytes[4]));
        }
        let opcode = Opcode::from_u8(bytes[5]).ok_or(DecodeError::BadOpcode(bytes[5]))?;
        let status_raw = u16::from_le_bytes([bytes[6], bytes[7]]);
        let status = Status::from_u16(status_raw).ok_or(DecodeError::BadStatus(status_raw))?;
        let request_id = u64::from_le_bytes(le8(&bytes[8..16]));
        let offset = u64::from_le_bytes(le8(&bytes[16..24]));
        let length = u32::from_le_bytes([bytes[24], bytes[25], bytes[26], bytes[27]]);
        let checksum = u32::from_le_bytes([bytes[28], bytes[29], bytes[30], bytes[31]]);
        let header = Self {
            opcode,
            status,
            request_id,
            offset,
            length,
            checksum,
        };
        if header.payload_len() > MAX_PAYLOAD_BYTES as usize {
            return Err(DecodeError::PayloadTooLarge(length));
        }
        Ok(header)
    }

    /// Decodes the first [`HEADER_LEN`] bytes of `bytes`; `Ok(None)` when fewer
    /// than that are present (a truncated message: wait for more).
    ///
    /// # Errors
    /// As [`Header::decode`].
    pub fn decode_prefix(bytes: &[u8]) -> Result<Option<Self>, DecodeError> {
        match bytes.get(..HEADER_LEN) {
            Some(head) => {
                let mut fixed = [0u8; HEADER_LEN];
                fixed.copy_from_slice(head);
                Self::decode(&fixed).map(Some)
            }
            None => Ok(None),
        }
    }
}

fn le8(bytes: &[u8]) -> [u8; 8] {
    let mut out = [0u8; 8];
    out.copy_from_slice(&bytes[..8]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        Header::request(Opcode::Write, 0xdead_beef_0001, 0x20_0000, 4096)
    }

    #[test]
    fn round_trip_every_opcode() {
        for op in [
            Opcode::Hello,
            Opcode::HelloAck,
            Opcode::Read,
            Opcode::ReadResp,
            Opcode::Write,
            Opcode::WriteResp,
            Opcode::CohToHome,
            Opcode::CohToNode,
            Opcode::Error,
        ] {
            let h = Header {
                opcode: op,
                status: Status::OutOfRange,
                request_id: 7,
                offset: 8192,
                length: 16,
                checksum: 0x1234_5678,
            };
            assert_eq!(Header::decode(&h.encode()), Ok(h));
        }
    }

    #[test]
    fn layout_is_little_endian_and_fixed() {
        let bytes = sample().encode();
        assert_eq!(&bytes[0..4], b"PGTP");
        assert_eq!(bytes[4], VERSION);
        assert_eq!(bytes[5], Opcode::Write as u8);
        assert_eq!(&bytes[8..16], &0xdead_beef_0001u64.to_le_bytes());
        assert_eq!(&bytes[16..24], &0x20_0000u64.to_le_bytes());
        assert_eq!(&bytes[24..28], &4096u32.to_le_bytes());
        assert_eq!(&bytes[28..32], &[0, 0, 0, 0]);
        let bytes = sample().with_checksum(0xa1b2_c3d4).encode();
        assert_eq!(&bytes[28..32], &0xa1b2_c3d4u32.to_le_bytes());
    }

    #[test]
    fn page_checksum_is_crc32c() {
        // The check value of CRC-32C (RFC 3720, B.4).
        assert_eq!(page_checksum(b"123456789"), 0xe306_9283);
        assert_eq!(page_checksum(&[0u8; 32]), 0x8a91_36aa);
        // A whole page takes the wide (folding) path, not the short one the
        // vectors above take: its value is pinned too, as the `crc32c`
        // crate computed it before this implementation replaced it, so
        // peers of either build agree on the wire.
        let pattern: Vec<u8> = (0..PAGE_SIZE).map(|i| (i * 7 + 3) as u8).collect();
        assert_eq!(page_checksum(&pattern), 0xed96_b643);
        let mut page = vec![0x5au8; PAGE_SIZE];
        let before = page_checksum(&page);
        page[4095] ^= 1;
        assert_ne!(page_checksum(&page), before);
    }

    #[test]
    fn an_offset_bound_checksum_is_the_crc_of_the_page_then_its_offset() {
        let bound_is_whole = |page: &[u8], offset: u64| {
            let mut whole = page.to_vec();
            whole.extend_from_slice(&offset.to_le_bytes());
            assert_eq!(
                offset_bound_checksum(page_checksum(page), offset),
                page_checksum(&whole),
                "offset {offset:#x}"
            );
        };
        let page: Vec<u8> = (0..PAGE_SIZE).map(|i| (i * 13 + 1) as u8).collect();
        for offset in [0u64, 0x3000, 0x2000, u64::MAX] {
            bound_is_whole(&page, offset);
        }
        // Every byte value in every position (each entry of the table),
        // from sums of other pages too.
        for b in 0..=255u64 {
            bound_is_whole(&[b as u8; 64], (b * 0x0101_0101_0101_0101) ^ (b << 3));
        }
        // One bit of the offset changes the sum.
        let sum = page_checksum(&page);
        assert_ne!(
            offset_bound_checksum(sum, 0x3000),
            offset_bound_checksum(sum, 0x2000)
        );
    }

    #[test]
    fn wrong_magic_is_refused() {
        let mut bytes = sample().encode();
        bytes[0] ^= 0xff;
        assert!(matches!(
            Header::decode(&bytes),
            Err(DecodeError::BadMagic(_))
        ));
    }

    #[test]
    fn wrong_version_is_refused() {
        let mut bytes = sample().encode();
        bytes[4] = 99;
        assert_eq!(Header::decode(&bytes), Err(DecodeError::BadVersion(99)));
        // Version 1 peers sent no READ depths in the HELLO RDMA section.
        bytes[4] = 1;
        assert_eq!(Header::decode(&bytes), Err(DecodeError::BadVersion(1)));
        // Version 3 peers know no coherence messages.
        bytes[4] = 3;
        assert_eq!(Header::decode(&bytes), Err(DecodeError::BadVersion(3)));
    }

    #[test]
    fn unknown_opcode_and_status_are_refused() {
        let mut bytes = sample().encode();
        bytes[5] = 200;
        assert_eq!(Header::decode(&bytes), Err(DecodeError::BadOpcode(200)));
        let mut bytes = sample().encode();
        bytes[6] = 0xff;
        assert!(matches!(
            Header::decode(&bytes),
            Err(DecodeError::BadStatus(_))
        ));
    }

    #[test]
    fn huge_payload_is_refused() {
        let mut h = sample();
        h.length = u32::MAX;
        assert_eq!(
            Header::decode(&h.encode()),
            Err(DecodeError::PayloadTooLarge(u32::MAX))
        );
        // A READ carries no payload, so its length is a semantic matter for the server.
        h.opcode = Opcode::Read;
        assert_eq!(Header::decode(&h.encode()), Ok(h));
    }

    #[test]
    fn truncated_prefix_waits_for_more() {
        let bytes = sample().encode();
        for cut in 0..HEADER_LEN {
            assert_eq!(Header::decode_prefix(&bytes[..cut]), Ok(None));
        }
        assert_eq!(Header::decode_prefix(&bytes), Ok(Some(sample())));
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut state = 0x1234_5678_9abc_def0u64;
        for _ in 0..20_000 {
            let mut bytes = [0u8; HEADER_LEN];
            for b in &mut bytes {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = state as u8;
            }
            if state % 3 == 0 {
                bytes[0..5].copy_from_slice(&sample().encode()[0..5]);
            }
            if let Ok(h) = Header::decode(&bytes) {
                assert!(h.payload_len() <= MAX_PAYLOAD_BYTES as usize);
            }
        }
    }
}
