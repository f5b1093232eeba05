//! The fault-mode decision, pure and against the kernel from an
//! unprivileged thread.

use super::*;
use crate::region::{MapOptions, MappedRegion};

#[test]
fn kernel_offers_write_protect_and_thread_ids_in_both_modes() {
    for mode in [FaultMode::KernelAndUser, FaultMode::UserOnly] {
        let features = probe_features(mode).expect("userfaultfd(2) works on this host");
        assert_eq!(features & REQUIRED, REQUIRED, "{mode:?}");
    }
}

#[test]
fn features_need_write_protect_and_thread_ids_and_take_poison_when_offered() {
    let err = features_to_enable(feature::THREAD_ID, Memory::Anonymous).expect_err("no WP");
    assert!(matches!(err, GuestMemoryError::Unsupported(_)), "{err:?}");
    assert_eq!(
        features_to_enable(REQUIRED | 1 << 40, Memory::Anonymous).unwrap(),
        REQUIRED
    );
    assert_eq!(
        features_to_enable(REQUIRED | feature::POISON, Memory::Anonymous).unwrap(),
        REQUIRED | feature::POISON
    );
}

#[test]
fn shared_memory_needs_minor_and_shmem_write_protect() {
    let err =
        features_to_enable(REQUIRED | feature::MISSING_SHMEM, Memory::Shmem).expect_err("no MINOR");
    assert!(
        matches!(&err, GuestMemoryError::Unsupported(m) if m.contains("minor faults")),
        "{err:?}"
    );
    assert_eq!(
        features_to_enable(REQUIRED | REQUIRED_SHMEM, Memory::Shmem).unwrap(),
        REQUIRED | REQUIRED_SHMEM,
        "Linux 5.14-5.18: no write protection of shmem, taken without it"
    );
    let wp = feature::WP_HUGETLBFS_SHMEM;
    assert_eq!(
        features_to_enable(REQUIRED | REQUIRED_SHMEM | wp, Memory::Shmem).unwrap(),
        REQUIRED | REQUIRED_SHMEM | wp,
        "enabled where offered"
    );
    assert_eq!(
        features_to_enable(REQUIRED | wp, Memory::Anonymous).unwrap(),
        REQUIRED,
        "not for anonymous memory"
    );
    let offered = probe_features(FaultMode::UserOnly).expect("userfaultfd(2) works on this host");
    assert_eq!(
        offered & REQUIRED_SHMEM,
        REQUIRED_SHMEM,
        "this host (6.18) has them"
    );
    assert!(
        probe_continue_wp().expect("probe runs"),
        "UFFDIO_CONTINUE_MODE_WP is in Linux >= 6.4; this host runs 6.18"
    );
}

#[test]
fn refused_kernel_faults_are_an_error_that_says_how_to_fix_it() {
    let eperm = || io::Error::from_raw_os_error(libc::EPERM);
    let err = open_error(FaultMode::KernelAndUser, eperm());
    assert!(
        matches!(err, GuestMemoryError::KernelFaultsRefused { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    for hint in [
        "CAP_SYS_PTRACE",
        "vm.unprivileged_userfaultfd=1",
        "/dev/userfaultfd",
        "UserOnly",
    ] {
        assert!(text.contains(hint), "{text:?} lacks {hint:?}");
    }
    // Anything else is a failed call, whatever the mode.
    let other = open_error(FaultMode::UserOnly, eperm());
    assert!(matches!(other, GuestMemoryError::Userfaultfd { .. }));
    let other = open_error(
        FaultMode::KernelAndUser,
        io::Error::from_raw_os_error(libc::ENOSYS),
    );
    assert!(matches!(other, GuestMemoryError::Userfaultfd { .. }));
}

/// Runs `f` on a thread whose credentials are those of user `nobody`
/// (`setresuid` by raw syscall changes the calling thread only): no
/// CAP_SYS_PTRACE, no access to the root-only /dev/userfaultfd.
fn as_unprivileged_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        const NOBODY: libc::uid_t = 65534;
        // SAFETY: changes this thread's credentials only; no memory effects.
        let ret = unsafe { libc::syscall(libc::SYS_setresuid, NOBODY, NOBODY, NOBODY) };
        assert_eq!(ret, 0, "setresuid: {}", io::Error::last_os_error());
        f()
    })
    .join()
    .expect("unprivileged thread")
}

#[test]
fn unprivileged_kernel_and_user_mode_fails_and_user_only_works() {
    let sysctl = std::fs::read_to_string("/proc/sys/vm/unprivileged_userfaultfd")
        .expect("vm.unprivileged_userfaultfd");
    let region = MappedRegion::new(2 * PAGE_SIZE, MapOptions::LAZY).expect("mmap");
    let (addr, len) = (region.as_ptr() as usize, region.len_bytes());
    let (kernel_and_user, user_only) = as_unprivileged_thread(move || {
        let open = |mode| {
            RegionUffd::new(addr as *mut u8, len, mode, Memory::Anonymous, 4096, false)
                .map(|u| u.kernel_faults())
        };
        (open(FaultMode::KernelAndUser), open(FaultMode::UserOnly))
    });
    if sysctl.trim() == "0" {
        let err = kernel_and_user.expect_err("kernel-mode faults must be refused, not dropped");
        assert!(
            matches!(err, GuestMemoryError::KernelFaultsRefused { .. }),
            "{err:?}"
        );
    } else {
        // The sysctl lets anyone have kernel-mode faults.
        assert!(kernel_and_user.expect("allowed by the sysctl"));
    }
    assert!(!user_only.expect("user-mode faults are always allowed"));
}
