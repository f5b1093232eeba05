//! Builds tests/c/queue.c with the system C compiler against this crate's
//! shared library and runs it against a real local cluster: the
//! asynchronous API (`rt_queue_*`) in its three reaping modes.

mod common;

use common::{build_and_run, Cluster};

/// Runs queue.c against a fresh cluster of two nodes of 256 pages (room
/// for a 300-page batch over distinct pages), with `extra` arguments.
fn run_queue_c(extra: &[&str]) {
    let cluster = Cluster::start(2, 1 << 20);
    let size = cluster.size_bytes().to_string();
    let mut args = vec![
        cluster.coord.url(),
        size,
        cluster.key_file.to_str().unwrap().to_owned(),
    ];
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let run = build_and_run("queue.c", &["-pthread"], &args);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains("c queue: ok"),
        "queue test failed ({:?}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    cluster.shutdown();
}

#[test]
fn c_program_drives_completion_queues() {
    run_queue_c(&[]);
}

/// Submissions of 300 pages whose every 64-page window holds pages of both
/// nodes, 20 times over. (The answers of a round's first node used to bring
/// its count to zero before its second node's requests were armed: the
/// round was settled early and they failed with Timeout within ms.)
#[test]
fn c_program_moves_batches_whose_windows_span_both_nodes() {
    run_queue_c(&["interleaved"]);
}
