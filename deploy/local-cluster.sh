#!/usr/bin/env bash
# A local cluster of REAL processes on loopback (the bench starts an
# in-process one by itself; this is for poking at the daemons by hand):
# a coordinator and N page-servers. Ctrl-C stops them all.
#
#   deploy/local-cluster.sh [NODES=2] [MEMORY_PER_NODE=256MiB]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
nodes=${1:-2}
memory=${2:-256MiB}
cargo build --release --quiet -p coordinator -p page-server
bin="${CARGO_TARGET_DIR:-target}/release"
dir=$(mktemp -d)
pids=()
cleanup() { kill "${pids[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"; }
trap cleanup EXIT INT TERM
# The cluster key every member proves in each connection's handshake, and
# from which the coordinator credentials are derived.
(umask 077 && openssl rand -hex 32 >"$dir/cluster.key" 2>/dev/null) ||
    (umask 077 && head -c 32 /dev/urandom | od -An -vtx1 | tr -d ' \n' >"$dir/cluster.key")
"$bin"/coordinator --listen 127.0.0.1:0 --db "$dir/coordinator.db" --ready-file "$dir/coord.addr" \
    --cluster-key-file "$dir/cluster.key" &
pids+=($!)
for _ in $(seq 100); do [[ -s "$dir/coord.addr" ]] && break; sleep 0.1; done
url="http://$(cat "$dir/coord.addr")"
bytes=$(numfmt --from=iec-i --suffix=B "$memory" 2>/dev/null | tr -d B || echo 268435456)
for i in $(seq 0 $((nodes - 1))); do
    "$bin"/page-server --node-id "node-$i" --listen 127.0.0.1:0 --memory "$memory" \
        --gpa-base $((i * bytes)) --coordinator "$url" --cluster-key-file "$dir/cluster.key" &
    pids+=($!)
done
echo "coordinator: $url  (try: $bin/bench --coordinator $url --cluster-key-file $dir/cluster.key)"
echo "admin credential: $bin/coordinator credential --admin --cluster-key-file $dir/cluster.key"
wait
