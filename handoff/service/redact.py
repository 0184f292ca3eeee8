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
# a flag's value: a quoted item of a list's text, or a command line's word (SGLang's ``launch_command`` is its argv
# joined by spaces, unquoted: a password's ``(``, ``,``, ``;`` or quote is part of it). After a space or an item a word
# that begins with ``-`` is the next flag (``--api-key --port 1``); after ``=`` it is the value (``--api-key=-k``).
_FLAG_VALUE = r"""("(?:[^"\\]|\\.)*"|'[^']*'|["']?[^\s"']+(?:["'][^\s"',\]})]+)*)"""
_FLAG = re.compile(r"""(?<![\w.-])--?([A-Za-z][\w.-]*)(=|(?:\s+|["'],\s*(?=["']))(?!-))""" + _FLAG_VALUE)
# an assignment's name; its value is read only after a secret name, so a value is no hiding place for the names
# in it (``url=http://h/?token=X``, ``https://h/?token=X``); an HTTP authorization's scheme is part of the value
_FIELD = re.compile(r"""(?<![\w.-])(["']?)([A-Za-z_][\w.-]*)\1\s*[=:]\s*""")
_FIELD_VALUE = re.compile(r"""(?:(?:Bearer|Basic|Token)\s+)?""" + _VALUE)
_LITERAL = re.compile(r"-?[0-9][0-9.eE+-]*|true|false|null|True|False|None")
_URL_PASSWORD = re.compile(r"((?<![\w+.-])[A-Za-z][A-Za-z0-9+.-]*://[^\s/:@]*:)[^\s/@]+@")
_USERINFO = re.compile(r"(?<=://)\S*@")  # up to the last @: a password may hold what ends an authority


def shown_url(url: str) -> str:
    """``url`` as a message may show it: whatever stands before an ``@`` (``user:password@``, a token given as
    the user) is ``***``, a secret-named query parameter's value (``?token=X``) redacted."""
    return redact_text(_USERINFO.sub("***@", url))


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

    def flag(match: re.Match[str]) -> str:  # a command line's value is text, a number too
        if not is_secret_name(match.group(1)):
            return match.group(0)
        return match.group(0)[:match.start(3) - match.start(0)] + _redacted_value(match.group(3))

    return _URL_PASSWORD.sub(rf"\1{REDACTED_TEXT}@", _redacted_fields(_FLAG.sub(flag, text)))


def _redacted_fields(text: str) -> str:
    """``text`` with the value of every secret-named assignment redacted (a number, bool or null kept). Every name
    is looked at, one inside another's value too; a value is read once, after a secret name, and skipped."""
    parts: list[str] = []
    done = 0
    for name in _FIELD.finditer(text):
        if name.start() < done or not is_secret_name(name.group(2)):
            continue
        value = _FIELD_VALUE.match(text, name.end())
        if value is None or _LITERAL.fullmatch(value.group(0)):
            continue
        parts += [text[done:value.start()], _redacted_value(value.group(0))]
        done = value.end()
    return "".join(parts) + text[done:] if parts else text


def _redacted_value(text: str) -> str:
    quote = text[0] if text[0] in "'\"" else ""
    return f"{quote}{REDACTED_TEXT}{quote}"


def redact_secrets(value: Any, *, max_depth: int = MAX_DEPTH) -> Any:
    """A copy of a peer's JSON ``value`` fit to relay: every secret-named field (:func:`is_secret_name`, at
    any depth) whose value holds text is null (a number, a bool or null stays: no secret, and a client may
    read it), and every string is passed through :func:`redact_text`. Anything nested deeper than
    ``max_depth`` is null (:func:`loads_bounded` never returns such a value). The shape is otherwise kept.
    One walk of the value: whether a field holds text is learnt as its copy is made."""
    return _redacted(value, max_depth)[0]


def _redacted(value: Any, depth: int) -> tuple[Any, bool]:
    """(the copy of ``value`` fit to relay, whether ``value`` is or holds text: anything nested past ``depth``
    counts as text, and is null)."""
    if isinstance(value, str):
        return redact_text(value), True
    if isinstance(value, (dict, list)) and depth <= 0:
        return None, True
    if isinstance(value, dict):
        copy: dict[Any, Any] = {}
        holds_text = False
        for key, item in value.items():
            item_copy, item_holds_text = _redacted(item, depth - 1)
            holds_text = holds_text or item_holds_text
            copy[key] = None if item_holds_text and isinstance(key, str) and is_secret_name(key) else item_copy
        return copy, holds_text
    if isinstance(value, list):  # an argv: a secret flag's value is the next item
        items = []
        holds_text = False
        for i, item in enumerate(value):
            item_copy, item_holds_text = _redacted(item, depth - 1)
            holds_text = holds_text or item_holds_text
            items.append(REDACTED_TEXT if i and isinstance(item, str) and _is_secret_flag(value[i - 1])
                         else item_copy)
        return items, holds_text
    return value, False


def _is_secret_flag(item: Any) -> bool:
    return isinstance(item, str) and item.startswith("-") and "=" not in item and is_secret_name(item)
