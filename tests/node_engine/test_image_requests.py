"""Images over HTTP on a vision-language engine (builtin:tiny-vl): SGLang's ``image_data`` on ``/generate`` in
every spelling and batch shape, OpenAI chat ``image_url`` parts through the ``openai`` package, and bad images
refused with 400 before anything runs (nothing prefilled, no KV slot taken)."""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import openai
import pytest
from PIL import Image

from tests.node_engine.vl_checkpoints import encoded, progressive_jpeg, random_image
from tests.support.procs import ServerProcess

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
PROMPT = "<|vision_start|><|image_pad|><|vision_end|>What is in the picture?"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + b64(data)


IMAGES = [encoded(random_image(60 + 40 * i, 90 + 30 * i, seed=i)) for i in range(3)]


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(IMAGES[0])
    return folder


@pytest.fixture(scope="module")
def vl_engine(tmp_path_factory: pytest.TempPathFactory, media: Path):
    proc = ServerProcess("node_engine", ["--model-path", "builtin:tiny-vl", "--max-total-tokens", "4096",
                                         "--max-image-tokens", "64", "--allowed-local-media-path", str(media)],
                         log_dir=tmp_path_factory.mktemp("engine"))
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(vl_engine: ServerProcess):
    with httpx.Client(base_url=vl_engine.url, timeout=60) as c:
        yield c


def generate(client: httpx.Client, **body) -> dict | list:
    r = client.post("/generate", json={"sampling_params": GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def refused(client: httpx.Client, path: str = "/generate", **body) -> dict:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def counters(client: httpx.Client) -> dict[str, float]:
    """The engine's request, prompt-token and KV-slot figures (what an admitted request would move)."""
    wanted = ("handoff_engine_prompt_tokens_total", "handoff_engine_kv_slots_used", "handoff_engine_requests_total",
              "handoff_engine_queued_requests", "handoff_engine_running_requests")
    values = {name: 0.0 for name in wanted}
    for line in client.get("/metrics").text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in values:
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


def test_every_spelling_of_one_image_gives_the_same_tokens(client: httpx.Client, media: Path) -> None:
    expected = generate(client, text=PROMPT, image_data=b64(IMAGES[0]))["output_ids"]
    spellings = [data_url(IMAGES[0]), str(media / "cat.png"), f"file://{media / 'cat.png'}", [b64(IMAGES[0])],
                 [[data_url(IMAGES[0])]]]
    for item in spellings:
        assert generate(client, text=PROMPT, image_data=item)["output_ids"] == expected, str(item)[:40]
    # <image> in a text prompt stands for the model's placeholder; input_ids with a collapsed placeholder too.
    assert generate(client, text="<image>What is in the picture?", image_data=b64(IMAGES[0]))["output_ids"] == expected
    ids = generate(client, text=PROMPT, image_data=b64(IMAGES[0]), return_prompt_token_ids=True)["prompt_token_ids"]
    collapsed = [t for i, t in enumerate(ids) if not (t == 260 and ids[i - 1] == 260)]
    assert len(collapsed) < len(ids)
    assert generate(client, input_ids=collapsed, image_data=b64(IMAGES[0]))["output_ids"] == expected
    # The image reaches the model: other pixels, other tokens.
    others = [generate(client, text=PROMPT, image_data=b64(image))["output_ids"] for image in IMAGES[1:]]
    assert any(other != expected for other in others)


def test_several_images_per_prompt_batches_and_n(client: httpx.Client) -> None:
    two = "<image> and <image>: which is brighter?"
    singles = [generate(client, text=two, image_data=[b64(IMAGES[i]), b64(IMAGES[i + 1])])["output_ids"]
               for i in range(2)]
    assert singles[0] != generate(client, text=two, image_data=[b64(IMAGES[1]), b64(IMAGES[0])])["output_ids"] or \
        singles[0] != singles[1]
    batch = generate(client, text=[two, two], image_data=[[b64(IMAGES[0]), b64(IMAGES[1])],
                                                          [b64(IMAGES[1]), b64(IMAGES[2])]])
    assert [answer["output_ids"] for answer in batch] == singles
    # A batch with one image per prompt (a flat list), and a text-only prompt beside it (null).
    one = generate(client, text=PROMPT, image_data=b64(IMAGES[2]))["output_ids"]
    mixed = generate(client, text=[PROMPT, "no image here"], image_data=[b64(IMAGES[2]), None])
    assert mixed[0]["output_ids"] == one and len(mixed[1]["output_ids"]) == GREEDY["max_new_tokens"]
    # n samples of one image prompt: each owns its features; greedy samples agree.
    samples = generate(client, text=PROMPT, image_data=b64(IMAGES[2]), sampling_params={**GREEDY, "n": 3})
    assert [s["output_ids"] for s in samples] == [one] * 3


def test_an_oversized_image_is_resized_to_the_cap(client: httpx.Client) -> None:
    big = encoded(Image.new("RGB", (3000, 200), (200, 30, 90)))
    answer = generate(client, text=PROMPT, image_data=b64(big), return_prompt_token_ids=True)
    assert 0 < answer["prompt_token_ids"].count(260) <= 64
    info = client.get("/get_server_info").json()["vision"]
    assert info["max_image_tokens"] <= 64 and info["reservation_bytes"] > 0
    assert client.get("/get_model_info").json()["has_image_understanding"] is True


def _bad(data: bytes) -> str:
    return b64(data)


def _palette_png_with_long_transparency() -> bytes:
    """A 4 x 3 palette PNG whose tRNS chunk holds 300 entries for a palette of 4: it decodes, and Pillow's
    conversion to RGBA raises ValueError (found by review: a 500, "internal_error"); its conversion to RGB, SGLang's,
    drops the tRNS and succeeds."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", 4, 3, 8, 3, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"PLTE", bytes(12)) + chunk(b"tRNS", bytes(300))
            + chunk(b"IDAT", zlib.compress(b"\x00\x00\x01\x02\x03" * 3)) + chunk(b"IEND", b""))


BAD_IMAGES = [
    (b64(b"plain text, not an image"), "not an image"),
    (b64(IMAGES[0][: len(IMAGES[0]) // 2]), "truncated or corrupt"),
    (b64(encoded(Image.new("1", (20000, 20000)))), "decompression bomb"),
    ("http://127.0.0.1:1/cat.png", "not fetched from the network"),
    ("/etc/passwd.png", "no such image file"),
    ("not base64!", "not valid base64"),
    ("", "empty"),
    (7, "must be a string"),
    (b64(progressive_jpeg(150)), "more than 100 scans"),
]


def test_bad_images_are_400_and_nothing_runs(client: httpx.Client, tmp_path: Path) -> None:
    before = counters(client)
    for item, reason in BAD_IMAGES:
        error = refused(client, text=PROMPT, image_data=item, sampling_params=GREEDY)
        assert error["type"] == "invalid_request" and reason in error["message"], (reason, error)
        assert error["message"].startswith("image_data[0]:"), error
    outside = tmp_path / "outside.png"
    outside.write_bytes(IMAGES[0])
    error = refused(client, text=PROMPT, image_data=str(outside))
    assert "no such image file below --allowed-local-media-path" in error["message"]
    # A bad image anywhere in a batch: nothing of the batch runs, the good prompt included.
    error = refused(client, text=[PROMPT, PROMPT], image_data=[b64(IMAGES[0]), b64(b"junk")])
    assert error["message"].startswith("image_data[1][0]:")
    # Placeholders and images must match.
    assert "2 image(s)" in refused(client, text=PROMPT, image_data=[b64(IMAGES[0])] * 2)["message"]
    assert "no image was given" in refused(client, text=PROMPT)["message"]
    assert "entries for 2 prompts" in refused(client, text=[PROMPT, PROMPT], image_data=[b64(IMAGES[0])])["message"]
    assert "at most 64 images per prompt" in refused(client, text=PROMPT, image_data=[b64(IMAGES[0])] * 65)["message"]
    # OpenAI parts: a remote URL, an image_url that is no object, a video (the engine takes text and images).
    chat = {"model": "builtin:tiny-vl", "max_tokens": 2}
    for content, kind, reason in [
            ([{"type": "image_url", "image_url": {"url": "https://127.0.0.1:1/x.png"}}], "invalid_request",
             "not fetched from the network"),
            ([{"type": "image_url", "image_url": data_url(IMAGES[0])}], "invalid_request", "image_url.image_url"),
            ([{"type": "video_url", "video_url": {"url": data_url(IMAGES[0])}}], "unsupported", "video_url parts")]:
        error = refused(client, "/v1/chat/completions", messages=[{"role": "user", "content": content}], **chat)
        assert error["type"] == kind and reason in error["message"], error
    assert counters(client) == before
    assert generate(client, text=PROMPT, image_data=b64(IMAGES[0]))["meta_info"]["finish_reason"]["type"] == "length"


def test_a_palette_whose_transparency_pillow_cannot_apply_is_served_as_sglang_serves_it(client: httpx.Client) -> None:
    """SGLang's loader converts it with ``convert("RGB")``, which drops the broken tRNS chunk (stop 40 refused it
    with a 400 while transparency was composited through RGBA)."""
    answer = generate(client, text=PROMPT, image_data=b64(_palette_png_with_long_transparency()))
    assert answer["meta_info"]["finish_reason"]["type"] == "length"


def test_openai_chat_with_image_url_data_urls(vl_engine: ServerProcess, client: httpx.Client) -> None:
    question = "Compare them."
    content = [{"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}},
               {"type": "text", "text": question},
               {"type": "image_url", "image_url": {"url": data_url(IMAGES[1]), "detail": "auto"}}]
    with openai.OpenAI(base_url=vl_engine.url + "/v1", api_key="none", timeout=60, max_retries=0) as sdk:
        chat = sdk.chat.completions.create(model="builtin:tiny-vl", messages=[{"role": "user", "content": content}],
                                           max_tokens=8, temperature=0)
        # The template renders each image part as one placeholder: the same prompt through /generate.
        text = f"<|user|><image>{question}<image>\n<|assistant|>"
        expected = generate(client, text=text, image_data=[b64(IMAGES[0]), b64(IMAGES[1])],
                            sampling_params={"temperature": 0, "max_new_tokens": 8})
        assert chat.choices[0].message.content == expected["text"]
        assert chat.usage.prompt_tokens == expected["meta_info"]["prompt_tokens"]
        swapped = sdk.chat.completions.create(model="builtin:tiny-vl", max_tokens=8, temperature=0,
                                              messages=[{"role": "user", "content": content[::-1]}])
        assert swapped.usage.prompt_tokens == chat.usage.prompt_tokens


def test_thinking_parts_in_the_history_reach_no_template(client: httpx.Client) -> None:
    """SGLang's Jinja path drops an assistant's thinking parts: the prompt is the one without them."""
    image = {"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}}

    def prompt_tokens(answer: list[dict]) -> int:
        messages = [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]},
                    {"role": "assistant", "content": answer}, {"role": "user", "content": "Sure?"}]
        r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    text = {"type": "text", "text": "A square."}
    assert prompt_tokens([{"type": "thinking", "thinking": "Looks square."}, text]) == prompt_tokens([text])


def test_a_text_model_refuses_images_as_unsupported(tiny_engine: ServerProcess) -> None:
    with httpx.Client(base_url=tiny_engine.url, timeout=30) as c:
        error = refused(c, text="<image>hi", image_data=b64(IMAGES[0]))
        assert error["type"] == "unsupported" and error["message"].startswith("image_data")
        content = [{"type": "image_url", "image_url": {"url": data_url(IMAGES[0])}}, {"type": "text", "text": "hi"}]
        error = refused(c, "/v1/chat/completions", model="builtin:tiny",
                        messages=[{"role": "user", "content": content}])
        assert error["type"] == "unsupported"
        # A text model still takes image_data at its empty values (what sglang-router sends).
        r = c.post("/generate", json={"text": "hi", "image_data": [], "sampling_params": GREEDY})
        assert r.status_code == 200, r.text


def test_an_abandoned_request_decodes_no_further_image_and_others_go_on(vl_engine: ServerProcess,
                                                                         client: httpx.Client) -> None:
    """Found by review: a request of 64 cheap-to-send, costly-to-decode images (a 4 KiB PNG of 32 Mi pixels
    each) kept a core busy for half a minute after its client left, and image requests behind it waited."""
    import io
    import os
    import time

    buffer = io.BytesIO()
    Image.new("P", (8192, 4096), 0).save(buffer, "PNG", transparency=0)  # under --max-image-pixels
    body = {"text": PROMPT.replace("What", "") * 64 + "?", "image_data": [b64(buffer.getvalue())] * 64,
            "sampling_params": GREEDY}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(vl_engine.url + "/generate", json=body, timeout=1.5)  # the client gives up

    def cpu_s() -> float:
        fields = open(f"/proc/{vl_engine.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    deadline = time.monotonic() + 10  # the 64 images take over 30 s of CPU to decode
    while True:
        before, started = cpu_s(), time.monotonic()
        small = generate(client, text=PROMPT, image_data=b64(IMAGES[0]))  # an image request behind it
        time.sleep(0.5)  # a window to measure the engine's CPU over, not a synchronisation
        rate = (cpu_s() - before) / (time.monotonic() - started)
        if rate < 0.5:
            break
        assert time.monotonic() < deadline, f"the engine still decodes for a client that left ({rate:.2f} CPU)"
    assert small["meta_info"]["finish_reason"]["type"] == "length"


def test_generic_placeholders_are_bounded_before_they_are_expanded(client: httpx.Client) -> None:
    """Found by review (stop 42): each ``<image>`` of a text prompt was replaced by the model's 43-character
    placeholder on the event loop before the prompt's length was checked: a 60 MB body of them with one image
    became a 387 MB string (2 s of one core holding the loop) and a 400 naming 387,000,000 characters the client
    never sent; and more of them than images were all expanded and tokenized before the count was refused."""
    import re

    sent = "<image>" * 200_000  # over this engine's characters bound as sent
    error = refused(client, text=sent, image_data=b64(IMAGES[0]), sampling_params=GREEDY)
    assert f"a prompt of {len(sent)} characters" in error["message"], error
    limit = int(re.search(r"at most (\d+) characters", error["message"])[1])
    within = "<image>" * (limit // 7 - 10)  # within the bound as sent, thousands of placeholders for one image
    error = refused(client, text=within, image_data=b64(IMAGES[0]), sampling_params=GREEDY)
    assert error["message"].startswith(f"image_data: the prompt has {limit // 7 - 10} <image> placeholders for 1 "
                                       "image(s)"), error
    # the same on a batch, naming the prompt; the images are not decoded first
    error = refused(client, text=["<image>x", within], image_data=[b64(IMAGES[0]), b64(b"junk")],
                    sampling_params=GREEDY)
    assert error["message"].startswith("image_data[1]: the prompt has"), error
    assert generate(client, text="<image>What is it?", image_data=b64(IMAGES[0]))["meta_info"]["prompt_tokens"] > 3


def test_placeholders_are_matched_to_images_before_any_image_is_decoded(client: httpx.Client) -> None:
    """Found by review (R2): a prompt whose placeholders do not match its images (too few, or ending inside
    one) was refused only after every image was decoded and resized: 16 cheap-to-send, costly-to-decode images
    (a 4 KiB PNG of 32 Mi pixels each) held a decode slot for about 12 s before the 400, and a batch's bad
    prompt was found only after the good prompts before it had decoded theirs."""
    import io
    import time

    buffer = io.BytesIO()
    Image.new("P", (8192, 4096), 0).save(buffer, "PNG", transparency=0)  # under --max-image-pixels
    heavy = b64(buffer.getvalue())
    sixteen = PROMPT.replace("What", "") * 16 + "?"
    for body, reason in [({"text": "What is it?", "image_data": [heavy] * 16}, "image_data: the prompt has 0 image"),
                         ({"text": "<|vision_start|><|image_pad|>", "image_data": [heavy]}, "ends with an image"),
                         ({"text": [sixteen, "What is it?"], "image_data": [[heavy] * 16, heavy]},
                          "image_data[1]: the prompt has 0 image")]:
        started = time.monotonic()
        error = refused(client, sampling_params=GREEDY, **body)
        elapsed = time.monotonic() - started
        assert error["type"] == "invalid_request" and reason in error["message"], error
        assert elapsed < 3, f"{elapsed:.1f} s before the 400: the images were decoded first"


def test_a_prompt_too_long_for_the_context_is_refused_before_its_images_are_decoded(client: httpx.Client) -> None:
    """Found by review (R2): a prompt whose text alone fills the context was refused only after its images
    were decoded (16 costly images: 12-21 s of a decode slot for a 400 that the prompt's length decided)."""
    import io
    import time

    buffer = io.BytesIO()
    Image.new("P", (8192, 4096), 0).save(buffer, "PNG", transparency=0)
    heavy = b64(buffer.getvalue())
    context = client.get("/v1/models").json()["data"][0]["max_model_len"]
    text = PROMPT.replace("What", "") * 16 + " a" * context
    chat = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + heavy}}] * 16
    for path, body in [("/generate", {"text": text, "image_data": [heavy] * 16, "sampling_params": GREEDY}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": chat + [
                           {"type": "text", "text": " a" * context}]}], "max_tokens": 1})]:
        started = time.monotonic()
        error = refused(client, path, **body)
        elapsed = time.monotonic() - started
        assert error["type"] == "invalid_request" and "context length" in error["message"], error
        assert elapsed < 3, f"{path}: {elapsed:.1f} s before the 400: the images were decoded first"


def test_an_item_that_cannot_be_an_image_is_refused_before_any_image_is_decoded(client: httpx.Client) -> None:
    """Found by review (R2): an item that is no image whatever its bytes (a number, a network URL, a file URL
    naming a host) was found only when its turn to decode came: after 16 costly images before it (12-21 s)."""
    import io
    import time

    buffer = io.BytesIO()
    Image.new("P", (8192, 4096), 0).save(buffer, "PNG", transparency=0)
    heavy = b64(buffer.getvalue())
    text = PROMPT.replace("What", "") * 17 + "?"
    for last, reason in [(17, "must be a string"), ("https://127.0.0.1:1/x.png", "not fetched from the network"),
                         ("file://host/x.png", "names no host")]:
        started = time.monotonic()
        error = refused(client, text=text, image_data=[heavy] * 16 + [last], sampling_params=GREEDY)
        elapsed = time.monotonic() - started
        assert error["message"].startswith("image_data[16]:") and reason in error["message"], error
        assert elapsed < 3, f"{elapsed:.1f} s before the 400: the images were decoded first"
