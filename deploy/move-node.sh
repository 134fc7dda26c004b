#!/usr/bin/env bash
# Move one node between the device plugin and the DRA driver, the runbook of docs/dra.md
# ("Moving a node between the device plugin and the driver"): cordon, let the pods placed before
# the cordon start, label the node hyperlight.dev/dra=moving (neither daemon runs there) until the
# old daemon's pod is gone, then label it for the new one (hyperlight.dev/dra=true for the driver,
# no label for the device plugin), wait for it, its device and the node's allocatable, uncordon.
# So the kubelet never has both. Pods the device plugin served keep their device through a move
# to the driver, and the 1.36 kubelet admits the driver's pods beside them: they are listed.
#
#   deploy/move-node.sh --to dra NODE
#   deploy/move-node.sh --to device-plugin NODE
#
# --dry-run runs only the reads and prints the commands that would change the cluster.
# --to device-plugin refuses while pods the driver serves run on the node: each one ended after the
# driver left stays Terminating until the driver serves the node again. --keep-pods moves it anyway.
# --namespace NS (default hyperlight-system); --timeout SECONDS for each wait (default 300).
# KUBECTL overrides kubectl. A failed step leaves the node cordoned and says so.
set -Eeuo pipefail

usage() {  # a usage error: to stderr, exit 2
    sed -n '2,18s/^# \{0,1\}//p' "$0" >&2
    exit 2
}

help() {  # asked for: to stdout, exit 0
    sed -n '2,18s/^# \{0,1\}//p' "$0"
    exit 0
}

kubectl=${KUBECTL:-kubectl}
to=""
namespace=hyperlight-system
timeout=300
dry_run=false
keep_pods=false
nodes=()

while [ $# -gt 0 ]; do
    case "$1" in
        --to) [ $# -ge 2 ] || usage; to=$2; shift 2 ;;
        --to=*) to=${1#*=}; shift ;;
        --namespace|-n) [ $# -ge 2 ] || usage; namespace=$2; shift 2 ;;
        --namespace=*) namespace=${1#*=}; shift ;;
        --timeout) [ $# -ge 2 ] || usage; timeout=$2; shift 2 ;;
        --timeout=*) timeout=${1#*=}; shift ;;
        --dry-run) dry_run=true; shift ;;
        --keep-pods) keep_pods=true; shift ;;
        -h|--help) help ;;
        -*) echo "unknown option: $1" >&2; usage ;;
        *) nodes+=("$1"); shift ;;
    esac
done

case "$to" in
    dra|device-plugin) ;;
    *) echo "--to must be dra or device-plugin" >&2; usage ;;
esac
if [ ${#nodes[@]} -ne 1 ]; then
    echo "give exactly one node" >&2
    usage
fi
case "$timeout" in
    ''|*[!0-9]*) echo "--timeout must be a number of seconds" >&2; usage ;;
esac
node=${nodes[0]}
resource='hyperlight\.dev/hypervisor'  # in a kubectl JSONPath

change() {  # a command that changes the cluster: printed under --dry-run, else run
    if $dry_run; then
        printf 'would run:'; printf ' %q' "$kubectl" "$@"; printf '\n'
    else
        "$kubectl" "$@"
    fi
}

say() { echo "move-node: $*"; }

wait_for() {  # wait_for DESCRIPTION COMMAND...: until COMMAND succeeds, or the timeout
    local what=$1; shift
    if $dry_run; then
        say "would wait for $what"
        return 0
    fi
    say "waiting for $what"
    local deadline=$((SECONDS + timeout))
    until "$@"; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            say "timed out after ${timeout}s waiting for $what" >&2
            return 1
        fi
        sleep 2
    done
}

daemon_pods() {  # the names of the DaemonSet's pods (app.kubernetes.io/name=$1) on the node
    "$kubectl" -n "$namespace" get pods -l "app.kubernetes.io/name=$1" \
        --field-selector "spec.nodeName=$node" -o name
}
daemon_ready() {
    "$kubectl" -n "$namespace" get pods -l "app.kubernetes.io/name=$1" \
        --field-selector "spec.nodeName=$node" \
        -o 'jsonpath={range .items[*]}{.status.conditions[?(@.type=="Ready")].status}{"\n"}{end}' |
        grep -qx True
}
daemon_gone() { [ -z "$(daemon_pods "$1")" ]; }
node_field() { "$kubectl" get node "$node" -o "jsonpath={$1}"; }
allocatable_zero() { case "$(node_field ".status.allocatable.$resource")" in ''|0) return 0 ;; esac; return 1; }
allocatable_up() { ! allocatable_zero; }
slice_published() {
    [ -n "$("$kubectl" get resourceslices \
        --field-selector "spec.driver=hyperlight.dev,spec.nodeName=$node" -o name)" ]
}

starting() {  # workload pods asking for the device, placed on the node and not started yet
    "$kubectl" get pods -A --field-selector "spec.nodeName=$node,status.phase=Pending" \
        -o "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name}|{.spec.containers[*].resources.limits.$resource}|{.spec.resourceClaims[*].name}{\"\\n\"}{end}" |
        while IFS='|' read -r pod slots claims; do
            [ -n "$pod" ] || continue
            case "$pod" in "$namespace"/*) continue ;; esac
            if [ -n "$slots$claims" ]; then echo "$pod"; fi
        done
}
none_starting() { [ -z "$(starting)" ]; }

holding() {  # the workload pods on the node that hold the device the way being left
    "$kubectl" get pods -A \
        --field-selector "spec.nodeName=$node,status.phase!=Succeeded,status.phase!=Failed" \
        -o "jsonpath={range .items[*]}{.metadata.namespace}/{.metadata.name}|{.spec.containers[*].resources.limits.$resource}|{.status.extendedResourceClaimStatus.resourceClaimName}{\" \"}{.spec.resourceClaims[*].name}{\"\\n\"}{end}" |
        while IFS='|' read -r pod slots claims; do
            [ -n "$pod" ] || continue
            case "$pod" in "$namespace"/*) continue ;; esac
            claims=${claims// /}
            if [ "$to" = dra ]; then
                # Served by the device plugin: asks the resource, no claim the scheduler made.
                if [ -n "$slots" ] && [ -z "$claims" ]; then echo "$pod"; fi
            elif [ -n "$claims" ]; then
                echo "$pod"  # holds a claim, perhaps the driver's
            fi
        done
}

was_cordoned=$(node_field .spec.unschedulable)
left_cordoned() {
    if $dry_run; then
        say "stopped (dry run: nothing changed)" >&2
    else
        say "stopped: $node is left cordoned (docs/dra.md says how to go on or back out)" >&2
    fi
}
trap 'left_cordoned' ERR

change cordon "$node"
# A pod the scheduler placed just before the cordon is served the old way: admitted and prepared
# while the old daemon still runs (one that met the driver gone stayed Pending on the real cluster).
wait_for "the pods placed on $node before the cordon to start" none_starting

held=$(holding)
if [ -n "$held" ]; then
    if [ "$to" = dra ]; then
        # Proved on the 1.36 cluster (tests/test_cluster_migrate.py): they keep their device, and
        # the kubelet skips its device manager for a pod the driver serves.
        say "these pods keep the device the device plugin gave them:"
        echo "$held"
    elif $keep_pods; then
        say "moving with these pods the driver serves (--keep-pods): each one ended before the driver serves $node again stays Terminating:"
        echo "$held"
    else
        say "the driver serves these pods; let them finish or drain them, or give --keep-pods:" >&2
        echo "$held" >&2
        left_cordoned
        trap - ERR
        exit 1
    fi
fi

# The old daemon's pod goes before the new one's comes: hyperlight.dev/dra=moving keeps both off.
change label node "$node" hyperlight.dev/dra=moving --overwrite
if [ "$to" = dra ]; then
    wait_for "the device plugin's pod to leave $node" daemon_gone hyperlight-device-plugin
    change label node "$node" hyperlight.dev/dra=true --overwrite
    wait_for "the driver's pod on $node to be Ready" daemon_ready hyperlight-dra
    wait_for "the driver's ResourceSlice for $node" slice_published
    wait_for "$node's allocatable hyperlight.dev/hypervisor to be 0" allocatable_zero
else
    wait_for "the driver's pod to leave $node" daemon_gone hyperlight-dra
    change label node "$node" hyperlight.dev/dra-
    wait_for "the device plugin's pod on $node to be Ready" daemon_ready hyperlight-device-plugin
    wait_for "$node's allocatable hyperlight.dev/hypervisor to be above 0" allocatable_up
fi

trap - ERR
if [ "$was_cordoned" = true ]; then
    say "$node was cordoned before: left cordoned"
else
    change uncordon "$node"
fi
if $dry_run; then
    say "dry run: nothing changed"
else
    say "$node now serves hyperlight.dev/hypervisor through the $to"
fi
