"""What scripts written against SGLang 0.5.23 read from its control answers, through the LB and at a node.

SGLang answers ``/flush_cache`` in plain text (``Cache flushed.`` and a line on the logs, 200; ``Cache not
flushed...``, 400, while requests run) and takes ``?timeout=`` seconds to wait for idle, 0 by default
(``entrypoints/http_server.py``); benchmark and reset scripts send ``?timeout=0`` or ``?timeout=10`` and check
``"Cache flushed" in response.text``.
"""

from __future__ import annotations

import pytest
import requests

from handoff.cluster.local import LocalCluster


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("query", ["", "?timeout=0", "?timeout=10"])
def test_flush_cache_answers_as_sglang_scripts_read_it(cluster: LocalCluster, method: str, query: str) -> None:
    for url in (cluster.url, cluster.nodes[0].url):
        r = requests.request(method, f"{url}/flush_cache{query}", timeout=60)
        assert r.status_code == 200, (url, r.text)
        assert "Cache flushed" in r.text, (url, r.text)
