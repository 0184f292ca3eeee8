"""``handoff up`` starts a working cluster, reports dead children, and leaves nothing behind."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from tests.support.procs import REPO_ROOT, wait_until


def test_up_starts_serves_and_stops_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "up.out"
    with open(out, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "handoff", "up", "--nodes", "2", "--port", "0",
                                 "--log-dir", str(tmp_path / "logs")], stdout=sink, stderr=subprocess.STDOUT,
                                cwd=REPO_ROOT)
    try:
        text = wait_until(lambda: (t := out.read_text()) and "Ctrl-C" in t and t, timeout=120,
                          what="the banner")
        lb = re.search(r"LB\s+(http://\S+)", text).group(1)
        assert "curl -s" in text and "/release_memory_occupation" in text and "/generate" in text
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == 5  # 2 engines, 2 sidecars, 1 LB
        r = httpx.post(lb + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 3}}, timeout=30)
        assert r.status_code == 200
        # a child that dies is reported at once, with its log
        engine = next(c for c in children if "node_engine" in " ".join(c.cmdline()))
        engine.kill()
        wait_until(lambda: "exited with code" in out.read_text(), timeout=10, what="the death report")
        assert "last lines of" in out.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [c.cmdline() for c in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
