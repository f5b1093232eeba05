//! A coherence connection over RDMA (docs/coherence.md, "Over RDMA"):
//! once the handshake set up its message channel, the node's frames come
//! through the channel, one per message, and the home's go back the same
//! way (`Outbound::over_channel`). Nothing more may come on the socket: its
//! end means the node is gone.

use std::io::{self, Read};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_transport::rdma::MessageChannel;
use rdma_transport::wire::{Header, HEADER_LEN};

use crate::coherence_home::{self, CohSession};
use crate::connection::Exported;

/// Longest a wait lasts without looking at the socket again.
const TICK: Duration = Duration::from_millis(200);

/// Serves the channel until the node closes the socket (`Ok`), or breaks
/// the rules or the channel (`Err`). `coh` becomes the channel's session:
/// the caller declares its node lost afterwards, as for any connection.
/// After each message it polls the channel for `spin` (yielding the CPU)
/// before it sleeps, as TCP connections do with their sockets.
pub(crate) fn serve(
    stream: &TcpStream,
    ex: &Exported,
    channel: &Arc<MessageChannel>,
    coh: &mut CohSession,
    spin: Duration,
) -> io::Result<()> {
    *coh = coh.over_channel(stream, Arc::clone(channel))?;
    let mut armed = false;
    let mut idle_since: Option<Instant> = None;
    loop {
        ex.coherence.wait_while_held();
        if crate::node_exit::is_closed_by_home(coh) {
            // Nothing more from it is served (`node_exit`).
            return Err(crate::node_exit::closed_by_home());
        }
        let taken = take(stream, ex, channel, coh)?;
        if taken > 0 {
            armed = false;
            idle_since = None;
            continue;
        }
        if !spin.is_zero() && idle_since.get_or_insert_with(Instant::now).elapsed() < spin {
            std::thread::yield_now();
            continue;
        }
        if !armed {
            // Armed, then polled once more before waiting: a completion
            // that came in between is not missed.
            channel.arm().map_err(io::Error::other)?;
            armed = true;
            continue;
        }
        let woken = channel
            .wait(stream.as_fd(), TICK)
            .map_err(io::Error::other)?;
        if woken.other {
            let mut byte = [0u8; 1];
            match (&*stream).read(&mut byte) {
                Ok(0) => {
                    // What the node sent before it left counts.
                    take(stream, ex, channel, coh)?;
                    return Ok(());
                }
                Ok(_) => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "bytes on the socket of a coherence channel",
                    ))
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(e),
            }
        }
        armed = !woken.channel;
    }
}

/// Takes the messages that arrived; how many completions that was.
fn take(
    stream: &TcpStream,
    ex: &Exported,
    channel: &MessageChannel,
    coh: &mut CohSession,
) -> io::Result<usize> {
    let mut bad = None;
    let taken = channel
        .poll(|bytes| match frame(bytes) {
            Ok(header) => {
                ex.coherence.count_rdma_frame();
                coherence_home::on_frame(ex, &header, &bytes[HEADER_LEN..], stream, coh);
                true
            }
            Err(why) => {
                bad = Some(why);
                false
            }
        })
        .map_err(io::Error::other)?;
    match bad {
        Some(why) => Err(io::Error::new(io::ErrorKind::InvalidData, why)),
        None => Ok(taken),
    }
}

/// The header of a message that holds exactly one coherence frame.
fn frame(bytes: &[u8]) -> Result<Header, String> {
    let header = Header::decode_prefix(bytes)
        .map_err(|e| format!("malformed frame on a coherence channel: {e}"))?
        .ok_or("a coherence channel message shorter than a header")?;
    if header.opcode != rdma_transport::wire::Opcode::CohToHome {
        return Err(format!(
            "a {:?} frame on a coherence channel",
            header.opcode
        ));
    }
    if HEADER_LEN + header.payload_len() != bytes.len() {
        return Err(format!(
            "a coherence channel message of {} bytes holding a frame of {}",
            bytes.len(),
            HEADER_LEN + header.payload_len()
        ));
    }
    Ok(header)
}
