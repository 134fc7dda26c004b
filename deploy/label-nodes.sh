#!/usr/bin/env bash
# Label nodes for Hyperlight: the DaemonSets run only on nodes labelled
# hyperlight.dev/enabled=true, and workloads pick a hypervisor with the
# hyperlight.dev/hypervisor=kvm|mshv label.
#
#   deploy/label-nodes.sh --hypervisor kvm NODE...
#   deploy/label-nodes.sh --hypervisor mshv --selector agentpool=hyperlight
#   deploy/label-nodes.sh --remove NODE...
#
# --dry-run prints what would change. KUBECTL overrides the kubectl binary.
# Check a node's hypervisor on the node itself: /dev/kvm (KVM) or /dev/mshv
# (Microsoft Hypervisor) must be a character device.
set -euo pipefail

usage() {  # a usage error: to stderr, exit 2
    sed -n '2,12s/^# \{0,1\}//p' "$0" >&2
    exit 2
}

help() {  # asked for: to stdout, exit 0
    sed -n '2,12s/^# \{0,1\}//p' "$0"
    exit 0
}

kubectl=${KUBECTL:-kubectl}
hypervisor=""
selector=""
remove=false
dry_run=()
nodes=()

while [ $# -gt 0 ]; do
    case "$1" in
        --hypervisor) [ $# -ge 2 ] || usage; hypervisor=$2; shift 2 ;;
        --hypervisor=*) hypervisor=${1#*=}; shift ;;
        --selector|-l) [ $# -ge 2 ] || usage; selector=$2; shift 2 ;;
        --selector=*) selector=${1#*=}; shift ;;
        --remove) remove=true; shift ;;
        --dry-run) dry_run=(--dry-run=client); shift ;;
        -h|--help) help ;;
        -*) echo "unknown option: $1" >&2; usage ;;
        *) nodes+=("$1"); shift ;;
    esac
done

if [ -n "$selector" ] && [ ${#nodes[@]} -gt 0 ]; then
    echo "give node names or --selector, not both" >&2
    usage
fi
if [ -z "$selector" ] && [ ${#nodes[@]} -eq 0 ]; then
    echo "no nodes given" >&2
    usage
fi

if $remove; then
    labels=(hyperlight.dev/enabled- hyperlight.dev/hypervisor-)
else
    case "$hypervisor" in
        kvm|mshv) ;;
        *) echo "--hypervisor must be kvm or mshv" >&2; usage ;;
    esac
    labels=(hyperlight.dev/enabled=true "hyperlight.dev/hypervisor=$hypervisor")
fi

if [ -n "$selector" ]; then
    targets=(--selector "$selector")
else
    targets=("${nodes[@]}")
fi

"$kubectl" label nodes "${targets[@]}" "${labels[@]}" --overwrite ${dry_run[@]+"${dry_run[@]}"}
