"""A child's output, read in bounded chunks: every byte passed on as it comes, a bounded tail kept.

One reader for both children: a compile's output (:class:`cachemgr.runtime.launcher.OutputWatch`:
40 lines of 4 KiB kept, disk-full phrases looked for) and a server's (:class:`ServerOutput`: 20
lines of 400 bytes, kept for the failure it may end in).

A compiler may print anything: a 60 MB line with no newline (a dumped tensor, a progress bar
redrawn with ``\\r`` for an hour). Reading it line by line (``readline``) holds the whole line
in memory, and a ``\\r`` bar reaches the pod's log only at the next newline. So output is read
as it arrives, at most :data:`CHUNK_BYTES` at a time, written through to the same stream (whole
lines at once, an open one after a moment of silence: :class:`Pump`), and split here into *kept*
lines for the tail: each at most :data:`LINE_BYTES` (the rest is counted and marked as cut), a
lone ``\\r`` starting the line over as a terminal shows it. Memory is a chunk or two, one line
per stream and the tail, whatever the child prints.

The disk-full phrases are looked for in the bytes themselves, not in the kept lines, with the
end of the previous chunk carried over: a phrase split across two reads, or lying past the
cut of a long line, is still seen.

What the child *raised* is kept apart from the tail (:attr:`Tail.raised`): the line that ends each
Python traceback it printed (``SafetensorError: Error while deserializing header: ...``). A tail
alone does not say why a server died: the real vLLM prints its engine's traceback, then tens of
lines of its API server's, which end in ``RuntimeError: Engine core initialization failed. See root
cause above.``, so the root cause lies above the last 20 lines. A traceback is followed within
the lines that begin as its ``Traceback (most recent call last):`` line does (vLLM prefixes every
line of a process, ``(EngineCore pid=N)``, and of a log record), so interleaved processes and log
headers do not break it; a chunk holding a traceback is taken line by line, never skipped.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import re
import select
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import IO

from cachemgr.core.log import stderr_line_open, terminal_guard

CHUNK_BYTES = 64 << 10
LINE_BYTES = 4 << 10  # a kept line (the tail, the failure record); what is past it is counted, not kept
TAIL_LINES = 40
HOLD_SECONDS = 0.1  # an open line waits this long for its newline before it is passed on anyway
CUT_MARK = " [... {cut} bytes cut]"
_CONTEXT = 160  # of a disk-full phrase found past a line's cut: the text shown around it
_CARRY = 64  # longer than any disk-full phrase
TRACEBACK = "Traceback (most recent call last):"
_TRACEBACK_BYTES = TRACEBACK.encode()
RAISED_KEPT = 3  # the first distinct exceptions a child raised (the root cause comes first), and its last
_OPEN_TRACEBACKS = 8  # prefixes followed at once (processes printing tracebacks at the same time)
# Lines without a frame of any open traceback before they are given up (a process that died while
# it printed one): until then every chunk is taken line by line, never only counted.
_TRACEBACK_PATIENCE = 2000


class Tail:
    """What the streams of one child share: the last kept lines, their count, the disk-full line."""

    def __init__(self, *, lines: int = TAIL_LINES) -> None:
        self.lines: deque[str] = deque(maxlen=lines)
        self.count = 0
        self.bytes = 0
        self.disk_full_line: str | None = None
        self.lock = threading.Lock()
        self._raised: list[str] = []
        self._last_raised: str | None = None

    def add_raised(self, line: str) -> None:
        """An exception line that ended a traceback: kept if it is one of the first distinct ones,
        else as the last."""
        if line in self._raised:
            return
        if len(self._raised) < RAISED_KEPT:
            self._raised.append(line)
        else:
            self._last_raised = line

    @property
    def raised(self) -> list[str]:
        """The exceptions the child raised, as their tracebacks' last lines: the first distinct
        ones in order, then the last (call under the lock)."""
        last = [self._last_raised] if self._last_raised is not None else []
        return [*self._raised, *last]


class LineKeeper:
    """One stream's bytes to kept lines in a shared :class:`Tail`: bounded, ``\\r`` overwrites.

    ``phrases`` (lower case) are looked for in the output lowered (``bytes.lower`` and
    ``bytes.find``: several times faster than a case-insensitive regex over everything printed).
    """

    def __init__(self, tail: Tail, phrases: Sequence[bytes], *, line_bytes: int = LINE_BYTES) -> None:
        self._tail = tail
        self._phrases = tuple(phrases)
        self._line_bytes = line_bytes
        self._line = bytearray()
        self._cut = 0
        self._pending_cr = False
        self._carry = b""
        # The bytes around a disk-full phrase, until its line ends; and how many more the next
        # chunk may add (the phrase came at the end of a read).
        self._seen: bytes | None = None
        self._room = 0
        # Tracebacks under way: the text before "Traceback (most recent call last):" on its line.
        self._tracebacks: list[str] = []
        self._unmatched = 0  # lines since one was an open traceback's

    def feed(self, chunk: bytes) -> bool:
        """Take the next bytes (call under the tail's lock); True when they name a full disk."""
        self._tail.bytes += len(chunk)
        found = self._look(chunk)
        first = chunk.find(b"\n")
        if first < 0:
            self._split(chunk)
            return found
        # The line under way ends first: what it starts (a traceback whose first line an earlier
        # read cut) decides whether the lines after it may be only counted.
        self._split(chunk[: first + 1])
        resume = self._resume_at(chunk, first)
        if resume is None:
            self._split(chunk[first + 1 :])
        else:
            self._tail.count += chunk.count(b"\n", first + 1, resume)
            self._split(chunk[resume:])
        return found

    def _resume_at(self, chunk: bytes, first: int) -> int | None:
        """Where the lines the tail can still show begin, when more lines than it holds end in this
        chunk: those before are only counted (a compiler printing 100 MB of short lines costs a
        count per chunk, not Python work per line). None: every line of the chunk is taken."""
        if self._seen is not None and self._tail.disk_full_line is None:
            return None  # a disk-full phrase waits for its line to end: take every line
        if self._tracebacks or _TRACEBACK_BYTES in chunk:
            return None  # a traceback: its last line says what was raised
        at = len(chunk)
        for _ in range((self._tail.lines.maxlen or 0) + 1):
            at = chunk.rfind(b"\n", first + 1, at)
            if at < 0:
                return None
        return at + 1

    def _split(self, chunk: bytes) -> None:
        start = 0
        for index in _newlines(chunk):
            self._segment(chunk[start:index])
            self._pending_cr = False  # \r\n is one end of line
            self._finish()
            start = index + 1
        self._segment(chunk[start:])

    def _segment(self, part: bytes) -> None:
        """Bytes without a newline. A lone \r starts the line over once more bytes come (a bar's
        next frame): only what follows the last \r that has bytes after it is the line."""
        text = part.rstrip(b"\r")
        last = text.rfind(b"\r")
        if last >= 0:
            self._line.clear()
            self._cut = 0
            self._pending_cr = False
            text = text[last + 1 :]
        self._add(text)
        if len(text) < len(part) - (last + 1 if last >= 0 else 0):
            self._pending_cr = True  # it ended with \r: the next bytes start the line over

    def close(self) -> None:
        """End of the stream: a last line without a newline (a bar's final frame) is kept too."""
        if self._line or self._cut:
            self._finish()
        if self._seen is not None and self._tail.disk_full_line is None:
            self._tail.disk_full_line = self._seen_text()

    def open_line(self) -> str:
        """The line under way (no newline yet), as :meth:`close` would keep it; "" if none."""
        if not (self._line or self._cut):
            return ""
        text = self._line.decode(errors="replace").rstrip()
        return text + CUT_MARK.format(cut=self._cut) if self._cut else text

    def disk_full_text(self) -> str | None:
        """What names the full disk so far: its line once ended, else the text around the phrase."""
        return self._tail.disk_full_line or (self._seen_text() if self._seen is not None else None)

    def _seen_text(self) -> str:
        return (self._seen or b"").decode(errors="replace").strip()

    def _add(self, part: bytes) -> None:
        if not part:
            return
        if self._pending_cr:
            # A lone \r: the line starts over, as the terminal shows it (a progress bar's next frame).
            self._pending_cr = False
            self._line.clear()
            self._cut = 0
        room = max(0, self._line_bytes - len(self._line))
        self._line += part[:room]
        self._cut += max(0, len(part) - room)

    def _finish(self) -> None:
        text = self._line.decode(errors="replace").rstrip()
        if self._seen is not None and self._tail.disk_full_line is None:
            if _find(self._line.lower(), self._phrases) is not None:
                self._tail.disk_full_line = text.strip()
            elif self._cut:
                self._tail.disk_full_line = self._seen_text()  # the phrase lay past the cut
        self._follow_traceback(text)
        if self._cut:
            text += CUT_MARK.format(cut=self._cut)
        self._tail.count += 1
        self._tail.lines.append(text)
        self._line.clear()
        self._cut = 0
        self._pending_cr = False

    def _follow_traceback(self, text: str) -> None:
        """A traceback's frames are indented after its prefix; the first line that is not ends it
        and names what was raised."""
        at = text.find(TRACEBACK)
        if at >= 0:
            prefix = text[:at]
            if prefix in self._tracebacks:
                self._tracebacks.remove(prefix)  # a chained exception's next traceback
            self._tracebacks = [*self._tracebacks, prefix][-_OPEN_TRACEBACKS:]
            self._unmatched = 0
            return
        # The longest prefix first: "" (no prefix) would take every line.
        for prefix in sorted(self._tracebacks, key=len, reverse=True):
            if not text.startswith(prefix):
                continue
            self._unmatched = 0
            rest = text[len(prefix) :]
            if rest[:1].isspace():
                return  # a frame, or its code
            self._tracebacks.remove(prefix)
            if rest.strip():
                self._tail.add_raised(rest.strip())
            return
        if self._tracebacks:
            self._unmatched += 1
            if self._unmatched > _TRACEBACK_PATIENCE:
                self._tracebacks = []  # its process died mid-traceback: the tail may skip again

    def _look(self, chunk: bytes) -> bool:
        if not self._phrases or self._tail.disk_full_line is not None:
            return False
        if self._seen is not None:
            more = chunk[: self._room]
            self._seen += _first_line(more)  # the rest of the phrase's neighbourhood
            self._room = 0 if _LINE_ENDS.search(more) else max(0, self._room - len(chunk))
            return False
        window = self._carry + chunk
        self._carry = window[-_CARRY:]
        found = _find(window.lower(), self._phrases)
        if found is None:
            return False
        start, end = found
        head = _LINE_ENDS.split(window[max(0, start - _CONTEXT) : start])
        after = window[start : end + _CONTEXT]
        self._seen = (b"" if len(head) > 1 else b"... ") + head[-1] + _first_line(after)
        self._room = 0 if _LINE_ENDS.search(after) else _CONTEXT - (len(after) - (end - start))
        return True


_LINE_ENDS = re.compile(rb"[\r\n]")


def _find(lowered: bytes | bytearray, phrases: tuple[bytes, ...]) -> tuple[int, int] | None:
    """(start, end) of the first phrase found in ``lowered``; None if there is none."""
    hits = [(at, at + len(p)) for p in phrases if (at := lowered.find(p)) >= 0]
    return min(hits) if hits else None


def _first_line(data: bytes) -> bytes:
    return _LINE_ENDS.split(data, maxsplit=1)[0]


def _newlines(chunk: bytes) -> list[int]:
    """Offsets of \n, found by the regex engine (no Python step per byte)."""
    return [m.start() for m in _NEWLINE.finditer(chunk)]


_NEWLINE = re.compile(rb"\n")


class Pump:
    """Reads one stream of a child in bounded chunks until it ends: every byte goes to ``sink``,
    and through a :class:`LineKeeper` into the shared tail.

    What ends in a newline is written at once. A line still open at the end of a read is held
    until its newline comes, for at most :data:`HOLD_SECONDS` of silence and :data:`CHUNK_BYTES`:
    so lines reach the log whole, never with one of cachemgr's own log events (same stream)
    spliced into them, as line-by-line reading kept them; and a \r bar's frame, which ends no
    line, still reaches the log as it is drawn (the child falls silent after each frame).
    """

    def __init__(self, stream: IO[bytes], sink: IO[str], keeper: LineKeeper, tail: Tail) -> None:
        self._stream = stream
        self._sink = sink
        self.keeper = keeper
        self._tail = tail
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._out = getattr(sink, "buffer", None)
        self._held = b""
        self._stderr = sink is sys.stderr  # cachemgr's own events go there too

    def run(self, disk_full: threading.Event | None = None) -> None:
        fd = self._stream.fileno()
        try:
            while True:
                if self._held and not _readable(fd, HOLD_SECONDS):
                    self._write(self._held)  # the child fell silent mid-line: a frame, a prompt
                    self._held = b""
                chunk = _read(fd)
                if not chunk:
                    break
                self._pass_on(chunk)
                with self._tail.lock:
                    found = self.keeper.feed(chunk)
                if found and disk_full is not None:
                    disk_full.set()
        finally:
            self._write(self._held)
            with self._tail.lock:
                self.keeper.close()
            self._stream.close()

    def _pass_on(self, chunk: bytes) -> None:
        data = self._held + chunk
        end = data.rfind(b"\n") + 1
        if len(data) - end > CHUNK_BYTES:
            end = len(data)  # a long open line goes on as it comes: memory stays one chunk or two
        self._write(data[:end])
        self._held = data[end:]

    def _write(self, data: bytes) -> None:
        if not data:
            return
        with contextlib.suppress(OSError, ValueError), terminal_guard():
            if self._out is not None:
                self._out.write(data)
                self._out.flush()
            else:
                self._sink.write(self._decoder.decode(data))
                self._sink.flush()
            if self._stderr:
                stderr_line_open(not data.endswith(b"\n"))


def _readable(fd: int, seconds: float) -> bool:
    try:
        ready, _, _ = select.select([fd], [], [], seconds)
    except (OSError, ValueError):
        return True  # let the read say what is wrong
    return bool(ready)


def _read(fd: int) -> bytes:
    """The next chunk; b"" at the end, or when the pipe fails (the child is gone either way)."""
    try:
        return os.read(fd, CHUNK_BYTES)
    except OSError:
        return b""


# --- a server's output: passed through, its last lines kept ---------------------------------


SERVER_TAIL_LINES = 20  # a server's last lines kept for the failure it may end in
SERVER_TAIL_LINE_BYTES = 400  # each cut here: a 60 MB line without a newline stays 400 bytes


class ChildStreams:
    """A child's stdout and stderr, each read on a thread of its own by a :class:`Pump` (passed on
    to ours) into one :class:`Tail`: a compile's (:class:`cachemgr.runtime.launcher.OutputWatch`)
    and a server's (:class:`ServerOutput`), sized by the caller."""

    def __init__(
        self,
        child: subprocess.Popen[bytes],
        *,
        lines: int,
        line_bytes: int,
        phrases: Sequence[bytes],
        name: str,
        disk_full: threading.Event | None = None,
    ) -> None:
        self._tail = Tail(lines=lines)
        self._pumps = [
            Pump(stream, sink, LineKeeper(self._tail, phrases, line_bytes=line_bytes), self._tail)
            for stream, sink in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))
            if stream is not None
        ]
        self._threads = [
            threading.Thread(target=pump.run, args=(disk_full,), daemon=True, name=name)
            for pump in self._pumps
        ]
        for thread in self._threads:
            thread.start()

    def raised(self) -> list[str]:
        """What the child raised: its tracebacks' last lines (:attr:`Tail.raised`), raw text
        (escape it to print: core.printable)."""
        with self._tail.lock:
            return self._tail.raised


class ServerOutput(ChildStreams):
    """Passes a server's stdout and stderr on to ours, keeping its last lines: a shorter tail
    (:data:`SERVER_TAIL_LINES` of :data:`SERVER_TAIL_LINE_BYTES`) than a compile's, and no
    disk-full phrases.

    A stream that is a terminal is not piped at all (:func:`cachemgr.runtime.launcher.start`
    with ``capture="tail"``): a person reading it sees the server's own output, and the server
    still sees its terminal.
    """

    def __init__(self, child: subprocess.Popen[bytes]) -> None:
        super().__init__(
            child,
            lines=SERVER_TAIL_LINES,
            line_bytes=SERVER_TAIL_LINE_BYTES,
            phrases=(),
            name="cachemgr-server-output",
        )

    def lines(self) -> list[str]:
        """The last lines, and any line still open (the streams may not have ended: the server's
        children can hold them); raw text (escape it to print: core.printable)."""
        with self._tail.lock:
            lines = list(self._tail.lines)
            return [*lines, *(text for pump in self._pumps if (text := pump.keeper.open_line()))]

    def join(self, timeout: float) -> None:
        """Until the streams end (the server's children may hold them open: bounded by ``timeout``)."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
