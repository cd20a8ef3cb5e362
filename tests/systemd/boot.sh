#!/bin/sh
# PID 1 of fresh pid, mount, uts, net and cgroup namespaces (see host.py): build a private root
# on a tmpfs, pivot into it and exec systemd there. The host's /, /tmp, /run, /var and /etc are
# never writable from the booted system: /usr and the given paths are read-only binds, /etc and
# /var are overlays whose writes land in this tmpfs, /tmp /var/tmp /run /root /home are tmpfs.
#   boot.sh ROOT PAYLOAD [RO_PATH...]
# ROOT: an empty directory (the tmpfs is mounted on it, in this mount namespace only)
# PAYLOAD: a directory whose tree is copied over the new root (units, ssh config, keys)
set -eu
PATH=/usr/sbin:/usr/bin:/sbin:/bin
export PATH
root=$1
payload=$2
shift 2

[ "$$" = 1 ] || { echo "boot.sh: not PID 1 of a new pid namespace" >&2; exit 1; }
mount --make-rprivate /  # nothing below propagates to the host's mounts
mount -t tmpfs -o mode=0755 ddtree-root "$root"
cd "$root"
touch .ddtree-private-root
mkdir -p usr etc var tmp run proc sys dev root home .overlay/etc/up .overlay/etc/work \
    .overlay/var/up .overlay/var/work .oldroot

for link in bin sbin lib lib32 lib64 libx32; do
    if [ -L "/$link" ]; then ln -s "$(readlink "/$link")" "$link"
    elif [ -d "/$link" ]; then mkdir "$link"; set -- "/$link" "$@"
    fi
done
mount --bind /usr usr
mount -o remount,bind,ro usr
mount -t overlay -o lowerdir=/etc,upperdir=.overlay/etc/up,workdir=.overlay/etc/work ddtree-etc etc
mount -t overlay -o lowerdir=/var,upperdir=.overlay/var/up,workdir=.overlay/var/work ddtree-var var
mount -t tmpfs -o mode=1777,nosuid,nodev ddtree-tmp tmp
mount -t tmpfs -o mode=1777,nosuid,nodev ddtree-vartmp var/tmp
mount -t tmpfs -o mode=0755,nosuid,nodev ddtree-run run
mount -t tmpfs -o mode=0700 ddtree-roothome root
mount -t tmpfs -o mode=0755 ddtree-home home
mount -t proc -o nosuid,nodev,noexec proc proc
mount -t sysfs -o ro,nosuid,nodev,noexec sysfs sys
mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 sys/fs/cgroup  # this cgroup namespace's subtree

mount -t tmpfs -o mode=0755,nosuid ddtree-dev dev
mknod -m 0666 dev/null c 1 3
mknod -m 0666 dev/zero c 1 5
mknod -m 0666 dev/full c 1 7
mknod -m 0666 dev/random c 1 8
mknod -m 0666 dev/urandom c 1 9
mknod -m 0666 dev/tty c 5 0
mkdir dev/pts dev/shm
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts dev/pts
ln -s pts/ptmx dev/ptmx
mount -t tmpfs -o mode=1777,nosuid,nodev ddtree-shm dev/shm
ln -s /proc/self/fd dev/fd
touch dev/console
mount --bind dev/null dev/console

for path in "$@"; do  # the interpreter and the repository, read-only at their own paths
    mkdir -p ".$path"
    mount --bind "$path" ".$path"
    mount -o remount,bind,ro ".$path"
done
cp -a "$payload/." .
echo ddtree-systemd-test > /proc/sys/kernel/hostname  # this uts namespace only

pivot_root . .oldroot
cd /
umount -l /.oldroot
rmdir /.oldroot
[ -f /.ddtree-private-root ] || { echo "boot.sh: pivot_root did not take" >&2; exit 1; }
exec env -i container=ddtree-test PATH=/usr/sbin:/usr/bin:/sbin:/bin \
    /lib/systemd/systemd --unit=ddtree-test.target --show-status=0 --log-target=console
