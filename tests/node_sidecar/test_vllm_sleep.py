"""The vLLM adapter's sleep levels and wake-up tags against a fake of vLLM's own sleep bookkeeping (its executor's
``is_sleeping`` and ``sleeping_tags``, vLLM's ``v1/executor/abstract.py``): what the adapter counts released is what
vLLM holds asleep, in every order of releases and resumes of ``weights`` and ``kv_cache``. The real thing:
tests/vllm/test_vllm_node.py."""

from __future__ import annotations

from urllib.parse import parse_qs, urlsplit

from node_sidecar.engines.vllm import VllmEngine

BOTH = {"weights", "kv_cache"}


class SleepBook:
    """vLLM's executor as its dev endpoints show it: ``/sleep`` while anything sleeps does nothing (vLLM logs
    "Executor is already sleeping." and answers 200); ``/wake_up`` of a tag not asleep does nothing either."""

    base_url = "http://127.0.0.1:9"

    def __init__(self) -> None:
        self.sleeping: set[str] = set()
        self.calls: list[str] = []

    async def call(self, method: str, path: str, body: dict | None = None, **kwargs: object) -> dict:
        self.calls.append(path)
        url = urlsplit(path)
        query = parse_qs(url.query)
        if url.path == "/sleep":
            if not self.sleeping:
                self.sleeping = set(BOTH)
        elif url.path == "/wake_up":
            tags = query.get("tags") or sorted(BOTH)
            if self.sleeping and all(t in self.sleeping for t in tags):
                self.sleeping -= set(tags)
        elif url.path == "/is_sleeping":
            return {"is_sleeping": bool(self.sleeping)}
        return {}


def adapter() -> tuple[VllmEngine, SleepBook]:
    book = SleepBook()
    vllm = VllmEngine(book)
    vllm.memory.read = lambda device: None  # type: ignore[method-assign]  # nothing to measure here
    return vllm, book


async def test_the_kv_cache_released_again_while_the_weights_sleep_goes_to_sleep() -> None:
    """Released all, ``kv_cache`` resumed alone, then released again: the adapter slept at level 1 and woke the
    weights, but vLLM ignores a sleep while its weights sleep, so the "release" woke the weights and freed
    nothing, while the node counted both released (found by review). Now both sleep, at the weights' level."""
    for level in (1, 2):
        vllm, book = adapter()
        await vllm.release(["weights", "kv_cache", "cuda_graph", "workspace"], stage_to_cpu=level == 1)
        assert book.sleeping == BOTH
        await vllm.resume(["kv_cache"])
        assert book.sleeping == {"weights"}
        await vllm.release(["kv_cache"], stage_to_cpu=None)
        assert book.sleeping == BOTH, book.calls
        assert BOTH <= vllm.released and vllm.level == level
        change = await vllm.resume(["weights", "kv_cache", "cuda_graph", "workspace"])
        assert book.sleeping == set() and not vllm.released
        assert change.weights_valid is (level == 1)


async def test_every_order_of_releases_and_resumes_leaves_vllm_asleep_as_counted() -> None:
    """Each sequence of single-tag and two-tag releases and resumes: what vLLM holds asleep is what the adapter
    counts released."""
    steps = [("release", ["kv_cache"]), ("release", ["weights", "kv_cache"]), ("resume", ["weights"]),
             ("resume", ["kv_cache"]), ("release", ["weights"]), ("resume", ["weights", "kv_cache"])]
    for first in steps:
        for second in steps:
            for third in steps:
                vllm, book = adapter()
                for verb, tags in (first, second, third):
                    if verb == "release":
                        resident = [t for t in ("weights", "kv_cache") if t not in vllm.released]
                        todo = vllm.release_set([t for t in tags if t in resident], resident)
                        if todo:
                            await vllm.release(todo, stage_to_cpu=True)
                    else:
                        await vllm.resume([t for t in tags if t in vllm.released])
                    assert book.sleeping == vllm.released & BOTH, (first, second, third, book.calls)


async def test_a_new_sidecar_resumes_whatever_part_of_vllm_sleeps() -> None:
    """A sidecar that meets vLLM asleep counts every tag released, not knowing which sleep. vLLM wakes nothing for
    a ``/wake_up`` naming a tag that is awake, so the resume of all of them left ``kv_cache`` (or the weights)
    asleep while the node counted them resident: generation hung in vLLM, a reload wrote into sleeping weights
    (found by review). Now each tag is woken on its own."""
    for asleep in ({"kv_cache"}, {"weights"}, set(BOTH)):
        vllm, book = adapter()
        book.sleeping = set(asleep)
        view = await vllm.read_view()
        assert {t for t, s in view.tags.items() if s.value == "released"} >= BOTH
        await vllm.resume(["weights", "kv_cache", "cuda_graph", "workspace"])
        assert book.sleeping == set(), (asleep, book.calls)
        assert not vllm.released
