//! The device list: which RDMA devices exist, by name and GUID.

use std::ffi::CStr;

use super::error::{last_errno, VerbsError};
use super::generated::ibv_device;
use super::loader::Verbs;

/// One RDMA device as listed by `ibv_get_device_list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name, e.g. `rxe0` or `mlx5_0`.
    pub name: String,
    /// Node GUID in host byte order (0 for rxe on some kernels).
    pub guid: u64,
}

/// Lists the RDMA devices. A host whose kernel has no RDMA support (ENOSYS)
/// has an empty list, not an error.
///
/// # Errors
/// [`VerbsError::Verb`] naming `ibv_get_device_list` for other failures.
pub fn list_devices(verbs: &Verbs) -> Result<Vec<DeviceInfo>, VerbsError> {
    let list = DeviceList::new(verbs)?;
    Ok(list
        .iter()
        .map(|dev| DeviceInfo {
            name: list.name(dev),
            guid: list.guid(dev),
        })
        .collect())
}

/// An owned `ibv_get_device_list` array, freed on drop. Devices that are
/// opened before the drop stay valid (verbs.h, `ibv_free_device_list`).
pub(crate) struct DeviceList<'a> {
    verbs: &'a Verbs,
    list: *mut *mut ibv_device,
    len: usize,
}

impl<'a> DeviceList<'a> {
    pub(crate) fn new(verbs: &'a Verbs) -> Result<Self, VerbsError> {
        let mut num: i32 = 0;
        // SAFETY: `num` is a valid out-pointer for the call's duration; the
        // returned array is owned by us until `ibv_free_device_list` in Drop.
        let list = unsafe { verbs.lib().ibv_get_device_list(&mut num) };
        if list.is_null() {
            let err = last_errno();
            if err.raw_os_error() == Some(libc::ENOSYS) {
                return Ok(Self {
                    verbs,
                    list,
                    len: 0,
                });
            }
            return Err(VerbsError::Verb {
                verb: "ibv_get_device_list",
                source: err,
            });
        }
        Ok(Self {
            verbs,
            list,
            len: usize::try_from(num).unwrap_or(0),
        })
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = *mut ibv_device> + '_ {
        (0..self.len).map(move |i| {
            let slot = self.list.wrapping_add(i);
            // SAFETY: the array holds `len` valid device pointers (plus a NULL
            // terminator) until it is freed in Drop, which `&self` prevents.
            unsafe { *slot }
        })
    }

    pub(crate) fn name(&self, dev: *mut ibv_device) -> String {
        // SAFETY: `dev` comes from this live list; libibverbs returns a
        // pointer to the NUL-terminated name inside the device struct.
        let name = unsafe { self.verbs.lib().ibv_get_device_name(dev) };
        if name.is_null() {
            return String::new();
        }
        // SAFETY: non-NULL, NUL-terminated and valid while the list lives.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    }

    fn guid(&self, dev: *mut ibv_device) -> u64 {
        // SAFETY: `dev` comes from this live list.
        let guid_be = unsafe { self.verbs.lib().ibv_get_device_guid(dev) };
        u64::from_be(guid_be)
    }
}

impl Drop for DeviceList<'_> {
    fn drop(&mut self) {
        if !self.list.is_null() {
            // SAFETY: the array came from `ibv_get_device_list` and is freed
            // exactly once, here.
            unsafe { self.verbs.lib().ibv_free_device_list(self.list) };
        }
    }
}
