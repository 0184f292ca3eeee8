"""A restricted unpickler for SGLang's tensor payloads: torch's tensor and storage rebuilds, plain containers,
and nothing else.

``update_weights_from_tensor`` carries ``MultiprocessingSerializer`` output: a
pickle made by torch's ``ForkingPickler``, in which tensors are references to
shared memory (CPU) or CUDA IPC handles. Unpickling runs any callable a pickle
names, so a payload from the network is never unpickled as it is. Here:

- :meth:`RestrictedUnpickler.find_class` knows a fixed table of globals
  (:mod:`.rebuilds`). Each maps to a *checking* stand-in, never to the callable
  the pickle names when that callable could be abused: tensor and storage
  classes are inert markers, and the rebuild functions check their arguments
  before calling torch's. Anything else (``os.system``, ``builtins.open``,
  ``functools.partial``, a resource sharer that would connect to an address in
  the payload) is :class:`UnsafePayload` and nothing runs.
- Opcodes act only where they are meant to: state is set (BUILD) only on
  SGLang's two data classes, which check it (never on a tensor, whose
  ``__setstate__`` would re-point it past its checked storage); items are
  added only to lists and to dicts with string keys (never written into a
  tensor, which maps another process's memory; never keys chosen to collide);
  sets are refused. Memo indices live in a dict, so a claimed index allocates
  nothing (CPython's C unpickler sizes an array by it: 9 bytes asked for 2 GiB).
- One :class:`~.payload_checks.PayloadBudget` bounds the whole payload, inner
  pickles included: pickle operations, shared-memory segments mapped, and the
  caller's deadline (checked as it goes, so a decode given up stops soon).

This is pickle's own pure-Python unpickler with those rules in its dispatch
table: slower than the C one, but every opcode runs through code checked here,
and payloads are small (the tensors' bytes stay in shared memory).
"""

from __future__ import annotations

import collections
import io
import pickle
from struct import error as struct_error
from typing import Any, Callable

from handoff.checkpoint.files import shown
from node_engine.weight_sync.payload_checks import PayloadBudget, UnsafePayload
from node_engine.weight_sync.rebuilds import (
    ALLOWED_GLOBALS,
    BUILDABLE,
    REFUSED_CLASSES,
    SAFE_CALLS,
    STORAGE_FILENAME,
    VALUES,
    FlattenedTensorMetadata,
    LocalSerializedTensor,
)
from node_engine.weight_sync.tensor_rebuilds import storage_filename_rebuild

__all__ = ["ALLOWED_GLOBALS", "FlattenedTensorMetadata", "LocalSerializedTensor", "PayloadBudget",
           "RestrictedUnpickler", "UnsafePayload", "restricted_loads"]

_MAX_MEMO_INDEX = 1 << 32
_MAPPINGS = (dict, collections.OrderedDict)
_Base: Any = pickle._Unpickler  # type: ignore[attr-defined]  # the reference implementation, in Python


class RestrictedUnpickler(_Base):
    """Unpickles only what :data:`ALLOWED_GLOBALS` names, by the rules of the module docstring."""

    dispatch: dict[int, Callable[[RestrictedUnpickler], None]] = {}  # filled below the class

    def __init__(self, data: bytes, budget: PayloadBudget, *, release_sender_reference: bool = True) -> None:
        super().__init__(io.BytesIO(data))
        self.budget = budget
        self._storage_filename = storage_filename_rebuild(budget, release_sender_reference)

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key == STORAGE_FILENAME:
            return self._storage_filename
        if key in SAFE_CALLS:
            return SAFE_CALLS[key]
        if key in VALUES:
            return VALUES[key]
        raise UnsafePayload(f"the payload names {shown(module + '.' + name)}, which is not a tensor, a storage or "
                            "a plain container; nothing was run")

    def persistent_load(self, pid: object) -> Any:
        raise UnsafePayload("the payload uses persistent ids; nothing was run")

    # -- opcodes that act on an object already built ------------------------------------------
    def load_build(self) -> None:
        if type(self.stack[-2]) not in BUILDABLE:
            raise UnsafePayload(f"the payload sets the state of a {type(self.stack[-2]).__name__}; only SGLang's "
                                "LocalSerializedTensor and FlattenedTensorMetadata take one")
        _Base.load_build(self)

    def load_append(self) -> None:
        value = self.stack.pop()
        _target(self.stack[-1], (list,)).append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        _target(self.stack[-1], (list,)).extend(items)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        _target(self.stack[-1], _MAPPINGS)[_key(key)] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        mapping = _target(self.stack[-1], _MAPPINGS)
        for i in range(0, len(items) - 1, 2):
            mapping[_key(items[i])] = items[i + 1]

    def load_dict(self) -> None:
        items = self.pop_mark()
        self.append({_key(items[i]): items[i + 1] for i in range(0, len(items) - 1, 2)})

    def load_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = _new(self.stack[-1], args, {})

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        self.stack[-1] = _new(self.stack[-1], args, kwargs)

    def load_put(self) -> None:
        index = int(self.readline()[:-1])
        if not 0 <= index < _MAX_MEMO_INDEX:
            raise UnsafePayload(f"a memo index must be below {_MAX_MEMO_INDEX}")
        self.memo[index] = self.stack[-1]


def _new(cls: object, args: object, kwargs: object) -> Any:
    """NEWOBJ: only SGLang's data classes, with no arguments, made with their (checked) defaults for BUILD to
    set (``cls.__new__`` alone would leave an instance without its fields)."""
    if any(cls is refused for refused in REFUSED_CLASSES):
        return cls()  # type: ignore[operator]  # raises, saying why
    if not any(cls is kind for kind in BUILDABLE) or args or kwargs:
        raise UnsafePayload("the payload creates an object with NEWOBJ; only SGLang's data classes, without "
                            "arguments, are made that way")
    return cls()  # type: ignore[operator]


def _target(obj: object, kinds: tuple[type, ...]) -> Any:
    if type(obj) not in kinds:
        raise UnsafePayload(f"the payload adds items to a {type(obj).__name__}; only lists and dicts take them")
    return obj


def _key(key: object) -> str:
    if type(key) is not str:
        raise UnsafePayload(f"a dict key of the payload is a {type(key).__name__}, not a string")
    return key


def _counted(step: Callable[[RestrictedUnpickler], None]) -> Callable[[RestrictedUnpickler], None]:
    def run(self: RestrictedUnpickler) -> None:
        self.budget.spend_opcode()
        step(self)
    return run


def _refused(opcode: bytes) -> Callable[[RestrictedUnpickler], None]:
    def refuse(self: RestrictedUnpickler) -> None:
        raise UnsafePayload(f"the payload uses pickle opcode {opcode!r} (sets), which tensor payloads never hold")
    return refuse


_OWN_STEPS = {pickle.BUILD: RestrictedUnpickler.load_build, pickle.NEWOBJ: RestrictedUnpickler.load_newobj,
              pickle.NEWOBJ_EX: RestrictedUnpickler.load_newobj_ex, pickle.APPEND: RestrictedUnpickler.load_append,
              pickle.APPENDS: RestrictedUnpickler.load_appends, pickle.SETITEM: RestrictedUnpickler.load_setitem,
              pickle.SETITEMS: RestrictedUnpickler.load_setitems, pickle.DICT: RestrictedUnpickler.load_dict,
              pickle.PUT: RestrictedUnpickler.load_put}
RestrictedUnpickler.dispatch = {code: _counted(_OWN_STEPS.get(bytes([code]), step))
                                for code, step in _Base.dispatch.items()}
for _opcode in (pickle.EMPTY_SET, pickle.ADDITEMS, pickle.FROZENSET):
    RestrictedUnpickler.dispatch[_opcode[0]] = _refused(_opcode)


def restricted_loads(data: bytes, budget: PayloadBudget | None = None, *,
                     release_sender_reference: bool = True) -> Any:
    """Unpickle ``data`` with :class:`RestrictedUnpickler`; every failure is an :class:`UnsafePayload`."""
    try:
        return RestrictedUnpickler(data, budget or PayloadBudget(),
                                   release_sender_reference=release_sender_reference).load()
    except UnsafePayload:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RuntimeError, MemoryError, OverflowError, RecursionError, struct_error) as exc:
        raise UnsafePayload(f"the payload cannot be unpickled: {type(exc).__name__}: {exc}") from exc
