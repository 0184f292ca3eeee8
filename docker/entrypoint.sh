#!/bin/sh
# Entrypoint of the handoff image: the first argument names the process to run
# (lb, node_sidecar or node_engine), the rest are that process's own flags.
#   docker run IMAGE lb --host 0.0.0.0 --port 8000 --discover-dns mixed=nodes:8080
set -eu

usage() {
    echo "usage: IMAGE {lb|node_sidecar|node_engine} [FLAGS...]" >&2
    echo "       IMAGE {lb|node_sidecar|node_engine} --help   for a process's flags" >&2
}

if [ "$#" -eq 0 ]; then
    echo "handoff-entrypoint: no process named" >&2
    usage
    exit 64
fi

case "$1" in
    lb | node_sidecar | node_engine)
        exec python -m "$@"
        ;;
    -h | --help | help)
        usage
        exit 0
        ;;
    *)
        echo "handoff-entrypoint: unknown process '$1' (expected lb, node_sidecar or node_engine)" >&2
        usage
        exit 64
        ;;
esac
