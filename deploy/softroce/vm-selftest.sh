#!/bin/sh
# Inside the SoftRoCE VM: check the rxe device three ways, then run perftest.
#
#   vm-selftest.sh VM_PERFTEST_SCRIPT [VERBS_DLOPEN_CHECK]
#
# Prints "SELFTEST <check> ok|FAILED" lines; exits 1 if any check failed.
set -u

perftest_script="$1"
dlopen_check="${2:-}"
status=0

check() {
    name="$1"
    shift
    if "$@"; then
        echo "SELFTEST $name ok"
    else
        echo "SELFTEST $name FAILED"
        status=1
    fi
}

# shellcheck disable=SC2317 # called through check
devinfo_active() {
    ibv_devinfo -d "$RDMA_DEVICE" >/tmp/devinfo.txt 2>&1
    rc=$?
    cat /tmp/devinfo.txt
    [ "$rc" = 0 ] && grep -q PORT_ACTIVE /tmp/devinfo.txt
}

check rxe_sysfs test -d "/sys/class/infiniband/$RDMA_DEVICE"
check ibv_devinfo devinfo_active
if [ -n "$dlopen_check" ]; then
    check verbs_dlopen "$dlopen_check"
fi
check perftest "$perftest_script"
exit "$status"
