//! Builds tests/c/shared.c with the system C compiler against this crate's
//! shared library and runs it against a real local cluster: guest RAM in
//! the C program's memfd (`shared_fd`), mapped by the region or handed
//! over with the program's own userfaultfd and mapping.

mod common;

use common::{build_and_run, Cluster};

/// Runs shared.c in `mode` against a fresh cluster of two nodes of 64
/// pages each.
fn run_shared_c(mode: &str) {
    let cluster = Cluster::start(2, 256 << 10);
    let run = build_and_run(
        "shared.c",
        &[],
        &[
            &cluster.coord.url(),
            &cluster.size_bytes().to_string(),
            cluster.key_file.to_str().unwrap(),
            mode,
        ],
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    // Its counters, for `--nocapture`.
    println!("{stdout}");
    assert!(
        run.status.success() && stdout.contains("c shared: ok"),
        "shared.c {mode} failed ({:?}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    cluster.shutdown();
}

#[test]
fn c_program_puts_guest_memory_in_its_memfd() {
    run_shared_c("memfd");
}

#[test]
fn c_program_hands_over_its_userfaultfd_and_mapping() {
    run_shared_c("handover");
}
