"""handoff/cluster/process.py: a child started to die with its parent never outlives a parent that died first."""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial

import pytest

from handoff.cluster.process import _die_with_parent

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


def test_a_child_whose_parent_died_before_it_ran_exits_at_once() -> None:
    """Found by review: ``handoff up`` killed while it launched left an engine behind (parent 1). A parent that
    dies between the fork and the child's ``PR_SET_PDEATHSIG`` sends no signal; the child now checks that its
    parent is still the one that started it (here another pid stands for a parent already gone)."""
    gone = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            preexec_fn=partial(_die_with_parent, os.getpid() + 1))
    kept = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            preexec_fn=partial(_die_with_parent, os.getpid()))
    try:
        assert gone.wait(timeout=10) == 1
        assert kept.poll() is None
    finally:
        for proc in (gone, kept):
            proc.kill()
            proc.wait(timeout=10)
