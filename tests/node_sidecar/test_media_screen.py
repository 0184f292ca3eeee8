"""Media items on their way to an engine that loads them on its own: screened by the sidecar (node_sidecar/media.py).

Found by review: the sidecar passed image items to SGLang untouched, and SGLang 0.5.23 reads any ``file://``
URL or path starting with ``/`` with no folder and no size limit (``utils/common.py``: ``get_image_bytes``), so
a client could have the node's files read into a prompt, or ``file:///dev/zero`` exhaust its memory. Each
refused body is shown never to reach the engine (the SGLang stand-in records every media item it receives).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from node_sidecar.engines.handoff import HandoffEngine
from node_sidecar.engines.sglang import SglangEngine
from node_sidecar.engines.vllm import VllmEngine
from node_sidecar.media import may_hold_media
from tests.node_sidecar.test_sglang_adapter import Node

DATA_URL = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot really").decode()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    folder = root / "media"
    folder.mkdir()
    (folder / "cat.png").write_bytes(b"\x89PNG")
    (root / "secret.png").write_bytes(b"\x89PNG")
    (folder / "link.png").symlink_to(root / "secret.png")
    os.mkfifo(folder / "pipe.png")
    return folder


@pytest.fixture(scope="module")
def plain_node(proc_log_dir: Path):
    node = Node(proc_log_dir)
    yield node
    node.stop()


@pytest.fixture(scope="module")
def strict_node(proc_log_dir: Path, media_dir: Path):
    node = Node(proc_log_dir, sidecar_flags=("--allowed-local-media-path", str(media_dir), "--refuse-media-urls"))
    yield node
    node.stop()


def generate(image_data: object) -> dict:
    return {"input_ids": [1, 2], "image_data": image_data, "sampling_params": {"max_new_tokens": 2}}


def chat(part: dict) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, part]}]}


def assert_refused(node: Node, path: str, body: dict | bytes, field: str, words: str) -> None:
    before = node.fake_state()
    if isinstance(body, bytes):
        r = httpx.post(node.sidecar.url + path, content=body, headers={"Content-Type": "application/json"},
                       timeout=30)
    else:
        r = node.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request" and error["field"] == field and words in error["message"], error
    after = node.fake_state()
    assert after["media"] == before["media"] and after["calls"] == before["calls"]  # never reached the engine


@pytest.mark.parametrize("path,body,field,words", [
    ("/generate", generate("file:///etc/hostname"), "body.image_data", "not allowed here"),
    ("/generate", generate("file:///dev/zero"), "body.image_data", "not allowed here"),
    ("/generate", generate("/etc/passwd"), "body.image_data", "SGLang opens any image that starts with '/'"),
    ("/generate", generate(" FILE:///etc/hostname.png"), "body.image_data", "not allowed here"),
    ("/generate", generate([[DATA_URL], [DATA_URL, "/etc/hostname.png"]]), "body.image_data[1][1]", "not allowed"),
    ("/generate", generate([{"url": "file:///etc/passwd"}]), "body.image_data[0].url", "not allowed here"),
    ("/generate", {"input_ids": [1], "video_data": "etc/passwd"}, "body.video_data", "any video or audio"),
    ("/generate", {"text": ["a", "b"], "audio_data": ["data:audio/wav;base64,AAAA", "../../dev/zero"]},
     "body.audio_data[1]", "any video or audio"),
    ("/v1/chat/completions", chat({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}),
     "body.messages[0].content[1].image_url.url", "not allowed here"),
    ("/v1/chat/completions", chat({"image_url": "/etc/passwd"}), "body.messages[0].content[1].image_url",
     "starts with '/'"),
    ("/v1/chat/completions", chat({"type": "video_url", "video_url": {"url": "file:///dev/zero"}}),
     "body.messages[0].content[1].video_url.url", "not allowed here"),
    ("/generate", b'{"input_ids": [1], "image\\u005fdata": "file:///etc/passwd"}', "body.image_data",
     "not allowed here"),
    ("/generate", generate("file://[::1/etc/passwd"), "body.image_data", "not a file URL"),  # was a 500
], ids=["file-url", "dev-zero", "slash-path", "file-url-spelt-otherwise", "nested-batch", "image-data-object",
        "relative-video", "audio-batch", "chat-image-url", "chat-simple-image-url", "chat-video-url", "escaped-key",
        "file-url-unparsable"])
def test_local_media_is_refused_at_the_sidecar_by_default(plain_node: Node, path: str, body, field: str,
                                                          words: str) -> None:
    assert_refused(plain_node, path, body, field, words)
    plain_node.assert_fake_alive()


def test_bytes_and_urls_pass_by_default(plain_node: Node) -> None:
    for item in (DATA_URL, "https://example.com/cat.png", [["http://example.com/a.png", DATA_URL]]):
        r = plain_node.post("/generate", generate(item))
        assert r.status_code == 200, r.text
        assert plain_node.fake_state()["media"][-1] == item
    part = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png", "detail": "auto"}}
    r = plain_node.post("/v1/chat/completions", chat(part))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok", r.text
    assert plain_node.fake_state()["media"][-1][0]["content"][1] == part
    # A body without media is not parsed, and passes as it came.
    assert plain_node.post("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_the_allowed_folder_and_refused_urls(strict_node: Node, media_dir: Path) -> None:
    for item in (str(media_dir / "cat.png"), f"file://{media_dir / 'cat.png'}"):
        r = strict_node.post("/generate", generate(item))
        assert r.status_code == 200, r.text
        assert strict_node.fake_state()["media"][-1] == item
    for item, words in [(str(media_dir / "link.png"), "no such image file below --allowed-local-media-path"),
                        (str(media_dir / ".." / "secret.png"), "no such image file below"),
                        (str(media_dir / "pipe.png"), "is not a file"),
                        ("media/cat.png", "must be absolute"),
                        ("https://example.com/cat.png", "--refuse-media-urls"),
                        ("\tHTTP://example.com/cat", "--refuse-media-urls")]:
        assert_refused(strict_node, "/generate", generate(item), "body.image_data", words)
    part = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}}
    assert_refused(strict_node, "/v1/chat/completions", chat(part), "body.messages[0].content[1].image_url.url",
                   "--refuse-media-urls")
    strict_node.assert_fake_alive()


def test_only_bodies_that_may_name_media_are_parsed() -> None:
    assert not may_hold_media(json.dumps({"input_ids": [1, 2], "text": "a url: http://x", "rid": "r"}).encode())
    for body in (generate("x"), chat({"image_url": "x"}), {"text": "\u00e9", "input_ids": [1]}):
        assert may_hold_media(json.dumps(body).encode())  # the last: an escape could spell a key
    assert SglangEngine.screens_media and VllmEngine.screens_media and not HandoffEngine.screens_media


def test_the_sidecar_reads_image_sources_without_torch() -> None:
    """The reading of an image item is written once, for the engine and the sidecar; the sidecar never loads torch."""
    code = "import sys, node_sidecar.app, node_sidecar.media; print(sorted({'torch', 'PIL'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_bare_base64_video_passes_to_sglang(plain_node: Node) -> None:
    """SGLang reads a video item that names no existing file as base64 (``utils/common.py``:
    ``_normalize_video_input``), and one of PATH_MAX characters or more can never name one (the file system
    refuses the path): such bytes pass, where a shorter item, which could be a relative path, stays a 400."""
    video = base64.b64encode(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 16).decode()
    assert len(video) >= 4096 and "/" in video
    body = {"input_ids": [1], "video_data": video, "sampling_params": {"max_new_tokens": 2}}
    r = plain_node.post("/generate", body)
    assert r.status_code == 200, r.text
    part = {"type": "video_url", "video_url": {"url": video}}
    r = plain_node.post("/v1/chat/completions", chat(part))
    assert r.status_code == 200, r.text
    assert plain_node.fake_state()["media"][-1][0]["content"][1] == part
    # a long item that is not base64 may still be read as a path by SGLang or its decoder: refused
    for item in ("concat:/etc/passwd?" + "A" * 5000, "etc/passwd#" + "A" * 5000):
        assert_refused(plain_node, "/generate", {"input_ids": [1], "video_data": item}, "body.video_data",
                       "any video or audio")
    plain_node.assert_fake_alive()
