//! What two sides exchange to connect a pair of RC QPs.

use super::error::VerbsError;
use super::gid::Gid;

/// The connection data of one QP: sent to the peer, which passes it to
/// [`super::QueuePair::modify_to_rtr`] in [`super::RtrParams`].
///
/// Wire form ([`QpEndpoint::to_le_bytes`]): `qpn` u32 LE, `psn` u32 LE, `gid`
/// 16 bytes as in the GID table, `lid` u16 LE, `mtu` u8 — 27 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpEndpoint {
    /// QP number.
    pub qpn: u32,
    /// Initial packet sequence number of the sender's send queue (24 bits):
    /// the receiver's expected PSN (`rq_psn`) at RTR.
    pub psn: u32,
    /// Port GID (RoCE: the IPv4-mapped RoCE v2 GID); all-zero on IB fabrics
    /// addressed by LID.
    pub gid: [u8; 16],
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// Active path MTU as the raw `enum ibv_mtu` value (1 = 256 ... 5 = 4096).
    pub mtu: u8,
}

impl QpEndpoint {
    /// Bytes of the wire form.
    pub const WIRE_SIZE: usize = 27;

    /// The GID as a [`Gid`].
    pub fn gid(&self) -> Gid {
        Gid(self.gid)
    }

    /// Encodes the wire form.
    pub fn to_le_bytes(&self) -> [u8; Self::WIRE_SIZE] {
        let mut out = [0u8; Self::WIRE_SIZE];
        out[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        out[4..8].copy_from_slice(&self.psn.to_le_bytes());
        out[8..24].copy_from_slice(&self.gid);
        out[24..26].copy_from_slice(&self.lid.to_le_bytes());
        out[26] = self.mtu;
        out
    }

    /// Decodes the wire form.
    pub fn from_le_bytes(bytes: &[u8; Self::WIRE_SIZE]) -> Self {
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&bytes[8..24]);
        Self {
            qpn: u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            psn: u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]),
            gid,
            lid: u16::from_le_bytes([bytes[24], bytes[25]]),
            mtu: bytes[26],
        }
    }

    /// Decodes the wire form from a slice that must be exactly
    /// [`QpEndpoint::WIRE_SIZE`] bytes.
    ///
    /// # Errors
    /// [`VerbsError::InvalidArgument`] for another length.
    pub fn try_from_slice(bytes: &[u8]) -> Result<Self, VerbsError> {
        let array: &[u8; Self::WIRE_SIZE] = bytes.try_into().map_err(|_| {
            VerbsError::InvalidArgument(format!(
                "QP endpoint message is {} bytes, expected {}",
                bytes.len(),
                Self::WIRE_SIZE
            ))
        })?;
        Ok(Self::from_le_bytes(array))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_round_trips_through_le_bytes() {
        let ep = QpEndpoint {
            qpn: 0x0012_3456,
            psn: 0x00ab_cdef,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1],
            lid: 0xbeef,
            mtu: 5,
        };
        let bytes = ep.to_le_bytes();
        assert_eq!(&bytes[0..4], &[0x56, 0x34, 0x12, 0x00]);
        assert_eq!(&bytes[24..26], &[0xef, 0xbe]);
        assert_eq!(bytes[26], 5);
        assert_eq!(QpEndpoint::from_le_bytes(&bytes), ep);
        assert_eq!(QpEndpoint::try_from_slice(&bytes).unwrap(), ep);
        assert_eq!(ep.gid().to_string(), "::ffff:127.0.0.1");
        assert!(QpEndpoint::try_from_slice(&bytes[..26]).is_err());
    }
}
