//! GIDs and finding the RoCE v2 GID index to use.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::Path;

use super::context::Context;
use super::error::VerbsError;
use super::generated::{ibv_gid, ibv_gid_entry, ibv_gid_type};

/// A 128-bit GID in network byte order, as in the GID table.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// The all-zero GID (an empty table entry).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The IPv4 address of an IPv4-mapped GID (`::ffff:a.b.c.d`).
    pub fn ipv4(&self) -> Option<Ipv4Addr> {
        Ipv6Addr::from(self.0).to_ipv4_mapped()
    }

    /// The raw bytes in the layout verbs expects.
    pub(crate) fn to_ibv(self) -> ibv_gid {
        ibv_gid { raw: self.0 }
    }

    /// Parses sysfs's form: eight colon-separated groups of four hex digits.
    fn parse_sysfs(text: &str) -> Option<Self> {
        let mut bytes = [0u8; 16];
        let mut groups = text.trim().split(':');
        for pair in bytes.chunks_exact_mut(2) {
            let group = u16::from_str_radix(groups.next()?, 16).ok()?;
            pair.copy_from_slice(&group.to_be_bytes());
        }
        groups.next().is_none().then_some(Self(bytes))
    }
}

impl fmt::Display for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&Ipv6Addr::from(self.0), f)
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// The protocol a GID table entry is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum GidType {
    /// InfiniBand, or RoCE v1 on kernels that do not tell them apart.
    Ib,
    /// RoCE v1 (Ethernet, not routable).
    RoceV1,
    /// RoCE v2 (UDP/IP, routable): the one to use with rxe.
    RoceV2,
    /// Any other value, raw.
    Other(u32),
}

impl GidType {
    fn from_raw(raw: u32) -> Self {
        match raw {
            ibv_gid_type::IBV_GID_TYPE_IB => Self::Ib,
            ibv_gid_type::IBV_GID_TYPE_ROCE_V1 => Self::RoceV1,
            ibv_gid_type::IBV_GID_TYPE_ROCE_V2 => Self::RoceV2,
            other => Self::Other(other),
        }
    }
}

/// Finds the index of the first IPv4-mapped RoCE v2 GID of `port` — the
/// entry RoCE v2 connections should use (indexes 0/1 are often link-local
/// IPv6 or RoCE v1). Asks `ibv_query_gid_ex` when libibverbs exports it,
/// else (or when that finds nothing) reads sysfs, see
/// [`find_roce_v2_ipv4_gid_index_sysfs`].
///
/// The kernel fills the GID table asynchronously after a device is added:
/// a caller that has just created one should retry for a few seconds.
///
/// # Errors
/// [`VerbsError::NoRoceV2Gid`] when there is no such entry; errors of
/// `ibv_query_port`.
pub fn find_roce_v2_ipv4_gid_index(ctx: &Context, port: u8) -> Result<u8, VerbsError> {
    let table_len = ctx.query_port(port)?.gid_tbl_len.min(256);
    let found =
        (0..table_len)
            .filter_map(|i| u8::try_from(i).ok())
            .find(|&index| match query_gid_ex(ctx, port, index) {
                Some((gid, ty)) => ty == GidType::RoceV2 && gid.ipv4().is_some(),
                None => false,
            });
    if let Some(index) = found {
        return Ok(index);
    }
    find_roce_v2_ipv4_gid_index_sysfs(ctx.name(), port).ok_or_else(|| VerbsError::NoRoceV2Gid {
        device: ctx.name().to_owned(),
        port,
    })
}

/// The sysfs half of [`find_roce_v2_ipv4_gid_index`], usable without opening
/// the device: scans `/sys/class/infiniband/<device>/ports/<port>/gids/N`
/// with `gid_attrs/types/N`. `None` when no entry is an IPv4-mapped RoCE v2
/// GID (or sysfs has no such device).
pub fn find_roce_v2_ipv4_gid_index_sysfs(device: &str, port: u8) -> Option<u8> {
    let port_dir = Path::new("/sys/class/infiniband")
        .join(device)
        .join("ports")
        .join(port.to_string());
    let table_len = std::fs::read_dir(port_dir.join("gids")).ok()?.count();
    (0..table_len)
        .filter_map(|i| u8::try_from(i).ok())
        .find(|&index| match sysfs_gid_entry(&port_dir, index) {
            Some((gid, ty)) => ty == GidType::RoceV2 && gid.ipv4().is_some(),
            None => false,
        })
}

/// One GID entry via `_ibv_query_gid_ex` (what verbs.h's inline
/// `ibv_query_gid_ex` calls); `None` when the symbol is missing or the entry
/// is empty or unreadable.
fn query_gid_ex(ctx: &Context, port: u8, index: u8) -> Option<(Gid, GidType)> {
    let query = ctx.inner.verbs.lib()._ibv_query_gid_ex.as_ref().ok()?;
    let mut entry = ibv_gid_entry::default();
    // SAFETY: live context; `entry` is a valid out-pointer and we pass its
    // true size, exactly as verbs.h's inline wrapper does.
    let rc = unsafe {
        query(
            ctx.inner.ctx,
            u32::from(port),
            u32::from(index),
            &mut entry,
            0,
            std::mem::size_of::<ibv_gid_entry>(),
        )
    };
    if rc != 0 {
        return None;
    }
    // SAFETY: every bit pattern is a valid `[u8; 16]`.
    let gid = Gid(unsafe { entry.gid.raw });
    (!gid.is_zero()).then_some((gid, GidType::from_raw(entry.gid_type)))
}

/// One GID entry from sysfs; `None` for an empty or unreadable entry (the
/// kernel answers EINVAL for the type of an empty one).
fn sysfs_gid_entry(port_dir: &Path, index: u8) -> Option<(Gid, GidType)> {
    let gid_text = std::fs::read_to_string(port_dir.join("gids").join(index.to_string())).ok()?;
    let gid = Gid::parse_sysfs(&gid_text).filter(|g| !g.is_zero())?;
    let type_path = port_dir
        .join("gid_attrs")
        .join("types")
        .join(index.to_string());
    let ty = match std::fs::read_to_string(type_path).ok()?.trim() {
        "RoCE v2" => GidType::RoceV2,
        "IB/RoCE v1" => GidType::RoceV1,
        _ => GidType::Other(u32::MAX),
    };
    Some((gid, ty))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sysfs_gid_and_finds_ipv4() {
        let gid = Gid::parse_sysfs("0000:0000:0000:0000:0000:ffff:7f00:0001\n").unwrap();
        assert_eq!(gid.ipv4(), Some(Ipv4Addr::new(127, 0, 0, 1)));
        assert_eq!(gid.to_string(), "::ffff:127.0.0.1");
        let link_local = Gid::parse_sysfs("fe80:0000:0000:0000:5054:00ff:fe12:3456").unwrap();
        assert_eq!(link_local.ipv4(), None);
        assert!(Gid::parse_sysfs("fe80:0000").is_none());
        assert!(Gid::parse_sysfs("0:0:0:0:0:0:0:0:0").is_none());
    }
}
