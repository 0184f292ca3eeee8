"""A peer's configuration fit to relay: its secrets taken out.

A peer's configuration relayed to a client (``/get_server_info``: SGLang's
server arguments with its ``api_key`` and ``admin_api_key`` and its
``launch_command``; vLLM's config and environment) may hold the peer's
secrets: :func:`redact_secrets` drops them, the answer keeping its shape
otherwise. Secrets are found by name (:func:`is_secret_name`), in fields at
any depth, in argv lists and inside text (:func:`redact_text`: command lines,
a config's text, URLs with a password); every pattern runs in linear time.
"""

from __future__ import annotations

import re
from typing import Any

from handoff.service.peer_json import MAX_DEPTH

# a name is split into lowercase words (``apiKey``, ``API-Key``, ``api_key`` alike: ``api``, ``key``; digits split
# too: ``secret2``); it names a secret when one of its words is one of these, or its last word (bar a one-letter
# suffix: SGLang's ``watermark_key_b``) is ``key`` or ``token``. Not ``tokens``, ``tokenizer_path``,
# ``speculative_token_map``; ``bucket_time_to_first_token`` is one, but its value (numbers) is kept.
SECRET_WORDS = frozenset({"secret", "secrets", "password", "passwd", "passphrase", "credential", "credentials",
                          "apikey", "authorization"})
SECRET_LAST_WORDS = frozenset({"key", "token"})
REDACTED_TEXT = "<redacted>"  # what stands for a secret inside a string (a command line); a field's value is null
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")  # apiKey, HFToken
_WORD_SEPARATORS = re.compile(r"[^a-z]+")
# in text: ``--api-key X``, ``--api-key=X`` (a command line: SGLang's ``launch_command``), ``'--api-key', 'X'`` (a
# list's text), ``hf_token='X'``, ``"secret_key": "X"`` (a config's text, a JSON string), a URL's ``user:password@``
_VALUE = r"""("(?:[^"\\]|\\.)*"|'[^']*'|[^\s,;()\[\]{}"']+)"""  # not an object or list: its fields are looked at
_FLAG = re.compile(r"""(?<![\w.-])--?([A-Za-z][\w.-]*)(=|\s+|["'],\s*(?=["']))(?!-)""" + _VALUE)
_FIELD = re.compile(r"""(?<![\w.-])(["']?)([A-Za-z_][\w.-]*)\1(\s*[=:]\s*)""" + _VALUE)
_LITERAL = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null|True|False|None")
_URL_PASSWORD = re.compile(r"((?<![\w+.-])[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*:)[^\s/@]+@")


def is_secret_name(name: str) -> bool:
    """Whether a field (or flag, or variable) named ``name`` holds a secret: ``api_key``, ``admin_api_key``,
    ``hf_token``, ``HF_TOKEN``, ``ssl_keyfile_password``, ``aws_secret_access_key``, ``watermark_key_b``."""
    words = [w for w in _WORD_SEPARATORS.split(_CAMEL.sub("_", name).lower()) if w]
    if any(word in SECRET_WORDS for word in words):
        return True
    if len(words) >= 2 and len(words[-1]) == 1:
        words.pop()  # a one-letter suffix: ``watermark_key_b``
    return bool(words) and words[-1] in SECRET_LAST_WORDS


def redact_text(text: str) -> str:
    """``text`` with the value of every secret-named flag or assignment in it, and every URL's password,
    replaced by :data:`REDACTED_TEXT`."""
    if not text or ("=" not in text and ":" not in text and "-" not in text):
        return text

    def flag(match: re.Match[str]) -> str:
        return _redacted_match(match, name=1, value=3, keeps_literals=False)  # a command line's value is text

    def field(match: re.Match[str]) -> str:
        return _redacted_match(match, name=2, value=4, keeps_literals=True)

    return _URL_PASSWORD.sub(rf"\1{REDACTED_TEXT}@", _FIELD.sub(field, _FLAG.sub(flag, text)))


def _redacted_match(match: re.Match[str], *, name: int, value: int, keeps_literals: bool) -> str:
    """The match with its value group redacted when its name group names a secret (a number, bool or null kept
    with ``keeps_literals``, as a field's)."""
    text = match.group(value)
    if not is_secret_name(match.group(name)) or (keeps_literals and _LITERAL.fullmatch(text)):
        return match.group(0)
    quote = text[0] if text[0] in "'\"" else ""
    return match.group(0)[:match.start(value) - match.start(0)] + f"{quote}{REDACTED_TEXT}{quote}"


def redact_secrets(value: Any, *, max_depth: int = MAX_DEPTH) -> Any:
    """A copy of a peer's JSON ``value`` fit to relay: every secret-named field (:func:`is_secret_name`, at
    any depth) whose value holds text is null (a number, a bool or null stays: no secret, and a client may
    read it), and every string is passed through :func:`redact_text`. Anything nested deeper than
    ``max_depth`` is null (:func:`loads_bounded` never returns such a value). The shape is otherwise kept."""
    return _redacted(value, max_depth)


def _redacted(value: Any, depth: int) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, (dict, list)) and depth <= 0:
        return None
    if isinstance(value, dict):
        return {key: None if isinstance(key, str) and is_secret_name(key) and _holds_text(item, depth)
                else _redacted(item, depth - 1) for key, item in value.items()}
    if isinstance(value, list):  # an argv: a secret flag's value is the next item
        return [REDACTED_TEXT if i and isinstance(item, str) and _is_secret_flag(value[i - 1])
                else _redacted(item, depth - 1) for i, item in enumerate(value)]
    return value


def _is_secret_flag(item: Any) -> bool:
    return isinstance(item, str) and item.startswith("-") and "=" not in item and is_secret_name(item)


def _holds_text(value: Any, depth: int) -> bool:
    """Whether ``value`` is a string or holds one (anything nested past ``depth`` counts as text)."""
    if isinstance(value, str):
        return True
    if isinstance(value, (dict, list)):
        if depth <= 0:
            return True
        items = value.values() if isinstance(value, dict) else value
        return any(_holds_text(item, depth - 1) for item in items)
    return False
