"""``handoff up``: a local cluster in the foreground until Ctrl-C or SIGTERM."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import TextIO

from handoff.cluster.local import ClusterSpec, LocalCluster
from handoff.cluster.process import ProcessFailed, ServerProcess


def banner(cluster: LocalCluster, out: TextIO) -> None:
    spec = cluster.spec
    lb = cluster.url
    gen_auth = ' -H "Authorization: Bearer $HANDOFF_API_KEY"' if spec.api_key else ""
    # with no admin token, control calls take the API key (handoff.service.auth.admin_token_of)
    auth = ' -H "Authorization: Bearer $HANDOFF_ADMIN_TOKEN"' if spec.admin_token else gen_auth
    kinds = sorted({spec.engine_kind(i) for i in range(spec.num_nodes)})
    print(f"\nhandoff cluster up: {spec.num_nodes} node(s) ({', '.join(kinds)}), model {spec.model_path} on "
          f"{spec.device}, weights backup {spec.weights_backup}", file=out)
    print(f"  LB        {lb}", file=out)
    for node in cluster.nodes:
        print(f"  {node.name:<9} {node.sidecar.url}  (role {node.role}; engine {node.engine.url})", file=out)
    print(f"  logs      {cluster.log_dir}\n", file=out)
    print("try:", file=out)
    print(f"  curl -s {lb}/generate{gen_auth} -d '{{\"text\": \"Hello\", \"sampling_params\": "
          f"{{\"max_new_tokens\": 16}}}}'", file=out)
    print(f"  curl -s {lb}/release_memory_occupation{auth} -d '{{\"mode\": \"wait\"}}'", file=out)
    print(f"  curl -s {lb}/resume_memory_occupation{auth} -d '{{}}'", file=out)
    print(f"  curl -s {lb}/nodes", file=out)
    print(f"  curl -s {lb}/memory_occupation\n", file=out)
    print("Ctrl-C stops every process.", file=out, flush=True)


def report_death(proc: ServerProcess, out: TextIO) -> None:
    print(f"\n!! {proc.name} (pid {proc.pid}) exited with code {proc.returncode}\n{proc.log_tail(20)}\n",
          file=out, flush=True)


class Interrupted(Exception):
    """A stop signal came while the cluster was starting."""


def run_up(spec: ClusterSpec, log_dir: Path, *, out: TextIO = sys.stdout) -> int:
    """Start the cluster and keep it until SIGINT, SIGTERM or SIGHUP (a closed terminal); 0 when every process
    ran until then, 1 if one died meanwhile or the cluster could not start, 130 when stopped while starting.
    Stopping gives each process its graceful shutdown; a second signal meanwhile kills them at once.

    The processes die with this one however it ends (SIGKILL included: Linux's parent-death signal), so none
    is left behind listening on a port."""
    cluster = LocalCluster(spec, log_dir, die_with_parent=True)
    stop = threading.Event()
    starting = True
    forced: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:
        if stop.is_set():  # a second signal: no more waiting on graceful shutdowns
            forced.append(signal.Signals(signum).name)
            cluster.kill(wait=False)
            return
        stop.set()
        if starting:  # break out of the waits of a start (seconds to minutes for a model's load)
            raise Interrupted(signal.Signals(signum).name)

    # a signal this process was told to ignore (nohup's SIGHUP, a background job's SIGINT) stays ignored
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        print(f"starting {spec.num_nodes} node(s) and the LB (logs in {log_dir}) ...", file=out, flush=True)
        try:
            cluster.start()
        except ProcessFailed as exc:
            print(f"cannot start the cluster: {exc}", file=out, flush=True)
            return 1
        except Interrupted as exc:
            print(f"\n{exc}: stopping while starting ...", file=out, flush=True)
            return 130
        starting = False
        if stop.is_set():  # a signal between the end of the start and here
            return 130
        banner(cluster, out)
        reported: set[int] = set()
        while not stop.wait(0.5):
            for proc in cluster.dead_processes():
                if proc.pid not in reported:
                    reported.add(proc.pid)
                    report_death(proc, out)
        print("\nstopping (each process gets its graceful shutdown; Ctrl-C again kills them at once) ...", file=out,
              flush=True)
        return 1 if reported else 0
    finally:
        starting = False
        cluster.stop()
        if forced:  # said here, not in the handler, whose print could land inside one this thread was making
            print(f"{forced[0]} again: killed every process still stopping", file=out, flush=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
