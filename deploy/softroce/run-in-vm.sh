#!/usr/bin/env bash
# Run a host-built program inside a QEMU (TCG) VM with a SoftRoCE device.
#
#   deploy/softroce/run-in-vm.sh [OPTIONS] -- PROGRAM [ARGS...]
#
# PROGRAM is a host file (an ELF binary or a script; copied in at the same
# absolute path, with every shared library ldd lists) or a bare name found
# on the VM's PATH (ibv_devinfo, ib_read_lat, sh, ...).
#
# Options:
#   --timeout SECS    wall-clock bound for the whole VM run (default 600,
#                     or $SOFTROCE_TIMEOUT)
#   --env K=V         set K=V in the program's environment (repeatable)
#   --copy SRC[:DEST] copy a host file or directory into the VM, at DEST or
#                     else at SRC's absolute path; ELF files bring their
#                     libraries (repeatable)
#   --workdir DIR     working directory of the program in the VM (default /tmp)
#   --mem MIB         VM memory (default 2048)
#   --smp N           VM CPUs (default 2)
#   --console-log F   keep the VM console (kernel + /init log) in F
#   --keep            keep the per-run directory (overlay, console log)
#
# Environment: SOFTROCE_CACHE (cache dir, default ~/.cache/softroce-vm),
# SOFTROCE_TIMEOUT (default for --timeout), SOFTROCE_BOOT_TIMEOUT (seconds
# until the program must have started, default 120), SOFTROCE_SKIP_SETUP=1
# (do not call setup.sh first; the cache must exist).
#
# Inside, the program sees RDMA_DEVICE=rxe0, RXE_GID_INDEX (index of the
# IPv4-mapped GID ::ffff:127.0.0.1), RXE_GID, SOFTROCE_VM=1,
# SOFTROCE_KERNEL_VERSION, memlock unlimited, and runs as root. Its stdout
# and stderr (merged) stream to this script's stdout.
#
# Exit status: the program's own; 124 when the run timed out; 125 when the
# VM failed to boot or to set up rxe (the console tail is shown on stderr).
# A kernel that panics before the program starts is booted once more.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
. "$here/lib.sh"

readonly EXIT_TIMEOUT=124
readonly EXIT_HARNESS=125

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
}

harness_fail() {
    printf 'softroce: error: %s\n' "$*" >&2
    exit "$EXIT_HARNESS"
}

timeout_s="${SOFTROCE_TIMEOUT:-600}"
boot_timeout_s="${SOFTROCE_BOOT_TIMEOUT:-120}"
mem_mib=2048
smp=2
workdir=/tmp
console_keep=
keep=0
envs=()
copies=()

while (($#)); do
    case "$1" in
        --timeout) timeout_s="${2:?--timeout needs SECS}"; shift ;;
        --env) envs+=("${2:?--env needs K=V}"); shift ;;
        --copy) copies+=("${2:?--copy needs a path}"); shift ;;
        --workdir) workdir="${2:?--workdir needs DIR}"; shift ;;
        --mem) mem_mib="${2:?--mem needs MIB}"; shift ;;
        --smp) smp="${2:?--smp needs N}"; shift ;;
        --console-log) console_keep="${2:?--console-log needs FILE}"; shift ;;
        --keep) keep=1 ;;
        -h | --help) usage; exit 0 ;;
        --) shift; break ;;
        -*) harness_fail "unknown option $1 (see --help)" ;;
        *) break ;;
    esac
    shift
done
(($#)) || harness_fail "no PROGRAM given (see --help)"
[[ "$timeout_s" =~ ^[1-9][0-9]*$ ]] || harness_fail "--timeout must be a positive integer"
[[ "$mem_mib" =~ ^[1-9][0-9]*$ ]] || harness_fail "--mem must be a positive integer"
# The unpacked kernel and the initramfs alone take ~100 MiB; below this the
# kernel hangs before printing anything.
((mem_mib >= 512)) || harness_fail "--mem must be at least 512 (MiB)"
[[ "$boot_timeout_s" =~ ^[1-9][0-9]*$ ]] || harness_fail "SOFTROCE_BOOT_TIMEOUT must be a positive integer"
[[ "$smp" =~ ^[1-9][0-9]*$ ]] || harness_fail "--smp must be a positive integer"

# Cached kernel and base image (built on first use; fast when cached).
if [[ "${SOFTROCE_SKIP_SETUP:-0}" != 1 ]]; then
    "$here/setup.sh" --quiet || harness_fail "setup.sh failed"
fi
env_file="$SOFTROCE_CACHE_DIR/current.env"
[[ -f "$env_file" ]] || harness_fail "no $env_file: run deploy/softroce/setup.sh"
kernel_image="$(sed -n 's/^SOFTROCE_KERNEL_IMAGE=//p' "$env_file")"
base_initrd="$(sed -n 's/^SOFTROCE_BASE_INITRD=//p' "$env_file")"
[[ -f "$kernel_image" && -f "$base_initrd" ]] || harness_fail "cache incomplete: run deploy/softroce/setup.sh --force"

run_dir="$(mktemp -d "${TMPDIR:-/tmp}/softroce-run.XXXXXX")"
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
    if ((keep)); then
        softroce_log "run directory kept: $run_dir"
    else
        rm -rf "$run_dir"
    fi
}
trap cleanup EXIT
overlay="$run_dir/overlay"
mkdir -p "$overlay/etc/softroce"

# Where a host path lands in the VM; refuses places the harness owns.
dest_for() {
    local dest
    dest="$(softroce_vm_path "$1")"
    case "$dest" in
        /init | /etc/softroce | /etc/softroce/* | /proc* | /sys* | /dev* | /usr/lib/modules*)
            harness_fail "cannot copy to $dest: the harness owns it" ;;
        /* ) ;;
        *) harness_fail "destination must be absolute: $dest" ;;
    esac
    [[ "$dest" != / ]] || harness_fail "cannot copy onto /"
    printf '%s\n' "$dest"
}

is_elf() {
    [[ -f "$1" && "$(head -c 4 "$1" | od -An -tx1 | tr -d ' ')" == 7f454c46 ]]
}

stage_path() {
    local src="$1" dest="$2" f rel
    if [[ -d "$src" ]]; then
        mkdir -p "$overlay$dest"
        cp -rL "$src/." "$overlay$dest/"
        while IFS= read -r -d '' f; do
            is_elf "$f" || continue
            rel="${f#"$src"}"
            softroce_stage_with_libs "$overlay" "$f" "$dest$rel"
        done < <(find "$src" -type f -perm -u+x -print0)
    elif [[ -f "$src" ]]; then
        if is_elf "$src"; then
            softroce_stage_with_libs "$overlay" "$src" "$dest"
        else
            softroce_stage_file "$overlay" "$src" "$dest"
        fi
    else
        harness_fail "no such file or directory: $src"
    fi
}

for spec in "${copies[@]}"; do
    src="${spec%%:*}"
    if [[ "$spec" == *:* ]]; then
        dest="$(dest_for "${spec#*:}")"
    else
        [[ -e "$src" ]] || harness_fail "--copy: no such file or directory: $src"
        dest="$(dest_for "$(realpath "$src")")"
    fi
    stage_path "$src" "$dest"
done

# The program: a host file goes in at its absolute path; a bare name is
# looked up on the VM's PATH.
program="$1"
shift
if [[ "$program" == */* || -f "$program" ]]; then
    [[ -f "$program" ]] || harness_fail "PROGRAM not found: $program"
    host_program="$(realpath "$program")"
    program="$(dest_for "$host_program")"
    stage_path "$host_program" "$program"
    [[ -x "$host_program" ]] || chmod +x "$overlay$program"
fi

{
    for kv in "${envs[@]}"; do
        [[ "$kv" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || harness_fail "--env wants K=V, got: $kv"
        printf 'export %s=%s\n' "${kv%%=*}" "$(softroce_shell_quote "${kv#*=}")"
    done
} >"$overlay/etc/softroce/run.env"
{
    printf 'SOFTROCE_WORKDIR=%s\n' "$(softroce_shell_quote "$workdir")"
    printf 'set --'
    for arg in "$program" "$@"; do
        printf ' %s' "$(softroce_shell_quote "$arg")"
    done
    printf '\n'
} >"$overlay/etc/softroce/run.cmd"
[[ "$workdir" == /* ]] || harness_fail "--workdir must be an absolute path: $workdir"
mkdir -p "$overlay$(softroce_vm_path "$workdir")"

# Base image + overlay: the kernel unpacks concatenated cpio archives in
# order, later files replacing earlier ones. The overlay stays uncompressed:
# gunzip under TCG costs more than copying a few more megabytes.
initrd="$run_dir/initrd.img"
cp "$base_initrd" "$initrd"
# The kernel reads an uncompressed archive after a compressed one only at a
# 4-byte aligned offset (zero bytes in between are skipped).
truncate -s %4 "$initrd"
(cd "$overlay" && find . -mindepth 1 | LC_ALL=C sort |
    cpio -o -H newc -R 0:0 --quiet) >>"$initrd"

console_log="$run_dir/console.log"

# One boot: sets qemu_rc, booted, boot_timed_out and elapsed_s.
boot_vm() {
    : >"$console_log"
    softroce_log "booting VM: $(basename "$kernel_image"), ${mem_mib} MiB, ${smp} CPUs, timeout ${timeout_s}s, program $program"
    start_s="$(date +%s.%N)"
    # stdin is /dev/null: CI has none, and the program never reads the host's.
    # tsc=reliable: no clocksource watchdog. Under TCG on a loaded host it
    # can find the TSC skewed against the HPET and mark it unstable, and the
    # switch that follows (sched_clock's static key, patched with int3)
    # once crashed the guest kernel in CI ("Oops: int3" in sched_clock_cpu,
    # 2026-12-08) after every test had passed.
    timeout -k 10 "$timeout_s" qemu-system-x86_64 \
        -accel tcg -machine pc -cpu max -smp "$smp" -m "$mem_mib" \
        -nodefaults -no-user-config -nic none -display none -monitor none \
        -no-reboot \
        -kernel "$kernel_image" -initrd "$initrd" \
        -append "console=ttyS0 panic=-1 rdinit=/init tsc=reliable ${SOFTROCE_KERNEL_ARGS:-}" \
        -serial "file:$console_log" \
        -chardev stdio,id=out,signal=off -serial chardev:out \
        </dev/null &
    qemu_pid=$!
    trap 'kill "$qemu_pid" 2>/dev/null; exit "$EXIT_HARNESS"' INT TERM

    # Boot watchdog: a VM that has not started the program within the boot
    # timeout (too little memory, a kernel that hangs early) is stopped
    # then, not at the end of the whole run's timeout.
    boot_deadline=$((SECONDS + boot_timeout_s))
    booted=0
    boot_timed_out=0
    while kill -0 "$qemu_pid" 2>/dev/null; do
        if ((!booted)); then
            if grep -aq -e '^softroce-init: running' -e SOFTROCE_ "$console_log"; then
                booted=1
            elif ((SECONDS >= boot_deadline)); then
                boot_timed_out=1
                kill "$qemu_pid" 2>/dev/null || true
                break
            fi
        fi
        sleep 0.2
    done
    qemu_rc=0
    wait "$qemu_pid" || qemu_rc=$?
    trap - INT TERM
    elapsed_s="$(awk -v s="$start_s" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')"
}

boot_vm
# A kernel that panicked before the program started (panic=-1 and
# -no-reboot end QEMU at once) gets one more boot: nothing of the program
# ran, so nothing runs twice. Seen once in CI, a TCG flake: an int3 Oops in
# run_timer_softirq while the 6.12 kernel patched its own text at boot.
if ((!booted && !boot_timed_out)) && grep -aq 'Kernel panic' "$console_log"; then
    softroce_log "the VM kernel panicked after ${elapsed_s}s, before the program started: $(grep -ao 'Kernel panic.*' "$console_log" | head -n 1 | tr -d '\r')"
    tail -n 20 "$console_log" | sed 's/^/  | /' >&2
    cp "$console_log" "$run_dir/console.first-boot.log"
    softroce_log "booting once more"
    boot_vm
fi
[[ -z "$console_keep" ]] || cp "$console_log" "$console_keep"

show_console_tail() {
    softroce_log "last lines of the VM console ($console_log):"
    tail -n 40 "$console_log" | sed 's/^/  | /' >&2
    keep=1
}

marker="$(grep -ao 'SOFTROCE_EXIT_CODE=[0-9]*' "$console_log" | tail -n 1 || true)"
if [[ -n "$marker" ]]; then
    rc="${marker#SOFTROCE_EXIT_CODE=}"
    softroce_log "VM run done in ${elapsed_s}s, program exit code $rc"
    exit "$rc"
fi
if grep -aq 'SOFTROCE_SETUP_FAILED' "$console_log"; then
    softroce_log "VM set-up failed after ${elapsed_s}s: $(grep -ao 'SOFTROCE_SETUP_FAILED.*' "$console_log" | head -n 1)"
    show_console_tail
    exit "$EXIT_HARNESS"
fi
if ((boot_timed_out)); then
    softroce_log "boot failure: the program had not started after ${boot_timeout_s}s (SOFTROCE_BOOT_TIMEOUT)"
    show_console_tail
    exit "$EXIT_HARNESS"
fi
if ((qemu_rc == 124 || qemu_rc == 137)); then
    softroce_log "timeout: the VM run exceeded ${timeout_s}s and was killed"
    show_console_tail
    exit "$EXIT_TIMEOUT"
fi
if ((!booted)) && grep -aq 'Kernel panic' "$console_log"; then
    softroce_log "boot failure: the VM kernel panicked again after ${elapsed_s}s, before the program started"
    show_console_tail
    exit "$EXIT_HARNESS"
fi
softroce_log "VM ended after ${elapsed_s}s without an exit marker (qemu exit code $qemu_rc): boot failure?"
show_console_tail
exit "$EXIT_HARNESS"
