"""Int lists as packed little-endian bytes: how long id lists travel (ChatRequest v2+, KvEvent v2).

A 16k-token prompt as a MessagePack array is 16k integers that every reader must unpack into Python
ints and type-check one by one, although most readers (the scheduler, the KV manager, intake's
accounting) only ever ask for its length. As a ``bin`` field it is one buffer: decoding is a length
check, and the ints are made only when someone reads them. The worker reads them as one numpy view
(:meth:`PackedInts.numpy`) without a copy.

Two widths: :class:`TokenIds` (uint32 token ids) and :class:`BlockHashes` (uint64 chained block
hashes, schemas.blocks; as a MessagePack array each costs 9 bytes and a checked int on decode).
Both are immutable ``Sequence[int]``: ``len``, indexing, slicing (to a list), iteration, and equality
with any list or tuple of the same ints behave as for the list they replace.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, overload

import numpy as np

_SWAP = sys.byteorder != "little"
_P = TypeVar("_P", bound="PackedInts")


class PackedInts(Sequence[int]):
    """An immutable run of unsigned ints backed by packed little-endian bytes (see subclasses).

    Build one from ints with ``Cls(ids)``, or from wire bytes with :meth:`from_bytes`.
    The unpacked ``array`` is made once, on the first element access.
    """

    __slots__ = ("_arr", "_buf")
    TYPECODE: ClassVar[str]
    ITEM_BYTES: ClassVar[int]
    DTYPE: ClassVar[str]
    WHAT: ClassVar[str]

    def __init__(self, ids: Iterable[int] = ()) -> None:
        if type(ids) is type(self):
            self._buf: bytes = ids._buf
            self._arr: array[int] | None = ids._arr
            return
        if isinstance(ids, np.ndarray):
            # packed in C: a prompt as a list costs a Python int per token on the way in and out
            self._buf = self._pack_numpy(ids)
            self._arr = None
            return
        try:
            t = type(ids)  # exact types first: KvEvents build two of these per event
            seq = ids if t is list or t is tuple or isinstance(ids, list | tuple | array) else list(ids)
            arr = array(self.TYPECODE, seq)
        except (OverflowError, TypeError) as exc:
            # array accepts bools and int subclasses; a float or a negative value is refused here
            raise ValueError(
                f"{self.WHAT} must be ints in 0..{2 ** (8 * self.ITEM_BYTES) - 1}: {exc}"
            ) from exc
        if _SWAP:
            wire = array(self.TYPECODE, arr)
            wire.byteswap()
            self._buf = wire.tobytes()
        else:
            self._buf = arr.tobytes()
        self._arr = arr

    @classmethod
    def _pack_numpy(cls, ids: np.ndarray) -> bytes:
        top = 2 ** (8 * cls.ITEM_BYTES) - 1
        if ids.ndim != 1 or ids.dtype.kind not in "biu":
            raise ValueError(f"{cls.WHAT} must be a 1-d array of ints, got {ids.dtype} of shape {ids.shape}")
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) > top):
            raise ValueError(f"{cls.WHAT} must be ints in 0..{top}")
        return ids.astype(cls.DTYPE).tobytes()

    @classmethod
    def from_bytes(cls: type[_P], data: bytes) -> _P:
        """Wrap wire bytes (no copy); raises ValueError unless the length is a multiple of the width."""
        if len(data) % cls.ITEM_BYTES:
            raise ValueError(
                f"packed {cls.WHAT} must be a multiple of {cls.ITEM_BYTES} bytes, got {len(data)}"
            )
        out = cls.__new__(cls)
        out._buf = bytes(data)  # a no-op for bytes; owns a copy of a bytearray/memoryview
        out._arr = None
        return out

    def to_bytes(self) -> bytes:
        """The wire form: little-endian, ``ITEM_BYTES`` per value."""
        return self._buf

    def _array(self) -> array[int]:
        arr = self._arr
        if arr is None:
            arr = array(self.TYPECODE)
            arr.frombytes(self._buf)
            if _SWAP:
                arr.byteswap()
            self._arr = arr
        return arr

    def numpy(self) -> np.ndarray:
        """A read-only view of the values (no copy)."""
        return np.frombuffer(self._buf, dtype=self.DTYPE)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        # numpy's protocol: np.asarray(ids) is the packed buffer, not a walk over a Sequence
        view = self.numpy()
        if dtype is not None and np.dtype(dtype) != view.dtype:
            return view.astype(dtype)
        return view.copy() if copy else view

    def tolist(self) -> list[int]:
        if self._arr is None and not _SWAP:
            # one C-level pass over the buffer, without building (and keeping) the array
            # (typeshed's cast() overloads know only literal format strings; TYPECODE is a ClassVar[str])
            ints: list[int] = memoryview(self._buf).cast(self.TYPECODE).tolist()  # type: ignore[call-overload]
            return ints
        return self._array().tolist()

    def __len__(self) -> int:
        return len(self._buf) // self.ITEM_BYTES

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
        if type(other) is type(self):
            return self._buf == other._buf
        if isinstance(other, list | tuple | PackedInts):
            return len(other) == len(self) and self.tolist() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._buf)

    def __add__(self, other: Sequence[int]) -> list[int]:
        return [*self._array(), *other]

    def __radd__(self, other: Sequence[int]) -> list[int]:
        return [*other, *self._array()]

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self).from_bytes, (self._buf,))

    def __repr__(self) -> str:
        n = len(self)
        head = ", ".join(map(str, self[:8]))
        return f"{type(self).__name__}([{head}{', ...' if n > 8 else ''}], n={n})"


class TokenIds(PackedInts):
    """Token ids, each in 0 .. 2**32-1, as uint32."""

    __slots__ = ()
    TYPECODE = "I"
    ITEM_BYTES = 4
    DTYPE = "<u4"
    WHAT = "token ids"


class BlockHashes(PackedInts):
    """Chained block hashes (schemas.blocks), each in 0 .. 2**64-1, as uint64."""

    __slots__ = ()
    TYPECODE = "Q"
    ITEM_BYTES = 8
    DTYPE = "<u8"
    WHAT = "block hashes"


# array('I') is the C unsigned int and 'Q' the unsigned long long: 4 and 8 bytes on every platform
# CPython supports for kvmesh
assert array("I").itemsize == TokenIds.ITEM_BYTES and array("Q").itemsize == BlockHashes.ITEM_BYTES


if TYPE_CHECKING:
    #: The field type of a packed token id list: a ``Sequence[int]`` to its users (a constructor takes
    #: any list of ints, which the message's ``__post_init__`` packs), a ``TokenIds`` to the codec,
    #: which writes it as ``bin`` and reads ``bin`` (or an older writer's int array) back.
    PackedTokenIds = Sequence[int]
    #: Likewise for block hashes (``BlockHashes`` at run time).
    PackedBlockHashes = Sequence[int]
else:
    PackedTokenIds = TokenIds
    PackedBlockHashes = BlockHashes


def wire_value(obj: Any) -> bytes:
    """How the codec writes a packed run (msgspec's ``enc_hook``); TypeError for anything else."""
    if isinstance(obj, PackedInts):
        return obj.to_bytes()
    raise TypeError(f"{type(obj).__name__} is not a wire type")


def from_wire(cls: type, value: Any) -> PackedInts:
    """How the codec reads a packed run (msgspec's ``dec_hook``): ``bin`` of the current versions, or
    the int array an older writer sent, every element checked (a bool is not an int)."""
    if not (isinstance(cls, type) and issubclass(cls, PackedInts)):
        raise TypeError(f"{cls!r} is not a wire type")
    if isinstance(value, bytes | bytearray):
        return cls.from_bytes(bytes(value))  # ValueError for a length that is not a multiple
    if isinstance(value, list) and (not value or set(map(type, value)) == {int}):
        return cls(value)  # ValueError for a value out of range
    raise TypeError(f"expected packed {cls.WHAT} (bin) or an array of ints")


def int_list(values: Sequence[int]) -> list[int]:
    """``values`` as a fresh list of ints: one C-level unpack for a packed run, else ``list()``.

    For code that walks the same ids several times: iterating a packed run makes new int objects
    on every pass.
    """
    return values.tolist() if isinstance(values, PackedInts) else list(values)
