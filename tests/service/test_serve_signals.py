"""Every service stopped by SIGTERM (Kubernetes, ``handoff up``) or SIGINT (Ctrl-C in its terminal) shuts down
gracefully and exits 0, its log ending on uvicorn's last line: no KeyboardInterrupt traceback, no exit by the
signal, no false "before serving" line."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest

from tests.support.procs import ServerProcess, wait_until
from tests.support.streams import GenerationClient

pytestmark = pytest.mark.timeout(120)

SERVICES = {"lb": ["--node", "http://127.0.0.1:1"], "node_sidecar": ["--engine-url", "http://127.0.0.1:1"],
            "node_engine": ["--model-path", "builtin:tiny", "--num-threads", "1"]}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("module", list(SERVICES))
def test_a_stopped_service_exits_0_after_its_graceful_shutdown(proc_log_dir: Path, module: str,
                                                                 sig: signal.Signals) -> None:
    """uvicorn puts back the handlers it found and raises the caught signal again once it has shut down: the
    default action ended the LB and the sidecar by the signal (143), the engine's start-up handler logged "SIGTERM
    before serving" and exited 143, and SIGINT became a KeyboardInterrupt traceback."""
    proc = ServerProcess(module, SERVICES[module], log_dir=proc_log_dir, name=f"stopped-{module}-{sig.name}")
    try:
        proc.start(timeout=60)
        assert proc.proc is not None
        proc.proc.send_signal(sig)
        code = proc.proc.wait(30)
        log = proc.log_path.read_text()
        assert code == 0, (code, proc.log_tail())
        assert "Finished server process" in log and "Traceback" not in log and "before serving" not in log, log
    finally:
        proc.kill()


def test_requests_cut_by_the_shutdown_timeout_get_a_clear_error(proc_log_dir: Path) -> None:
    """Past ``--shutdown-timeout`` uvicorn cancels the requests still in flight: one whose answer had not
    started got a ``text/plain`` 500 "Internal Server Error" (a release in flight when ``handoff up`` stopped
    got it from the LB), a stream just stopped, and the log had a traceback per request. Now: a 503 envelope
    naming the shutdown, a final error event without ``[DONE]``, one log line each. The engine thread is held in
    a stall (the fault drill) so that both requests are still running when the timeout passes."""
    drill = proc_log_dir / "cut_drill.json"
    engine = ServerProcess("node_engine", ["--model-path", "builtin:tiny", "--num-threads", "1",
                                           "--fault-drill-file", str(drill), "--shutdown-timeout", "1"],
                           log_dir=proc_log_dir, name="cut_engine")
    try:
        engine.start(timeout=60)
        params = {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}
        stream, answer = (GenerationClient(engine.url + "/generate", {"text": "go on", "stream": stream,
                                                                      "sampling_params": params}, timeout=60)
                          for stream in (True, False))
        stream.start()
        answer.start()
        wait_until(lambda: "handoff_engine_running_requests 2.0" in httpx.get(engine.url + "/metrics").text,
                   timeout=30, what="both requests running")
        armed = drill.with_suffix(".tmp")
        armed.write_text(json.dumps({"kind": "stall", "at": "decode", "delay_s": 6}))
        armed.replace(drill)
        wait_until(lambda: drill.with_name(drill.name + ".fired").exists(), timeout=20, what="the engine stalled")
        assert engine.proc is not None
        engine.proc.send_signal(signal.SIGTERM)
        cut = answer.finish(timeout=30)
        assert cut.status == 503 and cut.body["error"]["type"] == "unavailable", cut
        assert "shutting down" in cut.body["error"]["message"] and "(1 s)" in cut.body["error"]["message"], cut
        streamed = stream.finish(timeout=30)
        assert streamed.status == 200 and not streamed.saw_done and streamed.error is None, streamed
        assert streamed.events[-1]["error"]["type"] == "unavailable", streamed.events[-1]
        assert engine.proc.wait(30) == 0
        log = engine.log_path.read_text()
        assert log.count("cut by the shutdown") == 2 and "Traceback" not in log, engine.log_tail()
    finally:
        engine.kill()
