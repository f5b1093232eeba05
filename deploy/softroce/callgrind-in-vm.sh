#!/usr/bin/env bash
# Instruction counts of one bench run over SoftRoCE. The VM has no hardware
# counters and emulates every instruction (TCG), so what a page costs in
# instructions is what it costs in time there. This runs the release bench
# under valgrind's callgrind INSIDE the VM (valgrind is copied in from the
# host), one profile per thread, and brings the profiles back to the host
# (as base64 on the VM's output) into DIR.
#
#   deploy/softroce/callgrind-in-vm.sh [--out DIR] -- BENCH_ARGS...
#
# e.g. -- --transport rdma --memory 16MiB --register-buffers --op read
#         --depth 16 --api async --verbs-baseline --verbs-block 2000 --ops 4000
#
# Prints the bench's result lines, then per thread its instructions and
# which of the bench's loops it ran (ours: `async_loop` or the blocking
# `workload::thread_loop`; the bare verbs loop: `baseline::verbs`).
# Divide by the ops for a per-page figure (one-time set-up is in it: use
# a few thousand ops). Read a profile with `callgrind_annotate
# DIR/cg.PID-NN` on the host:
# it names the host's bench binary and sources. Needs valgrind on the host
# (Debian's package). Builds the bench (release) first.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# shellcheck source=lib.sh
. "$here/lib.sh"

out=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --) shift; break ;;
        *) softroce_die "unknown option $1 (usage: callgrind-in-vm.sh [--out DIR] -- BENCH_ARGS...)" ;;
    esac
done
[[ $# -gt 0 ]] || softroce_die "no bench arguments (after --)"
for f in /usr/bin/valgrind /usr/bin/valgrind.bin /usr/libexec/valgrind /usr/bin/base64 /usr/bin/tar /usr/bin/gzip; do
    [[ -e "$f" ]] || softroce_die "$f missing on the host (apt-get install valgrind)"
done
out="${out:-$(mktemp -d "${TMPDIR:-/tmp}/softroce-callgrind.XXXXXX")}"
mkdir -p "$out"
cd "$repo"
softroce_build_bench "$repo"

work="$(mktemp -d "${TMPDIR:-/tmp}/softroce-cg.XXXXXX")"
trap 'rm -rf "$work"' EXIT
runner="$work/vm-callgrind.sh"
args=""
for a in "$@"; do
    args+=" $(softroce_shell_quote "$a")"
done
{
    echo '#!/bin/sh'
    echo 'export VALGRIND_LIB=/usr/libexec/valgrind'
    echo 'mkdir -p /tmp/cg && cd /tmp || exit 1'
    printf '/usr/bin/valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file=/tmp/cg/cg.%%p %s%s >/tmp/bench.out 2>&1\n' \
        "$(softroce_shell_quote "$bench_exe")" "$args"
    # shellcheck disable=SC2016 # expanded in the VM
    echo 'rc=$?'
    echo 'grep -v "^==" /tmp/bench.out'
    echo 'echo "@@CALLGRIND-BEGIN"'
    echo 'tar czf - -C /tmp/cg . | base64'
    echo 'echo "@@CALLGRIND-END"'
    # shellcheck disable=SC2016 # expanded in the VM
    echo 'exit $rc'
} >"$runner"
chmod +x "$runner"

log="$work/vm.out"
set +e
"$here/run-in-vm.sh" --timeout 1800 --copy "$bench_exe" --copy /usr/bin/valgrind \
    --copy /usr/bin/valgrind.bin --copy /usr/libexec/valgrind --copy /usr/bin/base64 \
    --copy /usr/bin/tar --copy /usr/bin/gzip -- "$runner" >"$log" 2>&1
rc=$?
set -e
sed '/^@@CALLGRIND-BEGIN$/,/^@@CALLGRIND-END$/d' "$log"
sed -n '/^@@CALLGRIND-BEGIN$/,/^@@CALLGRIND-END$/p' "$log" | sed '1d;$d' | base64 -d | tar xzf - -C "$out" \
    || softroce_die "no profiles came back (VM exit $rc)"
echo "profiles in $out:"
for f in "$out"/cg.*; do
    total="$(awk '/^totals:/ {print $2}' "$f")"
    [[ -n "$total" && "$total" -gt 0 ]] || continue
    ran=""
    grep -q 'async_loop::thread_loop' "$f" && ran+=" ours(async)"
    grep -q 'workload::thread_loop' "$f" && ran+=" ours(blocking)"
    grep -q 'baseline::verbs::' "$f" && ran+=" bare-verbs"
    printf '  %s: %s instructions%s\n' "$(basename "$f")" "$total" "$ran"
done
exit "$rc"
