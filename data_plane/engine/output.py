"""A request's streamed text: UTF-8-safe deltas, stop strings held back until they can't match."""

from __future__ import annotations

from data_plane.engine.detokenizer import IncrementalDetokenizer
from data_plane.model.tokenizer import Tokenizer


class OutputText:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = stop
        self._text = ""  # everything decoded so far
        self._emitted = 0  # characters of _text already released

    def push(self, token_id: int) -> tuple[str, bool]:
        """Adds a token; returns (text to release now, whether a stop string was hit)."""
        self._text += self._detok.add(token_id)
        return self._release()

    def flush(self) -> str:
        """The rest of the text at the end of generation."""
        self._text += self._detok.flush()
        text, _ = self._release(final=True)
        return text

    def _release(self, final: bool = False) -> tuple[str, bool]:
        # Search from just before the unreleased text (a stop string may straddle the boundary), and
        # cut at the earliest match: two stop strings can complete on one token ("B" and "AB" on "xAB").
        found = [at for stop in self._stop
                 if (at := self._text.find(stop, max(0, self._emitted - len(stop) + 1))) != -1]
        if found:
            delta = self._text[self._emitted : min(found)]
            self._emitted = len(self._text)
            return delta, True
        hold = 0 if final else self._longest_stop_prefix_suffix()
        end = len(self._text) - hold
        delta = self._text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta, False

    def _longest_stop_prefix_suffix(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        best = 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(self._text)), best, -1):
                if self._text.endswith(stop[:n]):
                    best = n
                    break
        return best
