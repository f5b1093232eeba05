//! What the C tests share: a real local cluster (coordinator and
//! page-servers holding a cluster key), and building and running a C
//! program of tests/c against this crate's shared library.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use coordinator::{CoordinatorConfig, RunningCoordinator};
use page_server::{RunningServer, ServerConfig};

/// A coordinator and `nodes` page-servers of `node_bytes` each, node i
/// serving `[i * node_bytes, (i + 1) * node_bytes)`, all holding one
/// cluster key (hex, in `key_file`).
pub struct Cluster {
    pub coord: RunningCoordinator,
    pub servers: Vec<RunningServer>,
    pub key_file: PathBuf,
    pub node_bytes: usize,
    _dir: tempfile::TempDir,
}

impl Cluster {
    pub fn start(nodes: usize, node_bytes: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let coord = coordinator::spawn(CoordinatorConfig::new(
            SocketAddr::from(([127, 0, 0, 1], 0)),
            dir.path().join("c.db"),
        ))
        .unwrap();
        let key = rdma_transport::auth::ClusterKey::generate().unwrap();
        let key_file = dir.path().join("cluster.key");
        std::fs::write(&key_file, key.to_hex()).unwrap();
        std::fs::set_permissions(
            &key_file,
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        )
        .unwrap();
        let servers: Vec<_> = (0..nodes)
            .map(|i| {
                let mut cfg = ServerConfig::new(format!("n{i}"), node_bytes);
                cfg.cluster_key = Some(key.clone());
                cfg.gpa_base = (i * node_bytes) as u64;
                cfg.coordinator_url = Some(coord.url());
                page_server::spawn(cfg).unwrap()
            })
            .collect();
        for s in &servers {
            s.wait_registered(Duration::from_secs(10)).unwrap();
        }
        Self {
            coord,
            servers,
            key_file,
            node_bytes,
            _dir: dir,
        }
    }

    /// Bytes of guest-physical space the cluster serves.
    pub fn size_bytes(&self) -> usize {
        self.servers.len() * self.node_bytes
    }

    pub fn shutdown(self) {
        for s in self.servers {
            s.shutdown();
        }
    }
}

/// The directory holding librdma_transport_ffi.so: cargo builds the
/// library (all its crate types) next to the test's executable.
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

/// Compiles tests/c/`source` (C11, warnings are errors, with `extra`
/// flags) against the shared library and runs it with `args`.
pub fn build_and_run(source: &str, extra: &[&str], args: &[&str]) -> Output {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let lib_dir = library_dir();
    let out = tempfile::tempdir().unwrap();
    let exe = out.path().join(source.trim_end_matches(".c"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let build = Command::new(&cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-O1"])
        .args(extra)
        .arg("-I")
        .arg(crate_dir.join("include"))
        .arg(crate_dir.join("tests/c").join(source))
        .arg("-L")
        .arg(&lib_dir)
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .args(["-lrdma_transport_ffi", "-o"])
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C compiler {cc:?}: {e}"));
    assert!(
        build.status.success(),
        "compiling {source} failed:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    // The library just built, not a stale copy elsewhere on the search path:
    // `cargo test` puts target/debug (where `cargo build` leaves one) in
    // LD_LIBRARY_PATH, which wins over the executable's RUNPATH.
    Command::new(&exe)
        .env("LD_LIBRARY_PATH", &lib_dir)
        .args(args)
        .output()
        .unwrap()
}
