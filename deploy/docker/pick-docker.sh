#!/bin/sh
# `make image`'s Docker client: the first that can build with BuildKit, printed as "PATH buildx" (the buildx
# plugin answers: `docker buildx build --load`) or "PATH buildkit" (a 18.09-20.10 client: BuildKit built in,
# `DOCKER_BUILDKIT=1 docker build`). Usage: pick-docker.sh [CLIENT] (CLIENT: make's DOCKER=, tried alone).
# DOCKER_CANDIDATES: the clients tried in order (default: docker on PATH, /usr/bin/docker, /usr/local/bin/docker).
# When none can build: exit 2 with the one line that fixes it on stderr (a Docker 23+ client without buildx
# fails with "the buildx component is missing").
set -u
seen=""

kind() {  # sets k to "buildx" / "buildkit" for a client that can build, else "" (and says why in $why)
    k=""
    if "$1" buildx version >/dev/null 2>&1; then k=buildx; return; fi
    v=$("$1" --version 2>/dev/null | sed -n 's/^Docker version \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')
    case "$v" in
        18.09|19.*|20.*) k=buildkit ;;
        "") why="$why; $1 does not answer --version" ;;
        *) why="$why; $1 (Docker $v) has no buildx plugin" ;;
    esac
}

try() {
    path=$(command -v "$1" 2>/dev/null) || { [ "${1#/}" = "$1" ] && why="$why; no $1 on PATH"; return 1; }
    case " $seen " in *" $path "*) return 1 ;; esac
    seen="$seen $path"
    kind "$path"
    [ -n "$k" ] && { echo "$path $k"; exit 0; }
    return 1
}

why=""
if [ -n "${1:-}" ]; then
    try "$1"
    echo "make image: DOCKER=$1 cannot build with BuildKit (${why#; }): fix: apt-get install -y docker-buildx-plugin (or docker-buildx), or make image DOCKER=/usr/bin/docker with a 20.10 client (apt-get install -y docker.io)" >&2
    exit 2
fi
for c in ${DOCKER_CANDIDATES:-docker /usr/bin/docker /usr/local/bin/docker}; do try "$c"; done
echo "make image: no Docker client here can build with BuildKit (${why#; }): fix: apt-get install -y docker.io (a 20.10 client with BuildKit, /usr/bin/docker), or install the buildx plugin (docker-buildx-plugin)" >&2
exit 2
