# shellcheck shell=bash
# Helpers shared by the SoftRoCE harness scripts (setup.sh, run-in-vm.sh).
# Sourced, never executed. Everything here is host-side.

# Where built artefacts live between runs: outside the repository so that
# `git clean` and fresh clones keep it, keyed below by kernel version.
# shellcheck disable=SC2034 # used by the scripts that source this file
SOFTROCE_CACHE_DIR="${SOFTROCE_CACHE:-${HOME:-/root}/.cache/softroce-vm}"

# Debian's multiarch triplet; the VM is always x86_64 like this host.
# shellcheck disable=SC2034 # used by the scripts that source this file
SOFTROCE_TRIPLET="x86_64-linux-gnu"

# Progress lines go to stderr so that stdout stays the program's own output.
softroce_log() {
    printf 'softroce: %s\n' "$*" >&2
}

softroce_die() {
    printf 'softroce: error: %s\n' "$*" >&2
    exit 1
}

# Map a host path to the path it must have inside the VM's merged-/usr
# layout. /lib, /lib64, /bin and /sbin are symlinks into /usr in the base
# image; a later cpio archive that carries a real /lib directory would
# replace the symlink and hide /lib/modules, so nothing may be put there.
softroce_vm_path() {
    local p="$1"
    case "$p" in
        /lib/* | /lib64/* | /bin/* | /sbin/*) printf '/usr%s\n' "$p" ;;
        *) printf '%s\n' "$p" ;;
    esac
}

# Print the shared libraries (absolute host paths, one a line) that the
# dynamic loader resolves for an ELF file, the loader itself included.
# Prints nothing for a script or a static binary. Fails if a library is
# missing on the host.
softroce_ldd_paths() {
    local file="$1" out line
    # ldd exits non-zero for "not a dynamic executable": nothing to copy.
    if ! out="$(LC_ALL=C ldd "$file" 2>/dev/null)"; then
        return 0
    fi
    while IFS= read -r line; do
        case "$line" in
            *"=> not found"*)
                softroce_die "ldd $file: missing library: ${line%%=>*}"
                ;;
            *"=> /"*)
                line="${line#*=> }"
                printf '%s\n' "${line%% (*}"
                ;;
            [[:space:]]/*)
                line="${line#"${line%%[![:space:]]*}"}"
                printf '%s\n' "${line%% (*}"
                ;;
        esac
    done <<<"$out"
}

# Copy one host file into a staging root at its VM path, following
# symlinks so the VM gets the real bytes under the name asked for.
softroce_stage_file() {
    local staging="$1" src="$2" dest="${3:-}"
    [[ -n "$dest" ]] || dest="$(softroce_vm_path "$src")"
    mkdir -p "$staging$(dirname "$dest")"
    cp -L --preserve=mode "$src" "$staging$dest"
}

# Copy a host file and every shared library it needs into a staging root.
softroce_stage_with_libs() {
    local staging="$1" src="$2" dest="${3:-}" lib libs
    softroce_stage_file "$staging" "$src" "$dest"
    # Not a process substitution: a missing library must stop the caller.
    libs="$(softroce_ldd_paths "$src")"
    while IFS= read -r lib; do
        [[ -n "$lib" ]] || continue
        # Libraries already staged (shared by several binaries) are skipped.
        [[ -e "$staging$(softroce_vm_path "$lib")" ]] && continue
        softroce_stage_file "$staging" "$lib"
    done <<<"$libs"
}

# Quote a string for a POSIX shell (busybox sh reads the result).
softroce_shell_quote() {
    local s="$1"
    printf "'%s'" "${s//\'/\'\\\'\'}"
}

# The bench scripts' command line: `[--rounds N] [--ops N] [-h|--help]`,
# anything else passed on to run-in-vm.sh. Sets `rounds`, `ops` (from the
# defaults given first) and the array `vm_opts`; --help prints the calling
# script's header comment.
softroce_round_args() {
    rounds="$1" ops="$2"
    shift 2
    vm_opts=()
    while (($#)); do
        case "$1" in
            --rounds) rounds="${2:?--rounds needs N}"; shift ;;
            --ops) ops="${2:?--ops needs N}"; shift ;;
            -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
            *) vm_opts+=("$1") ;;
        esac
        shift
    done
    [[ "$rounds" =~ ^[1-9][0-9]*$ && "$ops" =~ ^[1-9][0-9]*$ ]] ||
        softroce_die "--rounds and --ops take positive integers"
}

# Builds the release bench in the repository `$1` and sets `bench_exe`.
softroce_build_bench() {
    softroce_log "building the bench (release)"
    (cd "$1" && cargo build --release --quiet -p bench)
    bench_exe="${CARGO_TARGET_DIR:-$1/target}/release/bench"
    [[ -x "$bench_exe" ]] || softroce_die "no $bench_exe after the build"
}
