//! Per-connection remote keys: every client connection gets its own rkey
//! over the exported region, valid only while that connection lasts.
//!
//! Two ways, chosen at server start ([`ClientKeys::Auto`] probes):
//! - a **type-2 memory window** bound over the whole region with a bind work
//!   request posted on the client's own server QP: its rkey works on that QP
//!   only, and deallocating the window (when the connection ends) revokes
//!   it. Needs the region MR registered with `MW_BIND`.
//! - a **per-client MR**: the region registered once more, in a protection
//!   domain of the client's own (so no other client's QP can use the key),
//!   deregistered when the connection ends. Costs a registration (pinning
//!   the whole region) per connection: docs/rdma.md has the figures.
//!
//! Either way the region's own MR grants no remote access: the only keys
//! that reach the region are these per-connection ones.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use rdma_transport::verbs::{
    AccessFlags, CompletionQueue, MemoryRegion, MemoryWindow, ProtectionDomain, QueuePair, SendWr,
    VerbsError, WorkCompletion,
};

/// The `wr_id` of the bind request (the server QP posts nothing else).
const BIND_WR_ID: u64 = 0x6d77_6269_6e64;
/// How long a bind may take to complete: it is a local operation, but
/// SoftRoCE under emulation can be slow.
const BIND_TIMEOUT: Duration = Duration::from_secs(5);
/// What a client's key grants.
pub(crate) const CLIENT_ACCESS: AccessFlags =
    AccessFlags::REMOTE_READ.union(AccessFlags::REMOTE_WRITE);

/// How client connections get their keys (`--rdma-client-keys`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ClientKeys {
    /// Memory windows where the device has type-2 windows (probed at
    /// start), per-client MRs otherwise.
    #[default]
    Auto,
    /// Type-2 memory windows; the server does not start RDMA without them.
    MemoryWindow,
    /// Per-client memory regions.
    MemoryRegion,
}

impl FromStr for ClientKeys {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "mw" => Ok(Self::MemoryWindow),
            "mr" => Ok(Self::MemoryRegion),
            other => Err(format!("{other:?}: expected auto, mw or mr")),
        }
    }
}

/// What a client connection's key is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientKeyKind {
    /// A type-2 memory window bound to the connection's QP.
    MemoryWindow,
    /// A memory region of the connection's own, in its own PD.
    MemoryRegion,
}

impl fmt::Display for ClientKeyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::MemoryWindow => "type-2 memory window",
            Self::MemoryRegion => "per-client memory region",
        })
    }
}

/// One connection's key; dropping it revokes the key.
#[derive(Debug)]
pub(crate) enum ClientKey {
    Window(MemoryWindow),
    Region(MemoryRegion),
}

impl ClientKey {
    pub(crate) fn rkey(&self) -> u32 {
        match self {
            Self::Window(mw) => mw.rkey(),
            Self::Region(mr) => mr.rkey(),
        }
    }

    pub(crate) fn kind(&self) -> ClientKeyKind {
        match self {
            Self::Window(_) => ClientKeyKind::MemoryWindow,
            Self::Region(_) => ClientKeyKind::MemoryRegion,
        }
    }
}

/// Allocates a type-2 window and binds it over all of `region` on `qp`
/// (which must be in RTS, in `pd`, with `cq` as its send CQ and nothing else
/// outstanding), waiting for the bind's completion.
///
/// # Errors
/// The failed verb, the bind's error completion, or a timeout.
pub(crate) fn bind_window(
    pd: &ProtectionDomain,
    region: &MemoryRegion,
    qp: &QueuePair,
    cq: &CompletionQueue,
) -> Result<MemoryWindow, VerbsError> {
    let mut mw = pd.alloc_mw_type2()?;
    let rkey = mw.next_rkey();
    let bind = SendWr::bind_mw(
        BIND_WR_ID,
        &mw,
        rkey,
        region,
        0,
        region.len(),
        CLIENT_ACCESS,
    )
    .ok_or_else(|| VerbsError::InvalidArgument("an empty region cannot be bound".into()))?;
    qp.post_send(&mut [bind])?;
    wait_one(cq, BIND_TIMEOUT)?;
    mw.set_bound_rkey(rkey);
    Ok(mw)
}

/// Polls `cq` until one completion arrives (its status checked) or
/// `timeout` passes.
fn wait_one(cq: &CompletionQueue, timeout: Duration) -> Result<(), VerbsError> {
    let started = Instant::now();
    let mut wc = [WorkCompletion::default()];
    loop {
        if cq.poll(&mut wc)? == 1 {
            return wc[0].result();
        }
        if started.elapsed() > timeout {
            return Err(VerbsError::Verb {
                verb: "ibv_poll_cq",
                source: std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the memory window bind did not complete within {timeout:?}"),
                ),
            });
        }
        std::thread::sleep(Duration::from_micros(20));
    }
}
