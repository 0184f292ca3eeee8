"""A peer's configuration is relayed without its secrets (``handoff/service/redact.py``): names, fields at any
depth, argv lists, text; in linear time."""

from __future__ import annotations

import time

import pytest

from handoff.service.redact import is_secret_name, redact_secrets, redact_text

# SGLang 0.5.23's server arguments that name a secret (api_key, admin_api_key, ssl_keyfile_password, watermark_key,
# watermark_key_b), some that do not, and other spellings
SECRET_NAMES = ["api_key", "admin_api_key", "ssl_keyfile_password", "watermark_key", "watermark_key_b", "hf_token",
                "HF_TOKEN", "OPENAI_API_KEY", "apiKey", "accessToken", "HFToken", "X-Api-Key", "aws_secret_access_key",
                "client_secret", "secrets", "password", "db_passwd", "key", "token", "private_key", "secret2",
                "Authorization"]
PLAIN_NAMES = ["tokenizer_path", "tokenizer_mode", "max_total_tokens", "max_prefill_tokens", "speculative_token_map",
               "image_token_id", "skip_tokenizer_init", "ssl_keyfile", "ssl_certfile", "tokens", "keys", "model_path",
               "tp_size", "enable_memory_saver", "kv_cache_dtype", "monkey", "", "_"]


@pytest.mark.parametrize("name", SECRET_NAMES)
def test_secret_names(name: str) -> None:
    assert is_secret_name(name)


@pytest.mark.parametrize("name", PLAIN_NAMES)
def test_plain_names(name: str) -> None:
    assert not is_secret_name(name)


def test_secrets_are_null_at_any_depth_and_the_shape_is_kept() -> None:
    info = {"api_key": "sk-1", "admin_api_key": None, "tp_size": 2, "model_path": "/m",
            "nested": {"deeper": [{"hf_token": "hf-2", "max_total_tokens": 7}, {"secrets": {"a": ["s-3"]}}]},
            "hf_token": True, "bucket_time_to_first_token": [0.1, 0.5], "client_secret": {"n": 1},
            "internal_states": [{"last_gen_throughput": 1.5}], "empty": {}, "list": []}
    assert redact_secrets(info) == {
        "api_key": None, "admin_api_key": None, "tp_size": 2, "model_path": "/m",
        "nested": {"deeper": [{"hf_token": None, "max_total_tokens": 7}, {"secrets": None}]},
        "hf_token": True, "bucket_time_to_first_token": [0.1, 0.5], "client_secret": {"n": 1},
        "internal_states": [{"last_gen_throughput": 1.5}], "empty": {}, "list": []}
    assert info["api_key"] == "sk-1"  # a copy: the peer's value is left alone
    for scalar in (None, True, 3, 1.5, "plain"):
        assert redact_secrets(scalar) == scalar


def test_an_argv_and_a_command_line_lose_their_secret_values() -> None:
    argv = ["--model-path", "m", "--api-key", "sk-1", "--admin-api-key=adm-2", "--port", "30000"]
    assert redact_secrets({"argv": argv})["argv"] == ["--model-path", "m", "--api-key", "<redacted>",
                                                      "--admin-api-key=<redacted>", "--port", "30000"]
    command = "python -m sglang.launch_server --model-path m --api-key sk-1 --admin-api-key=adm-2 --port 30000"
    assert redact_secrets({"launch_command": command}) == {"launch_command": (
        "python -m sglang.launch_server --model-path m --api-key <redacted> --admin-api-key=<redacted> --port 30000")}
    assert redact_text("--api-key 123456 --tp-size 2") == "--api-key <redacted> --tp-size 2"  # a flag's value is text
    assert redact_text("--api-key --port 3") == "--api-key --port 3"  # no value: nothing to hide


@pytest.mark.parametrize("text,expected", [
    ("model='m', hf_token='hf_abc', seed=0", "model='m', hf_token='<redacted>', seed=0"),
    ('{"secret_key": "abc", "bucket": "b", "n_token": 3}', '{"secret_key": "<redacted>", "bucket": "b", "n_token": 3}'),
    ('{"cfg": {"hf_token": "x"}}', '{"cfg": {"hf_token": "<redacted>"}}'),
    ("['--api-key', 'sk-1', '--port', '1']", "['--api-key', '<redacted>', '--port', '1']"),
    ("HF_TOKEN=hf_x\nPATH=/bin", "HF_TOKEN=<redacted>\nPATH=/bin"),
    ("s3://user:pw@bucket/k http://h:80/a@b", "s3://user:<redacted>@bucket/k http://h:80/a@b"),
    ("max_total_tokens=5, tokenizer_path=/t", "max_total_tokens=5, tokenizer_path=/t"),
])
def test_secrets_in_text(text: str, expected: str) -> None:
    assert redact_text(text) == expected


def test_anything_deeper_than_the_bound_is_null() -> None:
    value: object = "sk-deep"
    for _ in range(5):
        value = {"a": value}
    assert redact_secrets(value, max_depth=3) == {"a": {"a": {"a": None}}}
    assert redact_secrets({"api_key": [[["x"]]]}, max_depth=1) == {"api_key": None}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text", ["a.-a" * 300_000, "a." * 500_000, "-a" + " " * 1_000_000 + "-", "x" * 1_000_000 + "=",
                                  "a://" * 250_000, "-token " * 150_000, '"a": ' * 200_000, "k=" * 500_000])
def test_no_text_makes_the_redaction_quadratic(text: str) -> None:
    started = time.process_time()  # CPU time: a quadratic pass costs minutes of it, a loaded box none
    redact_text(text)
    assert time.process_time() - started < 15  # up to 1.4 s on a dev box, twice that on a CI box


@pytest.mark.parametrize("command,expected", [
    # SGLang's launch_command is its argv joined by spaces, unquoted: a flag's value is the whole word
    ("--api-key=-Zq9tok --port 1", "--api-key=<redacted> --port 1"),  # token_urlsafe: 1 in 64 begins with -
    ("--ssl-keyfile-password P@ss(w0rd);x,y{z} --port 1", "--ssl-keyfile-password <redacted> --port 1"),
    ("--admin-api-key=ab'cd\"ef --port 1", "--admin-api-key=<redacted> --port 1"),
    ("--api-key 'abc --port 1", "--api-key '<redacted>' --port 1"),
    ("['--api-key=a,b', '--port', '1']", "['--api-key=<redacted>', '--port', '1']"),  # a list's text keeps its form
    ("--api-key --port 1", "--api-key --port 1"),
])
def test_a_flag_value_is_redacted_whole(command: str, expected: str) -> None:
    """A value after ``=`` that begins with ``-``, and one holding ``(``, ``,``, ``;``, ``{`` or a quote, was
    redacted only up to that character (or not at all), the rest relayed (found by review)."""
    assert redact_text(command) == expected
    assert redact_secrets({"launch_command": command}) == {"launch_command": expected}


@pytest.mark.parametrize("text,expected", [
    ("http://collector:4318/v1/traces?api_key=XYZ", "http://collector:4318/v1/traces?api_key=<redacted>"),
    ("https://u:pw@h/x?token=abc", "https://u:<redacted>@h/x?token=<redacted>"),
    ("url=http://h/?token=abc", "url=http://h/?token=<redacted>"),
    ('{"endpoint": "tcp://h:5557?token=x"}', '{"endpoint": "tcp://h:5557?token=<redacted>"}'),
    ("Authorization=Bearer abc123", "Authorization=<redacted>"),
    ("Authorization: Token 12345, x: 1", "Authorization: <redacted>, x: 1"),
])
def test_a_name_inside_another_fields_value_is_looked_at(text: str, expected: str) -> None:
    """``scheme:`` read as an assignment took the whole URL as its value, so the ``?api_key=`` in it (an OTLP
    endpoint, an encoder URL) was never looked at; ``Authorization: Bearer X`` lost ``Bearer`` and kept X (found
    by review)."""
    assert redact_text(text) == expected


@pytest.mark.timeout(60)
def test_secret_names_nested_deep_cost_one_walk() -> None:
    """Each secret-named field walked its whole value to learn whether it held text, and then walked it again to
    copy it: 30 such fields nested, each beside 100,000 numbers (9 MB, under the sidecar's 8 MiB-ish bound), took
    20 s of CPU per ``/get_server_info`` (found by review)."""
    value: object = [0] * 100_000
    for _ in range(30):
        value = {"key": [0] * 100_000 + [value]}
    flat = {"numbers": [0] * 3_100_000}
    started = time.monotonic()
    redact_secrets(flat)
    flat_s = time.monotonic() - started
    started = time.monotonic()
    redacted = redact_secrets(value)
    assert time.monotonic() - started < 3 * flat_s + 1
    assert redacted == value  # numbers only: nothing hidden
