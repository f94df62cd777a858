"""One msgpack codec for every socket: typed decoding by explicit tag, never pickle.

A frame that is not valid msgpack, carries an unknown tag or fails validation decodes to None and
is logged: a receiver must never crash on what a peer (or an attacker) sends.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

import msgspec

logger = logging.getLogger(__name__)

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    """msgpack bytes of a message (its tag travels inside)."""
    return _encoder.encode(message)


class Decoder(Generic[T]):
    """Decodes frames into one of the message types in `union`; bad frames give None."""

    def __init__(self, union: Any, name: str) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)
        self._name = name
        self.num_dropped = 0

    def decode(self, frame: bytes | memoryview) -> T | None:
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, ValueError) as exc:
            # ValueError: a message's own __post_init__ validation (e.g. SamplingParams).
            self.num_dropped += 1
            logger.warning("%s: dropped a malformed frame of %d bytes: %s", self._name, len(frame), exc)
            return None
