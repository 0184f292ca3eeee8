"""The demo's image step (``handoff demo --model builtin:tiny-vl``).

Image requests go through the LB and the sidecars as RL clients send them
(SGLang's ``image_data`` as data URLs and bare base64, a batch, two images in
one prompt, an OpenAI chat with ``image_url`` parts, a panorama larger than
``--max-image-tokens`` allows); then every VL node releases all its memory and
resumes it. The step checks that each node's vision reservation left with the
``workspace`` tag and came back whole, and that the same requests give the
same tokens after the cycle.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from PIL import Image

from handoff.protocol.tags import Tag

if TYPE_CHECKING:
    from handoff.demo import Demo

MiB = 2**20
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
PLACEHOLDER = "<image>"


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def demo_images() -> dict[str, bytes]:
    """Three PNGs: a gradient "photo", a noisy square, a 4000 x 300 panorama (over the per-image cap)."""
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, 640, dtype=np.float32)
    photo = np.stack([np.tile(ramp, (480, 1)), np.tile(ramp[::-1], (480, 1)),
                      np.full((480, 640), 90, np.float32)], axis=-1).astype(np.uint8)
    noise = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    panorama = rng.integers(0, 256, (300, 4000, 3), dtype=np.uint8)
    return {"photo": _png(Image.fromarray(photo)), "noise": _png(Image.fromarray(noise)),
            "panorama": _png(Image.fromarray(panorama))}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + _b64(data)


class ImageStep:
    def __init__(self, demo: Demo) -> None:
        self.demo = demo
        self.images = demo_images()

    async def run(self) -> str:
        from handoff.demo import check

        async with httpx.AsyncClient(timeout=120) as http:
            before = await self._vision_state(http)
            first = await self._requests(http)
            self._show(first, before)
            result = await self.demo.client.release(mode="wait", stage_to_cpu=True)
            for node in result.results:
                freed = node.body["bytes_freed"].get(Tag.WORKSPACE.value, 0)
                reserved = before[node.node]["reservation_bytes"]
                check(freed >= reserved > 0, f"{node.node} freed {freed} B of workspace, less than its vision "
                                             f"reservation of {reserved} B")
            released = await self._vision_state(http)
            check(all(s["workspace_state"] == "released" for s in released.values()), "workspace not released")
            await self.demo.client.resume()
            after = await self._vision_state(http)
            check(after == before, f"the vision state after the cycle differs: {before} -> {after}")
            again = await self._requests(http)
            check(again == first, "image outputs differ after the release/resume cycle")
        reservation = sum(s["reservation_bytes"] for s in before.values()) / len(before) / MiB
        return (f"{first['num_requests']} image requests through the LB; the panorama served as "
                f"{first['panorama_tokens']} tokens (cap {first['cap']}); {reservation:.1f} MiB vision reservation "
                f"per node released with workspace and restored; outputs identical")

    async def _vision_state(self, http: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
        """Each node's image caps, reservation and workspace bytes and state, read through its sidecar."""
        states = {}
        for node in self.demo.cluster.nodes:
            info = (await http.get(f"{node.url}/get_server_info")).raise_for_status().json()
            workspace = info["memory"]["tags"][Tag.WORKSPACE.value]
            states[node.url] = {**info["vision"], "workspace_bytes": workspace["bytes"],
                                "workspace_state": workspace["state"]}
        return states

    async def _requests(self, http: httpx.AsyncClient) -> dict[str, Any]:
        from handoff.demo import check

        client, images = self.demo.client, self.images
        prompt = f"{PLACEHOLDER}What is in the picture?"
        batch = await client.generate([prompt] * 3, sampling_params=GREEDY, return_prompt_token_ids=True,
                                      image_data=[_data_url(images["photo"]), _b64(images["noise"]),
                                                  _data_url(images["panorama"])])
        pair = await client.generate(f"{PLACEHOLDER} then {PLACEHOLDER}: which one is brighter?",
                                     sampling_params=GREEDY,
                                     image_data=[_data_url(images["photo"]), _data_url(images["noise"])])
        content = [{"type": "text", "text": "Describe "},
                   {"type": "image_url", "image_url": {"url": _data_url(images["photo"])}}]
        chat = (await http.post(f"{self.demo.cluster.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": content}], "max_tokens": 16, "temperature": 0,
        })).raise_for_status().json()
        outputs = [a["output_ids"] for a in batch] + [pair["output_ids"]]
        check(len({tuple(o) for o in outputs[:2]}) == 2, "two different images gave the same tokens")
        cap = (await http.get(f"{self.demo.cluster.nodes[0].url}/get_server_info")).json()["vision"]
        panorama_tokens = batch[2]["prompt_token_ids"].count(cap["image_token_id"])
        check(0 < panorama_tokens <= cap["max_image_tokens"], f"the panorama became {panorama_tokens} tokens")
        return {"outputs": outputs, "chat": chat["choices"][0]["message"]["content"], "num_requests": 5,
                "panorama_tokens": panorama_tokens, "cap": cap["max_image_tokens"]}

    def _show(self, first: dict[str, Any], before: dict[str, dict[str, Any]]) -> None:
        say = self.demo.say
        say("   a batch of 3 images (data URL, base64, a 4000 x 300 panorama), a prompt with 2 images and an "
            "OpenAI chat with an image_url part, through the LB")
        for url, state in before.items():
            say(f"   {url}: images up to {state['max_image_tokens']} tokens, {state['visual_batch_max_tokens']} "
                f"per step; vision reservation {state['reservation_bytes'] / MiB:.1f} MiB of "
                f"{state['workspace_bytes'] / MiB:.1f} MiB workspace")
