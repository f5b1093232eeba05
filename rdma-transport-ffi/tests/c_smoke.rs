//! Builds tests/c/smoke.c with the system C compiler against this crate's
//! shared library and runs it against a real local cluster (coordinator
//! and two page-servers started here).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use coordinator::CoordinatorConfig;
use page_server::ServerConfig;

const NODE_BYTES: usize = 256 << 10;

/// The directory holding librdma_transport_ffi.so: cargo builds the
/// library (all its crate types) next to this test's executable.
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps directory").to_path_buf();
    for dir in [
        deps.clone(),
        deps.parent().map(Path::to_path_buf).unwrap_or_default(),
    ] {
        if dir.join("librdma_transport_ffi.so").exists() {
            return dir;
        }
    }
    panic!(
        "librdma_transport_ffi.so not found next to {}",
        exe.display()
    );
}

#[test]
fn c_program_drives_manager_and_guest_memory() {
    let db = tempfile::tempdir().unwrap();
    let coord = coordinator::spawn(CoordinatorConfig::new(
        SocketAddr::from(([127, 0, 0, 1], 0)),
        db.path().join("c.db"),
    ))
    .unwrap();
    let key = rdma_transport::auth::ClusterKey::generate().unwrap();
    let key_file = db.path().join("cluster.key");
    std::fs::write(&key_file, key.to_hex()).unwrap();
    std::fs::set_permissions(
        &key_file,
        std::os::unix::fs::PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let servers: Vec<_> = (0..2)
        .map(|i| {
            let mut cfg = ServerConfig::new(format!("n{i}"), NODE_BYTES);
            cfg.cluster_key = Some(key.clone());
            cfg.gpa_base = (i * NODE_BYTES) as u64;
            cfg.coordinator_url = Some(coord.url());
            page_server::spawn(cfg).unwrap()
        })
        .collect();
    for s in &servers {
        s.wait_registered(Duration::from_secs(10)).unwrap();
    }

    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib_dir = library_dir();
    let out = tempfile::tempdir().unwrap();
    let exe = out.path().join("smoke");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let build = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .arg("-I")
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("tests/c/smoke.c"))
        .arg("-L")
        .arg(&lib_dir)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .args(["-lrdma_transport_ffi", "-o"])
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc:?}: {e}"));
    assert!(
        build.status.success(),
        "compiling smoke.c failed:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    // The library just built, not a stale copy elsewhere on the search path:
    // `cargo test` puts target/debug (where `cargo build` leaves one) in
    // LD_LIBRARY_PATH, which wins over the executable's RUNPATH.
    let run = Command::new(&exe)
        .env("LD_LIBRARY_PATH", &lib_dir)
        .arg(coord.url())
        .arg((2 * NODE_BYTES).to_string())
        .arg(&key_file)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains("c smoke: ok"),
        "smoke failed ({:?}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    for s in servers {
        s.shutdown();
    }
}
