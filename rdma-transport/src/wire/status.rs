//! Status codes carried in response headers.

/// Outcome of a request, as carried in a response header's `status` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Status {
    /// The request was carried out.
    Ok = 0,
    /// The header's magic was wrong; the server closes the connection.
    BadMagic = 1,
    /// The protocol version is not supported; the server closes the connection.
    BadVersion = 2,
    /// Unknown or unexpected opcode.
    BadOpcode = 3,
    /// `length` is not what the opcode requires (a page for READ/WRITE).
    BadLength = 4,
    /// `offset + length` falls outside the exported region.
    OutOfRange = 5,
    /// `offset` is not page aligned.
    Unaligned = 6,
    /// A READ or WRITE arrived before the HELLO handshake.
    NoHello = 7,
    /// The server failed for a reason of its own.
    Internal = 8,
    /// A WRITE's page does not match the checksum in its header (only on a
    /// connection that negotiated checksums); nothing was written. The
    /// connection stays open.
    BadChecksum = 9,
    /// A coherence message from a connection whose AUTH declared no node
    /// bound, or one longer than the home accepts
    /// (`AuthRequest::node_bound_ms`): it is not made a node. The
    /// connection stays open.
    NodeBound = 10,
}

impl Status {
    /// Decodes a wire value; unknown values are `None`.
    pub const fn from_u16(value: u16) -> Option<Self> {
        Some(match value {
            0 => Self::Ok,
            1 => Self::BadMagic,
            2 => Self::BadVersion,
            3 => Self::BadOpcode,
            4 => Self::BadLength,
            5 => Self::OutOfRange,
            6 => Self::Unaligned,
            7 => Self::NoHello,
            8 => Self::Internal,
            9 => Self::BadChecksum,
            10 => Self::NodeBound,
            _ => return None,
        })
    }

    /// A short human-readable description.
    pub const fn describe(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::BadMagic => "bad magic",
            Self::BadVersion => "unsupported protocol version",
            Self::BadOpcode => "bad opcode",
            Self::BadLength => "bad length",
            Self::OutOfRange => "offset out of the exported range",
            Self::Unaligned => "offset not page aligned",
            Self::NoHello => "request before HELLO",
            Self::Internal => "internal server error",
            Self::BadChecksum => "page checksum mismatch",
            Self::NodeBound => {
                "no bound on the home's silence declared, or one longer than the home waits"
            }
        }
    }
}

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}
