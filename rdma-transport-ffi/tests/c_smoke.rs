//! Builds tests/c/smoke.c with the system C compiler against this crate's
//! shared library and runs it against a real local cluster (coordinator
//! and two page-servers started here).

mod common;

use common::{build_and_run, Cluster};

#[test]
fn c_program_drives_manager_and_guest_memory() {
    let cluster = Cluster::start(2, 256 << 10);
    let run = build_and_run(
        "smoke.c",
        &[],
        &[
            &cluster.coord.url(),
            &cluster.size_bytes().to_string(),
            cluster.key_file.to_str().unwrap(),
        ],
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains("c smoke: ok"),
        "smoke failed ({:?}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    cluster.shutdown();
}
