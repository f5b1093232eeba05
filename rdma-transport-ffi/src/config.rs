//! `RtManagerConfig`: every `ManagerConfig` option, as C sees it, and its
//! checked conversion.

use std::ffi::{c_char, CStr};
use std::mem::offset_of;
use std::path::Path;

use rdma_transport::auth::ClusterKey;
use rdma_transport::{ManagerConfig, PollMode, TransportKind};

use crate::abi::{flag, struct_size, CConfig};
use crate::status::{fail, RtStatus};

/// Which data path a manager uses (`RtManagerConfig.transport`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RtTransportKind {
    /// RDMA where both ends have a usable device, TCP otherwise (default).
    Auto = 0,
    /// TCP only.
    Tcp = 1,
    /// RDMA only: `rt_manager_connect` fails with `RT_STATUS_UNSUPPORTED`
    /// on a host without a usable device.
    Rdma = 2,
}

/// How poller threads wait for answers (`RtManagerConfig.poll_mode`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RtPollMode {
    /// Spin while traffic flows, block after `poll_idle_spin_us` without an
    /// answer (default; lowest latency, costs a core while busy).
    Busy = 0,
    /// Always block until a connection is readable.
    Event = 1,
}

/// `RtManagerConfig.rdma_gid_index`: pick the GID automatically (the
/// IPv4-mapped RoCE v2 GID on Ethernet ports, 0 on InfiniBand).
pub const RT_RDMA_GID_INDEX_AUTO: i32 = -1;

/// Settings of `rt_manager_connect`; fill with `rt_manager_config_default`
/// first, then change what you need. Flags are 0 or 1 and enum fields hold
/// a value of their enum; anything else is refused with
/// `RT_STATUS_INVALID_ARGUMENT`. Strings are NUL-terminated UTF-8 and are
/// only read during `rt_manager_connect`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct RtManagerConfig {
    /// `sizeof(RtManagerConfig)`, set by `rt_manager_config_default`: lets
    /// the struct grow (see docs/embedding.md). The sizes of the earlier
    /// layouts (64, up to `cluster_key_file`; 168, up to `cluster_key_len`)
    /// are accepted too, with defaults for the fields after them; other
    /// sizes are refused with `RT_STATUS_STRUCT_SIZE`.
    pub struct_size: u32,
    /// Poller threads (at least 1).
    pub poller_threads: u32,
    /// Coordinator base URL, e.g. "http://127.0.0.1:7070" (required).
    pub coordinator_url: *const c_char,
    /// Deadline of every page request, in milliseconds (at least 1). A
    /// write to a replicated range that one replica missed may take a
    /// quarter of it longer, to mark that replica stale.
    pub request_timeout_ms: u64,
    /// Deadline of a connection attempt, in milliseconds.
    pub connect_timeout_ms: u64,
    /// Size of the page pool in bytes (a multiple of 4096).
    pub pool_size_bytes: u64,
    /// How long a caller spins for its answer before it parks, in
    /// microseconds (about 10 on hosts with 2-4 CPUs, see docs/embedding.md).
    pub wait_spin_us: u64,
    /// 1: pin pollers (to `poller_cpus`, or the last CPUs of the host when
    /// `poller_cpus_len` is 0); 0: no pinning.
    pub pin_pollers: u32,
    /// 1: run without a cluster key (insecure: only page-servers without a
    /// key are used, and nothing proves who they are); 0: `cluster_key_file`
    /// or `cluster_key` is required.
    pub insecure: u32,
    /// Path of the cluster key file (hex, at least 32 bytes, not readable by
    /// other users); NULL when the key is given in `cluster_key` or
    /// `insecure` is 1.
    pub cluster_key_file: *const c_char,
    /// An `RtTransportKind` value.
    pub transport: u32,
    /// An `RtPollMode` value.
    pub poll_mode: u32,
    /// CPUs to pin pollers to (poller i on `poller_cpus[i % len]`), with
    /// `pin_pollers` = 1 (default 0: no pinning); NULL and 0: the last CPUs
    /// of the host.
    pub poller_cpus: *const u32,
    /// Entries of `poller_cpus`.
    pub poller_cpus_len: usize,
    /// Busy poll mode: how long a poller keeps spinning after the last
    /// answer, in microseconds.
    pub poll_idle_spin_us: u64,
    /// Period of the background map refresh in milliseconds; 0 turns it
    /// off (the map is still refreshed on a miss or a lost node).
    pub map_refresh_ms: u64,
    /// RDMA device name (e.g. "mlx5_0", "rxe0"); NULL: the first device.
    pub rdma_device: *const c_char,
    /// Port of the RDMA device (1 to 255).
    pub rdma_port: u32,
    /// GID index (0 to 255), or `RT_RDMA_GID_INDEX_AUTO`.
    pub rdma_gid_index: i32,
    /// Local ACK timeout code of the queue pairs (4.096 us * 2^code; 1 to 31).
    pub rdma_ack_timeout: u32,
    /// Transport retries before an RDMA request fails (0 to 7).
    pub rdma_retry_count: u32,
    /// Flag: ask page-servers for end-to-end page checksums (CRC-32C, TCP
    /// data path; default 1).
    pub page_checksums: u32,
    /// Replicated ranges: how long a read waits for a replica before it
    /// also goes to the next one, in microseconds; 0 (default): four times
    /// the recent p99, at least 1 ms. At most half of `request_timeout_ms`.
    pub read_hedge_delay_us: u64,
    /// Bearer token for a coordinator without a cluster key (its
    /// `--token`); NULL: none. Unused with a cluster key.
    pub coordinator_token: *const c_char,
    /// The cluster key's bytes (32 to 1024, not hex), instead of
    /// `cluster_key_file`; NULL and 0: none. Copied during
    /// `rt_manager_connect`.
    pub cluster_key: *const u8,
    /// Bytes at `cluster_key`.
    pub cluster_key_len: usize,
    /// This client's identity on its connections; 0 (default): a random
    /// one. Give one that survives a restart of the VMM (e.g. derived from
    /// the VM's UUID), never the same to two managers alive at once: see
    /// docs/embedding.md.
    pub client_id: u64,
}

/// `struct_size` of the first layout (up to `cluster_key_file`).
const FIRST_LAYOUT_BYTES: usize = 64;
const _: () = assert!(offset_of!(RtManagerConfig, transport) == FIRST_LAYOUT_BYTES);
/// `struct_size` of the second layout (up to `cluster_key_len`).
const SECOND_LAYOUT_BYTES: usize = 168;
const _: () = assert!(offset_of!(RtManagerConfig, client_id) == SECOND_LAYOUT_BYTES);

impl CConfig for RtManagerConfig {
    const NAME: &'static str = "RtManagerConfig";
    const OLD_SIZES: &'static [usize] = &[FIRST_LAYOUT_BYTES, SECOND_LAYOUT_BYTES];

    fn defaults() -> Self {
        let d = ManagerConfig::default();
        Self {
            struct_size: struct_size::<Self>(),
            poller_threads: u32::try_from(d.poller_threads).unwrap_or(1),
            coordinator_url: std::ptr::null(),
            request_timeout_ms: d.request_timeout_ms,
            connect_timeout_ms: d.connect_timeout_ms,
            pool_size_bytes: d.pool_size_bytes as u64,
            wait_spin_us: d.wait_spin_us,
            pin_pollers: 0,
            insecure: 0,
            cluster_key_file: std::ptr::null(),
            transport: match d.transport {
                TransportKind::Auto => RtTransportKind::Auto,
                TransportKind::Tcp => RtTransportKind::Tcp,
                TransportKind::Rdma => RtTransportKind::Rdma,
            } as u32,
            poll_mode: match d.poll_mode {
                PollMode::Busy => RtPollMode::Busy,
                PollMode::Event => RtPollMode::Event,
            } as u32,
            poller_cpus: std::ptr::null(),
            poller_cpus_len: 0,
            poll_idle_spin_us: d.poll_idle_spin_us,
            map_refresh_ms: d.map_refresh_ms,
            rdma_device: std::ptr::null(),
            rdma_port: u32::from(d.rdma_port),
            rdma_gid_index: d.rdma_gid_index.map_or(RT_RDMA_GID_INDEX_AUTO, i32::from),
            rdma_ack_timeout: u32::from(d.rdma_ack_timeout),
            rdma_retry_count: u32::from(d.rdma_retry_count),
            page_checksums: u32::from(d.page_checksums),
            read_hedge_delay_us: d.read_hedge_delay_us,
            coordinator_token: std::ptr::null(),
            cluster_key: std::ptr::null(),
            cluster_key_len: 0,
            client_id: 0,
        }
    }
}

const NAME: &str = RtManagerConfig::NAME;

fn invalid(message: impl std::fmt::Display) -> RtStatus {
    fail(RtStatus::InvalidArgument, message)
}

/// The optional string at `ptr` (NULL: `None`); an empty one is refused.
///
/// # Safety
/// `ptr` must be NULL or a NUL-terminated string.
unsafe fn opt_str(ptr: *const c_char, field: &str) -> Result<Option<String>, RtStatus> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: non-null, NUL-terminated by the caller's contract.
    let text = unsafe { CStr::from_ptr(ptr) };
    match text.to_str() {
        Ok("") => Err(invalid(format!("{NAME}.{field} is empty (NULL for none)"))),
        Ok(s) => Ok(Some(s.to_owned())),
        Err(_) => Err(invalid(format!("{NAME}.{field} is not UTF-8"))),
    }
}

/// The `len` items at `ptr` (NULL with 0: none).
///
/// # Safety
/// `ptr` must be NULL or point to `len` readable items.
unsafe fn opt_slice<'a, T>(ptr: *const T, len: usize, field: &str) -> Result<&'a [T], RtStatus> {
    match (ptr.is_null(), len) {
        (_, 0) => Ok(&[]),
        (true, _) => Err(invalid(format!(
            "{NAME}.{field} is NULL but {field}_len is {len}"
        ))),
        // SAFETY: non-null and `len` readable items (caller's contract).
        (false, _) => Ok(unsafe { std::slice::from_raw_parts(ptr, len) }),
    }
}

/// `value` if it lies in `range`, as a `u8`.
fn small(value: u32, range: std::ops::RangeInclusive<u8>, field: &str) -> Result<u8, RtStatus> {
    match u8::try_from(value) {
        Ok(v) if range.contains(&v) => Ok(v),
        _ => Err(invalid(format!(
            "{NAME}.{field} is {value}; it must be {} to {}",
            range.start(),
            range.end()
        ))),
    }
}

/// The cluster key from exactly one of `cluster_key_file`, `cluster_key`
/// and `insecure`.
///
/// # Safety
/// As [`rust_config`].
unsafe fn cluster_key(c: &RtManagerConfig) -> Result<Option<ClusterKey>, RtStatus> {
    let insecure = flag(c.insecure, NAME, "insecure")?;
    // SAFETY: the caller's contract (NULL or NUL-terminated).
    let file = unsafe { opt_str(c.cluster_key_file, "cluster_key_file") }?;
    // SAFETY: the caller's contract (NULL or `cluster_key_len` bytes).
    let bytes = unsafe { opt_slice(c.cluster_key, c.cluster_key_len, "cluster_key") }?;
    match (file, bytes.is_empty(), insecure) {
        (Some(path), true, false) => ClusterKey::from_file(Path::new(&path))
            .map(Some)
            .map_err(|e| invalid(format!("{NAME}.cluster_key_file: {e}"))),
        (None, false, false) => ClusterKey::from_bytes(bytes)
            .map(Some)
            .map_err(|e| invalid(format!("{NAME}.cluster_key: {e}"))),
        (None, true, true) => Ok(None),
        (None, true, false) => Err(invalid(format!(
            "no cluster key: set {NAME}.cluster_key_file (make one with `openssl rand -hex 32 \
             > cluster.key && chmod 600 cluster.key`) or cluster_key/cluster_key_len, or \
             insecure = 1 to let anyone on the network read and write guest memory"
        ))),
        _ => Err(invalid(format!(
            "{NAME}: cluster_key_file, cluster_key and insecure exclude each other; set one"
        ))),
    }
}

/// The Rust config of a C one, every value checked.
///
/// # Safety
/// The pointers of `c` must be NULL or valid as their field documents
/// (strings NUL-terminated, arrays of their `_len`).
pub(crate) unsafe fn rust_config(c: &RtManagerConfig) -> Result<ManagerConfig, RtStatus> {
    let pin_pollers = flag(c.pin_pollers, NAME, "pin_pollers")?;
    let page_checksums = flag(c.page_checksums, NAME, "page_checksums")?;
    let transport = match c.transport {
        0 => TransportKind::Auto,
        1 => TransportKind::Tcp,
        2 => TransportKind::Rdma,
        other => {
            return Err(invalid(format!(
                "{NAME}.transport {other} is not an RtTransportKind (0 auto, 1 tcp, 2 rdma)"
            )))
        }
    };
    let poll_mode = match c.poll_mode {
        0 => PollMode::Busy,
        1 => PollMode::Event,
        other => {
            return Err(invalid(format!(
                "{NAME}.poll_mode {other} is not an RtPollMode (0 busy, 1 event)"
            )))
        }
    };
    // SAFETY: the caller's contract (NULL or `poller_cpus_len` items).
    let cpus = unsafe { opt_slice(c.poller_cpus, c.poller_cpus_len, "poller_cpus") }?;
    let poller_cpus = match (pin_pollers, cpus.is_empty()) {
        (false, true) => Some(vec![]),
        (false, false) => {
            return Err(invalid(format!(
                "{NAME}.poller_cpus is given but pin_pollers is 0"
            )))
        }
        (true, true) => None,
        (true, false) => Some(cpus.iter().map(|&cpu| cpu as usize).collect()),
    };
    let rdma_gid_index = match c.rdma_gid_index {
        RT_RDMA_GID_INDEX_AUTO => None,
        index => Some(u8::try_from(index).map_err(|_| {
            invalid(format!(
                "{NAME}.rdma_gid_index is {index}; it must be 0 to 255 or \
                 RT_RDMA_GID_INDEX_AUTO (-1)"
            ))
        })?),
    };
    let Ok(pool_size_bytes) = usize::try_from(c.pool_size_bytes) else {
        return Err(invalid(format!("{NAME}.pool_size_bytes is too large")));
    };
    if c.coordinator_url.is_null() {
        return Err(invalid(format!("{NAME}.coordinator_url is NULL")));
    }
    Ok(ManagerConfig {
        // SAFETY: the caller's contract (NUL-terminated); not NULL (above).
        coordinator_url: unsafe { opt_str(c.coordinator_url, "coordinator_url") }?
            .unwrap_or_default(),
        // SAFETY: the caller's contract (NULL or NUL-terminated).
        coordinator_token: unsafe { opt_str(c.coordinator_token, "coordinator_token") }?,
        // SAFETY: the caller's contract.
        cluster_key: unsafe { cluster_key(c) }?,
        transport,
        pool_size_bytes,
        poller_threads: c.poller_threads as usize,
        poller_cpus,
        poll_mode,
        poll_idle_spin_us: c.poll_idle_spin_us,
        wait_spin_us: c.wait_spin_us,
        request_timeout_ms: c.request_timeout_ms,
        connect_timeout_ms: c.connect_timeout_ms,
        map_refresh_ms: c.map_refresh_ms,
        // SAFETY: the caller's contract (NULL or NUL-terminated).
        rdma_device: unsafe { opt_str(c.rdma_device, "rdma_device") }?,
        rdma_port: small(c.rdma_port, 1..=255, "rdma_port")?,
        rdma_gid_index,
        rdma_ack_timeout: small(c.rdma_ack_timeout, 1..=31, "rdma_ack_timeout")?,
        rdma_retry_count: small(c.rdma_retry_count, 0..=7, "rdma_retry_count")?,
        page_checksums,
        read_hedge_delay_us: c.read_hedge_delay_us,
        client_id: (c.client_id != 0).then_some(c.client_id),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `ManagerConfig` field, set to a value other than its default,
    /// arrives in the Rust config.
    #[test]
    fn every_option_reaches_the_rust_config() {
        let cpus = [0u32, 1];
        let key = [7u8; 32];
        let c = RtManagerConfig {
            coordinator_url: c"http://127.0.0.1:1".as_ptr(),
            poller_threads: 2,
            request_timeout_ms: 77,
            connect_timeout_ms: 88,
            pool_size_bytes: 8 * 4096,
            wait_spin_us: 9,
            transport: RtTransportKind::Tcp as u32,
            poll_mode: RtPollMode::Busy as u32,
            pin_pollers: 1,
            poller_cpus: cpus.as_ptr(),
            poller_cpus_len: cpus.len(),
            poll_idle_spin_us: 11,
            map_refresh_ms: 0,
            rdma_device: c"rxe9".as_ptr(),
            rdma_port: 2,
            rdma_gid_index: 3,
            rdma_ack_timeout: 20,
            rdma_retry_count: 6,
            page_checksums: 0,
            read_hedge_delay_us: 555,
            coordinator_token: c"tok".as_ptr(),
            cluster_key: key.as_ptr(),
            cluster_key_len: key.len(),
            client_id: 0x5eed,
            ..RtManagerConfig::defaults()
        };
        // SAFETY: every pointer of `c` is live and valid as documented.
        let r = unsafe { rust_config(&c) }.unwrap();
        assert_eq!(r.coordinator_url, "http://127.0.0.1:1");
        assert_eq!(r.coordinator_token.as_deref(), Some("tok"));
        assert_eq!(r.cluster_key.unwrap().to_hex(), "07".repeat(32));
        assert_eq!(r.transport, TransportKind::Tcp);
        assert_eq!(r.poll_mode, PollMode::Busy);
        assert_eq!(r.poller_cpus, Some(vec![0, 1]));
        assert_eq!(
            (r.poller_threads, r.pool_size_bytes, r.wait_spin_us),
            (2, 8 * 4096, 9)
        );
        assert_eq!(
            (r.request_timeout_ms, r.connect_timeout_ms, r.map_refresh_ms),
            (77, 88, 0)
        );
        assert_eq!(r.poll_idle_spin_us, 11);
        assert_eq!(r.rdma_device.as_deref(), Some("rxe9"));
        assert_eq!(
            (
                r.rdma_port,
                r.rdma_gid_index,
                r.rdma_ack_timeout,
                r.rdma_retry_count
            ),
            (2, Some(3), 20, 6)
        );
        assert!(!r.page_checksums);
        assert_eq!(r.read_hedge_delay_us, 555);
        assert_eq!(r.client_id, Some(0x5eed));
    }

    #[test]
    fn defaults_match_the_rust_defaults() {
        let c = RtManagerConfig {
            coordinator_url: c"http://127.0.0.1:1".as_ptr(),
            insecure: 1,
            ..RtManagerConfig::defaults()
        };
        // SAFETY: every pointer of `c` is NULL or a live string.
        let r = unsafe { rust_config(&c) }.unwrap();
        let d = ManagerConfig::default();
        assert_eq!(
            format!("{r:?}"),
            format!(
                "{:?}",
                ManagerConfig {
                    coordinator_url: "http://127.0.0.1:1".into(),
                    ..d
                }
            )
        );
    }
}
