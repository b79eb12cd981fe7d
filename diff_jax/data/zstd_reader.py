"""Zstandard (.zst) files read as a stream of bytes, every frame of them, and never silently short.

zstandard's readers (`ZstdDecompressor.stream_reader`, with or without `read_across_frames`,
and `read_to_iter`; zstandard 0.25.0) stop without an error where a file ends inside a frame:
a file cut short reads as a shorter file, often as an empty one, since a block's output comes
whole once the block has been read. `ZstdDecompressor.decompressobj()` decodes one frame and
says when it has ended (`eof`) and what followed it (`unused_data`), so this reader decodes a
frame at a time with one and calls a file that ends inside a frame, or holds no byte (as the
zstd CLI does), cut short. Skippable frames (pzstd writes one before each frame) are frames of
no output to it. Damage is an error where the decoder meets it, else at the end of a frame whose
checksum it fails (the frame's output before it is read by then: the zstd CLI writes one frame,
with a checksum, for a whole file), but for damaged literal bytes in a frame written without a
checksum (zstandard's compressor writes none unless asked to), which decode as other bytes.
Importing this module needs zstandard (the zstd extra).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import zstandard

READ_BYTES = 1 << 14  # compressed bytes decoded at a time; their output is held until read


class BadZstdFile(OSError):
    """A .zst file whose bytes are no Zstandard frames: damaged, or another format."""


class _FrameReader(io.RawIOBase):
    """The decompressed bytes of a stream of Zstandard frames (`source`, read `READ_BYTES` at a
    time), the frames one after the other; EOFError where the stream ends inside a frame or
    holds no byte, BadZstdFile where its bytes are no frames."""

    def __init__(self, source: io.BufferedIOBase):
        self._source = source
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame: Any = None  # the decompressobj of the frame being read; None between frames
        self._started = False  # a compressed byte has been read
        self._output = memoryview(b"")  # decoded bytes not read yet
        self._error: BadZstdFile | None = None  # raised once the output before it is read

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._output:
            if self._error is not None:
                raise self._error
            data = self._source.read(READ_BYTES)
            if not data:
                if self._frame is not None:
                    raise EOFError("compressed file ended inside a zstd frame: cut short")
                if not self._started:
                    raise EOFError("empty file: no zstd frame")
                return 0
            self._started = True
            self._output = memoryview(self._decode(data))
        n = min(len(buffer), len(self._output))
        buffer[:n] = self._output[:n]
        self._output = self._output[n:]
        return n

    def _decode(self, data: bytes) -> bytes:
        """The output of the compressed bytes `data`, which may end frames and begin others, up
        to the frame of any damage (then `_error`)."""
        out = []
        while data:
            if self._frame is None:
                self._frame = self._decompressor.decompressobj()
            try:
                out.append(self._frame.decompress(data))
            except zstandard.ZstdError as e:
                self._error = BadZstdFile(str(e))
                break
            if not self._frame.eof:  # every byte taken, the frame goes on
                break
            data, self._frame = self._frame.unused_data, None
        return b"".join(out)

    def close(self) -> None:
        self._source.close()
        super().close()


def open_zstd(path: Path) -> io.BufferedReader:
    """The decompressed bytes of the .zst file `path` as a binary file (line iteration included),
    holding about one `READ_BYTES` of input's output at a time."""
    return io.BufferedReader(_FrameReader(open(path, "rb")))
