#!/bin/sh
# A Debian bookworm base image made from Debian's packages, for a machine that cannot pull from Docker Hub:
# debootstrap (minbase) with Python 3.11 and its venv module, CA certificates, wget (the NATS healthcheck)
# and tini, imported into podman as $KEEL_BASE_IMAGE.
#
#   infra/images/base.sh            (as root; does nothing when the image exists with these packages)
#
# The root filesystem is cached as a tarball in $KEEL_BUILD_CACHE (default /var/tmp/keel-build), so a second
# machine state only imports it. Needs debootstrap and podman (Debian's packages) and Debian's mirror.
set -eu
image="${KEEL_BASE_IMAGE:-localhost/keel-base:bookworm}"
cache="${KEEL_BUILD_CACHE:-/var/tmp/keel-build}"
mirror="${KEEL_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
packages="python3,python3-venv,ca-certificates,wget,tini"

# The image records the packages it was made with: a changed list makes it anew.
if [ "$(podman image inspect --format '{{index .Labels "keel.packages"}}' "$image" 2>/dev/null)" = "$packages" ]; then
    exit 0
fi
mkdir -p "$cache"
tarball="$cache/bookworm-$(echo "$packages" | cksum | cut -d' ' -f1).tar"
if [ ! -s "$tarball" ]; then
    root="$cache/rootfs.$$"
    rm -rf "$root"
    echo "debootstrap bookworm into $root ($packages)" >&2
    debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" >"$cache/debootstrap.log" 2>&1 \
        || { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
    # No package lists or downloaded archives in the image.
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" --numeric-owner -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
fi
podman import --change 'CMD ["/bin/bash"]' --change "LABEL keel.packages=$packages" "$tarball" "$image" >/dev/null
echo "imported $image from $tarball" >&2
