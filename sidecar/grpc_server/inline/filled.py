"""Messages built in place: a layer file's bytes read straight into the ``bytes`` grpcio sends.

    filled_bytes(n, fill)            a new ``bytes`` of ``n`` bytes, written by ``fill(view)``
    preadv_exactly(fd, views, off)   the file's bytes from ``off`` into ``views``, in order

grpcio 1.85 sends only ``bytes`` (it copies them into its own slice), so a message framed from
a file costs two copies when the file is read into one buffer and joined into another. Here
the kernel's read writes into the message itself: one copy, the kernel's.

How: CPython's ``PyBytes_FromStringAndSize(NULL, n)`` returns a bytes object whose contents
are undefined until its creator fills them (the C API's way to build bytes in place; nothing
else holds it yet, its hash is not computed). ``fill`` gets a writable view of it and must
fill all of it; the view dies before the object is returned. Elsewhere than on CPython a
``bytearray`` is filled and copied once more into ``bytes``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Sequence
from typing import Final

#: Buffers per ``preadv`` call (the POSIX minimum of IOV_MAX; Linux allows 1024).
IOV_MAX: Final = 1024

_ON_CPYTHON: Final = sys.implementation.name == "cpython"
if _ON_CPYTHON:
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    _new_bytes.restype = ctypes.py_object
    _bytes_data = ctypes.pythonapi.PyBytes_AsString
    _bytes_data.argtypes = (ctypes.py_object,)
    _bytes_data.restype = ctypes.c_void_p


def filled_bytes(nbytes: int, fill: Callable[[memoryview], None], *,
                 in_place: bool = _ON_CPYTHON) -> bytes:
    """``nbytes`` new bytes, their contents written by ``fill`` (see the module docstring);
    ``in_place=False`` (tests): the ``bytearray`` path."""
    if nbytes <= 0:
        return b""
    if not in_place:
        buffer = bytearray(nbytes)
        with memoryview(buffer) as view:
            fill(view)
        return bytes(buffer)
    message: bytes = _new_bytes(None, nbytes)
    address = _bytes_data(message)
    with memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B") as view:
        fill(view)
    return message


def preadv_exactly(fd: int, views: Sequence[memoryview], offset: int) -> None:
    """Fill ``views`` from ``fd`` at ``offset`` onwards, as one contiguous read; a file that
    ends first raises ``EOFError``."""
    pending = list(views)
    start = 0
    while start < len(pending):
        got = os.preadv(fd, pending[start : start + IOV_MAX], offset)
        if got == 0:
            raise EOFError(f"the file ends at byte {offset}")
        offset += got
        # A short read (not on tmpfs, but allowed): skip what was filled, retry the rest.
        while start < len(pending) and got >= len(pending[start]):
            got -= len(pending[start])
            start += 1
        if got:
            pending[start] = pending[start][got:]
