//! `--op fault --baseline --fault-rounds N` against the bench's own local
//! cluster: N rounds of our fault and its baselines, each page checked by
//! the run that moved it, and a ratio per round.

use std::process::Command;

fn bench(extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(["--op", "fault", "--ops", "400", "--memory", "2MiB"])
        .args(["--prefetch", "off", "--pattern", "random"])
        .args(extra)
        .output()
        .expect("bench runs")
}

#[test]
fn every_round_has_its_ratios() {
    let out = bench(&["--baseline", "--fault-rounds", "2"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed ({}): {}{stdout}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    for prefix in [
        "Random fault, 2 rounds of 400: ours / (local uffd fault + bare TCP) per round ",
        "Random fault, the same rounds: ours / bare remote fault per round ",
    ] {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no line {prefix:?} in:\n{stdout}"));
        let rest = &line[prefix.len()..];
        let (ratios, median) = rest.split_once("; median x").expect("a median");
        let ratios: Vec<f64> = ratios
            .split(' ')
            .map(|r| r.parse().expect("a ratio"))
            .collect();
        assert_eq!(ratios.len(), 2, "{line}");
        assert!(ratios.iter().all(|&r| r > 0.0), "{line}");
        assert!(median.parse::<f64>().expect("a median") > 0.0, "{line}");
    }
}

#[test]
fn rounds_need_the_fault_op_and_its_baseline() {
    let out = bench(&["--fault-rounds", "2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--fault-rounds needs --op fault and --baseline"),
        "{err}"
    );
}
