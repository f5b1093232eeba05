//! Builds tests/c/queue.c with the system C compiler against this crate's
//! shared library and runs it against a real local cluster: the
//! asynchronous API (`rt_queue_*`) in its three reaping modes.

mod common;

use common::{build_and_run, Cluster};

#[test]
fn c_program_drives_completion_queues() {
    // 256 pages per node: room for a 300-page batch over distinct pages.
    let cluster = Cluster::start(2, 1 << 20);
    let run = build_and_run(
        "queue.c",
        &["-pthread"],
        &[
            &cluster.coord.url(),
            &cluster.size_bytes().to_string(),
            cluster.key_file.to_str().unwrap(),
        ],
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains("c queue: ok"),
        "queue test failed ({:?}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    cluster.shutdown();
}
