"""HTTP/2 frames read by their 9-byte headers only, for the frame guard (frameguard.py): the
client's, to bound its header blocks (the CONTINUATION flood), and both sides', to know which
streams the client opened and the server has ended.

Payloads are skipped by count, so a 4 MiB message costs one header parse per 16 KiB frame.
"""

from __future__ import annotations

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # an HTTP/2 client's first 24 bytes
FRAME_HEAD = 9  # length (24 bits), type, flags, reserved bit and stream (31 bits)
DATA, HEADERS, RST_STREAM, PUSH_PROMISE, CONTINUATION = 0x0, 0x1, 0x3, 0x5, 0x9
END_STREAM, END_HEADERS = 0x1, 0x4

# grpc advertises SETTINGS_MAX_HEADER_LIST_SIZE 16 KiB (decoded, with 32 bytes per field) and
# refuses a call past it; HPACK's encoding is never longer than the list it decodes to but for
# padding and priority (a few hundred bytes), so a block past 64 KiB is never a call grpc would
# serve. A gRPC client's blocks are a few hundred bytes at most: its first Allocate's 238, the
# next ones 8 (HPACK's table).
MAX_HEADER_BLOCK = 64 * 1024
# Go's HTTP/2 and grpc split a block only at the peer's frame size (16 KiB at least): 64 KiB
# needs 4 CONTINUATIONs. 64 leaves room for a client of small frames and stops empty ones,
# which grow no block but cost a header parse each.
MAX_CONTINUATIONS = 64
# Streams kept per connection (for the hand-over's wait). grpc serves 10 at once per connection
# (grpcserver.MAX_STREAMS_PER_CONNECTION) and ends or refuses the rest (RST_STREAM), so a client
# has at most a few dozen open; one read of HEADERS frames on fresh ids could add thousands
# before grpc closes the connection for them. Past the bound new ones are not kept.
MAX_STREAMS = 256


class _Frames:
    """A byte stream read as HTTP/2 frames, headers only: ``feed`` takes the bytes as they
    arrive, in any split, and calls ``_frame`` at each frame's header and ``_done`` once its
    payload has passed too."""

    def __init__(self, preface: int, streams: set[int]) -> None:
        self._preface = preface  # preface bytes still to come
        self._head = b""  # a frame header split across reads
        self._skip = 0  # payload bytes of the current frame still to come
        self._kind = self._flags = self._stream = 0  # the current frame's
        self.streams = streams  # the connection's open streams (_Pair.streams)

    def feed(self, data: bytes) -> str | None:
        """Why the connection must be closed, or None."""
        at, end = 0, len(data)
        if self._preface:
            at = min(self._preface, end)
            self._preface -= at
        while at < end:
            if self._skip:
                step = min(self._skip, end - at)
                self._skip -= step
                at += step
                if not self._skip:
                    self._done(self._kind, self._flags, self._stream)
                continue
            if self._head or end - at < FRAME_HEAD:
                take = FRAME_HEAD - len(self._head)
                self._head += data[at:at + take]
                at += take
                if len(self._head) < FRAME_HEAD:
                    return None
                head, self._head = self._head, b""
            else:
                head = data[at:at + FRAME_HEAD]
                at += FRAME_HEAD
            length = int.from_bytes(head[:3], "big")
            kind, flags = head[3], head[4]
            stream = int.from_bytes(head[5:9], "big") & 0x7FFFFFFF
            if refusal := self._frame(kind, flags, length, stream):
                return refusal
            if length:
                self._skip = length
                self._kind, self._flags, self._stream = kind, flags, stream
            else:
                self._done(kind, flags, stream)
        return None

    def _frame(self, kind: int, flags: int, length: int, stream: int) -> str | None:
        return None

    def _done(self, kind: int, flags: int, stream: int) -> None:
        pass


class FrameReader(_Frames):
    """The client-to-server byte stream read as HTTP/2 frames, headers only.

    ``feed`` returns why the connection must be closed, or None. Anything that is not a bound of
    ours (a bad preface, a frame out of place) is grpc's to refuse and is passed on. The streams
    the client opens (HEADERS) and resets (RST_STREAM) are kept in ``streams``."""

    def __init__(self, streams: set[int] | None = None) -> None:
        super().__init__(len(PREFACE), set() if streams is None else streams)
        self._block: int | None = None  # bytes of the open header block, None outside one
        self._continuations = 0

    def _frame(self, kind: int, flags: int, length: int, stream: int) -> str | None:
        """Account for one frame's header; the place for every frame-level bound."""
        if kind == HEADERS and len(self.streams) < MAX_STREAMS:
            self.streams.add(stream)
        elif kind == RST_STREAM:
            self.streams.discard(stream)
        if self._block is not None and kind == CONTINUATION:
            self._block += length
            self._continuations += 1
        elif kind in (HEADERS, PUSH_PROMISE):
            self._block, self._continuations = length, 0
        else:
            self._block = None  # a block cut short: grpc's protocol error, not our bound
            return None
        if self._block > MAX_HEADER_BLOCK or self._continuations > MAX_CONTINUATIONS:
            return (f"a header block of {self._block} bytes in {self._continuations} CONTINUATION "
                    f"frames, past the bound of {MAX_HEADER_BLOCK} bytes or {MAX_CONTINUATIONS} "
                    "frames")
        if flags & END_HEADERS:
            self._block = None
        return None


class ServerFrames(_Frames):
    """The server-to-client byte stream read as HTTP/2 frames, headers only, for one thing: the
    streams the server ends (END_STREAM, on the frame that carries it or, on a header block, on
    its last CONTINUATION; RST_STREAM) leave ``streams`` once the frame has passed whole. A
    hand-over waits on that (FrameGuard.forwarded): behind the guard, a stream's end reaches the
    kubelet when the guard writes it, not when gRPC does."""

    def __init__(self, streams: set[int]) -> None:
        super().__init__(0, streams)
        self._ending: int | None = None  # a stream whose END_STREAM header block is not whole

    def _done(self, kind: int, flags: int, stream: int) -> None:
        if kind == RST_STREAM:
            self.streams.discard(stream)
        elif kind in (DATA, HEADERS) and flags & END_STREAM:
            if kind == DATA or flags & END_HEADERS:
                self.streams.discard(stream)
            else:
                self._ending = stream
        elif kind == CONTINUATION and flags & END_HEADERS and self._ending is not None:
            self.streams.discard(self._ending)
            self._ending = None
