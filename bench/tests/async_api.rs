//! `bench --api async` against the bench's own local cluster (coordinator
//! and two page-servers on loopback): 8 one-page submissions kept in
//! flight, random writes then random reads, with the pages handed to the
//! queue (`submit_read`/`submit_write`) and, with `--register-buffers`,
//! kept in the thread's registered memory (`submit_read_raw`/
//! `submit_write_raw`). Every read is checked in the slot it landed in and
//! every write is read back: a page checked in the wrong slot, or landing
//! in the wrong one, fails `verified`.

use std::process::Command;

fn run(extra: &[&str]) -> serde_json::Value {
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("run.json");
    let out = Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(["--api", "async", "--depth", "8", "--ops", "3000"])
        .args(["--memory", "4MiB", "--json"])
        .arg(&json)
        .args(extra)
        .output()
        .expect("bench runs");
    assert!(
        out.status.success(),
        "bench {extra:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&json).expect("bench wrote its JSON");
    serde_json::from_str(&text).expect("the JSON parses")
}

fn assert_every_page_checked(records: &serde_json::Value, what: &str) {
    let records = records.as_array().expect("a list of runs");
    let ops: Vec<&str> = records.iter().filter_map(|r| r["op"].as_str()).collect();
    assert_eq!(ops, ["write", "read"], "{what}: runs");
    for r in records {
        assert_eq!(r["api"], "async", "{what}: {r}");
        assert_eq!(r["ops"], 3000, "{what}: {r}");
        assert_eq!(r["depth"], 8, "{what}: {r}");
        assert_eq!(r["errors"], 0, "{what}: {r}");
        assert_eq!(r["verified"], true, "{what}: {r}");
    }
}

#[test]
fn pages_handed_to_the_queue_all_come_back_checked() {
    assert_every_page_checked(&run(&[]), "owned buffers");
}

#[test]
fn pages_in_registered_memory_all_come_back_checked() {
    assert_every_page_checked(&run(&["--register-buffers"]), "registered buffers");
}
