"""Query parameters the LB's fan-out calls share: ``?role=`` and ``?timeout=`` (``?node=`` for a tensor push).

A parameter a route does not take is a 400, never ignored: a misspelt ``?rol=decode``
or a ``?node=`` on a call that goes to every node would otherwise act on the whole
cluster."""

from __future__ import annotations

from starlette.requests import Request

from handoff.service.errors import InvalidRequest
from lb.config import LBConfig, Role


def single_param(request: Request, name: str) -> str | None:
    """``?name=`` given at most once: given twice (``?role=decode&role=mixed``) which one the caller meant is
    unknown, and taking either may act on nodes the caller did not name, so it is a 400."""
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise InvalidRequest(f"query parameter {name!r} given {len(values)} times on {request.url.path}; "
                             f"give it once", extra={"repeated": name})
    return values[0] if values else None


def role_param(request: Request) -> Role | None:
    value = single_param(request, "role")
    if value is None:
        return None
    try:
        return Role(value)
    except ValueError:
        raise InvalidRequest(f"role must be one of {', '.join(r.value for r in Role)}, got {value!r}") from None


def timeout_param(request: Request, config: LBConfig, default_s: float | None = None, *,
                  zero_is_default: bool = False) -> float:
    """``?timeout=S`` (0 < S <= --max-control-timeout), else ``default_s`` (--control-timeout when None).
    ``zero_is_default``: ``0`` is taken as absent (SGLang's ``/flush_cache?timeout=0``, its default)."""
    value = single_param(request, "timeout")
    if value is None:
        return config.control_timeout_s if default_s is None else default_s
    try:
        timeout_s = float(value)
    except ValueError:
        raise InvalidRequest(f"timeout must be a number of seconds, got {value!r}") from None
    if zero_is_default and timeout_s == 0:
        return config.control_timeout_s if default_s is None else default_s
    if not 0 < timeout_s <= config.max_control_timeout_s:
        raise InvalidRequest(f"timeout must be > 0 and at most {config.max_control_timeout_s:g} s "
                             f"(--max-control-timeout), got {value}")
    return timeout_s


FANOUT_QUERY = frozenset({"role", "timeout"})


def check_query(request: Request, accepted: frozenset[str]) -> None:
    unknown = sorted(set(request.query_params.keys()) - accepted)
    if unknown:
        raise InvalidRequest(f"unknown query parameter {unknown[0][:80]!r} on {request.url.path}: it takes "
                             f"{', '.join('?' + name + '=' for name in sorted(accepted))}",
                             extra={"unknown": [name[:80] for name in unknown[:8]]})
