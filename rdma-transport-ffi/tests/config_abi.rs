//! Config structs from C: flags that are not 0 or 1 and unknown
//! `struct_size` values get their documented status through the extern "C"
//! functions, before anything else is looked at.

use std::ffi::CStr;
use std::os::fd::AsRawFd;

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
    assert_eq!((c.pin_handlers, c.fault_mode), (0, 0));
    // A valid config reaches the next check: the NULL manager.
    assert_eq!(
        create(&c),
        (RtStatus::InvalidArgument, "manager is NULL".to_owned())
    );
}

#[test]
fn guest_defaults_are_anonymous_memory() {
    let c = guest_defaults();
    assert_eq!((c.shared_fd, c.handed_over_uffd), (-1, -1));
    assert_eq!(c.shared_offset_bytes, 0);
    assert!(c.handed_over_mapping.is_null());
}

/// The first layout of `RtGuestMemoryConfig` (72 bytes, up to
/// `on_fault_error_user`), in a buffer of the current size whose tail is
/// 0xff bytes: the tail is not read and takes its defaults (anonymous
/// memory), so the config passes its checks and reaches the NULL manager.
#[test]
fn guest_config_of_the_first_layout_still_works() {
    const FIRST: usize = 72;
    let defaults = RtGuestMemoryConfig {
        struct_size: FIRST as u32,
        ..guest_defaults()
    };
    let mut buf = std::mem::MaybeUninit::<RtGuestMemoryConfig>::uninit();
    let bytes = buf.as_mut_ptr().cast::<u8>();
    // SAFETY: `buf` has room for a whole config.
    unsafe { std::ptr::write_bytes(bytes, 0xff, std::mem::size_of::<RtGuestMemoryConfig>()) };
    // SAFETY: FIRST < size_of::<RtGuestMemoryConfig>() bytes, from a live
    // config (no padding in its first layout) into `buf`.
    unsafe {
        std::ptr::copy_nonoverlapping(std::ptr::from_ref(&defaults).cast::<u8>(), bytes, FIRST)
    };
    // SAFETY: every byte of `buf` is initialised, and every field is valid
    // for any bytes (the pointer past FIRST is never dereferenced).
    let old = unsafe { buf.assume_init() };
    assert_eq!(
        create(&old),
        (RtStatus::InvalidArgument, "manager is NULL".to_owned())
    );
    // The fields of the first layout are still checked.
    let (status, message) = create(&RtGuestMemoryConfig {
        pin_handlers: 2,
        ..old
    });
    assert_eq!(status, RtStatus::InvalidArgument);
    assert!(message.contains("pin_handlers must be 0 or 1"), "{message}");
    // The whole struct with the same tail is refused: it is read.
    let (status, message) = create(&RtGuestMemoryConfig {
        struct_size: std::mem::size_of::<RtGuestMemoryConfig>() as u32,
        dirty_tracking: 0,
        rdma_bounce: 0,
        ..old
    });
    assert_eq!(status, RtStatus::InvalidArgument);
    assert!(
        message.contains("handed_over_mapping is given"),
        "{message}"
    );
}

/// The second layout (up to `handed_over_mapping`) is still accepted, with
/// a tail of 0xff bytes that is not read (`dirty_tracking` Auto); bad values
/// of the fields past it are refused with their names.
#[test]
fn guest_config_of_the_second_layout_and_bad_dirty_tracking() {
    let full = std::mem::size_of::<RtGuestMemoryConfig>();
    // The third layout added `handler_slice_us` (8 bytes) past the two
    // u32s the second one does not have.
    let second = full - 16;
    let defaults = RtGuestMemoryConfig {
        struct_size: second as u32,
        ..guest_defaults()
    };
    let mut buf = std::mem::MaybeUninit::<RtGuestMemoryConfig>::uninit();
    let bytes = buf.as_mut_ptr().cast::<u8>();
    // SAFETY: `buf` has room for a whole config.
    unsafe { std::ptr::write_bytes(bytes, 0xff, full) };
    // SAFETY: `second` < `full` bytes, from a live config into `buf`.
    unsafe {
        std::ptr::copy_nonoverlapping(std::ptr::from_ref(&defaults).cast::<u8>(), bytes, second)
    };
    // SAFETY: every byte of `buf` is initialised; the tail is two u32s and
    // a u64.
    let old = unsafe { buf.assume_init() };
    assert_eq!(
        create(&old),
        (RtStatus::InvalidArgument, "manager is NULL".to_owned())
    );
    let d = guest_defaults();
    for (config, want) in [
        (
            RtGuestMemoryConfig {
                dirty_tracking: 3,
                ..d
            },
            "dirty_tracking 3 is not an RtDirtyTracking",
        ),
        (
            RtGuestMemoryConfig {
                rdma_bounce: 2,
                ..d
            },
            "rdma_bounce must be 0 or 1",
        ),
    ] {
        let (status, message) = create(&config);
        assert_eq!(status, RtStatus::InvalidArgument);
        assert!(message.contains(want), "{message} (want {want})");
    }
}

/// The third layout (up to `rdma_bounce`, before `handler_slice_us`) is
/// still accepted: a caller built against it never sets the slice.
#[test]
fn guest_config_of_the_third_layout_still_works() {
    let full = std::mem::size_of::<RtGuestMemoryConfig>();
    let third = full - 8;
    let old = RtGuestMemoryConfig {
        struct_size: third as u32,
        handler_slice_us: u64::MAX,
        ..guest_defaults()
    };
    assert_eq!(
        create(&old),
        (RtStatus::InvalidArgument, "manager is NULL".to_owned())
    );
    // A size between the layouts is none of them.at all.
    let (status, _) = create(&RtGuestMemoryConfig {
        struct_size: (third - 1) as u32,
        ..guest_defaults()
    });
    assert_eq!(status, RtStatus::StructSize);
}

/// Every bad combination of the shared-file fields is refused with
/// `RT_STATUS_INVALID_ARGUMENT` and a message naming it, before the
/// manager is looked at.
#[test]
fn bad_shared_file_fields_are_refused_with_a_clear_message() {
    let file = tempfile::tempfile().unwrap();
    let fd = file.as_raw_fd();
    let mut mapped = [0u8; 8];
    let mapping = mapped.as_mut_ptr().cast::<std::ffi::c_void>();
    let d = guest_defaults();
    let uffd_without_file = format!("handed_over_uffd is {fd} but shared_fd is -1");
    let uffd_without_mapping = format!("handed_over_mapping is NULL but handed_over_uffd is {fd}");
    let cases: Vec<(RtGuestMemoryConfig, &str)> = vec![
        (
            RtGuestMemoryConfig { shared_fd: -2, ..d },
            "shared_fd is -2; it must be a descriptor or -1",
        ),
        (
            RtGuestMemoryConfig {
                shared_fd: fd,
                handed_over_uffd: -7,
                handed_over_mapping: mapping,
                ..d
            },
            "handed_over_uffd is -7; it must be a descriptor or -1",
        ),
        (
            RtGuestMemoryConfig {
                shared_offset_bytes: 4096,
                ..d
            },
            "shared_offset_bytes is 0x1000 but shared_fd is -1",
        ),
        (
            RtGuestMemoryConfig {
                handed_over_mapping: mapping,
                ..d
            },
            "handed_over_mapping is given but handed_over_uffd is -1",
        ),
        (
            RtGuestMemoryConfig {
                shared_fd: fd,
                handed_over_mapping: mapping,
                ..d
            },
            "handed_over_mapping is given but handed_over_uffd is -1",
        ),
        (
            RtGuestMemoryConfig {
                handed_over_uffd: fd,
                handed_over_mapping: mapping,
                ..d
            },
            &uffd_without_file,
        ),
        (
            RtGuestMemoryConfig {
                shared_fd: fd,
                handed_over_uffd: fd,
                ..d
            },
            &uffd_without_mapping,
        ),
        (
            RtGuestMemoryConfig {
                shared_fd: i32::MAX,
                ..d
            },
            "shared_fd 2147483647 cannot be duplicated",
        ),
        (
            RtGuestMemoryConfig {
                shared_fd: fd,
                handed_over_uffd: i32::MAX,
                handed_over_mapping: mapping,
                ..d
            },
            "handed_over_uffd 2147483647 cannot be duplicated",
        ),
    ];
    for (config, expected) in cases {
        let (status, message) = create(&config);
        assert_eq!(status, RtStatus::InvalidArgument, "{expected}: {message}");
        assert!(
            message.contains(expected),
            "{expected:?} not in {message:?}"
        );
    }
    // Good combinations pass every check and reach the NULL manager.
    for config in [
        RtGuestMemoryConfig {
            shared_fd: fd,
            shared_offset_bytes: 4096,
            ..d
        },
        RtGuestMemoryConfig {
            shared_fd: fd,
            handed_over_uffd: fd,
            handed_over_mapping: mapping,
            ..d
        },
    ] {
        assert_eq!(
            create(&config),
            (RtStatus::InvalidArgument, "manager is NULL".to_owned())
        );
    }
    // The caller's descriptor is still its own: the library closed only
    // its duplicates.
    // SAFETY: F_GETFD reads no memory.
    assert!(unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0);
    drop(file);
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
    // (size - 8 and size - 16 are the third and second layouts, accepted.)
    for struct_size in [0, 4, size - 4, size - 12, size - 24, size + 8, u32::MAX] {
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

fn manager_defaults() -> RtManagerConfig {
    let mut c = std::mem::MaybeUninit::<RtManagerConfig>::uninit();
    // SAFETY: fills every field of the struct.
    unsafe { rt_manager_config_default(c.as_mut_ptr()) };
    // SAFETY: initialised just above.
    let mut c = unsafe { c.assume_init() };
    // Nothing listens on port 1: a config that passes every check fails to
    // reach the coordinator, quickly.
    c.coordinator_url = c"http://127.0.0.1:1".as_ptr();
    c.insecure = 1;
    c
}

/// `rt_manager_connect` of `config`, which must fail: its status and message.
///
/// # Safety
/// `config` must be valid for `rt_manager_connect`.
unsafe fn connect_fails(config: *const RtManagerConfig) -> (RtStatus, String) {
    let mut out: *mut RtManager = std::ptr::null_mut();
    // SAFETY: the caller's contract; `out` is writable.
    let status = unsafe { rt_manager_connect(config, &mut out) };
    assert!(out.is_null());
    (status, last_error())
}

/// The first layout of `RtManagerConfig` (64 bytes, up to
/// `cluster_key_file`), in a buffer of the current size whose tail is 0xff
/// bytes: the tail is not read (0xffffffff is no valid transport, poll mode
/// or flag) and takes its defaults, so the config reaches the coordinator.
#[test]
fn manager_config_of_the_first_layout_still_works() {
    const FIRST: usize = 64;
    let mut buf = std::mem::MaybeUninit::<RtManagerConfig>::uninit();
    let defaults = RtManagerConfig {
        struct_size: FIRST as u32,
        ..manager_defaults()
    };
    let bytes = buf.as_mut_ptr().cast::<u8>();
    // SAFETY: `buf` has room for a whole config.
    unsafe { std::ptr::write_bytes(bytes, 0xff, std::mem::size_of::<RtManagerConfig>()) };
    // SAFETY: FIRST < size_of::<RtManagerConfig>() bytes, from a live
    // config (no padding in its first layout) into `buf`.
    unsafe {
        std::ptr::copy_nonoverlapping(std::ptr::from_ref(&defaults).cast::<u8>(), bytes, FIRST)
    };
    let ptr = buf.as_ptr();
    // SAFETY: FIRST readable bytes starting with struct_size, a live URL.
    let (status, message) = unsafe { connect_fails(ptr) };
    assert_eq!(status, RtStatus::Coordinator, "{message}");
    // The fields of the first layout are still checked.
    // SAFETY: as above; pin_pollers lies in the first layout.
    unsafe { buf.as_mut_ptr().as_mut() }.unwrap().pin_pollers = 2;
    // SAFETY: as above.
    let (status, message) = unsafe { connect_fails(ptr) };
    assert_eq!(status, RtStatus::InvalidArgument);
    assert!(
        message.contains("pin_pollers must be 0 or 1, not 2"),
        "{message}"
    );
    // The whole struct with the same tail is refused: it is read.
    // SAFETY: as above.
    let c = unsafe { buf.as_mut_ptr().as_mut() }.unwrap();
    c.pin_pollers = 1;
    c.struct_size = std::mem::size_of::<RtManagerConfig>() as u32;
    // Pointers no check reads through.
    c.poller_cpus = std::ptr::null();
    c.rdma_device = std::ptr::null();
    c.coordinator_token = std::ptr::null();
    c.cluster_key = std::ptr::null();
    // SAFETY: a whole config whose pointers are NULL or live.
    let (status, message) = unsafe { connect_fails(ptr) };
    assert_eq!(status, RtStatus::InvalidArgument);
    assert!(message.contains("not 4294967295"), "{message}");
}

/// The second layout of `RtManagerConfig` (168 bytes, up to
/// `cluster_key_len`, before `client_id`) is accepted: a program built
/// against that header reaches the coordinator, with a random client id.
#[test]
fn manager_config_of_the_second_layout_still_works() {
    const SECOND: usize = 168;
    assert_eq!(
        std::mem::offset_of!(RtManagerConfig, client_id),
        SECOND,
        "client_id is the first field after the second layout"
    );
    let c = RtManagerConfig {
        struct_size: SECOND as u32,
        ..manager_defaults()
    };
    // SAFETY: a whole config (a prefix of it is read), a live URL.
    let (status, message) = unsafe { connect_fails(&c) };
    assert_eq!(status, RtStatus::Coordinator, "{message}");
    // A size between the layouts is none of them.
    let c = RtManagerConfig {
        struct_size: SECOND as u32 - 8,
        ..manager_defaults()
    };
    // SAFETY: as above.
    let (status, message) = unsafe { connect_fails(&c) };
    assert_eq!(status, RtStatus::StructSize, "{message}");
}

/// Every bad value of the fields past the first layout is refused with
/// `RT_STATUS_INVALID_ARGUMENT` and a message naming it, before connecting.
#[test]
fn bad_manager_options_are_refused_with_a_clear_message() {
    let cpus = [0u32];
    let key = [1u8; 32];
    let d = manager_defaults();
    let cases: Vec<(RtManagerConfig, &str)> = vec![
        (
            RtManagerConfig { transport: 3, ..d },
            "transport 3 is not an RtTransportKind",
        ),
        (
            RtManagerConfig { poll_mode: 2, ..d },
            "poll_mode 2 is not an RtPollMode",
        ),
        (
            RtManagerConfig {
                page_checksums: 9,
                ..d
            },
            "page_checksums must be 0 or 1, not 9",
        ),
        (
            RtManagerConfig {
                poller_cpus_len: 2,
                ..d
            },
            "poller_cpus is NULL but poller_cpus_len is 2",
        ),
        (
            RtManagerConfig {
                pin_pollers: 0,
                poller_cpus: cpus.as_ptr(),
                poller_cpus_len: 1,
                ..d
            },
            "poller_cpus is given but pin_pollers is 0",
        ),
        (RtManagerConfig { rdma_port: 0, ..d }, "rdma_port is 0"),
        (
            RtManagerConfig {
                rdma_port: 256,
                ..d
            },
            "rdma_port is 256",
        ),
        (
            RtManagerConfig {
                rdma_gid_index: -2,
                ..d
            },
            "rdma_gid_index is -2",
        ),
        (
            RtManagerConfig {
                rdma_gid_index: 256,
                ..d
            },
            "rdma_gid_index is 256",
        ),
        (
            RtManagerConfig {
                rdma_ack_timeout: 0,
                ..d
            },
            "rdma_ack_timeout is 0; it must be 1 to 31",
        ),
        (
            RtManagerConfig {
                rdma_ack_timeout: 32,
                ..d
            },
            "rdma_ack_timeout is 32",
        ),
        (
            RtManagerConfig {
                rdma_retry_count: 8,
                ..d
            },
            "rdma_retry_count is 8; it must be 0 to 7",
        ),
        (
            RtManagerConfig {
                rdma_device: c"".as_ptr(),
                ..d
            },
            "rdma_device is empty",
        ),
        (
            RtManagerConfig {
                coordinator_token: c"".as_ptr(),
                ..d
            },
            "coordinator_token is empty",
        ),
        (
            RtManagerConfig {
                coordinator_url: std::ptr::null(),
                ..d
            },
            "coordinator_url is NULL",
        ),
        (
            RtManagerConfig {
                insecure: 0,
                cluster_key_len: 32,
                ..d
            },
            "cluster_key is NULL but cluster_key_len is 32",
        ),
        (
            RtManagerConfig {
                insecure: 0,
                cluster_key: key.as_ptr(),
                cluster_key_len: 31,
                ..d
            },
            "cluster key has 31 bytes",
        ),
        (
            RtManagerConfig {
                cluster_key: key.as_ptr(),
                cluster_key_len: key.len(),
                ..d
            },
            "cluster_key_file, cluster_key and insecure exclude each other",
        ),
        (RtManagerConfig { insecure: 0, ..d }, "no cluster key"),
    ];
    for (config, expected) in cases {
        // SAFETY: every pointer of `config` is NULL or live.
        let (status, message) = unsafe { connect_fails(&config) };
        assert_eq!(status, RtStatus::InvalidArgument, "{expected}: {message}");
        assert!(
            message.contains(expected),
            "{expected:?} not in {message:?}"
        );
    }
    // The same defaults pass every check (and fail at the coordinator).
    // SAFETY: every pointer of `d` is NULL or live.
    let (status, message) = unsafe { connect_fails(&d) };
    assert_eq!(status, RtStatus::Coordinator, "{message}");
}
