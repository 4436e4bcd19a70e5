"""Turns a growing list of token ids into text deltas that never split a UTF-8 character."""

from __future__ import annotations

from data_plane.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a
    prefix yields U+FFFD. Text is released only once the character is complete. Decoding a
    short window of recent tokens (not the whole output) keeps each step O(1)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the window whose text has already been released
        self._read = 0  # end of that window

    def add(self, token_id: int) -> str:
        """Appends a token and returns the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(self.ids[self._prefix :], self._skip)
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back at the end of generation (an incomplete character)."""
        prefix_text = self._tok.decode(self.ids[self._prefix : self._read], self._skip)
        full_text = self._tok.decode(self.ids[self._prefix :], self._skip)
        self._prefix = self._read = len(self.ids)
        return full_text[len(prefix_text) :].rstrip(_REPLACEMENT)
