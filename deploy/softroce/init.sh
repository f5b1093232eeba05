#!/bin/sh
# /init of the SoftRoCE VM. Runs under busybox sh as PID 1.
#
# Console (ttyS0, kept in a log file on the host): this script's own lines,
# the kernel's messages, and the final "SOFTROCE_EXIT_CODE=N" marker (or
# "SOFTROCE_SETUP_FAILED: why").
# ttyS1 (streamed to the host's stdout): the program's stdout and stderr.
#
# The run is described by files run-in-vm.sh puts in the per-run overlay:
#   /etc/softroce/run.env  "export K='V'" lines for the program
#   /etc/softroce/run.cmd  sets SOFTROCE_WORKDIR and "set -- PROGRAM ARGS..."
#
# busybox sh prefers its own applets to PATH: real programs are called by
# full path (busybox `ip` cannot do what rxe needs).

PATH=/usr/sbin:/usr/bin
HOME=/root
export PATH HOME

say() {
    echo "softroce-init: $*"
}

power_off() {
    sync
    echo o >/proc/sysrq-trigger
    # The power-off is asynchronous; never return (PID 1 must not exit).
    while :; do sleep 60; done
}

# Markers for the host go through printk (/dev/kmsg): the kernel writes its
# serial console synchronously, so they are in the log before power-off.
marker() {
    echo "<3>$*" >/dev/kmsg
}

fail() {
    echo "softroce-init: setup failed: $*"
    marker "SOFTROCE_SETUP_FAILED: $*"
    power_off
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts devpts /dev/pts
# / is the initramfs's own tmpfs: /tmp and /run stay on it (a tmpfs mounted
# there would hide files the overlay put there).
mount -t tmpfs -o mode=1777 tmpfs /dev/shm
exec </dev/null >/dev/console 2>&1
hostname softroce-vm

read -r kver </etc/softroce/kernel-version
[ "$kver" = "$(uname -r)" ] || fail "modules are for $kver, kernel is $(uname -r)"

# Libraries of the per-run overlay join the loader's cache.
/usr/sbin/ldconfig || fail "ldconfig"

while read -r rel; do
    insmod "/usr/lib/modules/$kver/$rel" || fail "insmod $rel"
done </etc/softroce/modules.order

/usr/sbin/ip link set lo up || fail "ip link set lo up"
/usr/bin/rdma link add rxe0 type rxe netdev lo || fail "rdma link add rxe0"

# The GID table fills in asynchronously. GID 0 (link-local) fails at RTR on
# lo; the IPv4-mapped one for 127.0.0.1 works. Poll for it, bounded (10 s).
want=0000:0000:0000:0000:0000:ffff:7f00:0001
gid_dir=/sys/class/infiniband/rxe0/ports/1/gids
gid_index=
tries=0
while [ -z "$gid_index" ] && [ "$tries" -lt 200 ]; do
    n=0
    while [ "$n" -lt 64 ]; do
        gid=
        read -r gid <"$gid_dir/$n" 2>/dev/null
        if [ "$gid" = "$want" ]; then
            gid_index=$n
            break
        fi
        n=$((n + 1))
    done
    [ -n "$gid_index" ] && break
    tries=$((tries + 1))
    usleep 50000
done
[ -n "$gid_index" ] || fail "no GID ::ffff:127.0.0.1 on rxe0 after 10 s"
read -r uptime_s _ </proc/uptime
say "rxe0 up on lo, GID index $gid_index (::ffff:127.0.0.1), uptime ${uptime_s}s"

export RDMA_DEVICE=rxe0
export RXE_GID_INDEX="$gid_index"
export RXE_GID=::ffff:127.0.0.1
export SOFTROCE_VM=1
export SOFTROCE_KERNEL_VERSION="$kver"

# busybox ash has ulimit -l (POSIX does not say so).
# shellcheck disable=SC3045
ulimit -l unlimited || fail "ulimit -l unlimited"

[ -f /etc/softroce/run.cmd ] || fail "no /etc/softroce/run.cmd (no program given)"
SOFTROCE_WORKDIR=/tmp
# shellcheck disable=SC1091 # written by run-in-vm.sh
[ -f /etc/softroce/run.env ] && . /etc/softroce/run.env
# shellcheck disable=SC1091 # written by run-in-vm.sh
. /etc/softroce/run.cmd
cd "$SOFTROCE_WORKDIR" || fail "cd $SOFTROCE_WORKDIR"

stty -F /dev/ttyS1 raw -echo || fail "stty ttyS1"
say "running: $*"
"$@" </dev/null >/dev/ttyS1 2>&1
rc=$?
# stty sets the mode with TCSADRAIN: it returns once the UART has sent all
# the program wrote, so no output is lost at power-off.
stty -F /dev/ttyS1 raw -echo
read -r uptime_s _ </proc/uptime
marker "SOFTROCE_EXIT_CODE=$rc uptime=${uptime_s}s"
power_off
