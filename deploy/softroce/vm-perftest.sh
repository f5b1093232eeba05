#!/bin/sh
# Run perftest tests over rxe0 INSIDE the SoftRoCE VM and print one
# machine-readable line per test. Latency tests (ib_*_lat):
#
#   PERFTEST ib_read_lat size_bytes=4096 iters=5000 t_min_us=.. t_max_us=..
#       t_typical_us=.. t_avg_us=.. t_stdev_us=.. t99_us=.. t999_us=..
#
# (on one line); bandwidth tests (ib_*_bw, PERFTEST_TX_DEPTH outstanding):
#
#   PERFBW ib_write_bw tx_depth=1 msg_per_s=.. bw_avg_mb_s=..
#
# On failure: "PERFTEST <test> error=<why>" (or "PERFBW <test> tx_depth=N
# error=<why>") and exit 1, after PERFTEST_TRIES attempts (default 3),
# each failed one shown as "PERFRETRY <test> attempt=N of M failed" and
# perftest's own output.
#
#   vm-perftest.sh [TEST...]      default: ib_read_lat ib_write_lat
#
# Environment: PERFTEST_SIZE (bytes, default 4096), PERFTEST_ITERS (default
# 5000), PERFTEST_TX_DEPTH (bandwidth tests, default 1), PERFTEST_PORT (the
# first test's exchange port, default 18515; each next test takes the next
# one, a retry that port + 1000), PERFTEST_TRIES, PERFTEST_VERBOSE=1 (also
# print perftest's own output), plus the harness's RDMA_DEVICE and
# RXE_GID_INDEX. Each test runs its server in the background and its client
# against 127.0.0.1, on the same rxe device.
#
# Runs under busybox sh; call it from a script given to run-in-vm.sh (with
# --copy) to compare perftest with another benchmark in the same VM boot.
# Absolute latencies under TCG move up to 2x between boots: compare ratios
# taken in one boot, never absolute times across boots.
set -eu

size_bytes="${PERFTEST_SIZE:-4096}"
iters="${PERFTEST_ITERS:-5000}"
tx_depth="${PERFTEST_TX_DEPTH:-1}"
device="${RDMA_DEVICE:?not in the SoftRoCE VM: RDMA_DEVICE unset}"
gid_index="${RXE_GID_INDEX:?not in the SoftRoCE VM: RXE_GID_INDEX unset}"
verbose="${PERFTEST_VERBOSE:-0}"
tries_max="${PERFTEST_TRIES:-3}"
[ "$#" -gt 0 ] || set -- ib_read_lat ib_write_lat

logdir="$(mktemp -d /tmp/vm-perftest.XXXXXX)"
port="${PERFTEST_PORT:-18515}"
status=0

# True once something listens on TCP port $1 (perftest's exchange socket).
listening() {
    netstat -ltn 2>/dev/null | grep -q ":$1 "
}

# Print the summary line from a perftest client log: the columns are found
# by their header names ("99% percentile[usec]" is two words).
summarise() {
    awk -v test="$1" -v size="$size_bytes" '
        /t_typical\[usec\]/ {
            n = 0
            for (i = 1; i <= NF; i++) {
                if ($i ~ /^percentile/ && n > 0) { name[n] = name[n] $i; continue }
                name[++n] = $i
            }
            ncols = n
            next
        }
        ncols && $1 == size && NF == ncols {
            key["#bytes"] = "size_bytes"; key["#iterations"] = "iters"
            key["t_min[usec]"] = "t_min_us"; key["t_max[usec]"] = "t_max_us"
            key["t_typical[usec]"] = "t_typical_us"; key["t_avg[usec]"] = "t_avg_us"
            key["t_stdev[usec]"] = "t_stdev_us"
            key["99%percentile[usec]"] = "t99_us"; key["99.9%percentile[usec]"] = "t999_us"
            line = "PERFTEST " test
            for (i = 1; i <= NF; i++) {
                k = (name[i] in key) ? key[name[i]] : name[i]
                line = line " " k "=" $i
            }
            print line
            found = 1
            exit
        }
        END { if (!found) exit 1 }
    ' "$2"
}

# Print the summary line of a bandwidth test's client log: its row is
# "#bytes #iterations BW-peak BW-average MsgRate[Mpps]". A rate of zero
# (perftest printed 0.000000 once in the VM) is no result.
summarise_bw() {
    awk -v test="$1" -v size="$size_bytes" -v t="$tx_depth" '
        $1 == size && NF == 5 && $5 > 0 {
            printf "PERFBW %s tx_depth=%s msg_per_s=%.0f bw_avg_mb_s=%s\n", test, t, $5 * 1e6, $4
            found = 1
            exit
        }
        END { if (!found) exit 1 }
    ' "$2"
}

summary_of() {
    case "$1" in
    *_bw) summarise_bw "$@" ;;
    *) summarise "$@" ;;
    esac
}

# One run of test $1 on exchange port $2: server in the background, client
# against it, the summary line printed. Status 1 when the client failed or
# printed no result; the logs are kept in $logdir for the caller.
run_once() {
    # (busybox sh: no "local"; $port is the caller's, left alone)
    server_log="$logdir/$1.server.log" client_log="$logdir/$1.client.log"
    args="-d $device -x $gid_index -s $size_bytes -n $iters -p $2 -F"
    case "$1" in
    *_bw) args="$args -t $tx_depth" ;;
    esac
    # shellcheck disable=SC2086 # args is a list of words
    timeout 120 "$1" $args >"$server_log" 2>&1 &
    server_pid=$!
    tries=0
    until listening "$2"; do
        tries=$((tries + 1))
        if [ "$tries" -gt 200 ] || ! kill -0 "$server_pid" 2>/dev/null; then
            break
        fi
        usleep 50000
    done
    ok=0
    # shellcheck disable=SC2086 # args is a list of words
    if timeout 120 "$1" $args 127.0.0.1 >"$client_log" 2>&1 &&
        summary_of "$1" "$client_log"; then
        ok=1
    fi
    # The server ends by itself after the run; a failed client can leave
    # it waiting: give it 5 s, then stop it.
    tries=0
    while kill -0 "$server_pid" 2>/dev/null && [ "$tries" -lt 100 ]; do
        tries=$((tries + 1))
        usleep 50000
    done
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    [ "$ok" = 1 ]
}

show_logs() {
    sed "s/^/  | $1 client: /" "$logdir/$1.client.log"
    sed "s/^/  | $1 server: /" "$logdir/$1.server.log"
}

for test in "$@"; do
    case "$test" in
    *_bw) fail="PERFBW $test tx_depth=$tx_depth" ;;
    *) fail="PERFTEST $test" ;;
    esac
    # perftest itself fails now and then under TCG (a client that gets no
    # result, a message rate of 0): a failed attempt is shown and retried
    # on a fresh port, up to $tries_max attempts.
    attempt=1
    passed=0
    while :; do
        if run_once "$test" "$((port + 1000 * (attempt - 1)))"; then
            passed=1
            break
        fi
        echo "PERFRETRY $test attempt=$attempt of $tries_max failed"
        show_logs "$test"
        if [ "$attempt" -ge "$tries_max" ]; then
            echo "$fail error=client_failed"
            status=1
            break
        fi
        attempt=$((attempt + 1))
    done
    # A failed attempt's logs were shown above; verbose adds a passing one's.
    [ "$verbose" != 1 ] || [ "$passed" != 1 ] || show_logs "$test"
    port=$((port + 1))
done
rm -rf "$logdir"
exit "$status"
