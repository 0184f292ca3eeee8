"""Decoding a tensor payload: handoff's restricted unpickler against C ``pickle.loads`` of the same bytes.

    .venv/bin/python bench/payload_decode.py [--tensors 111,1000] [--repeat 7]

A verl-shaped ``update_weights_from_tensor`` payload (one ``LocalSerializedTensor``
per tensor, each an inner pickle of a shared-memory tensor), decoded by
``node_engine.weight_sync.tensor_payload.decode_payload`` (pickle's pure-Python
unpickler with a checked dispatch table, every rebuild checked) and by unchecked
C ``pickle.loads``, outer and inner, in the same run. Prints the medians and
their ratio; the tensors' bytes stay in shared memory either way.
"""

from __future__ import annotations

import argparse
import base64
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import median_s  # noqa: E402
from node_engine.weight_sync.tensor_payload import decode_payload  # noqa: E402
from tests.support.sglang_payloads import verl_payload  # noqa: E402


def unchecked(payload: str) -> list[tuple[str, Any]]:
    outer = pickle.loads(base64.b64decode(payload))
    return [(name, pickle.loads(wrapper.values[0])) for name, wrapper in outer]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", default="111,1000", help="payload sizes, comma-separated")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)  # torch's TypedStorage deprecation, once per rebuild
    print("| tensors | restricted | C pickle.loads | ratio |\n|---:|---:|---:|---:|")
    for num in (int(n) for n in args.tensors.split(",")):
        tensors = [torch.zeros(16) for _ in range(num)]  # kept alive: their shared memory must stay
        payload = verl_payload([(f"model.layers.{i}.w", t) for i, t in enumerate(tensors)])
        restricted = median_s(lambda: decode_payload([payload], None), args.repeat)
        plain = median_s(lambda: unchecked(payload), args.repeat)
        print(f"| {num} | {restricted * 1e3:.1f} ms | {plain * 1e3:.1f} ms | {restricted / plain:.1f}x |")


if __name__ == "__main__":
    main()
