"""The restricted unpickler's rules, pickle by pickle (no engine): what a payload may build, where its opcodes
may act, and what decoding one may cost."""

from __future__ import annotations

import pickle
import resource
import struct
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from node_engine.weight_sync.tensor_payload import decode_payload
from node_engine.weight_sync.unpickler import PayloadBudget, UnsafePayload, restricted_loads
from tests.support.sglang_payloads import FlattenedTensorMetadata, LocalSerializedTensor, b64, serialize

def test_a_tensor_payload_from_torch_still_decodes() -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    pairs = restricted_loads(serialize(list(tensors.items())))
    assert [name for name, _ in pairs] == ["a", "b"]
    assert all(torch.equal(t, tensors[name]) for name, t in pairs)


def test_a_claimed_memo_index_allocates_nothing() -> None:
    """LONG_BINPUT 2^31 on an empty list: CPython's C unpickler sized an array by it (2^27 took 2 GiB; 2^31
    would have been 32 GiB from a 9-byte pickle)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert restricted_loads(b"\x80\x04]r" + struct.pack("<I", 2**31) + b".") == []
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB: well under 256 MiB
    with pytest.raises(UnsafePayload):  # the text form of PUT, with an index past any real memo
        restricted_loads(b"(lp" + str(2**70).encode() + b"\n.")


def test_state_is_set_only_on_sglangs_data_classes() -> None:
    """BUILD on a tensor would call Tensor.__setstate__ (set_: a checked tensor re-pointed anywhere in its
    storage, an empty storage grown to any size)."""
    tensor = torch.zeros(4)
    tensor_pickle = serialize(tensor)
    state = b"(K\x00K\x01K\x02K\x03t"  # MARK, four ints, TUPLE: Tensor.__setstate__ would call set_ with them
    with pytest.raises(UnsafePayload, match="sets the state of a Tensor"):
        restricted_loads(tensor_pickle[:-1] + state + b"b.")


def test_items_go_only_into_lists_and_string_keyed_dicts() -> None:
    tensor = torch.zeros(4)
    with pytest.raises(UnsafePayload, match="adds items to a Tensor"):  # a write into (shared) tensor memory
        restricted_loads(serialize(tensor)[:-1] + b"K\x00G?\xf0\x00\x00\x00\x00\x00\x00s.")
    colliding = 2**61 - 1  # int keys equal modulo 2^61 - 1 share a hash: a dict of them is quadratic to build
    with pytest.raises(UnsafePayload, match="dict key"):
        restricted_loads(pickle.dumps({colliding * k: 0 for k in range(1, 4)}, protocol=4))
    with pytest.raises(UnsafePayload, match="sets"):
        restricted_loads(pickle.dumps({1, 2, 3}, protocol=4))
    assert restricted_loads(pickle.dumps({"a": [1, 2], "b": (3,)}, protocol=4)) == {"a": [1, 2], "b": (3,)}


def test_a_bytes_value_referred_to_many_times_is_never_copied() -> None:
    """One 1 MiB string of bytes, referred to 1500 times (2 bytes each) by a LocalSerializedTensor: 1500 copies
    (1.5 GiB) were made before any check. A bytearray there is refused outright."""
    blob = b"\0" * (1 << 20)
    decoded = restricted_loads(serialize(LocalSerializedTensor([blob] * 1500)))
    assert len(decoded.values) == 1500 and len({id(v) for v in decoded.values}) == 1
    with pytest.raises(UnsafePayload, match="byte strings"):  # protocol 5 pickles a bytearray as itself
        restricted_loads(pickle.dumps(LocalSerializedTensor([bytearray(8)]), protocol=5))


def test_each_inner_pickle_is_decoded_once() -> None:
    """The same inner tensor pickle under 1000 names costs one decode, not 1000."""
    tensor = torch.ones(3)
    wrapper = LocalSerializedTensor([serialize(tensor)])
    payload = b64(serialize([(f"w{i}", wrapper) for i in range(1000)]))
    pairs = decode_payload([payload], None)
    assert len(pairs) == 1000 and all(t is pairs[0][1] for _, t in pairs)


def test_the_budget_stops_a_long_decode_and_a_cancelled_one() -> None:
    data = pickle.dumps(list(range(20_000)), protocol=4)
    with pytest.raises(UnsafePayload, match="pickle operations"):
        restricted_loads(data, PayloadBudget(max_opcodes=10_000))
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(UnsafePayload, match="deadline"):
        restricted_loads(data, PayloadBudget(cancel))
    assert len(restricted_loads(data)) == 20_000


@pytest.mark.parametrize("fields", [
    (["not", "a", "name"], (64,), torch.float32, 0, 256, 64),
    ("model.norm.weight", (64,), torch.float32, 0.0, 256.0, 64),
    ("model.norm.weight", (2**63,), torch.float32, 0, 256, 64),
    ("model.norm.weight", (2**40, 2**40), torch.float32, 0, 256, 64),
])
def test_flattened_metadata_is_checked_however_it_is_built(fields: tuple) -> None:
    """By its state (BUILD) or by calling the class (REDUCE, which skipped the check): a 400, not a 500."""

    class Called:
        def __reduce__(self) -> tuple:
            return FlattenedTensorMetadata, fields

    buffer = torch.zeros(256, dtype=torch.uint8)
    for meta in (FlattenedTensorMetadata(*fields), Called()):
        payload = b64(serialize({"flattened_tensor": buffer, "metadata": [meta]}))
        with pytest.raises(UnsafePayload):
            decode_payload([payload], "flattened_bucket")


def test_a_local_serialized_tensor_built_by_its_class_is_checked() -> None:
    class Called:
        def __reduce__(self) -> tuple:
            return LocalSerializedTensor, ([bytearray(4)],)

    with pytest.raises(UnsafePayload, match="byte strings"):
        restricted_loads(pickle.dumps([("w", Called())], protocol=5))


def plain(leaves: st.SearchStrategy) -> st.SearchStrategy:
    return st.recursive(leaves, lambda children: st.lists(children, max_size=5) | st.tuples(children, children)
                        | st.dictionaries(st.text(max_size=10), children, max_size=5), max_leaves=30)


SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)


@settings(max_examples=300, deadline=None)
@given(value=plain(SCALARS | st.binary(max_size=20)), protocol=st.integers(min_value=3, max_value=5))
def test_plain_values_load_as_pickle_loads_them(value: object, protocol: int) -> None:
    """Differential: for everything a payload may hold besides tensors, the restricted unpickler agrees with
    CPython's own (the C one), at every protocol that has opcodes for bytes (torch writes 4 or 5)."""
    data = pickle.dumps(value, protocol=protocol)
    assert restricted_loads(data) == pickle.loads(data)


@settings(max_examples=100, deadline=None)
@given(value=plain(SCALARS), protocol=st.integers(min_value=0, max_value=2))
def test_plain_values_of_old_protocols_load_as_pickle_loads_them(value: object, protocol: int) -> None:
    data = pickle.dumps(value, protocol=protocol)
    assert restricted_loads(data) == pickle.loads(data)


def test_newobj_makes_only_sglangs_data_classes_with_their_checked_defaults() -> None:
    """A LocalSerializedTensor made by NEWOBJ without BUILD had no ``values`` at all (a 500 when read)."""
    module = b"sglang.srt.model_executor.model_runner_components.weight_updater"
    made = (b"\x80\x04(\x8c\x01w\x8c" + bytes([len(module)]) + module + b"\x8c\x15LocalSerializedTensor\x93)\x81"
            b"\x86l.")  # [("w", LocalSerializedTensor.__new__())]
    with pytest.raises(UnsafePayload, match="no bytes for rank 0"):
        decode_payload([b64(made)], None)
    with pytest.raises(UnsafePayload, match="NEWOBJ"):  # torch.Size made by NEWOBJ: not a data class
        restricted_loads(b"\x80\x04\x8c\x05torch\x8c\x04Size\x93)\x81.")
