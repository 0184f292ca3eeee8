"""The LB's configuration: one frozen dataclass, validated once, naming the bad flag."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from handoff.protocol.hosts import canonical_host
from handoff.service.flag_types import seconds_problem
from handoff.service.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_ANSWER_BYTES, DEFAULT_MAX_BODY_BYTES
from lb.addresses import canonical_url, literal_addresses, never_a_peer, split_canonical
from lb.answer_budget import DEFAULT_MAX_BUFFERED_ANSWER_BYTES


DEFAULT_MAX_NODES = 1024  # each member costs health checks, pooled connections and metric series


class Role(str, enum.Enum):
    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class Policy(str, enum.Enum):
    LEAST_INFLIGHT = "least_inflight"
    ROUND_ROBIN = "round_robin"
    RANDOM = "random"
    POWER_OF_TWO = "power_of_two"


def _parse_port(text: str, what: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 0 < int(text) < 65536:  # "²" is a digit int() refuses
        raise ValueError(f"{what} must be a port number, got {text!r}")
    return int(text)


@dataclass(frozen=True)
class NodeSpec:
    """A node as configured: where it is, its role and, for prefill, its bootstrap port."""

    url: str
    role: Role = Role.MIXED
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", canonical_url(self.url))
        object.__setattr__(self, "role", Role(self.role))
        if self.bootstrap_port is not None:
            if self.role is not Role.PREFILL:
                raise ValueError(f"bootstrap_port is only for prefill nodes, {self.url} is {self.role.value}")
            if not 0 < self.bootstrap_port < 65536:
                raise ValueError(f"bootstrap_port must be a port number, got {str(self.bootstrap_port)[:20]}")

    @classmethod
    def parse(cls, text: str, role: Role) -> NodeSpec:
        """``URL`` or, for prefill, ``URL@BOOTSTRAP_PORT``."""
        url, sep, port = text.rpartition("@")
        if sep and role is Role.PREFILL:
            return cls(url, role, _parse_port(port, "--prefill bootstrap port"))
        return cls(text, role)


@dataclass(frozen=True)
class DnsTarget:
    """``ROLE=HOST:PORT[@BOOTSTRAP_PORT]``: every address of HOST is a node of ROLE on PORT."""

    role: Role
    host: str
    port: int
    bootstrap_port: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "host", canonical_host(self.host))
        except ValueError as exc:
            raise ValueError(f"--discover-dns host {self.host[:80]!r}: {exc}") from None
        unreachable = never_a_peer(self.host)  # every lookup would leave its one address out, for ever
        if unreachable:
            raise ValueError(f"--discover-dns host {self.host}: {unreachable}")
        if self.bootstrap_port is not None and self.role is not Role.PREFILL:
            raise ValueError(f"--discover-dns: a bootstrap port is only for prefill, not {self.role.value}")

    @classmethod
    def parse(cls, text: str) -> DnsTarget:
        role_text, sep, rest = text.partition("=")
        if not sep:
            raise ValueError(f"--discover-dns must be ROLE=HOST:PORT, got {text!r}")
        try:
            role = Role(role_text.strip())
        except ValueError:
            raise ValueError(f"--discover-dns role must be one of "
                             f"{', '.join(r.value for r in Role)}, got {role_text!r}") from None
        rest, at, bootstrap = rest.partition("@")
        host, colon, port = rest.rpartition(":")
        if not colon:
            raise ValueError(f"--discover-dns must be ROLE=HOST:PORT, got {text!r}")
        return cls(role, host.strip("[]"), _parse_port(port, "--discover-dns port"),
                   _parse_port(bootstrap, "--discover-dns bootstrap port") if at else None)

    def __str__(self) -> str:
        return f"{self.role.value}={self.host}:{self.port}"


@dataclass(frozen=True)
class LBConfig:
    """Everything the LB needs besides its listening address. Durations in seconds."""

    nodes: tuple[NodeSpec, ...] = ()
    discover_dns: tuple[DnsTarget, ...] = ()
    discover_interval_s: float = 10.0
    policy: Policy = Policy.LEAST_INFLIGHT
    control_timeout_s: float = 120.0
    weight_sync_timeout_s: float = 600.0      # a group join, a tensor push, a broadcast update (per node)
    max_control_timeout_s: float = 3600.0
    generate_timeout_s: float = 3600.0
    connect_timeout_s: float = 5.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 1
    max_nodes: int = DEFAULT_MAX_NODES
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    max_buffered_answer_bytes: int = DEFAULT_MAX_BUFFERED_ANSWER_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    admin_token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "discover_dns", tuple(self.discover_dns))
        object.__setattr__(self, "policy", Policy(self.policy))
        for name in ("discover_interval_s", "control_timeout_s", "weight_sync_timeout_s", "max_control_timeout_s",
                     "generate_timeout_s", "connect_timeout_s", "health_interval_s", "health_timeout_s",
                     "body_timeout_s"):
            problem = seconds_problem(getattr(self, name))
            if problem is not None:
                raise ValueError(f"{_flag(name)} must be {problem}")
        for name in ("control_timeout_s", "weight_sync_timeout_s"):
            if self.max_control_timeout_s < getattr(self, name):
                raise ValueError(f"--max-control-timeout ({self.max_control_timeout_s:g}) must be at least "
                                 f"{_flag(name)} ({getattr(self, name):g})")
        for name in ("unhealthy_threshold", "healthy_threshold", "max_nodes", "max_body_bytes", "max_answer_bytes",
                     "max_buffered_answer_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{_flag(name)} must be a positive integer, got {value!r}")
        if self.max_buffered_answer_bytes < self.max_answer_bytes:  # an answer of the largest size would never pass
            raise ValueError(f"--max-buffered-answer-bytes ({self.max_buffered_answer_bytes}) must be at least "
                             f"--max-answer-bytes ({self.max_answer_bytes})")
        if len(self.nodes) > self.max_nodes:
            raise ValueError(f"--node, --prefill and --decode list {len(self.nodes)} nodes, more than --max-nodes "
                             f"({self.max_nodes})")
        repeated = sorted({str(t) for t in self.discover_dns if self.discover_dns.count(t) > 1})
        if repeated:
            raise ValueError(f"--discover-dns {repeated[0]} is listed twice")
        seen: dict[tuple[str, int], str] = {}
        for spec in self.nodes:
            host, port = split_canonical(spec.url)
            for address in literal_addresses(host) or {host}:
                if (address, port) in seen:
                    other = seen[(address, port)]
                    twice = "listed twice" if other == spec.url else f"the same address and port as {other}"
                    raise ValueError(f"nodes: {spec.url} is {twice}")
                seen[(address, port)] = spec.url


def _flag(field_name: str) -> str:
    """The command-line flag of a config field, as the user typed it (``control_timeout_s``: ``--control-timeout``)."""
    return "--" + field_name.removesuffix("_s").replace("_", "-")
