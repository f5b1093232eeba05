#!/usr/bin/env bash
# Regenerates include/rdma_transport.h from src/ with cbindgen (the crate's
# dev-dependency: nothing to install). The `header` test fails while the
# committed header differs from what this writes.
set -euo pipefail
cd "$(dirname "$0")/.."
RT_BLESS_HEADER=1 cargo test -p rdma-transport-ffi --test header --quiet
echo "wrote $(pwd)/include/rdma_transport.h"
