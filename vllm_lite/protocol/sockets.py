"""Addresses and typed ZMQ socket wrappers.

Locally every link is an `ipc://` path inside a private (0700) runtime directory; across nodes it is
`tcp://HOST:PORT`. Sockets bind to loopback or ipc unless a caller asks for another host.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from typing import Generic, TypeVar

import msgspec
import zmq

from vllm_lite.protocol.codec import Decoder, encode

T = TypeVar("T")


def new_runtime_dir() -> str:
    """A fresh private directory for this deployment's ipc sockets (removed by the caller)."""
    return tempfile.mkdtemp(prefix="vllm-lite-")


def ipc_address(runtime_dir: str, name: str) -> str:
    """`ipc://` address of a socket file in the runtime directory (unique per call)."""
    return f"ipc://{os.path.join(runtime_dir, f'{name}-{uuid.uuid4().hex[:8]}.sock')}"


def tcp_address(host: str, port: int) -> str:
    """`tcp://` address; IPv6 hosts are bracketed."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class MessageSender:
    """Sends encoded messages on a PUSH or DEALER socket."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.socket = socket

    def send(self, message: msgspec.Struct) -> None:
        self.socket.send(encode(message), copy=False)


class MessageReceiver(Generic[T]):
    """Receives and decodes messages of one union type; malformed frames are dropped (None)."""

    def __init__(self, socket: zmq.Socket, union: object, name: str) -> None:
        self.socket = socket
        self.decoder: Decoder[T] = Decoder(union, name)

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def recv(self) -> T | None:
        """The next message; None if its frame could not be decoded (already logged)."""
        frames = self.socket.recv_multipart(copy=False)
        # ROUTER sockets prefix the sender's identity; the payload is always the last frame.
        return self.decoder.decode(frames[-1].buffer)


def make_socket(
    context: zmq.Context,
    kind: int,
    address: str,
    bind: bool,
    identity: bytes | None = None,
    options: dict[int, int] | None = None,
) -> zmq.Socket:
    """A socket that never blocks process exit on unsent messages (linger 0) and never drops or
    blocks on a full queue (no high-water mark: what is in flight is bounded by the requests)."""
    socket = context.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        socket.setsockopt(zmq.IDENTITY, identity)
    for option, value in (options or {}).items():
        socket.setsockopt(option, value)
    if bind:
        socket.bind(address)
    else:
        socket.connect(address)
    return socket
