"""Incremental detokenization: generated token ids in, streamable text out, with stop strings.

Text is produced with the "prefix offset / read offset" technique: each new token is decoded together
with a few tokens of context before it (``ids[prefix:read]`` is the context, ``ids[read:]`` the tokens
not yet turned into text), and the new text is the difference between the two decodes. The context keeps
word boundaries right (metaspace decoders drop the leading space of the first token they see), and the
window is bounded, so the work per token does not grow with the length of the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded ahead of the first output token, so that its text starts the way it would in
# the middle of the conversation (leading space included).
_PROMPT_CONTEXT_TOKENS = 5
# An incomplete UTF-8 character at the end of the text has at most 3 bytes, so at most 3 byte tokens.
_MAX_INCOMPLETE_TOKENS = 3
# Tokens that stay undecodable for longer than this are invalid bytes, not an incomplete character.
_MAX_PENDING_TOKENS = 8


class IncrementalDetokenizer:
    """Per-request incremental detokenization with stop strings.

    The caller feeds each engine step's new token ids to `update`, aborts the request when it returns a
    stop string, and streams `get_delta` once per step (with ``finished=True`` on the last one).
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # An empty stop string would match before any text; it cannot be meant.
        self._stop = [s for s in stop or [] if s]
        self._include_stop = include_stop_str_in_output
        # A stop string can start this many characters before the newest text.
        self._stop_overlap = max((len(s) for s in self._stop), default=1) - 1

        context = self._prompt_context(prompt_token_ids)
        self._num_context = len(context)
        self._ids: list[int] = context
        # The decode window starts at the prefix offset; text was emitted up to the read offset. Both are
        # ends of earlier emits, so on complete characters (unless invalid bytes were forced out).
        self._prefix_offset = 0
        self._read_offset = len(context)

        # Decoded text is `_parts` + `_tail`. The tail is the part a stop string may still reach into
        # (the last `_stop_overlap` characters while running), so truncation never touches `_parts`.
        self._parts: list[str] = []
        self._tail = ""
        self._num_released = 0  # parts already handed out by get_delta
        self._stop_hit: str | None = None

    @property
    def token_ids(self) -> list[int]:
        """The output token ids so far (after a stop string hit: up to the token that completed it)."""
        return self._ids[self._num_context :]

    @property
    def num_tokens(self) -> int:
        """The number of output tokens so far (counted like `token_ids`)."""
        return len(self._ids) - self._num_context

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stop_hit

    @property
    def output_text(self) -> str:
        """The whole generated text so far, truncated at the stop string if one was hit.

        Tokens that end in an incomplete character are not part of it until the character completes
        (or until ``get_delta(finished=True)`` releases them as they decode).
        """
        return "".join(self._parts) + self._tail

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append the new tokens and decode them.

        Returns the stop string that was hit (the caller then aborts the request in the engine and
        finishes it with finish_reason 'stop'), else None. Tokens after the one that completed the stop
        string are dropped. After a stop string hit, later calls are no-ops.
        """
        if self._stop_hit is not None:
            return None
        # One token at a time, so that a stop string is caught at the token that completes it.
        for token_id in new_token_ids:
            self._ids.append(token_id)
            text = self._decode_pending(flush=False)
            if text and self._append_text(text) is not None:
                return self._stop_hit
        return None

    def get_delta(self, finished: bool) -> str:
        """The text released since the previous get_delta call.

        While not finished and stop strings are set, the last (longest stop string length - 1)
        characters are held back, since they may be the start of a stop string. With ``finished=True``
        everything is released, including tokens still waiting for a character to complete (decoded as
        they are, so an invalid byte sequence at the very end becomes U+FFFD).
        """
        if finished and self._stop_hit is None:
            text = self._decode_pending(flush=True)
            if text:
                self._append_text(text)
        if finished or self._stop_hit is not None:
            self._commit(keep=0)
        delta = "".join(self._parts[self._num_released :])
        self._num_released = len(self._parts)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        # Start the context at a complete character: byte-fallback decoders turn a whole run of byte
        # tokens into U+FFFD when it starts inside a character (output tokens that continue it included).
        while context and self._decode(context).startswith(_REPLACEMENT_CHAR):
            context.pop(0)
        # A prompt that ends inside a character would make the first output text longer than the
        # context's text grew by; decode the output on its own instead, as tokenizer.decode would.
        if context and self._decode(context).endswith(_REPLACEMENT_CHAR):
            return []
        return context

    def _decode_pending(self, flush: bool) -> str:
        """The text of the tokens past the read offset, or "" while their last character is incomplete."""
        prefix, read = self._prefix_offset, self._read_offset
        end = len(self._ids)
        if read == end:
            return ""
        prefix_text = self._decode(self._ids[prefix:read])
        new_text = self._decode(self._ids[prefix:end])
        if new_text.endswith(_REPLACEMENT_CHAR) and not flush:
            if end - read <= _MAX_PENDING_TOKENS:
                return ""
            # Invalid bytes, not a character in the making: release them, all but the last few tokens
            # (which may begin a real character), so the decode window stays bounded.
            end -= _MAX_INCOMPLETE_TOKENS
            new_text = self._decode(self._ids[prefix:end])
        self._prefix_offset, self._read_offset = read, end
        return new_text[len(prefix_text) :]

    def _append_text(self, text: str) -> str | None:
        """Add decoded text and look for a stop string in it; returns the stop string hit, if any."""
        # The tail holds at most the overlap before the new text, and nothing older can hold a stop
        # string not seen before, so the search costs O(new text).
        self._tail += text
        hit = self._find_stop()
        if hit is None:
            self._commit(keep=self._stop_overlap)
            return None
        start, stop = hit
        self._tail = self._tail[: start + len(stop) if self._include_stop else start]
        self._stop_hit = stop
        self._commit(keep=0)
        return stop

    def _find_stop(self) -> tuple[int, str] | None:
        # The earliest match wins; of two starting at the same place, the shorter one completed first.
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = self._tail.find(stop)
            if start != -1 and (best is None or (start, len(stop)) < best[:2]):
                best = (start, len(stop), stop)
        return None if best is None else (best[0], best[2])

    def _commit(self, keep: int) -> None:
        """Move all but the last `keep` characters of the tail into the parts that get_delta releases."""
        cut = len(self._tail) - keep
        if cut > 0:
            self._parts.append(self._tail[:cut])
            self._tail = self._tail[cut:]
