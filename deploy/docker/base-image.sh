#!/bin/bash
# Makes a Debian base image from Debian's own packages, for hosts that cannot pull `python:3.11-slim`:
# debootstrap writes a minimal bookworm root filesystem (Python 3.11 from Debian, venv, CA certificates), which
# `docker import` turns into an image. Needs root, debootstrap (`apt-get install debootstrap`), a running Docker
# daemon and a reachable Debian mirror.
#
#   deploy/docker/base-image.sh [TAG]        # default TAG: recsvc-base:bookworm
#   DEBIAN_SUITE=bookworm DEBIAN_MIRROR=http://deb.debian.org/debian deploy/docker/base-image.sh
#
# The image is built with `docker build --build-arg BASE_IMAGE=TAG` (`make image` does this by itself when the
# default base cannot be pulled).
set -euo pipefail

tag="${1:-recsvc-base:bookworm}"
suite="${DEBIAN_SUITE:-bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
# python3-venv brings ensurepip (the Dockerfile makes its virtualenv with it); ca-certificates: pip's HTTPS.
# Nothing else: the wheels bring their native libraries (torch and faiss their own OpenMP runtime).
packages="python3,python3-venv,ca-certificates"

if [[ $EUID -ne 0 ]]; then echo "error: debootstrap needs root" >&2; exit 2; fi
command -v debootstrap >/dev/null || { echo "error: no debootstrap (apt-get install debootstrap)" >&2; exit 2; }

root="$(mktemp -d "${TMPDIR:-/tmp}/recsvc-base.XXXXXX")"
trap 'rm -rf "$root"' EXIT
echo "debootstrap $suite from $mirror into $root (a few minutes)"
debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror"

# what the image does not need at run time: apt's package lists and caches, documentation (the packages'
# copyright files stay), man pages
chroot "$root" apt-get clean
find "$root"/usr/share/doc -mindepth 1 ! -type d ! -name copyright -delete
rm -rf "$root"/var/lib/apt/lists/* "$root"/usr/share/man/* "$root"/usr/share/info/* \
    "$root"/var/cache/debconf/*-old "$root"/var/log/*.log "$root"/tmp/*
# `python` as in the python images (Debian only ships `python3`)
ln -sf python3 "$root/usr/bin/python"

tar --numeric-owner -C "$root" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    --message "debootstrap --variant=minbase $suite ($mirror) + $packages" \
    - "$tag"
docker run --rm "$tag" python3 -c 'import sys, ssl, venv; print("base image ok: Python", sys.version.split()[0])'
