"""``python -m tests.lb.dns_lb``: the real LB whose DNS answers come from a JSON file a test rewrites.

``HANDOFF_TEST_DNS_FILE`` names the file: ``{"HOST": ["ADDRESS", ...]}``; a host
missing from it fails its lookup like an unknown name.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from lb.__main__ import main


async def file_resolver(host: str, port: int) -> list[str]:
    answers = json.loads(Path(os.environ["HANDOFF_TEST_DNS_FILE"]).read_text())
    if host not in answers:
        raise socket.gaierror(socket.EAI_NONAME, f"{host} not in the test's DNS file")
    return list(answers[host])


if __name__ == "__main__":
    main(resolver=file_resolver)
