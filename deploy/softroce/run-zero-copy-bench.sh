#!/usr/bin/env bash
# Zero-copy RDMA against perftest, in ONE SoftRoCE VM boot: per round,
# perftest's ib_read_lat, `ib_write_bw -s 4096 -t 1` (a write with its
# completion: per-operation time = 1 / message rate) and `ib_read_bw -t 16`,
# then the bench with registered buffers (`--register-buffers`: READs land
# in the caller's buffer, WRITEs go out of it, no pool frame) and without
# (the bounce through a pool frame), one in flight and at depth 16 (batches
# of 16 with the blocking API), and with registered buffers at depth 16 on
# the asynchronous API (`--api async`: 16 one-page READs kept in flight, a
# new one posted as each completes, as `ib_read_bw -t 16` does).
#
#   deploy/softroce/run-zero-copy-bench.sh [--rounds N] [--ops N] [run-in-vm.sh OPTIONS]
#
# Prints per round, then the medians of the per-round ratios, the same
# bracketed (each round against the mean of perftest's runs before it and
# after it: perftest runs once more after the last round) and the best-of
# ratios (best of ours over best of perftest's):
#   READ p50 / ib_read_lat t_typical, WRITE mean / ib_write_bw per-op time,
#   depth-16 READ pages/s (zc, bounce, async) / ib_read_bw -t 16 msg/s.
# And per round a `--verbs-baseline` run (ours with registered buffers and a
# bare verbs loop, alternated in blocks of 100 in one process): the median
# of its per-pair ratios (READ p50, WRITE mean), and the bare loop against
# perftest's run of the same round.
# Every bench run checks every page it moves; a run that is not verified
# fails the script. Builds the bench (release, baseline x86-64) first.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
# shellcheck source=lib.sh
. "$here/lib.sh"
# shellcheck source=results.sh
. "$here/results.sh"

softroce_round_args 3 5000 "$@"
cd "$repo"
softroce_build_bench "$repo"

work="$(mktemp -d "${TMPDIR:-/tmp}/softroce-zc.XXXXXX")"
trap 'rm -rf "$work"' EXIT
runner="$work/vm-zero-copy.sh"
# perftest_bw TEST TX_DEPTH PORT: the runner's line for one 5000-message
# bandwidth test (a PERFBW line; a failed one fails the run).
perftest_bw() {
    printf 'PERFTEST_ITERS=5000 PERFTEST_TX_DEPTH=%s PERFTEST_PORT=%s %s %s || failed=1\n' \
        "$2" "$3" "$(softroce_shell_quote "$here/vm-perftest.sh")" "$1"
}
b="$(softroce_shell_quote "$bench_exe")"
{
    echo '#!/bin/sh'
    echo 'failed=0'
    # shellcheck disable=SC2016 # expanded in the VM
    echo 'echo "VMCLOCK $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource) kernel $SOFTROCE_KERNEL_VERSION"'
    echo 'grep -qw "idle=poll" /proc/cmdline && echo "VMIDLE poll" || echo "VMIDLE halt"'
    for ((r = 1; r <= rounds; r++)); do
        printf 'PERFTEST_ITERS=%s %s ib_read_lat || failed=1\n' "$ops" "$(softroce_shell_quote "$here/vm-perftest.sh")"
        perftest_bw ib_write_bw 1 "$((18700 + 2 * r))"
        perftest_bw ib_read_bw 16 "$((18701 + 2 * r))"
        for run in "zc$r|--register-buffers --ops $ops" "bounce$r|--ops $ops" \
            "zc16_$r|--register-buffers --op read --depth 16 --ops $((ops * 4))" \
            "bounce16_$r|--op read --depth 16 --ops $((ops * 4))" \
            "async16_$r|--register-buffers --api async --op read --depth 16 --ops $((ops * 4))" \
            "vb$r|--register-buffers --verbs-baseline --verbs-block 100 --ops $ops" \
            "vb16_$r|--register-buffers --api async --op read --depth 16 --verbs-baseline --verbs-block 2000 --ops $((ops * 4))"; do
            name="${run%%|*}"
            printf 'if %s --transport rdma --memory 16MiB --json /tmp/%s.json %s >/tmp/%s.out 2>/tmp/%s.err; then\n' "$b" "$name" "${run#*|}" "$name" "$name"
            printf '    grep -a "^zero-copy" /tmp/%s.err | sed "s/^/ZC %s /"\n' "$name" "$name"
            printf '    grep -a "^overhead vs bare verbs\\|^throughput vs bare verbs" /tmp/%s.out | sed "s/^/VERBS %s /"\n' "$name" "$name"
            # shellcheck disable=SC2016 # expanded by the generated script
            printf '    echo "BENCHJSON %s $(tr -d %s </tmp/%s.json)"\n' "$name" "'\\n '" "$name"
            printf 'else tail -n 5 /tmp/%s.err; echo "RDMABENCH FAILED %s"; failed=1; fi\n' "$name" "$name"
        done
    done
    # perftest once more after the last round: every round's runs are then
    # bracketed by perftest's runs before and after them.
    printf 'PERFTEST_ITERS=%s %s ib_read_lat || failed=1\n' "$ops" "$(softroce_shell_quote "$here/vm-perftest.sh")"
    perftest_bw ib_write_bw 1 "$((18700 + 2 * rounds + 2))"
    perftest_bw ib_read_bw 16 "$((18701 + 2 * rounds + 2))"
    # shellcheck disable=SC2016 # expanded by the generated script
    echo 'exit "$failed"'
} >"$runner"
chmod +x "$runner"

rc=0
# shellcheck disable=SC2086 # SOFTROCE_VM_OPTS is a list of words on purpose
"$here/run-in-vm.sh" --timeout 900 --copy "$here/vm-perftest.sh" --copy "$bench_exe" \
    ${SOFTROCE_VM_OPTS:-} "${vm_opts[@]}" -- "$runner" | tee "$work/out.txt" || rc=$?
out="$work/out.txt"

failed=0
grep -q '^RDMABENCH FAILED' "$out" && failed=1
echo
echo "==== zero-copy RDMA vs perftest (same boot) ===="
grep -a '^VMCLOCK ' "$out" | sed 's/^VMCLOCK /VM clocksource: /' || true
if grep -aq '^VMIDLE halt' "$out" && ! grep -aq '^VMCLOCK .* kernel 6\.1\.' "$out"; then
    # rxe runs requests in kworkers there: see docs/softroce.md.
    echo "note: idle vCPUs halt in this boot; for latency ratios against perftest boot with SOFTROCE_KERNEL_ARGS=idle=poll (docs/softroce.md)"
fi
printf '%-6s | %-28s | %-30s | %-34s\n' round "READ p50 us zc/bounce/perf" "WRITE mean us zc/bounce/perf" "depth16 pages/s zc/bounce/async/perf"
declare -A all=()
# perftest's figures of round r (r = rounds + 1: the closing run).
perf_round() {
    local r="$1" perf wbw rbw
    perf="$(grep '^PERFTEST ib_read_lat .*t_typical_us=' "$out" | sed -n "${r}p")"
    wbw="$(grep '^PERFBW ib_write_bw .*msg_per_s=' "$out" | sed -n "${r}p")"
    rbw="$(grep '^PERFBW ib_read_bw .*msg_per_s=' "$out" | sed -n "${r}p")"
    p_read="$(field t_typical_us "$perf")"
    p_write="$(awk -v m="$(field msg_per_s "$wbw")" 'BEGIN { if (m > 0) printf "%.1f", 1e6 / m }')"
    p_bw="$(field msg_per_s "$rbw")"
    all[perf.read.$r]="$p_read" all[perf.write.$r]="$p_write" all[perf.d16.$r]="$p_bw"
}
perf_round $((rounds + 1))
for ((r = 1; r <= rounds; r++)); do
    perf_round "$r"
    for side in zc bounce; do
        rec_r="$(record "$side$r" read)" rec_w="$(record "$side$r" write)" rec_d="$(record "${side}16_$r" read)"
        for rec in "$rec_r" "$rec_w" "$rec_d"; do
            if [[ -z "$rec" || "$(json verified "$rec")" != true || "$(json transport "$rec")" != rdma ]]; then
                echo "round $r $side: a bench run is missing or not verified"
                failed=1
            fi
        done
        all[$side.read.$r]="$(fmt1 "$(json p50 "$rec_r")")"
        all[$side.write.$r]="$(fmt1 "$(json mean "$rec_w")")"
        all[$side.d16.$r]="$(awk -v v="$(json pages_per_s "$rec_d")" 'BEGIN { printf "%.0f", v }')"
    done
    rec_a="$(record "async16_$r" read)"
    if [[ -z "$rec_a" || "$(json verified "$rec_a")" != true || "$(json transport "$rec_a")" != rdma || "$(json api "$rec_a")" != async ]]; then
        echo "round $r async: the depth-16 run is missing or not verified"
        failed=1
    fi
    all[async.d16.$r]="$(awk -v v="$(json pages_per_s "$rec_a")" 'BEGIN { printf "%.0f", v }')"
    printf '%-6s | %-28s | %-30s | %-34s\n' "$r" \
        "${all[zc.read.$r]}/${all[bounce.read.$r]}/$p_read" \
        "${all[zc.write.$r]}/${all[bounce.write.$r]}/$p_write" \
        "${all[zc.d16.$r]}/${all[bounce.d16.$r]}/${all[async.d16.$r]}/$p_bw"
done
summary() { # summary KIND SIDE: median of per-round ratios, bracketed, best-of
    local kind="$1" side="$2" ratios="" bracketed="" ours="" theirs="" around
    for ((r = 1; r <= rounds; r++)); do
        ratios+=" $(ratio "${all[$side.$kind.$r]}" "${all[perf.$kind.$r]}")"
        # Against the mean of perftest's runs before and after this round's
        # (the VM's speed drifts within a round; a missing closing run
        # leaves the plain pairing).
        around="$(awk -v a="${all[perf.$kind.$r]}" -v b="${all[perf.$kind.$((r + 1))]:-}" \
            'BEGIN { print (b > 0 ? (a + b) / 2 : a) }')"
        bracketed+=" $(ratio "${all[$side.$kind.$r]}" "$around")"
        ours+=" ${all[$side.$kind.$r]}" theirs+=" ${all[perf.$kind.$r]}"
    done
    local best
    if [[ "$kind" == d16 ]]; then
        best="$(ratio "$(maximum <<<"$ours")" "$(maximum <<<"$theirs")")"
    else
        best="$(ratio "$(minimum <<<"$ours")" "$(minimum <<<"$theirs")")"
    fi
    printf '%s/perftest %-6s: per-round%s; median %s; best-of %s\n' "$side" "$kind" "$ratios" "$(median <<<"$ratios")" "$best"
    printf '%s/perftest %-6s: bracketed%s; median %s\n' "$side" "$kind" "$bracketed" "$(median <<<"$bracketed")"
}
for kind in read write d16; do
    for side in zc bounce; do
        summary "$kind" "$side"
    done
done
summary d16 async
# Ours against the bare verbs loop alternated with it in one process
# (`--verbs-baseline`, blocks of 100): the median of each run's per-pair
# ratios (READ p50, WRITE mean), and the bare loop against perftest.
verbs_pair() { # verbs_pair ROUND OP FIELD: "p50" or "mean" per-pair median
    sed -n "s/^VERBS vb$1 overhead vs bare verbs ($2 .*per pair: p50 median x\([0-9.]*\), mean median x\([0-9.]*\).*/\1 \2/p" "$out" |
        awk -v f="$3" '{ print (f == "p50" ? $1 : $2) }'
}
vr="" vw="" br="" bw_=""
for ((r = 1; r <= rounds; r++)); do
    vr+=" $(verbs_pair "$r" Read p50)" vw+=" $(verbs_pair "$r" Write mean)"
    bare_r="$(bare_record "vb$r" read)" bare_w="$(bare_record "vb$r" write)"
    for rec in "$(record "vb$r" read)" "$(record "vb$r" write)" "$bare_r" "$bare_w"; do
        if [[ -z "$rec" || "$(json verified "$rec")" != true ]]; then
            echo "round $r: the --verbs-baseline run is missing or not verified"
            failed=1
        fi
    done
    br+=" $(ratio "$(json p50 "$bare_r")" "${all[perf.read.$r]}")"
    bw_+=" $(ratio "$(json mean "$bare_w")" "${all[perf.write.$r]}")"
done
# Depth 16 on the asynchronous API against the bare loop kept 16 deep
# (`vb16_`, blocks of 2000): the median of each run's per-pair pages/s ratios.
v16=""
for ((r = 1; r <= rounds; r++)); do
    v16+=" $(sed -n "s/^VERBS vb16_$r throughput vs bare verbs (Read .*per pair: median x\([0-9.]*\).*/\1/p" "$out")"
    for rec in "$(record "vb16_$r" read)" "$(bare_record "vb16_$r" read)"; do
        if [[ -z "$rec" || "$(json verified "$rec")" != true ]]; then
            echo "round $r: the depth-16 --verbs-baseline run is missing or not verified"
            failed=1
        fi
    done
done
printf 'zc/bare verbs read   : per-pair p50, per round%s; median %s\n' "$vr" "$(median <<<"$vr")"
printf 'async16/bare verbs16 : per-pair pages/s, per round%s; median %s\n' "$v16" "$(median <<<"$v16")"
printf 'zc/bare verbs write  : per-pair mean, per round%s; median %s\n' "$vw" "$(median <<<"$vw")"
printf 'bare verbs/perftest read : per round%s; median %s\n' "$br" "$(median <<<"$br")"
printf 'bare verbs/perftest write: per round%s; median %s\n' "$bw_" "$(median <<<"$bw_")"
grep '^ZC ' "$out" | sed 's/^ZC /bench /' || true
((rc == 0)) || exit "$rc"
exit "$failed"
