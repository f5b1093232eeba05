#!/usr/bin/env bash
# One-page RDMA WRITE against perftest's `ib_write_bw -s 4096 -t 1` (a write
# with its completion: per-operation time = 1 / message rate), in ONE
# SoftRoCE VM boot, each of our runs closely bracketed by perftest's. Per
# round:
#   ib_write_bw, the bench's WRITE with registered buffers (`zc`: ours as
#   run-zero-copy-bench.sh runs it), ib_write_bw, the bench's WRITE with
#   `--verbs-baseline` (`vb`: ours and a bare verbs loop alternated in
#   blocks of 100 in one process, both pinned to one CPU);
# and ib_write_bw once more after the last round. Every run is short (--ops
# writes), so the VM's speed, which changes every few seconds, moves less
# within a bracket; many rounds then give a median that one long run cannot.
#
#   deploy/softroce/run-write-rounds.sh [--rounds N] [--ops N] [run-in-vm.sh OPTIONS]
#
# Prints per round, then the median of the per-round ratios and the ratio
# of the sums (all of ours' mean write times over all of perftest's):
#   ours (zc) / ib_write_bw   (the mean of the perftest runs before and after)
#   bare loop / ib_write_bw   (from vb)
#   ours / bare loop          (vb: the median of its per-pair mean ratios)
# Every bench run checks every page it writes; a run that is not verified,
# or a perftest run that failed, fails the script. Builds the bench
# (release) first.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# shellcheck source=lib.sh
. "$here/lib.sh"
# shellcheck source=results.sh
. "$here/results.sh"

softroce_round_args 12 2000 "$@"
cd "$repo"
softroce_build_bench "$repo"

work="$(mktemp -d "${TMPDIR:-/tmp}/softroce-write.XXXXXX")"
trap 'rm -rf "$work"' EXIT
runner="$work/vm-write-rounds.sh"
b="$(softroce_shell_quote "$bench_exe")"
perftest="$(softroce_shell_quote "$here/vm-perftest.sh")"
port=18800
perf() { # the runner's line for one ib_write_bw run, on a port of its own
    port=$((port + 1))
    printf 'PERFTEST_ITERS=%s PERFTEST_TX_DEPTH=1 PERFTEST_PORT=%s %s ib_write_bw || failed=1\n' "$ops" "$port" "$perftest"
}
{
    echo '#!/bin/sh'
    echo 'failed=0'
    # shellcheck disable=SC2016 # expanded in the VM
    echo 'echo "VMCLOCK $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource) kernel $SOFTROCE_KERNEL_VERSION"'
    for ((r = 1; r <= rounds; r++)); do
        for run in "zc$r|--register-buffers" "vb$r|--register-buffers --verbs-baseline --verbs-block 100"; do
            perf
            name="${run%%|*}"
            printf 'if %s --transport rdma --memory 16MiB --op write --ops %s --json /tmp/%s.json %s >/tmp/%s.out 2>/tmp/%s.err; then\n' \
                "$b" "$ops" "$name" "${run#*|}" "$name" "$name"
            printf '    grep -a "^overhead vs bare verbs" /tmp/%s.out | sed "s/^/VERBS %s /"\n' "$name" "$name"
            # shellcheck disable=SC2016 # expanded by the generated script
            printf '    echo "BENCHJSON %s $(tr -d %s </tmp/%s.json)"\n' "$name" "'\\n '" "$name"
            printf 'else tail -n 5 /tmp/%s.err; echo "RDMABENCH FAILED %s"; failed=1; fi\n' "$name" "$name"
        done
    done
    perf
    # shellcheck disable=SC2016 # expanded by the generated script
    echo 'exit "$failed"'
} >"$runner"
chmod +x "$runner"

rc=0
# shellcheck disable=SC2086 # SOFTROCE_VM_OPTS is a list of words on purpose
"$here/run-in-vm.sh" --timeout "$((300 + 90 * rounds))" --copy "$here/vm-perftest.sh" --copy "$bench_exe" \
    ${SOFTROCE_VM_OPTS:-} "${vm_opts[@]}" -- "$runner" | tee "$work/out.txt" || rc=$?
out="$work/out.txt"

failed=0
grep -q '^RDMABENCH FAILED' "$out" && failed=1
# perftest's per-write time of its n-th run (n = 1 .. 2 * rounds + 1;
# empty for a run that failed, whose line says error=).
mapfile -t perf_us < <(grep '^PERFBW ib_write_bw ' "$out" |
    while read -r line; do
        awk -v m="$(field msg_per_s "$line")" 'BEGIN { if (m > 0) printf "%.1f", 1e6 / m; print "" }'
    done)
if ((${#perf_us[@]} != 2 * rounds + 1)); then
    echo "expected $((2 * rounds + 1)) ib_write_bw runs, got ${#perf_us[@]}"
    failed=1
fi
around() { # around N: the mean of perftest's runs N and N+1 (1-based), or the one that has a result
    awk -v a="${perf_us[$(($1 - 1))]:-0}" -v b="${perf_us[$1]:-0}" \
        'BEGIN { if (a > 0 && b > 0) printf "%.1f", (a + b) / 2; else if (a + b > 0) printf "%.1f", a + b }'
}
echo
echo "==== one-page WRITE vs ib_write_bw -t 1 (same boot, bracketed) ===="
grep -a '^VMCLOCK ' "$out" | sed 's/^VMCLOCK /VM clocksource: /' || true
printf '%-6s | %-26s | %-26s | %s\n' round "ours mean us / perftest" "bare mean us / perftest" "ours/bare per pair"
ours_x="" bare_x="" pair_x="" ours_sum=0 bare_sum=0 perf_sum_ours=0 perf_sum_bare=0
for ((r = 1; r <= rounds; r++)); do
    zc="$(record "zc$r" write)" ours_vb="$(record "vb$r" write)" bare="$(bare_record "vb$r" write)"
    for rec in "$zc" "$ours_vb" "$bare"; do
        if [[ -z "$rec" || "$(json verified "$rec")" != true ]]; then
            echo "round $r: a bench record is missing or not verified"
            failed=1
        fi
    done
    p_zc="$(around $((2 * r - 1)))" p_vb="$(around $((2 * r)))"
    m_zc="$(fmt1 "$(json mean "$zc")")" m_bare="$(fmt1 "$(json mean "$bare")")"
    pair="$(sed -n "s/^VERBS vb$r overhead vs bare verbs (Write .*mean median x\([0-9.]*\).*/\1/p" "$out")"
    ours_x+=" $(ratio "$m_zc" "$p_zc")" bare_x+=" $(ratio "$m_bare" "$p_vb")" pair_x+=" ${pair:-n/a}"
    # The sums take only the runs that perftest brackets.
    if [[ -n "$p_zc" ]]; then
        ours_sum="$(awk -v s="$ours_sum" -v v="$m_zc" 'BEGIN { print s + v }')"
        perf_sum_ours="$(awk -v s="$perf_sum_ours" -v v="$p_zc" 'BEGIN { print s + v }')"
    fi
    if [[ -n "$p_vb" ]]; then
        bare_sum="$(awk -v s="$bare_sum" -v v="$m_bare" 'BEGIN { print s + v }')"
        perf_sum_bare="$(awk -v s="$perf_sum_bare" -v v="$p_vb" 'BEGIN { print s + v }')"
    fi
    printf '%-6s | %-26s | %-26s | %s\n' "$r" "$m_zc / ${p_zc:-?} = $(ratio "$m_zc" "$p_zc")" \
        "$m_bare / ${p_vb:-?} = $(ratio "$m_bare" "$p_vb")" "x${pair:-?}"
done
printf 'ours/ib_write_bw   : median %s, ratio of sums %s\n' "$(median <<<"$ours_x")" "$(ratio "$ours_sum" "$perf_sum_ours")"
printf 'bare/ib_write_bw   : median %s, ratio of sums %s\n' "$(median <<<"$bare_x")" "$(ratio "$bare_sum" "$perf_sum_bare")"
printf 'ours/bare (in vb)  : median of the per-round per-pair medians %s\n' "$(median <<<"$pair_x")"
((rc == 0)) || exit "$rc"
exit "$failed"
