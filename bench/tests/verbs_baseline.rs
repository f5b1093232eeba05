//! `--verbs-baseline` refuses what it cannot compare, before it starts a
//! cluster. (The comparison itself needs an RDMA device: the SoftRoCE
//! suite, `deploy/softroce/run-rdma-tests.sh`, runs it and checks every
//! page of both loops.)

use std::process::Command;

fn refused(extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(["--verbs-baseline", "--ops", "10", "--memory", "1MiB"])
        .args(extra)
        .output()
        .expect("bench runs");
    assert!(!out.status.success(), "bench {extra:?} was not refused");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn refuses_what_it_cannot_compare() {
    for extra in [
        &["--transport", "tcp"][..],
        &["--transport", "rdma", "--depth", "2000"],
        &["--transport", "rdma", "--threads", "2"],
        &["--transport", "rdma", "--op", "fault"],
        &["--transport", "rdma", "--baseline"],
        &["--transport", "rdma", "--verbs-block", "0"],
        &["--transport", "rdma", "--pattern", "seq"],
        &["--transport", "rdma", "--pattern", "all"],
    ] {
        let err = refused(extra);
        assert!(
            err.contains("--verbs-baseline needs --transport rdma"),
            "{extra:?}: {err}"
        );
    }
}
