//! `include/rdma_transport.h` is what cbindgen makes of `src/` now.
//! `RT_BLESS_HEADER=1` rewrites it (that is what scripts/gen-header.sh does).

use std::path::Path;

#[test]
fn committed_header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    // lib.rs only: cbindgen follows its `mod` declarations.
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen parses src/");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("header is UTF-8");
    let path = dir.join("include/rdma_transport.h");
    if std::env::var_os("RT_BLESS_HEADER").is_some() {
        std::fs::write(&path, &generated).expect("write header");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "{} is stale: run rdma-transport-ffi/scripts/gen-header.sh and commit it",
        path.display()
    );
}
