"""Sidecar configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from handoff.protocol.engines import ENGINE_KIND_NAMES
from handoff.service.flag_types import seconds_problem
from handoff.service.http1_request import split_url
from handoff.service.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_ANSWER_BYTES, DEFAULT_MAX_BODY_BYTES
from handoff.service.redact import shown_url
from handoff.service.upstream_errors import InvalidURL

ROLES = ("mixed", "prefill", "decode")


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the flag."""


@dataclass(frozen=True)
class SidecarConfig:
    engine_url: str
    role: str = "mixed"
    engine_kind: str | None = None      # None: detected from the engine's info endpoints
    vllm_sleep_level: int = 1           # vLLM: the sleep level of a release without stage_to_cpu
    vllm_weight_sync_timeout: float = 300.0  # vLLM: a weight-group join, or one update's broadcasts
    admin_token: str | None = field(default=None, repr=False)
    api_key: str | None = field(default=None, repr=False)
    hold_requests: bool = False
    hold_max: int = 256                 # requests waiting at most, with --hold-requests
    hold_timeout: float = 60.0          # seconds a held request waits at most
    pause_hold_max: int = 16384         # requests waiting at most while paused or while weights update
    pause_hold_timeout: float = 3600.0  # seconds each may wait then (SGLang sets no bound; a reload can be long)
    hold_max_bytes: int = 1 << 30       # bytes of request bodies held at once, whatever the reason
    max_inflight_bytes: int = 1 << 30   # bytes of admitted generation bodies and buffered answers at once
    drain_timeout: float = 60.0         # default drain bound of a release / reload / pause
    max_drain_timeout: float = 3600.0   # largest drain_timeout a body may ask for
    generate_timeout: float = 3600.0    # one generation through the engine, end to end
    control_timeout: float = 600.0      # one control call to the engine (a reload can be slow)
    engine_poll_interval: float = 1.0   # how often the engine's health is polled
    engine_health_timeout: float = 5.0  # one health probe's bound
    engine_health_misses: int = 3       # health probes in a row without an answer before the engine counts as down
    retry_after_s: int = 2              # Retry-After on 503s
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES  # an engine's non-stream answer larger than this is a 502
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S  # a request's whole body, from its head
    allowed_local_media_path: Path | None = None  # SGLang / vLLM: media files below it reach the engine (None: none)
    refuse_media_urls: bool = False     # SGLang / vLLM: http(s) media URLs are refused, not passed on
    state_file: Path | None = None      # the cluster's intent kept across a restart of the sidecar (None: memory only)

    def __post_init__(self) -> None:
        _check_engine_url(self.engine_url)
        if self.engine_kind is not None and self.engine_kind not in ENGINE_KIND_NAMES:
            raise ConfigError(f"--engine-kind must be one of {', '.join(ENGINE_KIND_NAMES)}, got {self.engine_kind!r}")
        if self.vllm_sleep_level not in (1, 2):
            raise ConfigError(f"--vllm-sleep-level must be 1 or 2, got {self.vllm_sleep_level}")
        if self.role not in ROLES:
            raise ConfigError(f"--role must be one of {', '.join(ROLES)}, got {self.role!r}")
        for name in ("hold_max", "pause_hold_max", "hold_max_bytes", "max_inflight_bytes", "retry_after_s",
                     "max_body_bytes", "max_answer_bytes", "engine_health_misses"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("hold_timeout", "pause_hold_timeout", "drain_timeout", "max_drain_timeout", "generate_timeout",
                     "control_timeout", "vllm_weight_sync_timeout", "engine_poll_interval", "engine_health_timeout",
                     "body_timeout"):
            problem = seconds_problem(getattr(self, name))
            if problem is not None:
                raise ConfigError(f"{_flag(name)} must be {problem}")
        if self.allowed_local_media_path is not None and not self.allowed_local_media_path.is_dir():
            raise ConfigError(f"--allowed-local-media-path {self.allowed_local_media_path} is not a folder")
        if self.max_inflight_bytes < self.max_body_bytes:  # a body of the largest size would never run
            raise ConfigError(f"--max-inflight-bytes ({self.max_inflight_bytes}) must be at least --max-body-bytes "
                              f"({self.max_body_bytes})")
        if self.drain_timeout > self.max_drain_timeout:
            raise ConfigError("--drain-timeout must not exceed --max-drain-timeout")

    @property
    def engine_base(self) -> str:
        return self.engine_url.rstrip("/")


def _check_engine_url(url: str) -> None:
    """``http://HOST[:PORT][/PREFIX]``, as the sidecar's client can reach it: refused now, naming the flag, rather
    than a node that starts and finds its engine unreachable on every call."""
    shown = shown_url(url)  # a password in it is never written out
    if not url.startswith("http://"):
        raise ConfigError(f"--engine-url must be an http:// URL, got {shown!r}")
    for char, what in (("@", "credentials (the engine takes none; they would be written to the logs)"),
                       ("?", "a query"), ("#", "a fragment")):
        if char in url:
            raise ConfigError(f"--engine-url must be http://HOST[:PORT] without {what}, got {shown!r}")
    try:
        split_url(url.rstrip("/") + "/health")
    except InvalidURL as exc:
        raise ConfigError(f"--engine-url {shown!r}: {exc}") from None


_FLAGS = {"retry_after_s": "--retry-after"}  # fields not named as their flag


def _flag(field_name: str) -> str:
    """The command-line flag of a config field, as the user typed it."""
    return _FLAGS.get(field_name, "--" + field_name.replace("_", "-"))
