#!/usr/bin/env bash
# Self-check of the SoftRoCE harness: set up (or reuse) the cache, boot the
# VM once, and in it check that rxe0 exists and is active (sysfs,
# ibv_devinfo, dlopen("libibverbs.so.1") like the Rust transport does) and
# run perftest; then check that a kernel panicking at boot is booted once
# more before the run is reported as a boot failure. Exits non-zero if no
# rxe device was found or a check failed.
#
#   deploy/softroce/selftest.sh [run-in-vm.sh OPTIONS]
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
. "$here/lib.sh"

now_s() { date +%s.%N; }
since_s() { awk -v s="$1" -v e="$(now_s)" 'BEGIN { printf "%.1f", e - s }'; }

t0="$(now_s)"
"$here/setup.sh"
setup_s="$(since_s "$t0")"

work="$(mktemp -d "${TMPDIR:-/tmp}/softroce-selftest.XXXXXX")"
trap 'rm -rf "$work"' EXIT

args=(--copy "$here/vm-perftest.sh")
check_args=()
if command -v gcc >/dev/null; then
    gcc -O2 -Wall -Wextra -Werror -o "$work/verbs-dlopen-check" "$here/verbs-dlopen-check.c"
    args+=(--copy "$work/verbs-dlopen-check")
    check_args=("$work/verbs-dlopen-check")
else
    softroce_log "no gcc: skipping the dlopen(libibverbs.so.1) check"
fi

t1="$(now_s)"
rc=0
SOFTROCE_SKIP_SETUP=1 "$here/run-in-vm.sh" --timeout 300 "${args[@]}" "$@" -- \
    "$here/vm-selftest.sh" "$here/vm-perftest.sh" "${check_args[@]}" | tee "$work/out.txt" || rc=$?
vm_s="$(since_s "$t1")"

# A kernel that panics before the program starts is booted twice, then
# reported as a boot failure (125): rdinit= and init= naming no file make
# the kernel panic at boot, deterministically.
panic_rc=0
SOFTROCE_SKIP_SETUP=1 SOFTROCE_KERNEL_ARGS="rdinit=/nonexistent init=/nonexistent" \
    "$here/run-in-vm.sh" --timeout 120 -- true >/dev/null 2>"$work/panic.err" || panic_rc=$?
boots="$(grep -c '^softroce: booting VM' "$work/panic.err" || true)"
if ((panic_rc == 125 && boots == 2)) && grep -q 'panicked again' "$work/panic.err"; then
    echo "SELFTEST boot-panic-retry ok" | tee -a "$work/out.txt"
else
    echo "SELFTEST boot-panic-retry (exit $panic_rc, $boots boots) FAILED" | tee -a "$work/out.txt"
fi
kept="$(sed -n 's/^softroce: run directory kept: //p' "$work/panic.err")"
[[ -z "$kept" ]] || rm -rf "$kept"

# Each required line missing counts as one more failed check.
failed="$(grep -c '^SELFTEST .* FAILED$' "$work/out.txt" || true)"
require() {
    grep -q "$1" "$work/out.txt" && return 0
    softroce_log "selftest: $2"
    failed=$((failed + 1))
}
require '^SELFTEST ibv_devinfo ok' "no active rxe device"
require '^PERFTEST ib_read_lat .*t_typical_us=' "no ib_read_lat figures"
require '^PERFTEST ib_write_lat .*t_typical_us=' "no ib_write_lat figures"
passed="$(grep -c '^SELFTEST .* ok$' "$work/out.txt" || true)"
echo "$passed passed, $failed failed"
if ((rc != 0 || failed != 0)); then
    softroce_log "selftest FAILED (VM exit code $rc)"
    exit $((rc != 0 ? rc : 1))
fi
softroce_log "selftest passed: setup ${setup_s}s, VM run ${vm_s}s"
