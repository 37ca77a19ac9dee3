"""Frames over a pipe (``serve/frames.py``): a frame read in pieces comes out once it is
whole, several frames in one read come out in order, a non-blocking pipe with nothing in
it gives nothing, and the writer's close reads as EOF after the last frame."""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
import threading

import pytest

from specdec.serve.frames import READ_SIZE, FrameReader, write_frame


@pytest.fixture
def pipe():
    r, w = os.pipe()
    os.set_blocking(r, False)
    yield r, w
    for fd in (r, w):
        with contextlib.suppress(OSError):  # a test closed it
            os.close(fd)


def test_a_frame_in_pieces_comes_out_once_whole(pipe):
    r, w = pipe
    reader = FrameReader(r)
    assert reader.read() == []  # nothing there yet
    message = ("step", [("r1", list(range(50)))], None)
    payload = pickle.dumps(message)
    frame = struct.pack("!Q", len(payload)) + payload
    for cut in (3, 8, 20):  # inside the header, at its end, inside the payload
        os.write(w, frame[:cut])
        assert reader.read() == [] and reader.pending == cut
        os.write(w, frame[cut:])
        assert reader.read() == [message] and reader.pending == 0


def test_frames_read_together_come_out_in_order_then_eof(pipe):
    r, w = pipe
    reader = FrameReader(r)
    messages = [("added", [(f"r{i}", None)]) for i in range(5)]
    for m in messages:
        write_frame(w, m)
    assert reader.read() == messages
    os.close(w)
    with pytest.raises(EOFError):
        reader.read()


def test_a_frame_larger_than_the_pipe_and_a_read_arrives_whole(pipe):
    """~3 MB: the writer blocks on the full pipe while the reader takes what is there."""
    r, w = pipe
    message = ("step", list(range(700_000)), None)
    assert len(pickle.dumps(message)) > 2 * READ_SIZE
    writer = threading.Thread(target=lambda: [write_frame(w, message) for _ in range(2)])
    writer.start()
    reader, got, reads = FrameReader(r), [], 0
    while len(got) < 2:
        got += reader.read()
        reads += 1
    writer.join()
    assert got == [message, message] and reader.pending == 0
    assert reads > 3  # it did arrive in pieces
