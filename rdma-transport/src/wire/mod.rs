//! The page wire protocol, defined once and used by every binary.
//!
//! Every message is a fixed 32-byte little-endian [`Header`] followed by a
//! payload whose length is the header's `length` field when the opcode
//! carries one (see [`Opcode::carries_payload`]). `docs/wire-protocol.md`
//! is the reference.

mod coherence;
mod header;
mod hello;
mod status;

pub use coherence::{
    coherence_checksum, decode_to_home, decode_to_node, encode_refusal, encode_to_home,
    encode_to_node, refusal_checksum, CohDecodeError, CohFrame, ToNodeFrame, COH_BODY_LEN,
};
pub use header::{
    offset_bound_checksum, page_checksum, write_checksum, DecodeError, Header, Opcode, HEADER_LEN,
    MAGIC, MAX_PAYLOAD_BYTES, VERSION,
};
pub use hello::{
    AuthRequest, Challenge, HelloAck, HelloRequest, MessageRing, RdmaHello, AUTH_MAX_LEN,
    CHALLENGE_LEN, HELLO_ACK_LEN, HELLO_LEN,
};
pub use status::Status;
