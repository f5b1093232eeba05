#!/usr/bin/env bash
# Boot the SoftRoCE VM once and run perftest's latency tests in it.
#
#   deploy/softroce/perftest.sh [run-in-vm.sh OPTIONS] [-- TEST...]
#
# Prints "PERFTEST <test> size_bytes=.. t_typical_us=.. t99_us=.." lines
# (see vm-perftest.sh). PERFTEST_SIZE, PERFTEST_ITERS and PERFTEST_VERBOSE
# are passed into the VM. Exit status: vm-perftest.sh's, or run-in-vm.sh's
# 124/125 on timeout or boot failure.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

opts=()
while (($#)); do
    if [[ "$1" == -- ]]; then
        shift
        break
    fi
    opts+=("$1")
    shift
done

for var in PERFTEST_SIZE PERFTEST_ITERS PERFTEST_VERBOSE; do
    if [[ -n "${!var:-}" ]]; then
        opts+=(--env "$var=${!var}")
    fi
done

exec "$here/run-in-vm.sh" --timeout 300 "${opts[@]}" -- "$here/vm-perftest.sh" "$@"
