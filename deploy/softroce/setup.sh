#!/usr/bin/env bash
# Prepare everything a SoftRoCE VM run needs, once; later runs reuse the cache.
#
#   deploy/softroce/setup.sh [--quiet] [--force]
#
#   --quiet  print progress only when something has to be built
#   --force  rebuild the kernel artefacts and the base initramfs
#
# Steps (each skipped when already done):
#   1. apt-get install the host packages that are missing;
#   2. fetch Debian's kernel package (the one linux-image-amd64 of
#      $SOFTROCE_KERNEL_SUITE, default bookworm-backports, depends on)
#      with `apt-get download`, unpack it with dpkg-deb -x (it is never
#      installed as the host kernel), run depmod, keep the rxe module closure
#      and an uncompressed vmlinux for a fast PVH boot (bzImage as fallback);
#   3. build the base initramfs: busybox, ip, rdma, libibverbs + the rxe
#      provider, perftest, ibv_devinfo, their libraries, modules and /init.
#
# Cache: ${SOFTROCE_CACHE:-$HOME/.cache/softroce-vm}/<kernel version>/, with
# `current.env` at the top naming the artefacts for run-in-vm.sh.
# shellcheck source-path=SCRIPTDIR
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=lib.sh
. "$here/lib.sh"

# Bump when the layout of the cache or of the base image changes.
readonly FORMAT_VERSION=1

readonly HOST_PACKAGES=(
    qemu-system-x86 busybox-static rdma-core ibverbs-providers ibverbs-utils
    perftest libibverbs-dev librdmacm-dev cpio kmod iproute2 xz-utils
    binutils gzip util-linux libc-bin bash zstd
)

# Userland packages whose files go into the base image: a new version of
# any of them makes the cached image stale.
readonly IMAGE_PACKAGES=(
    busybox-static libc6 libibverbs1 librdmacm1 ibverbs-providers
    ibverbs-utils perftest iproute2 libc-bin bash
)

# Kernel modules loaded at boot, in this order, with their dependencies.
# crc32_generic must be explicit: rxe asks the crypto layer for "crc32" and
# TCG's CPU has no PCLMUL, so nothing else provides it.
readonly MODULES=(
    crc32_generic rdma_rxe ib_uverbs
    configfs ib_cm iw_cm rdma_cm rdma_ucm
    veth
)

# Host programs copied into the base image, with their shared libraries.
readonly BASE_PROGRAMS=(
    /usr/sbin/ip /usr/bin/rdma /usr/bin/bash /usr/sbin/ldconfig
    /usr/bin/ibv_devinfo /usr/bin/ibv_devices /usr/bin/ibv_rc_pingpong
    /usr/bin/ib_read_lat /usr/bin/ib_write_lat /usr/bin/ib_read_bw
    /usr/bin/ib_write_bw /usr/bin/ib_send_lat
)

# Libraries that programs load with dlopen(), which ldd cannot see.
readonly DLOPEN_LIBS=(
    "/usr/lib/$SOFTROCE_TRIPLET/libibverbs.so.1"
    "/usr/lib/$SOFTROCE_TRIPLET/librdmacm.so.1"
    "/usr/lib/$SOFTROCE_TRIPLET/libibverbs/librxe-rdmav34.so"
)

quiet=0
force=0
while (($#)); do
    case "$1" in
        --quiet) quiet=1 ;;
        --force) force=1 ;;
        -h | --help)
            sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
            exit 0
            ;;
        *) softroce_die "setup.sh: unknown argument: $1" ;;
    esac
    shift
done

progress() {
    softroce_log "$*"
}

[[ "$(id -u)" == 0 ]] || softroce_die "setup.sh needs root (apt-get, mknod)"

mkdir -p "$SOFTROCE_CACHE_DIR"
# Two runs at once (parallel CI jobs) must not build the same files.
exec 9>"$SOFTROCE_CACHE_DIR/.lock"
flock 9

export DEBIAN_FRONTEND=noninteractive

# Run an apt-get command, once more after a pause if it fails (a mirror
# hiccup should not fail a CI run).
apt_retry() {
    "$@" || { progress "retrying in 10 s: $*"; sleep 10; "$@"; }
}

apt_updated=0
apt_update_once() {
    if ((apt_updated == 0)); then
        progress "apt-get update"
        apt_retry apt-get update -qq >/dev/null
        apt_updated=1
    fi
}

# 1. Host packages ---------------------------------------------------------

missing_packages() {
    local installed pkg
    # One dpkg-query for all (it exits 1 when one is unknown: not an error).
    installed="$(dpkg-query -W -f '${Package} ${db:Status-Status}\n' "${HOST_PACKAGES[@]}" 2>/dev/null || true)"
    for pkg in "${HOST_PACKAGES[@]}"; do
        grep -qxF "$pkg installed" <<<"$installed" || printf '%s\n' "$pkg"
    done
}

mapfile -t missing < <(missing_packages)
if ((${#missing[@]})); then
    apt_update_once
    progress "apt-get install ${missing[*]}"
    apt_retry apt-get install -y -qq \
        --no-install-recommends "${missing[@]}" >/dev/null
    mapfile -t missing < <(missing_packages)
    ((${#missing[@]} == 0)) || softroce_die "still missing after apt-get install: ${missing[*]}"
fi

# 2. Kernel ----------------------------------------------------------------

# The VM's kernel comes from SOFTROCE_KERNEL_SUITE (default
# bookworm-backports: 6.12, which has what the guest-memory tests need:
# UFFDIO_CONTINUE_MODE_WP 6.4, PAGEMAP_SCAN 6.7; `bookworm` gives Debian
# 12's own 6.1). Its package lists live in a private apt state under the
# cache, so the host's sources and lists are never touched.
readonly KERNEL_SUITE="${SOFTROCE_KERNEL_SUITE:-bookworm-backports}"
kapt_dir="$SOFTROCE_CACHE_DIR/apt-$KERNEL_SUITE"
kapt=(
    -o "Dir::Etc::SourceList=$kapt_dir/sources.list"
    -o "Dir::Etc::SourceParts=$kapt_dir/parts"
    -o "Dir::State::Lists=$kapt_dir/lists"
    -o "Dir::Cache=$kapt_dir/cache"
    -o APT::Sandbox::User=root
)
mkdir -p "$kapt_dir"/{parts,lists/partial,cache/archives/partial}
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $KERNEL_SUITE main" \
    >"$kapt_dir/sources.list"

kapt_updated=0
kapt_update_once() {
    if ((kapt_updated == 0)); then
        progress "apt-get update ($KERNEL_SUITE, kernel only)"
        apt_retry apt-get "${kapt[@]}" update -qq >/dev/null
        kapt_updated=1
    fi
}

# Prints nothing (and succeeds) while the suite's lists are not fetched.
kernel_package() {
    { apt-cache "${kapt[@]}" depends linux-image-amd64 2>/dev/null || true; } |
        awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ && !found { print $2; found = 1 }'
}

# apt-cache takes a second here (no pkgcache.bin): remember its answer for
# as long as the package lists stay the same.
lists_stamp() {
    find "$kapt_dir/lists" -maxdepth 1 -name '*Packages*' -printf '%T@ %s %f\n' 2>/dev/null |
        LC_ALL=C sort | sha256sum | cut -d' ' -f1
}
resolved_file="$SOFTROCE_CACHE_DIR/kernel-package-$KERNEL_SUITE"
kpkg=
if [[ -f "$resolved_file" ]]; then
    read -r stamp cached_kpkg <"$resolved_file" || true
    [[ "${stamp:-}" == "$(lists_stamp)" ]] && kpkg="${cached_kpkg:-}"
fi
if [[ -z "$kpkg" ]]; then
    kpkg="$(kernel_package)"
    if [[ -z "$kpkg" ]]; then
        kapt_update_once
        kpkg="$(kernel_package)"
    fi
    [[ -z "$kpkg" ]] || echo "$(lists_stamp) $kpkg" >"$resolved_file"
fi
if [[ -z "$kpkg" ]]; then
    # No package lists and no network: keep using what was built before.
    if [[ -f "$SOFTROCE_CACHE_DIR/current.env" ]]; then
        ((quiet)) || progress "cannot resolve linux-image-amd64 in $KERNEL_SUITE; using the cached kernel"
        exit 0
    fi
    softroce_die "cannot find the kernel package linux-image-amd64 depends on in $KERNEL_SUITE"
fi
kver="${kpkg#linux-image-}"
kdir="$SOFTROCE_CACHE_DIR/$kver"

build_kernel() {
    local tmp root deb ko rel line deps
    progress "kernel $kver: downloading $kpkg"
    rm -rf "$kdir"
    mkdir -p "$kdir"
    tmp="$(mktemp -d "$SOFTROCE_CACHE_DIR/kernel.XXXXXX")"
    # shellcheck disable=SC2064 # expand now: tmp is local
    trap "rm -rf '$tmp'" EXIT
    if ! (cd "$tmp" && apt-get "${kapt[@]}" download -qq "$kpkg" >/dev/null); then
        # Stale package lists name a version the mirror no longer has.
        kapt_update_once
        (cd "$tmp" && apt-get "${kapt[@]}" download -qq "$kpkg" >/dev/null)
    fi
    deb="$(echo "$tmp"/*.deb)"
    [[ -f "$deb" ]] || softroce_die "apt-get download $kpkg left no .deb"

    progress "kernel $kver: unpacking"
    root="$tmp/root"
    dpkg-deb -x "$deb" "$root"
    [[ -d "$root/lib/modules/$kver" ]] || softroce_die "$kpkg has no lib/modules/$kver"
    depmod -b "$root" "$kver"
    cp "$root/boot/vmlinuz-$kver" "$kdir/bzImage"
    cp "$root/boot/config-$kver" "$kdir/config"

    # The modules the VM loads, in dependency order, paths relative to
    # lib/modules/<kver>/ (busybox insmod loads them one by one).
    progress "kernel $kver: collecting modules ${MODULES[*]}"
    mkdir -p "$kdir/modules"
    : >"$kdir/modules/order"
    for ko in "${MODULES[@]}"; do
        deps="$(modprobe -d "$root" -S "$kver" --show-depends "$ko" 2>&1)" ||
            softroce_die "module $ko not found in $kpkg: $deps"
        while read -r line; do
            # "builtin NAME" lines need nothing loaded.
            [[ "$line" == insmod\ * ]] || continue
            line="${line#insmod }"
            line="${line%% *}"
            rel="${line#"$root/lib/modules/$kver/"}"
            # Newer kernels ship xz-compressed modules: stored plain, as
            # busybox insmod loads them.
            rel="${rel%.xz}"
            grep -qxF "$rel" "$kdir/modules/order" && continue
            [[ "$rel" == *.ko ]] || softroce_die "unsupported module format: $rel"
            mkdir -p "$kdir/modules/$(dirname "$rel")"
            if [[ "$line" == *.ko.xz ]]; then
                xz -dc "$line" >"$kdir/modules/$rel"
            else
                cp "$line" "$kdir/modules/$rel"
            fi
            printf '%s\n' "$rel" >>"$kdir/modules/order"
        done <<<"$deps"
    done

    progress "kernel $kver: extracting vmlinux for PVH boot"
    if extract_vmlinux "$kdir/bzImage" "$kdir/vmlinux.tmp"; then
        mv "$kdir/vmlinux.tmp" "$kdir/vmlinux"
    else
        rm -f "$kdir/vmlinux.tmp"
        progress "kernel $kver: no PVH vmlinux; falling back to the bzImage (slower boot)"
    fi
    rm -rf "$tmp"
    trap - EXIT
    echo "$kpkg" >"$kdir/kernel.ok"
}

# Read a little-endian unsigned integer of $3 bytes at offset $2 of file $1.
read_le() {
    od -An -tu"$3" -j "$2" -N "$3" "$1" | tr -d ' '
}

# The bzImage's setup header says where its compressed payload (the
# stripped vmlinux ELF, xz or zstd) sits: decompress just that. Under TCG this saves
# the ~6 s the in-kernel xz decompressor would take at every boot.
extract_vmlinux() {
    local bz="$1" out="$2" setup_sects pm_start payload_offset payload_length magic
    setup_sects="$(read_le "$bz" $((0x1f1)) 1)"
    ((setup_sects != 0)) || setup_sects=4
    pm_start=$(((setup_sects + 1) * 512))
    payload_offset="$(read_le "$bz" $((0x248)) 4)"
    payload_length="$(read_le "$bz" $((0x24c)) 4)"
    magic="$(od -An -tx1 -j $((pm_start + payload_offset)) -N 6 "$bz" | tr -d ' ')"
    # The kernel's build appends the payload's size (4 bytes): xz stops
    # before it by itself, zstd must not be given it.
    local decompress
    case "$magic" in
        fd377a585a00) decompress=(xz -dc --single-stream) ;; # 6.1
        28b52ffd*)                                          # 6.12
            decompress=(zstd -dcq)
            payload_length=$((payload_length - 4))
            ;;
        *) return 1 ;;
    esac
    # tail is cut short by head (SIGPIPE): that is expected, not a failure.
    { tail -c +$((pm_start + payload_offset + 1)) "$bz" || true; } |
        head -c "$payload_length" | "${decompress[@]}" >"$out" 2>/dev/null || return 1
    # It must be an ELF with the Xen PVH entry note (type 0x12).
    readelf -h "$out" >/dev/null 2>&1 || return 1
    readelf -n "$out" 2>/dev/null |
        grep -E 'Xen[[:space:]].*\(0x00000012\)' >/dev/null || return 1
}

if ((force)) || [[ ! -f "$kdir/kernel.ok" ]]; then
    build_kernel
fi

# 3. Base initramfs --------------------------------------------------------

image_key() {
    {
        echo "format=$FORMAT_VERSION kernel=$kver"
        dpkg-query -W -f '${Package}=${Version}\n' "${IMAGE_PACKAGES[@]}"
        cat "$here/setup.sh" "$here/lib.sh" "$here/init.sh"
        cat "$kdir/modules/order"
    } | sha256sum | cut -d' ' -f1
}

build_base() {
    local staging prog lib applet target drv
    progress "base initramfs: staging"
    staging="$(mktemp -d "$SOFTROCE_CACHE_DIR/base.XXXXXX")"
    # shellcheck disable=SC2064 # expand now: staging is local
    trap "rm -rf '$staging'" EXIT

    # Merged /usr: the top-level directories are symlinks into /usr.
    mkdir -p "$staging"/usr/{bin,sbin,lib,lib64} "$staging/usr/lib/$SOFTROCE_TRIPLET" \
        "$staging"/{dev,proc,sys,tmp,run,root,etc,mnt} "$staging/etc/softroce"
    ln -s usr/bin "$staging/bin"
    ln -s usr/sbin "$staging/sbin"
    ln -s usr/lib "$staging/lib"
    ln -s usr/lib64 "$staging/lib64"
    chmod 1777 "$staging/tmp"
    # The kernel opens /dev/console for /init before devtmpfs is mounted.
    mknod -m 600 "$staging/dev/console" c 5 1
    mknod -m 666 "$staging/dev/null" c 1 3

    softroce_stage_file "$staging" /bin/busybox /usr/bin/busybox
    for prog in "${BASE_PROGRAMS[@]}"; do
        [[ -x "$prog" ]] || softroce_die "missing host program $prog"
        softroce_stage_with_libs "$staging" "$prog"
    done
    for lib in "${DLOPEN_LIBS[@]}"; do
        [[ -e "$lib" ]] || softroce_die "missing host library $lib"
        softroce_stage_with_libs "$staging" "$lib"
    done
    mkdir -p "$staging/etc/libibverbs.d"
    drv=/etc/libibverbs.d/rxe.driver
    [[ -f "$drv" ]] || softroce_die "missing $drv (ibverbs-providers)"
    cp "$drv" "$staging$drv"

    # Busybox applets for everything not provided by a real program above.
    while read -r applet; do
        target="$(softroce_vm_path "/$applet")"
        [[ -e "$staging$target" || -L "$staging$target" ]] && continue
        mkdir -p "$staging$(dirname "$target")"
        ln -s /usr/bin/busybox "$staging$target"
    done < <(/bin/busybox --list-full)

    mkdir -p "$staging/usr/lib/modules"
    cp -a "$kdir/modules" "$staging/usr/lib/modules/$kver"
    mv "$staging/usr/lib/modules/$kver/order" "$staging/etc/softroce/modules.order"
    echo "$kver" >"$staging/etc/softroce/kernel-version"

    cat >"$staging/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/bin/sh
nobody:x:65534:65534:nobody:/nonexistent:/bin/false
EOF
    cat >"$staging/etc/group" <<'EOF'
root:x:0:
nogroup:x:65534:
EOF
    cat >"$staging/etc/hosts" <<'EOF'
127.0.0.1 localhost softroce-vm
::1 localhost ip6-localhost
EOF
    echo 'hosts: files' >"$staging/etc/nsswitch.conf"
    echo softroce-vm >"$staging/etc/hostname"
    printf '/usr/local/lib\n/usr/lib/%s\n/usr/lib\n' "$SOFTROCE_TRIPLET" >"$staging/etc/ld.so.conf"
    ldconfig -r "$staging"

    install -m 755 "$here/init.sh" "$staging/init"

    progress "base initramfs: packing"
    (cd "$staging" && find . -mindepth 1 | LC_ALL=C sort |
        cpio -o -H newc -R 0:0 --quiet) | gzip -6 >"$kdir/base.cpio.gz.tmp"
    mv "$kdir/base.cpio.gz.tmp" "$kdir/base.cpio.gz"
    rm -rf "$staging"
    trap - EXIT
}

key="$(image_key)"
if ((force)) || [[ ! -f "$kdir/base.cpio.gz" ]] || [[ "$(cat "$kdir/base.key" 2>/dev/null)" != "$key" ]]; then
    build_base
    echo "$key" >"$kdir/base.key"
fi

kernel_image="$kdir/bzImage"
[[ -f "$kdir/vmlinux" ]] && kernel_image="$kdir/vmlinux"

cat >"$SOFTROCE_CACHE_DIR/current.env.tmp" <<EOF
SOFTROCE_KERNEL_VERSION=$kver
SOFTROCE_KERNEL_IMAGE=$kernel_image
SOFTROCE_BASE_INITRD=$kdir/base.cpio.gz
EOF
mv "$SOFTROCE_CACHE_DIR/current.env.tmp" "$SOFTROCE_CACHE_DIR/current.env"

# Keep one kernel version: older ones are stale.
for old in "$SOFTROCE_CACHE_DIR"/*/; do
    old="${old%/}"
    [[ "$old" == "$kdir" ]] && continue
    [[ -f "$old/kernel.ok" ]] || continue
    progress "removing stale cache $(basename "$old")"
    rm -rf "$old"
done

((quiet)) || progress "ready: kernel $kver ($(basename "$kernel_image")), cache $SOFTROCE_CACHE_DIR"
