//! Builds tests/c/coherent.c with the system C compiler against this
//! crate's shared library and runs it against a real local cluster: two
//! coherent regions of one C program (two nodes) share guest RAM homed at
//! two page-servers.

mod common;

use common::{build_and_run, Cluster};

#[test]
fn c_program_shares_coherent_guest_memory_between_two_nodes() {
    let cluster = Cluster::start(2, 256 << 10);
    let run = build_and_run(
        "coherent.c",
        &[],
        &[
            &cluster.coord.url(),
            &cluster.size_bytes().to_string(),
            cluster.key_file.to_str().unwrap(),
        ],
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    println!("{stdout}");
    assert!(
        run.status.success() && stdout.contains("c coherent: ok"),
        "coherent.c failed ({:?}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    cluster.shutdown();
}
