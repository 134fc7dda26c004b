#!/usr/bin/env bash
# Run the whole node locally: build the image from the Dockerfile on a Debian
# stand-in base (no registry needed), then run both DaemonSets (the Helm chart's
# default rendering) and the example workload from it in podman, as the rendered
# manifests say, with the test suite's kubelet emulator in the kubelet's place
# (tests/test_node.py).
#
#   deploy/local-node.sh build     build the image; prints its name
#   deploy/local-node.sh test      build, then run the node test (pytest -m node)
#
# Needs root, podman, runc, mmdebstrap and /dev/kvm; helm and kubectl are fetched
# into .tools/bin (.ci/install-helm) where missing. Environment:
#   HLPLUGIN_IMAGE    image name to build (default localhost/hlplugin:local-node)
#   HLPLUGIN_CACHE    where the stand-in base tarball is kept (/var/cache/hlplugin)
#   CONTEXT           build context (default: the repository root)
#   PYTHON            python with the package and its test extras (default:
#                     the repository's .venv/bin/python, else python3)
set -euo pipefail

usage() {
    sed -n '2,19s/^# \{0,1\}//p' "$0" >&2
    exit 2
}

repo=$(cd "$(dirname "$0")/.." && pwd)
image=${HLPLUGIN_IMAGE:-localhost/hlplugin:local-node}
cache=${HLPLUGIN_CACHE:-/var/cache/hlplugin}
context=${CONTEXT:-$repo}
# The flags that work on a cgroup v1 machine without systemd (see docs/operations.md).
podman=(podman --runtime runc --cgroup-manager=cgroupfs --events-backend=file)

# The stand-in for python:3.12-slim-bookworm: Debian's own Python (3.11) and venv.
# The cache key is this list, so changing it builds a new base.
packages=python3,python3-venv,python-is-python3,ca-certificates
suite=bookworm
key=$(printf '%s %s minbase\n' "$suite" "$packages" | sha256sum | cut -c1-12)
base=localhost/hlplugin-base:$suite-$key

build_base() {
    if "${podman[@]}" image exists "$base"; then
        return
    fi
    local tarball=$cache/base-$suite-$key.tar
    if [ ! -s "$tarball" ]; then
        mkdir -p "$cache"
        echo "local-node: building the stand-in base ($suite: $packages) into $tarball" >&2
        # mmdebstrap picks the output format from the name: keep the .tar suffix.
        mmdebstrap --quiet --variant=minbase --include="$packages" "$suite" "$cache/partial.tar" >&2
        mv "$cache/partial.tar" "$tarball"
    fi
    "${podman[@]}" import --quiet "$tarball" "$base" >/dev/null
}

build_image() {
    build_base
    # pip inside the build reaches the package index through this machine's TLS proxy, whose CA
    # is in the host's bundle. It is bind-mounted for the RUN steps only, through a pip.conf, so
    # neither reaches a layer of the image we ship.
    local conf
    conf=$(mktemp -d)
    trap 'rm -rf "$conf"' RETURN
    printf '[global]\ncert = /run/hlplugin-build/ca.crt\n' >"$conf/pip.conf"
    local mounts=(--volume "$conf/pip.conf:/etc/pip.conf:ro")
    local bundle=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
    if [ -s "$bundle" ]; then
        mounts+=(--volume "$bundle:/run/hlplugin-build/ca.crt:ro")
    fi
    echo "local-node: building $image from $context/Dockerfile on $base" >&2
    local previous
    previous=$("${podman[@]}" image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
    "${podman[@]}" build --quiet --format docker --network=host --ulimit nofile=4096:4096 "${mounts[@]}" \
        --build-arg "BASE_IMAGE=$base" --tag "$image" --file "$context/Dockerfile" "$context" >&2
    # The image this build replaced, now untagged: remove it unless a container still uses it.
    if [ -n "$previous" ] && [ "$previous" != "$("${podman[@]}" image inspect --format '{{.Id}}' "$image")" ]; then
        "${podman[@]}" rmi "$previous" >/dev/null 2>&1 || true
    fi
    echo "$image"
}

[ $# -ge 1 ] || usage
case "$1" in
    build) build_image ;;
    test)
        shift
        HLPLUGIN_IMAGE=$(build_image)
        export HLPLUGIN_IMAGE HLPLUGIN_IMAGE_BUILT=1
        python=${PYTHON:-}
        if [ -z "$python" ]; then
            python=python3
            if [ -x "$repo/.venv/bin/python" ]; then python=$repo/.venv/bin/python; fi
        fi
        # helm renders the chart, for the node test (and kubectl, where the machine has none).
        if ! command -v helm >/dev/null 2>&1 || ! command -v kubectl >/dev/null 2>&1; then
            PATH="$PATH:$(bash "$repo/.ci/install-helm")"
        fi
        exec "$python" -m pytest -m node "$repo/tests/test_node.py" "$@"
        ;;
    -h|--help) usage ;;
    *) echo "local-node: unknown command: $1" >&2; usage ;;
esac
