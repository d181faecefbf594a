"""Incremental detokenization and stop-string matching for one output stream.

`TextStream.add(token)` returns the text delta that is now safe to send:
* text is only released once it decodes to whole UTF-8 characters, so the deltas
  concatenate to exactly `tokenizer.decode(tokens)` (no broken characters);
* with stop strings, text that could still be the start of a stop string is held
  back; when a stop string appears, the output ends just before it (the stop
  string itself is never sent, as in the OpenAI API).
"""

from __future__ import annotations

from typing import Any, Sequence

_REPLACEMENT = "\ufffd"


class TextStream:
    """Sans-io: feed token ids, get text deltas and whether a stop string hit."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._tokens: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._pending = ""
        self.stopped = False

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._tokens[start:end])

    def _new_text(self) -> str:
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        delta = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return delta

    def add(self, token: int) -> str:
        """Consume one token; return the releasable text delta (maybe empty)."""
        if self.stopped:
            raise ValueError("TextStream already stopped")
        self._tokens.append(token)
        self._pending += self._new_text()
        if not self._stop:
            out, self._pending = self._pending, ""
            return out
        hits = [(self._pending.find(s), s) for s in self._stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if hits:
            cut = min(i for i, _ in hits)
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        release = self._pending[: max(len(self._pending) - self._holdback, 0)]
        self._pending = self._pending[len(release):]
        return release

    def flush(self) -> str:
        """End of stream: release held-back text (no stop string can complete now)."""
        if self.stopped:
            return ""
        tail = self._decode(self._prefix_offset)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        out = self._pending + tail[len(prefix):]
        self._pending = ""
        self._read_offset = len(self._tokens)
        return out
