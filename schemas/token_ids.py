"""Token id lists as packed little-endian uint32 bytes: how long prompts travel (ChatRequest v2).

A 16k-token prompt as a MessagePack array is 16k integers that every reader must unpack into Python
ints and type-check one by one, although most readers (the scheduler, the KV manager, intake's
accounting) only ever ask for its length. As a ``bin`` field it is one buffer: decoding is a length
check, and the ints are made only when someone reads them. The worker reads them as one numpy view
(:meth:`TokenIds.numpy`) without a copy.

:class:`TokenIds` is an immutable ``Sequence[int]``: ``len``, indexing, slicing (to a list),
iteration, and equality with any list or tuple of the same ints behave as for the list it replaces.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Annotated, Any, overload

import numpy as np

#: Bytes per token id on the wire.
ITEM_BYTES = 4
_MAX = 0xFFFFFFFF
# array('I') is the C unsigned int: 4 bytes on every platform CPython supports for kvmesh
assert array("I").itemsize == ITEM_BYTES
_SWAP = sys.byteorder != "little"


class _PackedMarker:
    """``Annotated`` metadata: the schemas codec writes this field as :class:`TokenIds` bytes."""

    def __repr__(self) -> str:
        return "PACKED_U32"


PACKED_U32 = _PackedMarker()

#: The field type of a packed token id list: a ``Sequence[int]`` to its users, a ``TokenIds`` at run
#: time (a message's ``__post_init__`` converts a list), ``bin`` on the wire.
PackedTokenIds = Annotated[Sequence[int], PACKED_U32]


class TokenIds(Sequence[int]):
    """An immutable run of token ids (each in 0 .. 2**32-1) backed by packed little-endian bytes.

    Build one from ints with ``TokenIds(ids)``, or from wire bytes with :meth:`from_bytes`.
    The unpacked ``array`` is made once, on the first element access.
    """

    __slots__ = ("_arr", "_buf")

    def __init__(self, ids: Iterable[int] = ()) -> None:
        if isinstance(ids, TokenIds):
            self._buf: bytes = ids._buf
            self._arr: array[int] | None = ids._arr
            return
        try:
            arr = array("I", ids if isinstance(ids, list | tuple | array) else list(ids))
        except (OverflowError, TypeError) as exc:
            # array accepts bools and int subclasses; a float or a negative id is refused here
            raise ValueError(f"token ids must be ints in 0..{_MAX}: {exc}") from exc
        if _SWAP:
            wire = array("I", arr)
            wire.byteswap()
            self._buf = wire.tobytes()
        else:
            self._buf = arr.tobytes()
        self._arr = arr

    @classmethod
    def from_bytes(cls, data: bytes) -> TokenIds:
        """Wrap wire bytes (no copy); raises ValueError unless the length is a multiple of 4."""
        if len(data) % ITEM_BYTES:
            raise ValueError(f"packed token ids must be a multiple of {ITEM_BYTES} bytes, got {len(data)}")
        out = cls.__new__(cls)
        out._buf = bytes(data)  # a no-op for bytes; owns a copy of a bytearray/memoryview
        out._arr = None
        return out

    def to_bytes(self) -> bytes:
        """The wire form: little-endian uint32 per id."""
        return self._buf

    def _array(self) -> array[int]:
        arr = self._arr
        if arr is None:
            arr = array("I")
            arr.frombytes(self._buf)
            if _SWAP:
                arr.byteswap()
            self._arr = arr
        return arr

    def numpy(self) -> np.ndarray:
        """A read-only ``uint32`` view of the ids (no copy)."""
        return np.frombuffer(self._buf, dtype="<u4")

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        # numpy's protocol: np.asarray(ids) is the packed buffer, not a walk over a Sequence
        view = self.numpy()
        if dtype is not None and np.dtype(dtype) != view.dtype:
            return view.astype(dtype)
        return view.copy() if copy else view

    def tolist(self) -> list[int]:
        return self._array().tolist()

    def __len__(self) -> int:
        return len(self._buf) // ITEM_BYTES

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            return self._array()[index].tolist()
        return self._array()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._array())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self._buf == other._buf
        if isinstance(other, list | tuple):
            return len(other) == len(self) and self.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._buf)

    def __add__(self, other: Sequence[int]) -> list[int]:
        return [*self._array(), *other]

    def __radd__(self, other: Sequence[int]) -> list[int]:
        return [*other, *self._array()]

    def __reduce__(self) -> tuple[Any, ...]:
        return (TokenIds.from_bytes, (self._buf,))

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(map(str, self[:8]))
        return f"TokenIds([{head}{', ...' if n > 8 else ''}], n={n})"
