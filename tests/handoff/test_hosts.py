"""The one host rule (``handoff/protocol/hosts.py``) shared by the LB's membership, the upstream client and
the trainer's ``master_address``."""

from __future__ import annotations

import pytest

from handoff.protocol.hosts import canonical_host
from handoff.protocol.weights import InitWeightsUpdateGroupBody
from handoff.service.http1_request import parse_origin
from handoff.service.upstream_errors import InvalidURL
from lb.addresses import canonical_url


@pytest.mark.parametrize(("host", "canonical"), [
    ("LocalHost.", "localhost"),
    ("node-1.cluster_a.svc", "node-1.cluster_a.svc"),
    ("[::ffff:10.0.0.1]", "10.0.0.1"),
    ("::1", "::1"),
    ("[0:0:0:0:0:0:0:1]", "::1"),
    ("10.0.0.1", "10.0.0.1"),
    ("0", "0.0.0.0"),  # the resolver's number forms (inet_aton): the address, not a name (review, stop 42)
    ("127.1", "127.0.0.1"),
    ("0x7F.0.0.1.", "127.0.0.1"),
    ("0177.0.0.1", "127.0.0.1"),
    ("0xabc", "0.0.10.188"),
    ("1e3", "1e3"),
])
def test_spellings_of_one_host_are_one(host: str, canonical: str) -> None:
    assert canonical_host(host) == canonical


@pytest.mark.parametrize("host", ["", "-node", "node-", "a..b", "a" * 64, "x." * 127 + "yy", "nöde", "a\x00b",
                                  "[::1", "[fe80::1%eth0]", "fe80::1%eth0", "[10.0.0.1]", "a b"])
def test_one_rule_refuses_the_same_hosts_everywhere(host: str) -> None:
    with pytest.raises(ValueError):
        canonical_host(host)
    with pytest.raises(ValueError):
        canonical_url(f"http://{host}:8000")
    with pytest.raises(ValueError):
        InitWeightsUpdateGroupBody(master_address=host, master_port=29500, rank_offset=1, world_size=2)
    with pytest.raises(InvalidURL):
        parse_origin(f"{host}:8000" if host.startswith("[") or ":" not in host else f"[{host}]:8000")
