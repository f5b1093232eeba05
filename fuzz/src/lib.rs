//! What the fuzz targets share.

use coherence::ToHome;

/// The node → home message of `kind` (mod 5: read request, write request,
/// invalidate ack, downgrade ack, write-back) with these fields; `flag` is
/// a write request's `upgrade` and a downgrade ack's `kept`, and `value`
/// the sequence number or version (`reported`: an ack reports it written
/// back too).
pub fn to_home(kind: u8, req: u32, value: u64, reported: bool, flag: bool) -> ToHome {
    let written_back = reported.then_some(value);
    match kind % 5 {
        0 => ToHome::ReadReq { req },
        1 => ToHome::WriteReq { req, upgrade: flag },
        2 => ToHome::InvalidateAck {
            seq: value,
            written_back,
        },
        3 => ToHome::DowngradeAck {
            seq: value,
            written_back,
            kept: flag,
        },
        _ => ToHome::WriteBack { version: value },
    }
}
