//! Config structs from C: flags that are not 0 or 1 and unknown
//! `struct_size` values get their documented status through the extern "C"
//! functions, before anything else is looked at.

use std::ffi::CStr;

use rdma_transport_ffi::{
    rt_guest_memory_config_default, rt_guest_memory_create, rt_last_error,
    rt_manager_config_default, rt_manager_connect, RtGuestMemory, RtGuestMemoryConfig, RtManager,
    RtManagerConfig, RtStatus,
};

fn last_error() -> String {
    // SAFETY: rt_last_error returns a NUL-terminated string valid until the
    // next call on this thread.
    unsafe { CStr::from_ptr(rt_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn guest_defaults() -> RtGuestMemoryConfig {
    let mut c = std::mem::MaybeUninit::<RtGuestMemoryConfig>::uninit();
    // SAFETY: fills every field of the struct.
    unsafe { rt_guest_memory_config_default(c.as_mut_ptr()) };
    // SAFETY: initialised just above.
    let mut c = unsafe { c.assume_init() };
    c.size_bytes = 1 << 20;
    c
}

fn create(config: &RtGuestMemoryConfig) -> (RtStatus, String) {
    let mut out: *mut RtGuestMemory = std::ptr::null_mut();
    // SAFETY: NULL manager (the config is checked first), a live config and
    // a writable out pointer.
    let status = unsafe { rt_guest_memory_create(std::ptr::null(), config, &mut out) };
    assert!(out.is_null());
    (status, last_error())
}

#[test]
fn defaults_carry_their_struct_size() {
    let c = guest_defaults();
    assert_eq!(
        c.struct_size as usize,
        std::mem::size_of::<RtGuestMemoryConfig>()
    );
    assert_eq!((c.pin_handlers, c.fault_mode), (1, 0));
    // A valid config reaches the next check: the NULL manager.
    assert_eq!(
        create(&c),
        (RtStatus::InvalidArgument, "manager is NULL".to_owned())
    );
}

#[test]
fn guest_flag_of_two_is_refused() {
    let c = RtGuestMemoryConfig {
        pin_handlers: 2,
        ..guest_defaults()
    };
    let (status, message) = create(&c);
    assert_eq!(status, RtStatus::InvalidArgument);
    assert!(
        message.contains("pin_handlers must be 0 or 1, not 2"),
        "{message}"
    );
}

#[test]
fn guest_unknown_fault_mode_is_refused() {
    let c = RtGuestMemoryConfig {
        fault_mode: 2,
        ..guest_defaults()
    };
    let (status, message) = create(&c);
    assert_eq!(status, RtStatus::InvalidArgument);
    assert!(message.contains("fault_mode 2"), "{message}");
}

#[test]
fn guest_unknown_struct_sizes_are_refused() {
    let size = std::mem::size_of::<RtGuestMemoryConfig>() as u32;
    for struct_size in [0, 4, size - 8, size + 8, u32::MAX] {
        let c = RtGuestMemoryConfig {
            struct_size,
            ..guest_defaults()
        };
        let (status, message) = create(&c);
        assert_eq!(status, RtStatus::StructSize, "struct_size {struct_size}");
        assert!(message.contains("struct_size"), "{message}");
    }
}

#[test]
fn manager_flag_and_struct_size_are_checked_before_connecting() {
    let mut c = std::mem::MaybeUninit::<RtManagerConfig>::uninit();
    // SAFETY: fills every field of the struct.
    unsafe { rt_manager_config_default(c.as_mut_ptr()) };
    // SAFETY: initialised just above.
    let defaults = unsafe { c.assume_init() };
    let url = c"http://127.0.0.1:1";
    let connect = |config: RtManagerConfig| {
        let mut out: *mut RtManager = std::ptr::null_mut();
        // SAFETY: a live config with a NUL-terminated URL; `out` writable.
        let status = unsafe { rt_manager_connect(&config, &mut out) };
        assert!(out.is_null());
        (status, last_error())
    };
    let (status, message) = connect(RtManagerConfig {
        coordinator_url: url.as_ptr(),
        pin_pollers: 2,
        ..defaults
    });
    assert_eq!(status, RtStatus::InvalidArgument);
    assert!(
        message.contains("pin_pollers must be 0 or 1, not 2"),
        "{message}"
    );
    let (status, _) = connect(RtManagerConfig {
        coordinator_url: url.as_ptr(),
        struct_size: defaults.struct_size + 8,
        ..defaults
    });
    assert_eq!(status, RtStatus::StructSize);
}
