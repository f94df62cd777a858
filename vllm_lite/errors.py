"""Errors users of the client can catch (ground floor: imports nothing of the package)."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """An engine core died (crashed, was killed, or reported a fatal error): its requests are lost
    and it takes no new ones."""


class EngineStartupError(RuntimeError):
    """An engine core failed to start, or did not finish the handshake in time."""


class RequestError(RuntimeError):
    """The engine refused or failed one request; the engine itself keeps serving."""
