//! The committed `src/verbs/generated.rs` must equal a fresh bindgen run.
//!
//! Needs the pinned bindgen-cli, libclang and rdma-core's headers (see
//! `scripts/gen-verbs-bindings.sh`). Missing tools FAIL this test unless
//! `SKIP_BINDGEN_CHECK=1`, which only excuses missing tools: a stale file
//! fails whenever the check can run.

use std::io::Write;
use std::path::Path;
use std::process::Command;

/// The script's exit code for "a required tool or header is missing".
const EXIT_MISSING_TOOL: i32 = 2;

#[test]
fn generated_verbs_bindings_are_fresh() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/gen-verbs-bindings.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg("--check")
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => {}
        Some(EXIT_MISSING_TOOL) => {
            if std::env::var("SKIP_BINDGEN_CHECK").is_ok_and(|v| v == "1") {
                // Unbuffered stderr: cargo's capture does not hide it.
                let _ = writeln!(
                    std::io::stderr(),
                    "SKIPPED generated_verbs_bindings_are_fresh (SKIP_BINDGEN_CHECK=1): {}",
                    stderr.trim()
                );
                return;
            }
            panic!(
                "the bindings generator cannot run on this machine:\n{stderr}\n\
                 Install what it names (apt-get install libibverbs-dev libclang-dev clang; \
                 {} --install-tool), or set SKIP_BINDGEN_CHECK=1 to skip this check.",
                script.display()
            );
        }
        code => panic!(
            "{} --check failed (exit {code:?}): src/verbs/generated.rs differs from a fresh \
             generation or the generator failed. Run the script without --check and commit \
             the result.\nstdout:\n{stdout}\nstderr:\n{stderr}",
            script.display()
        ),
    }
}
