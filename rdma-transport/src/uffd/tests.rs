//! The wrapper against the running kernel (tests run as root on Linux
//! >= 6.6, where every feature used here exists).

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::thread::JoinHandle;

use super::*;
use crate::page::PAGE_SIZE;
use crate::region::{MapOptions, MappedRegion};

const FILL: u8 = 0x5a;

fn region(pages: usize) -> MappedRegion {
    MappedRegion::new(pages * PAGE_SIZE, MapOptions::LAZY).expect("mmap")
}

fn registered(mode: FaultMode, region: &MappedRegion, register: RegisterMode) -> Userfaultfd {
    let uffd = Userfaultfd::open(mode).expect("userfaultfd");
    uffd.enable(feature::PAGEFAULT_FLAG_WP | feature::THREAD_ID)
        .expect("UFFDIO_API");
    uffd.register(region.as_ptr(), region.len_bytes(), register)
        .expect("UFFDIO_REGISTER");
    uffd
}

/// Blocks until the next event and returns it.
fn next_event(uffd: &Userfaultfd, events: &mut EventBuffer) -> Event {
    loop {
        let mut fd = libc::pollfd {
            fd: uffd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd.
        let ret = unsafe { libc::poll(&mut fd, 1, -1) };
        assert!(ret >= 0, "poll: {}", io::Error::last_os_error());
        if uffd.read_events(events).expect("read") > 0 {
            return events.events().next().expect("one event");
        }
    }
}

/// Serves `faults` missing faults with pages of `FILL`, then returns them.
fn serve(uffd: Arc<Userfaultfd>, faults: usize) -> JoinHandle<Vec<Pagefault>> {
    std::thread::spawn(move || {
        let src = [FILL; PAGE_SIZE];
        let mut events = EventBuffer::new(1);
        let mut seen = Vec::new();
        while seen.len() < faults {
            let Event::Pagefault(fault) = next_event(&uffd, &mut events) else {
                continue;
            };
            let page = (fault.addr & !(PAGE_SIZE - 1)) as *mut u8;
            // SAFETY: `src` is a live page; `page` is a missing page of the
            // test's registered region, which nothing else references.
            unsafe { uffd.copy(src.as_ptr(), page, PAGE_SIZE, false, true) }.expect("copy");
            seen.push(fault);
        }
        seen
    })
}

fn pipe() -> [libc::c_int; 2] {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a live array of two ints.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    fds
}

fn close(fds: [libc::c_int; 2]) {
    for fd in fds {
        // SAFETY: our own pipe ends, closed once.
        unsafe { libc::close(fd) };
    }
}

/// `write(2)` of one page from `page` into a pipe: a kernel-mode read of
/// the page.
fn kernel_reads(page: *mut u8) -> io::Result<usize> {
    let fds = pipe();
    // SAFETY: `page` is one page of a live mapping; the pipe holds 64 KiB.
    let n = unsafe { libc::write(fds[1], page.cast(), PAGE_SIZE) };
    let result = cvt(n).map(|n| n as usize);
    close(fds);
    result
}

#[test]
fn user_only_descriptor_refuses_kernel_mode_faults() {
    let region = region(2);
    let uffd = registered(FaultMode::UserOnly, &region, RegisterMode::MISSING);
    assert!(!uffd.handles_kernel_faults());
    let err = kernel_reads(region.as_ptr()).expect_err("kernel access must fail");
    assert_eq!(err.raw_os_error(), Some(libc::EFAULT));
    // A user-mode access to the same page faults to the handler.
    let uffd = Arc::new(uffd);
    let handler = serve(Arc::clone(&uffd), 1);
    // SAFETY: first byte of the live region; the handler installs it.
    let byte = unsafe { std::ptr::read_volatile(region.as_ptr()) };
    assert_eq!(byte, FILL);
    let faults = handler.join().expect("handler");
    assert_eq!(faults[0].kind, FaultKind::Missing);
    assert!(!faults[0].write);
    // SAFETY: gettid has no side effects.
    let tid = unsafe { libc::gettid() };
    assert_eq!(faults[0].thread_id, tid);
}

#[test]
fn kernel_and_user_descriptor_serves_kernel_mode_faults() {
    let region = region(2);
    let uffd = Arc::new(registered(
        FaultMode::KernelAndUser,
        &region,
        RegisterMode::MISSING,
    ));
    assert!(uffd.handles_kernel_faults());
    let handler = serve(Arc::clone(&uffd), 1);
    let page = region.as_ptr().wrapping_add(PAGE_SIZE);
    assert_eq!(kernel_reads(page).expect("served"), PAGE_SIZE);
    let faults = handler.join().expect("handler");
    assert_eq!(faults[0].addr & !(PAGE_SIZE - 1), page as usize);
}

#[test]
fn dev_node_gives_a_kernel_mode_descriptor() {
    // Linux >= 6.1 has /dev/userfaultfd; root may open it.
    let uffd = Userfaultfd::open_dev_node().expect("/dev/userfaultfd");
    let offered = uffd.enable(feature::THREAD_ID).expect("UFFDIO_API");
    assert_ne!(offered & feature::THREAD_ID, 0);
    // A second handshake is refused.
    assert!(uffd.enable(0).is_err());
}

#[test]
fn write_protect_fault_then_unprotect_lets_the_write_through() {
    let region = region(1);
    let uffd = Arc::new(registered(
        FaultMode::KernelAndUser,
        &region,
        RegisterMode::MISSING_AND_WP,
    ));
    let src = [1u8; PAGE_SIZE];
    // SAFETY: `src` is a live page; the region's one page is missing and
    // referenced by nothing.
    let copied = unsafe { uffd.copy(src.as_ptr(), region.as_ptr(), PAGE_SIZE, true, true) };
    assert_eq!(copied.expect("copy"), PAGE_SIZE);
    // A second copy finds the page present.
    // SAFETY: as above; the kernel refuses to overwrite a present page.
    let again = unsafe { uffd.copy(src.as_ptr(), region.as_ptr(), PAGE_SIZE, true, true) };
    let err = again.expect_err("page present");
    assert_eq!(
        (err.copied_bytes, err.source.raw_os_error()),
        (0, Some(libc::EEXIST))
    );

    let addr = region.as_ptr() as usize;
    let writer = std::thread::spawn(move || {
        // SAFETY: the region's page, present and write-protected: the
        // write waits for the unprotect below.
        unsafe { std::ptr::write_volatile(addr as *mut u8, 9) };
        // SAFETY: gettid has no side effects.
        unsafe { libc::gettid() }
    });
    let mut events = EventBuffer::new(4);
    let Event::Pagefault(fault) = next_event(&uffd, &mut events) else {
        panic!("expected a page fault");
    };
    assert_eq!((fault.kind, fault.write), (FaultKind::WriteProtect, true));
    uffd.unprotect(region.as_ptr(), PAGE_SIZE, true)
        .expect("unprotect");
    let tid = writer.join().expect("writer");
    assert_eq!(fault.thread_id, tid);
    // SAFETY: the page is present.
    assert_eq!(unsafe { std::ptr::read_volatile(region.as_ptr()) }, 9);
    uffd.write_protect(region.as_ptr(), PAGE_SIZE)
        .expect("write-protect again");
}

#[test]
fn poisoned_page_fails_kernel_mode_access() {
    let region = region(1);
    let uffd = Userfaultfd::open(FaultMode::KernelAndUser).expect("userfaultfd");
    let offered = uffd.enable(feature::POISON).expect("poison (Linux >= 6.6)");
    assert_ne!(offered & feature::POISON, 0);
    uffd.register(region.as_ptr(), region.len_bytes(), RegisterMode::MISSING)
        .expect("register");
    // SAFETY: the region's missing page, referenced by nothing.
    unsafe { uffd.poison(region.as_ptr(), PAGE_SIZE) }.expect("poison");
    let err = kernel_reads(region.as_ptr()).expect_err("poisoned");
    assert_eq!(err.raw_os_error(), Some(libc::EFAULT));
}

#[test]
fn nothing_pending_reads_zero_events() {
    let uffd = Userfaultfd::open(FaultMode::UserOnly).expect("userfaultfd");
    uffd.enable(0).expect("UFFDIO_API");
    let mut events = EventBuffer::new(2);
    assert_eq!(uffd.read_events(&mut events).expect("read"), 0);
    assert_eq!(events.events().len(), 0);
}

#[test]
fn handed_over_descriptor_shows_its_enabled_features() {
    let uffd = Userfaultfd::open(FaultMode::UserOnly).expect("userfaultfd");
    assert_eq!(
        uffd.enabled_features().expect("fdinfo"),
        None,
        "no handshake yet"
    );
    uffd.enable(feature::PAGEFAULT_FLAG_WP | feature::THREAD_ID)
        .expect("UFFDIO_API");
    let fd = uffd.fd.try_clone().expect("dup");
    let taken = Userfaultfd::from_handed_over(fd, FaultMode::UserOnly).expect("a userfaultfd");
    assert_eq!(
        taken.enabled_features().expect("fdinfo"),
        Some(feature::PAGEFAULT_FLAG_WP | feature::THREAD_ID)
    );
    assert!(!taken.handles_kernel_faults());

    let not_uffd = OwnedFd::from(std::fs::File::open("/proc/self/stat").expect("a file"));
    let err = Userfaultfd::from_handed_over(not_uffd, FaultMode::UserOnly).expect_err("a file");
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
}

#[test]
fn fdinfo_features_parse() {
    let info =
        "pos:\t0\nflags:\t02004000\npending:\t0\ntotal:\t0\nAPI:\taa:80001521:80000000000001ff\n";
    assert_eq!(parse_fdinfo_features(info).unwrap(), Some(0x1521));
    let fresh = "API:\taa:0:80000000000001ff\n";
    assert_eq!(parse_fdinfo_features(fresh).unwrap(), None);
    assert!(parse_fdinfo_features("pos:\t0\n").is_err());
}
