#!/usr/bin/env bash
# Coverage-guided fuzzing (cargo fuzz, libFuzzer with AddressSanitizer) of
# everything that arrives from the network:
#   wire_roundtrip       every wire decoder: no panic; what decodes encodes
#                        back to the same value
#   coherence_home       one page's coherence home fed any node messages
#                        and losses, in or out of protocol: no panic,
#                        versions never go back, nothing sent to a node
#                        that never spoke or was lost
#   page_server_session  a real page-server fed any bytes, raw or after a
#                        good handshake: no panic or hang, well-framed
#                        answers, no data to a client without the key, a
#                        good client served after every input
#   client_answers       a TransportManager whose page-server answers
#                        anything: no panic, deadlines kept, no page
#                        returned that the server did not send
# Each target runs FUZZ_SECONDS (default 60) from its corpus in
# target/fuzz-corpus/<target> (kept between runs). A crash leaves its input
# in fuzz/artifacts/<target>/ and fails the script; replay it with
#   cargo fuzz run -O <target> fuzz/artifacts/<target>/<file>
#
#   deploy/fuzz.sh                        # every target, 60 s each
#   FUZZ_SECONDS=600 deploy/fuzz.sh page_server_session
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

seconds="${FUZZ_SECONDS:-60}"
targets=("$@")
((${#targets[@]})) || targets=(wire_roundtrip coherence_home page_server_session client_answers)

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install --quiet --locked cargo-fuzz --version 0.13.2
fi
# The sanitizer flags need a nightly compiler; the machine's stable one
# accepts them with RUSTC_BOOTSTRAP=1 (no other toolchain can be fetched).
toolchain=()
if rustup toolchain list 2>/dev/null | grep -q '^nightly'; then
    toolchain=(+nightly)
else
    export RUSTC_BOOTSTRAP=1
fi

cargo "${toolchain[@]}" fuzz build -O
for target in "${targets[@]}"; do
    corpus="target/fuzz-corpus/$target"
    log="target/fuzz-$target.log"
    mkdir -p "$corpus"
    extra=()
    asan_options=
    # The page-server's connection threads exit while the next input runs
    # (or the fuzzer exits): LeakSanitizer then reports glibc's per-thread
    # destructor list (__cxa_thread_atexit_impl) and a thread's start-up
    # allocation as leaked, per input and at exit. The other targets keep
    # leak detection: client_answers found a real leak with it.
    if [[ "$target" == page_server_session ]]; then
        extra=(-detect_leaks=0)
        asan_options=detect_leaks=0
    fi
    echo "==> fuzz $target for ${seconds}s (log: $log)"
    status=0
    ASAN_OPTIONS="$asan_options" cargo "${toolchain[@]}" fuzz run -O "$target" "$corpus" -- \
        -max_total_time="$seconds" -print_final_stats=1 "${extra[@]}" > "$log" 2>&1 || status=$?
    grep -E '^(Done|stat::new_units_added)' "$log" || true
    if ((status)); then
        grep -E -A30 'panicked|ERROR' "$log" | head -80
        echo "fuzz $target: FAILED (the input is in fuzz/artifacts/$target/)"
        exit 1
    fi
done
