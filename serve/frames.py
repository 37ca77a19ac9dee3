"""Pickled messages in length-prefixed frames over a pipe, readable from an event loop.

The engine core's messages travel up a pipe to the API process, whose event loop reads
them when the pipe is readable. A frame may be only partly in the pipe when the loop looks
(the writer is still writing it, or it is larger than the pipe's buffer), and the loop must
never wait for the rest: ``FrameReader`` reads what is there, keeps a partial frame for the
next call and returns the complete messages. Event loops disagree on a watched pipe's mode
(uvloop's libuv switches it to non-blocking, asyncio's selector leaves it blocking), so a
reader that relied on blocking reads to finish a frame would fail under one of them.

Frame: an 8-byte big-endian length, then that many bytes of pickle. The writer blocks until
the whole frame is written (its own thread's job).
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

_HEADER = struct.Struct("!Q")
READ_SIZE = 1 << 20  # bytes a read takes at most: a step message at c = 128 is ~10 KB


def write_frame(fd: int, message: Any) -> None:
    """Write ``message`` as one frame to ``fd`` (blocking until all of it is written)."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view) :]


class FrameReader:
    """The messages of the frames read from ``fd``, in order (module docstring)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = bytearray()

    def read(self) -> list[Any]:
        """One read of what the pipe holds (at most ``READ_SIZE`` bytes), and the messages
        it completed; [] when nothing was there (a non-blocking pipe) or no frame ended.
        Raises ``EOFError`` once the writer has closed its end and every frame was read.
        On a blocking pipe, call it only when the pipe is readable (it waits otherwise)."""
        try:
            data = os.read(self.fd, READ_SIZE)
        except BlockingIOError:
            return []
        if not data:
            raise EOFError("the pipe's writer closed it")
        buffer = self._buffer
        buffer += data
        messages, start, size = [], 0, len(buffer)
        with memoryview(buffer) as view:  # released before the buffer shrinks
            while size - start >= _HEADER.size:
                (length,) = _HEADER.unpack_from(view, start)
                end = start + _HEADER.size + length
                if end > size:
                    break
                messages.append(pickle.loads(view[start + _HEADER.size : end]))
                start = end
        del buffer[:start]
        return messages

    @property
    def pending(self) -> int:
        """Bytes of a frame read but not yet complete."""
        return len(self._buffer)
