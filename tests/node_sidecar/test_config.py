"""The sidecar's config names the flag the user typed when it refuses a value."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest

from node_sidecar.config import ConfigError, SidecarConfig, _flag


def test_a_refused_value_names_its_flag_as_typed() -> None:
    """``--retry-after 0`` was refused as "--retry-after-s must be >= 1": a flag that does not exist."""
    with pytest.raises(ConfigError, match=r"^--retry-after must be >= 1, got 0$"):
        SidecarConfig(engine_url="http://127.0.0.1:1", retry_after_s=0)


def test_every_field_is_named_by_a_flag_the_sidecar_has() -> None:
    help_text = subprocess.run([sys.executable, "-m", "node_sidecar", "--help"], capture_output=True, text=True,
                               timeout=60, check=True).stdout
    flags = set(re.findall(r"--[a-z][a-z-]*", help_text))
    missing = [f.name for f in dataclasses.fields(SidecarConfig) if _flag(f.name) not in flags]
    assert not missing, missing


@pytest.mark.parametrize("url,problem", [
    ("http://user:s3cr3t@127.0.0.1:1", "credentials"), ("http://s3cr3t@127.0.0.1:1", "credentials"),
    ("http://127.0.0.1:1/?token=s3cr3t", "a query"), ("https://u:s3cr3t@127.0.0.1:1", "an http:// URL"),
])
def test_an_engine_url_with_a_secret_is_refused_without_writing_it_out(url: str, problem: str) -> None:
    """The engine takes no credentials: a password in --engine-url was written to the log on every failed read."""
    done = subprocess.run([sys.executable, "-m", "node_sidecar", "--engine-url", url, "--port", "0"],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "--engine-url must be" in done.stderr and problem in done.stderr, done.stderr
    assert "s3cr3t" not in done.stderr
