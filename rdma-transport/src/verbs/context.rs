//! An opened device (`ibv_context`) and its device/port/GID queries.

use std::ffi::CStr;
use std::sync::Arc;

use super::device::DeviceList;
use super::error::{check_ptr, check_rc, note_destroy_failure, rc_to_io, VerbsError};
use super::generated::{
    _compat_ibv_port_attr, ibv_context, ibv_device_attr, ibv_device_cap_flags, ibv_gid,
    ibv_port_attr, ibv_port_state, IBV_LINK_LAYER_ETHERNET, IBV_LINK_LAYER_INFINIBAND,
};
use super::gid::Gid;
use super::loader::Verbs;
use super::qp::Mtu;

/// An open RDMA device. Cheap to clone; the device is closed when the last
/// clone and every object created from it are gone.
#[derive(Debug, Clone)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

#[derive(Debug)]
pub(crate) struct ContextInner {
    pub(crate) verbs: Arc<Verbs>,
    pub(crate) ctx: *mut ibv_context,
    pub(crate) name: String,
}

// SAFETY: libibverbs verbs are thread-safe (rdma-core documents every verb as
// callable from any thread); the pointer is only freed in Drop, once.
unsafe impl Send for ContextInner {}
// SAFETY: as for Send: shared use from several threads is what the verbs API
// supports.
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        // SAFETY: `ctx` came from `ibv_open_device`; every child object holds
        // an `Arc<ContextInner>`, so all of them are destroyed by now.
        let rc = unsafe { self.verbs.lib().ibv_close_device(self.ctx) };
        if rc != 0 {
            note_destroy_failure();
            tracing::warn!(device = %self.name, error = %rc_to_io(rc), "ibv_close_device failed");
        }
    }
}

/// Selected fields of `ibv_device_attr`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Node GUID, host byte order.
    pub node_guid: u64,
    /// Largest memory region, bytes.
    pub max_mr_size: u64,
    /// Most QPs.
    pub max_qp: u32,
    /// Most outstanding work requests per QP queue.
    pub max_qp_wr: u32,
    /// Most scatter/gather entries per work request.
    pub max_sge: u32,
    /// Most CQs.
    pub max_cq: u32,
    /// Most entries per CQ.
    pub max_cqe: u32,
    /// Most MRs.
    pub max_mr: u32,
    /// Most PDs.
    pub max_pd: u32,
    /// Most RDMA READ/atomic requests a QP can have outstanding as target
    /// (bounds `max_dest_rd_atomic`).
    pub max_qp_rd_atom: u32,
    /// Most RDMA READ/atomic requests a QP can initiate concurrently
    /// (bounds `max_rd_atomic`).
    pub max_qp_init_rd_atom: u32,
    /// Total RDMA READ/atomic resources of the device.
    pub max_res_rd_atom: u32,
    /// Number of physical ports.
    pub phys_port_cnt: u8,
    /// Most memory windows (0: none).
    pub max_mw: u32,
    /// `enum ibv_device_cap_flags` bits (e.g. `IBV_DEVICE_MEM_WINDOW_TYPE_2B`).
    pub device_cap_flags: u32,
}

impl DeviceAttr {
    /// Whether the device offers type-2 memory windows (`max_mw` > 0 and
    /// the `MEM_WINDOW_TYPE_2A` or `_2B` capability): windows bound to one
    /// QP by a work request posted on it.
    pub fn supports_type2_mw(&self) -> bool {
        let type2 = ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2A
            | ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B;
        self.max_mw > 0 && self.device_cap_flags & type2 != 0
    }
}

/// Port state (`enum ibv_port_state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PortState {
    /// Link down.
    Down,
    /// Initialising.
    Init,
    /// Armed.
    Armed,
    /// Up: the only state in which traffic flows.
    Active,
    /// Any other value, raw.
    Other(u32),
}

/// Link layer of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum LinkLayer {
    /// InfiniBand: addressed by LID.
    InfiniBand,
    /// Ethernet (RoCE): addressed by GID, LID is 0.
    Ethernet,
    /// Unspecified or unknown, raw.
    Other(u8),
}

/// Selected fields of `ibv_port_attr`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortAttr {
    /// Logical port state.
    pub state: PortState,
    /// Largest MTU the port supports (`None`: value unknown to this crate).
    pub max_mtu: Option<Mtu>,
    /// Active MTU.
    pub active_mtu: Option<Mtu>,
    /// Entries in the GID table.
    pub gid_tbl_len: u32,
    /// Base LID (0 on RoCE).
    pub lid: u16,
    /// Largest message, bytes.
    pub max_msg_sz: u32,
    /// Link layer.
    pub link_layer: LinkLayer,
}

fn non_negative(v: i32) -> u32 {
    u32::try_from(v).unwrap_or(0)
}

impl Context {
    /// Opens the device named `name`, or the first device when `None`.
    ///
    /// # Errors
    /// [`VerbsError::NoDevice`] when there is none,
    /// [`VerbsError::DeviceNotFound`] when `name` is not among them,
    /// [`VerbsError::Verb`] when `ibv_open_device` fails.
    pub fn open(verbs: &Arc<Verbs>, name: Option<&str>) -> Result<Self, VerbsError> {
        let list = DeviceList::new(verbs)?;
        let mut names = Vec::new();
        let mut chosen = None;
        for dev in list.iter() {
            let dev_name = list.name(dev);
            if name.map_or(true, |wanted| wanted == dev_name) {
                chosen = Some((dev, dev_name));
                break;
            }
            names.push(dev_name);
        }
        let Some((dev, dev_name)) = chosen else {
            return Err(match name {
                None => VerbsError::NoDevice,
                Some(wanted) => VerbsError::DeviceNotFound {
                    name: wanted.to_owned(),
                    available: names.join(", "),
                },
            });
        };
        // SAFETY: `dev` is from the live device list; the returned context
        // stays valid after the list is freed (verbs.h).
        let ctx = check_ptr("ibv_open_device", unsafe {
            verbs.lib().ibv_open_device(dev)
        })?;
        drop(list);
        Ok(Self {
            inner: Arc::new(ContextInner {
                verbs: Arc::clone(verbs),
                ctx,
                name: dev_name,
            }),
        })
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The loaded library.
    pub fn verbs(&self) -> &Arc<Verbs> {
        &self.inner.verbs
    }

    /// Number of completion vectors (valid `comp_vector` values are below it).
    pub fn num_comp_vectors(&self) -> i32 {
        // SAFETY: `ctx` is a live context; the field is set at open and
        // never changed.
        unsafe { (*self.inner.ctx).num_comp_vectors }
    }

    /// `ibv_query_device`.
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming the verb.
    pub fn query_device(&self) -> Result<DeviceAttr, VerbsError> {
        let mut attr = ibv_device_attr::default();
        // SAFETY: live context, `attr` is a valid out-pointer of the type the
        // verb expects.
        let rc = unsafe {
            self.inner
                .verbs
                .lib()
                .ibv_query_device(self.inner.ctx, &mut attr)
        };
        check_rc("ibv_query_device", rc)?;
        // SAFETY: the firmware string is NUL-terminated within its array
        // (the kernel fills it with a bounded, terminated copy) and
        // `c_char` and `u8` have the same layout.
        let fw_bytes: &[u8; 64] = unsafe { &*attr.fw_ver.as_ptr().cast::<[u8; 64]>() };
        let fw_ver = CStr::from_bytes_until_nul(fw_bytes)
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(DeviceAttr {
            fw_ver,
            node_guid: u64::from_be(attr.node_guid),
            max_mr_size: attr.max_mr_size,
            max_qp: non_negative(attr.max_qp),
            max_qp_wr: non_negative(attr.max_qp_wr),
            max_sge: non_negative(attr.max_sge),
            max_cq: non_negative(attr.max_cq),
            max_cqe: non_negative(attr.max_cqe),
            max_mr: non_negative(attr.max_mr),
            max_pd: non_negative(attr.max_pd),
            max_qp_rd_atom: non_negative(attr.max_qp_rd_atom),
            max_qp_init_rd_atom: non_negative(attr.max_qp_init_rd_atom),
            max_res_rd_atom: non_negative(attr.max_res_rd_atom),
            phys_port_cnt: attr.phys_port_cnt,
            max_mw: non_negative(attr.max_mw),
            device_cap_flags: attr.device_cap_flags,
        })
    }

    /// `ibv_query_port` for port `port` (ports count from 1).
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming the verb.
    pub fn query_port(&self, port: u8) -> Result<PortAttr, VerbsError> {
        // Zeroed, as verbs.h's inline wrapper does before the compat call.
        let mut attr = ibv_port_attr::default();
        // SAFETY: live context. The exported `ibv_query_port` takes the
        // smaller `_compat_ibv_port_attr`; passing the full, zeroed
        // `ibv_port_attr` is what verbs.h's own inline wrapper does, and the
        // provider writes at most `sizeof(struct ibv_port_attr)`.
        let rc = unsafe {
            self.inner.verbs.lib().ibv_query_port(
                self.inner.ctx,
                port,
                (&mut attr as *mut ibv_port_attr).cast::<_compat_ibv_port_attr>(),
            )
        };
        check_rc("ibv_query_port", rc)?;
        Ok(PortAttr {
            state: match attr.state {
                ibv_port_state::IBV_PORT_DOWN => PortState::Down,
                ibv_port_state::IBV_PORT_INIT => PortState::Init,
                ibv_port_state::IBV_PORT_ARMED => PortState::Armed,
                ibv_port_state::IBV_PORT_ACTIVE => PortState::Active,
                other => PortState::Other(other),
            },
            max_mtu: Mtu::from_raw(attr.max_mtu),
            active_mtu: Mtu::from_raw(attr.active_mtu),
            gid_tbl_len: non_negative(attr.gid_tbl_len),
            lid: attr.lid,
            max_msg_sz: attr.max_msg_sz,
            link_layer: match u32::from(attr.link_layer) {
                IBV_LINK_LAYER_INFINIBAND => LinkLayer::InfiniBand,
                IBV_LINK_LAYER_ETHERNET => LinkLayer::Ethernet,
                _ => LinkLayer::Other(attr.link_layer),
            },
        })
    }

    /// `ibv_query_gid`: GID table entry `index` of `port`.
    ///
    /// # Errors
    /// [`VerbsError::Verb`] naming the verb (e.g. EINVAL past the table).
    pub fn query_gid(&self, port: u8, index: u8) -> Result<Gid, VerbsError> {
        let mut gid = ibv_gid { raw: [0; 16] };
        // SAFETY: live context, `gid` is a valid out-pointer.
        let rc = unsafe {
            self.inner
                .verbs
                .lib()
                .ibv_query_gid(self.inner.ctx, port, i32::from(index), &mut gid)
        };
        check_rc("ibv_query_gid", rc)?;
        // SAFETY: every bit pattern is a valid `[u8; 16]`, and the union was
        // initialised through `raw`.
        Ok(Gid(unsafe { gid.raw }))
    }
}
