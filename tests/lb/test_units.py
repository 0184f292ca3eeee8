"""The LB's pure parts, in process: config validation, policies, PD helpers, discovery, views."""

from __future__ import annotations

import copy
import json
import socket
from collections import Counter

import pytest

from handoff.service.errors import InvalidRequest
from lb.config import DnsTarget, LBConfig, NodeSpec, Policy, Role
from lb.discovery import DnsDiscovery, node_url
from lb.errors import NoAvailableNode, NodeExists
from lb.membership import Membership
from lb.metrics import LBMetrics
from lb.node import Node, NodeHealth
from lb.pd import MAX_PD_BATCH, batch_size, bootstrap_host, check_batch, with_bootstrap
from lb.pd_logprobs import (
    MergeInputLogprobs,
    MissingInputLogprobs,
    first_events,
    merge_input_logprobs,
    stream_merge,
)
from lb.pd_refusals import RefusalWatch, starts_with_refusal
from lb.routing import LeastInflight, PowerOfTwo, Router
from lb.views import cluster_occupation

pytestmark = pytest.mark.timeout(10)


def make_nodes(*urls: str, role: Role = Role.MIXED, serving: bool = True) -> tuple[Membership, list[Node]]:
    membership = Membership(LBMetrics())
    nodes = []
    for url in urls:
        node = membership.add(NodeSpec(url, role), "test")
        node.set_health(NodeHealth.HEALTHY)
        node.set_serving(serving, "open" if serving else "closed")
        nodes.append(node)
    return membership, nodes


# -- config ---------------------------------------------------------------------

def test_node_specs_parse_and_normalize() -> None:
    assert NodeSpec.parse("http://10.0.0.1:30000/", Role.MIXED).url == "http://10.0.0.1:30000"
    spec = NodeSpec.parse("http://10.0.0.2:30000@8998", Role.PREFILL)
    assert (spec.url, spec.bootstrap_port) == ("http://10.0.0.2:30000", 8998)
    assert NodeSpec.parse("http://[::1]:8000", Role.DECODE).url == "http://[::1]:8000"
    for bad in ("10.0.0.1:80", "https://h:1", "http://h:1/x", "http://h:0", "http://", "http://h:1?q"):
        with pytest.raises(ValueError):
            NodeSpec(bad)
    with pytest.raises(ValueError, match="only for prefill"):
        NodeSpec("http://h:1", Role.DECODE, 8998)


def test_dns_targets_parse() -> None:
    target = DnsTarget.parse("prefill=nodes.ns.svc:30000@8998")
    assert (target.role, target.host, target.port, target.bootstrap_port) == (Role.PREFILL, "nodes.ns.svc",
                                                                               30000, 8998)
    assert str(DnsTarget.parse("mixed=svc:1")) == "mixed=svc:1"
    for bad in ("svc:1", "gpu=svc:1", "mixed=svc", "mixed=svc:x", "decode=svc:1@2"):
        with pytest.raises(ValueError):
            DnsTarget.parse(bad)


@pytest.mark.parametrize("field,value", [("control_timeout_s", 0), ("health_interval_s", -1),
                                         ("healthy_threshold", 0), ("max_body_bytes", 0),
                                         ("discover_interval_s", "1")])
def test_config_errors_name_the_flag(field: str, value: object) -> None:
    with pytest.raises(ValueError, match="^--" + field.removesuffix("_s").replace("_", "-") + " "):
        LBConfig(**{field: value})


def test_config_hides_its_secrets() -> None:
    config = LBConfig(admin_token="tok-1", api_key="key-2", policy="round_robin")
    assert config.policy is Policy.ROUND_ROBIN
    assert "tok-1" not in repr(config) and "key-2" not in repr(config)


# -- membership and routing -------------------------------------------------------

def test_health_transitions_are_guarded() -> None:
    membership, [node] = make_nodes("http://h:1")
    membership.remove(node.url, "test")
    with pytest.raises(RuntimeError, match="removed"):
        node.set_health(NodeHealth.HEALTHY)
    membership.add(NodeSpec("http://h:2"), "a")
    with pytest.raises(NodeExists):
        membership.add(NodeSpec("http://h:2"), "b")


def test_least_inflight_picks_the_least_busy_and_rotates_ties() -> None:
    _, nodes = make_nodes("http://a:1", "http://b:1", "http://c:1")
    picker = LeastInflight()
    assert Counter(picker.pick(nodes).url for _ in range(30)) == {n.url: 10 for n in nodes}
    nodes[0].begin_request()
    nodes[1].begin_request()
    assert {picker.pick(nodes).url for _ in range(10)} == {"http://c:1"}


def test_power_of_two_never_picks_the_busiest_of_two() -> None:
    _, nodes = make_nodes("http://a:1", "http://b:1")
    for _ in range(5):
        nodes[0].begin_request()
    assert {PowerOfTwo().pick(nodes).url for _ in range(20)} == {"http://b:1"}


def test_router_skips_fenced_and_released_and_falls_back_to_holding_nodes() -> None:
    membership, (fenced, released, holding) = make_nodes("http://a:1", "http://b:1", "http://c:1")
    router = Router(membership, Policy.ROUND_ROBIN, retry_after_s=2)
    fence = fenced.fence()
    released.set_serving(False, "closed")
    holding.set_serving(False, "holding")
    assert router.pick(Role.MIXED) is holding
    with pytest.raises(NoAvailableNode) as info:
        router.pick(Role.MIXED, exclude=[holding])
    assert info.value.headers["Retry-After"] == "2"
    assert "release or pause in progress" in info.value.message
    with fence:
        kept = fence.hand_over()  # work that goes on after the block takes the fence; the block leaves it alone
    assert fenced.num_fences == 1
    with pytest.raises(RuntimeError):
        fence.hand_over()
    kept.lift()
    kept.lift()  # lifting twice lifts once
    assert fenced.num_fences == 0
    assert router.pick(Role.MIXED) is fenced


def test_node_gauges_follow_health_fences_and_serving() -> None:
    metrics = LBMetrics()
    node = Membership(metrics).add(NodeSpec("http://a:1"), "test")

    def gauges() -> tuple[float | None, float | None]:
        labels = {"node": node.url, "role": "mixed"}
        return (metrics.registry.get_sample_value("handoff_lb_node_healthy", labels),
                metrics.registry.get_sample_value("handoff_lb_node_serving", labels))

    assert gauges() == (0, 0)
    node.set_health(NodeHealth.HEALTHY)
    assert gauges() == (1, 0)
    node.set_serving(True, "open")
    assert gauges() == (1, 1)
    fences = [node.fence(), node.fence()]
    assert gauges() == (1, 0)
    fences[0].lift()
    assert gauges() == (1, 0)  # one fence left
    fences[1].lift()
    assert gauges() == (1, 1)
    node.set_health(NodeHealth.UNHEALTHY)
    assert gauges() == (0, 0)


# -- PD -------------------------------------------------------------------------------

def test_batch_size_follows_sglang() -> None:
    assert batch_size({"text": "a"}) is None and batch_size({"text": ["a", "b"]}) == 2
    assert batch_size({"input_ids": [1, 2]}) is None and batch_size({"input_ids": [[1], [2], [3]]}) == 3
    assert batch_size({"messages": []}) is None
    assert check_batch({"text": [""] * MAX_PD_BATCH}) == MAX_PD_BATCH
    with pytest.raises(InvalidRequest, match="at most 4096 prompts"):
        check_batch({"text": [""] * (MAX_PD_BATCH + 1)})


def test_bootstrap_fields() -> None:
    _, [node] = make_nodes("http://[fd00::1]:30000", role=Role.PREFILL)
    assert bootstrap_host(node) == "[fd00::1]"
    payload = {"text": ["a", "b"]}
    out = with_bootstrap(payload, node, 2)
    assert payload == {"text": ["a", "b"]}  # the caller's dict is not changed
    assert out["bootstrap_host"] == ["[fd00::1]"] * 2 and out["bootstrap_port"] == [None, None]
    assert len(set(out["bootstrap_room"])) == 2


def test_merge_input_logprobs_of_batches() -> None:
    prefill = [{"meta_info": {"input_token_logprobs": [1], "input_top_logprobs": [["p"]]}},
               {"meta_info": {"input_token_logprobs": [2]}}]
    decode = [{"meta_info": {"input_token_logprobs": [9]}}, {"meta_info": {"input_token_logprobs": None}}]
    merge_input_logprobs(prefill, decode)
    assert decode == [{"meta_info": {"input_token_logprobs": [1, 9], "input_top_logprobs": [["p"]]}},
                      {"meta_info": {"input_token_logprobs": [2]}}]


def test_merge_input_logprobs_leaves_what_a_node_sent_otherwise() -> None:
    """A decode answer whose input logprobs are not a list (a peer's JSON) is left as sent, never a TypeError."""
    for odd in ("x", {"a": 1}, 7):
        decode = {"meta_info": {"input_token_logprobs": odd}}
        merge_input_logprobs({"meta_info": {"input_token_logprobs": [1]}}, decode)
        assert decode == {"meta_info": {"input_token_logprobs": odd}}


def test_merging_stream_handles_events_split_anywhere() -> None:
    events = b'data: {"meta_info": {"input_token_logprobs": [3]}}\n\n: comment\n\ndata: [DONE]\n\n'
    for cut in range(1, len(events)):
        merge = MergeInputLogprobs({0: {"meta_info": {"input_token_logprobs": [1, 2]}}})
        out = merge.feed(events[:cut]) + merge.feed(events[cut:]) + merge.finish()
        first, comment, done, _ = out.split(b"\n\n")
        assert json.loads(first[5:])["meta_info"]["input_token_logprobs"] == [1, 2, 3]
        assert (comment, done) == (b": comment", b"data: [DONE]")


def test_a_streamed_batch_gets_each_prompts_own_input_logprobs() -> None:
    """Found by review: every decode event got the prefill's first event (prompt 0's) merged in."""
    prefill = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in (
        {"index": 0, "meta_info": {"input_token_logprobs": [[None, 100, None]]}},
        {"index": 1, "meta_info": {"input_token_logprobs": [[None, 200, None], [-1.0, 201, None]]}},
        {"index": 1, "meta_info": {"input_token_logprobs": [[-2.0, 202, None]]}})) + b"data: [DONE]\n\n"
    merge = MergeInputLogprobs(first_events(prefill))
    decode = b"".join(b"data: " + json.dumps({"index": i, "text": t, "meta_info": {"input_token_logprobs": []}})
                      .encode() + b"\n\n" for i, t in ((1, "b"), (0, "a")))
    merged = [json.loads(event[5:]) for event in merge.feed(decode).split(b"\n\n") if event]
    assert [(e["index"], [t[1] for t in e["meta_info"]["input_token_logprobs"]]) for e in merged] == [
        (1, [200, 201]), (0, [100])]


def test_a_decode_event_of_a_prompt_the_prefill_has_no_logprobs_for_ends_the_merge() -> None:
    """Found by review: such an event (a prompt the prefill stream had no event for, or one without an
    ``input_token_logprobs`` list) went out without its prompt's input logprobs. The events before it are handed
    out, then :class:`MissingInputLogprobs` names the prompt (the relay ends the stream with an error)."""
    prefill = {0: {"meta_info": {"input_token_logprobs": [1]}}, 1: {"meta_info": {}}, 2: {"meta_info": 5}}
    for missing in (1, 2, 7, "odd"):
        merge = MergeInputLogprobs(prefill)
        decode = _sse([{"index": 0, "meta_info": {}}, {"meta_info": {}, "index": missing}, {"meta_info": {}}])
        pieces = merge.feed_pieces(decode + _sse([{"error": {"type": "x", "message": "y"}}]))
        assert json.loads(next(iter(pieces))[5:]) == {"index": 0, "meta_info": {"input_token_logprobs": [1]}}
        with pytest.raises(MissingInputLogprobs):
            next(iter(pieces))
        assert merge.missing_index == (missing if isinstance(missing, int) else -1)
    merge = MergeInputLogprobs(prefill)  # an event without meta_info (an error) is no prompt's: relayed as sent
    assert merge.feed(_sse([{"index": 3, "error": {"type": "x"}}])) == _sse([{"index": 3, "error": {"type": "x"}}])



def _sse(events: list[object]) -> bytes:
    return b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in events)


@pytest.mark.parametrize("in_turns", [False, True])
def test_merged_stream_events_are_the_decode_events_merged_and_written_as_before(in_turns: bool) -> None:
    """The prefill's logprobs are encoded once and spliced into each event: every event must still be exactly
    what merging the parsed events and ``json.dumps`` made (lists longer than one encoder call, non-ASCII text,
    empty and null lists, a peer's odd values, a batch, keys and strings holding quotes)."""
    long = [[-0.5 - i / 1000, i, "t\u00e9" if i % 7 else None] for i in range(700)]
    prefill_events = [
        {"index": 0, "meta_info": {"input_token_logprobs": long, "input_top_logprobs": [[x] for x in long],
                                   "input_token_ids_logprobs": [], "other": [1]}},
        {"index": 1, "meta_info": {"input_token_logprobs": long[:3], "input_top_logprobs": "odd"}},
        {"index": 2, "meta_info": 5}, {"index": 0, "meta_info": {"input_token_logprobs": [[9, 9, None]]}}]
    decode_events: list[object] = [
        {"index": 0, "text": "\u00e9", "meta_info": {"input_token_logprobs": [[-1.0, 5, None]], "a": 1}},
        {"meta_info": {"input_top_logprobs": None, "input_token_logprobs": "x", "input_token_ids_logprobs": [[1]]}},
        {"index": 1, "meta_info": {"input_token_logprobs": [], "input_top_logprobs": [[2]]}},
        {"index": 0, '"0': '"0"', "meta_info": {}}, {"index": 2}, {"index": 7},
        {"index": 0}, [{"meta_info": {}}], "text", 3]
    merge = stream_merge(_sse(prefill_events) + b"data: [DONE]\n\n", in_turns=in_turns)
    out = merge.feed(_sse(decode_events) + b": comment\n\ndata: {not json\n\ndata: [DONE]\n\n") + merge.finish()
    firsts = {0: prefill_events[0], 1: prefill_events[1], 2: prefill_events[2]}
    expected = []
    for event in decode_events:
        index = event.get("index", 0) if isinstance(event, dict) else 0
        merged = copy.deepcopy(event)
        merge_input_logprobs(firsts.get(index), merged)
        expected.append(merged)
    assert out == _sse(expected) + b": comment\n\ndata: {not json\n\ndata: [DONE]\n\n"


def test_a_read_of_many_large_merged_events_is_handed_out_event_by_event() -> None:
    """One read of the decode stream may hold hundreds of events, each megabytes once the prompt's logprobs are
    in: the relay gets them one by one (the event loop has its turns between them), not joined."""
    prefill = _sse([{"meta_info": {"input_token_logprobs": [[-0.5, i, None] for i in range(20_000)]}}])
    pieces = list(stream_merge(prefill).feed_pieces(_sse([{"meta_info": {}}] * 5)))
    assert len(pieces) == 5 and all(len(piece) < 500_000 for piece in pieces)


# -- discovery and views --------------------------------------------------------------

async def test_discovery_follows_the_resolver_and_survives_failures() -> None:
    membership = Membership(LBMetrics())
    membership.add(NodeSpec("http://10.0.0.9:80"), "flag")
    answers: dict[str, list[str]] = {"svc": ["10.0.0.1", "fd00::2"]}
    added_batches: list[list[str]] = []

    async def resolver(host: str, port: int) -> list[str]:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "unknown")
        return answers[host]

    async def on_added(nodes: list[Node]) -> None:
        added_batches.append([n.url for n in nodes])

    discovery = DnsDiscovery([DnsTarget.parse("decode=svc:80")], membership, 1.0, resolver, on_added)
    await discovery.refresh()
    assert [n.url for n in membership.nodes(Role.DECODE)] == ["http://10.0.0.1:80", "http://[fd00::2]:80"]
    answers["svc"] = ["10.0.0.1", "10.0.0.3"]
    await discovery.refresh()
    assert [n.url for n in membership.nodes(Role.DECODE)] == ["http://10.0.0.1:80", "http://10.0.0.3:80"]
    assert added_batches == [["http://10.0.0.1:80", "http://[fd00::2]:80"], ["http://10.0.0.3:80"]]
    del answers["svc"]
    await discovery.refresh()
    assert len(membership.nodes(Role.DECODE)) == 2
    answers["svc"] = []
    await discovery.refresh()
    assert membership.nodes(Role.DECODE) == [] and len(membership) == 1  # the flag's node stays
    assert node_url("fd00::1", 5) == "http://[fd00::1]:5"
    answers["svc"] = ["10.0.0.9", "::ffff:10.0.0.9", "10.0.0.4"]  # the flag's node, twice, and a new one
    await discovery.refresh()
    assert [n.url for n in membership.nodes()] == ["http://10.0.0.9:80", "http://10.0.0.4:80"]
    assert membership.get("http://10.0.0.9:80").source == "flag"
    # addresses no node URL holds (a zone index; this host's listen-all address): left out alone
    answers["svc"] = ["fe80::1%eth0", "0.0.0.0", "10.0.0.4", "10.0.0.5"]
    await discovery.refresh()
    assert [n.url for n in membership.nodes()] == ["http://10.0.0.9:80", "http://10.0.0.4:80", "http://10.0.0.5:80"]


async def test_a_large_dns_answer_is_added_in_linear_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: each new address was compared with every member, each member's host parsed again
    (2000 addresses held the LB's event loop for 34 s). Counted in host parses, not timed: at most a few per
    address, where a scan would make millions."""
    import lb.addresses
    import lb.membership
    import lb.node

    parses = Counter()
    real = lb.addresses.literal_addresses

    def counted(host: str) -> frozenset[str] | None:
        parses["host"] += 1
        return real(host)

    monkeypatch.setattr(lb.membership, "literal_addresses", counted)
    monkeypatch.setattr(lb.node, "literal_addresses", counted)
    addresses = [f"10.0.{i // 256}.{i % 256}" for i in range(2000)]

    async def resolver(host: str, port: int) -> list[str]:
        return addresses

    membership = Membership(LBMetrics(), max_nodes=len(addresses))  # past the default of --max-nodes
    await DnsDiscovery([DnsTarget.parse("mixed=svc:8000")], membership, 1.0, resolver).refresh()
    assert len(membership) == 2000
    assert parses["host"] <= 3 * len(addresses), parses
    assert membership.same_address("http://[::ffff:10.0.7.207]:8000").url == "http://10.0.7.207:8000"
    await DnsDiscovery([DnsTarget.parse("mixed=svc:8000")], membership, 1.0, resolver).refresh()
    assert [node.url for node in membership.nodes(Role.MIXED)][:2] == ["http://10.0.0.0:8000", "http://10.0.0.1:8000"]


async def test_requests_stay_counted_on_a_node_that_left_and_came_back() -> None:
    """Found by review: a node missing from one DNS round and back in the next was a new member counted at 0
    while its requests still ran, so least-in-flight routing sent it work first and the gauge read 0."""
    from prometheus_client import generate_latest

    metrics = LBMetrics()
    membership = Membership(metrics)
    answer = ["10.0.0.1"]

    async def resolver(host: str, port: int) -> list[str]:
        return list(answer)

    discovery = DnsDiscovery([DnsTarget.parse("mixed=svc:8000")], membership, 1.0, resolver)
    await discovery.refresh()
    leases = [membership.get("http://10.0.0.1:8000").begin_request() for _ in range(5)]
    answer.clear()
    await discovery.refresh()
    answer.append("10.0.0.1")
    await discovery.refresh()
    again = membership.get("http://10.0.0.1:8000")

    def gauge() -> str:
        return [line for line in generate_latest(metrics.registry).decode().splitlines()
                if line.startswith("handoff_lb_node_inflight{")][0].split()[-1]

    assert (again.num_inflight, gauge()) == (5, "5.0")
    for lease in leases[:3]:
        lease.release()
    assert (again.num_inflight, gauge()) == (2, "2.0")
    answer.clear()
    await discovery.refresh()  # gone while two still run; they end; it comes back idle
    for lease in leases[3:]:
        lease.release()
    answer.append("10.0.0.1")
    await discovery.refresh()
    assert (membership.get("http://10.0.0.1:8000").num_inflight, gauge()) == (0, "0.0")


def test_unhealthy_nodes_count_as_unknown_in_the_aggregate() -> None:
    _, (good, down) = make_nodes("http://a:1", "http://b:1")
    good.occupation = {"tags": {"weights": {"state": "released", "bytes": 0}}}
    down.occupation = {"tags": {"weights": {"state": "resident", "bytes": 7}}}
    down.set_health(NodeHealth.UNHEALTHY)
    weights = cluster_occupation([good, down])["tags"]["weights"]
    assert (weights["released"], weights["unknown"], weights["bytes"]) == (1, 1, 0)


def test_a_request_lease_is_given_back_once_by_its_last_holder() -> None:
    _, (node,) = make_nodes("http://a:1")
    with node.begin_request() as lease:
        assert node.num_inflight == 1
        relay = lease.hand_over()  # a streaming response takes it on
    assert node.num_inflight == 1  # the block's exit left it to the relay
    relay.release()
    relay.release()
    assert node.num_inflight == 0
    with pytest.raises(RuntimeError, match="already released"):
        relay.hand_over()


@pytest.mark.parametrize("body,is_refusal", [
    (b'data: {"error": {"message": "Duplicate request ID detected: r"}}\n\ndata: [DONE]\n\n', True),
    (b': a comment\r\n\r\ndata: {"error": {"type": "engine_failed"}}\r\n\r\n', True),
    (b'data: {"text": "a", "meta_info": {}}\n\ndata: {"error": {"message": "later"}}\n\n', False),
    (b"data: [DONE]\n\n", False), (b"data: not json\n\n", False), (b'data: ["error"]\n\n', False),
    (b'data: {"error": {"message": "an event never ended"}}', False), (b"", False)])
def test_a_stream_refusal_is_its_first_event_being_an_error(body: bytes, is_refusal: bool) -> None:
    assert starts_with_refusal(body) is is_refusal
    assert starts_with_refusal(body, piece_bytes=3) is is_refusal  # however the stream arrives
    watch = RefusalWatch()
    assert b"".join(watch.feed(body[i:i + 5]) for i in range(0, len(body), 5)) == body  # passed on unchanged
    assert watch.is_refusal is is_refusal
