"""The DP group: a stateless torch.distributed group over the DP ranks, built from the DP env vars.

Stateless: its own TCPStore and process group object, never `init_process_group`, so that it
cannot collide with a TP group or a user's default group in the same process. Rank 0 hosts the
store. When the launcher leaves the port open (`VLLM_LITE_DP_MASTER_PORT=0`), rank 0 binds a
free port itself and the frontend relays it to the other ranks in the handshake: the rank that
binds the port publishes it, so two deployments can never race for one port.
"""

from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vllm_lite.dp.env import DPEnv

DEFAULT_TIMEOUT_S = 300.0


def create_store(dp: DPEnv, master_port: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
    """The group's store: rank 0 binds it (port 0 = any free port), the others connect."""
    return dist.TCPStore(
        dp.master_ip,
        master_port,
        dp.size,
        dp.rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


@dataclass
class DPGroup:
    """This engine's place among the DP ranks, and the collectives they share."""

    rank: int
    size: int
    store: dist.TCPStore
    group: dist.ProcessGroup

    @classmethod
    def create(cls, dp: DPEnv, store: dist.TCPStore, timeout_s: float = DEFAULT_TIMEOUT_S) -> DPGroup:
        """Join the group (blocks until every rank has joined, up to `timeout_s`). Gloo: the DP
        collectives carry a few scalars per step, so CPU tensors serve on any device."""
        prefixed = dist.PrefixStore("vllm_lite_dp", store)
        group = dist.ProcessGroupGloo(prefixed, dp.rank, dp.size, datetime.timedelta(seconds=timeout_s))
        return cls(rank=dp.rank, size=dp.size, store=store, group=group)

    def all_reduce(self, values: list[float] | list[int]) -> list[float]:
        """Element-wise sum over the ranks."""
        tensor = torch.tensor(values, dtype=torch.float64)
        self.group.allreduce([tensor]).wait()
        return tensor.tolist()

    def all_gather_digest(self, text: str) -> list[bytes]:
        """Every rank's 32-byte digest of `text`, in rank order (for agreement checks)."""
        mine = torch.tensor(list(hashlib.sha256(text.encode()).digest()), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self.group.allgather([parts], [mine]).wait()
        return [bytes(p.tolist()) for p in parts]

    def check_agreement(self, what: str, text: str) -> None:
        """Raise on every rank unless all ranks hold the same `text` (e.g. the config hash)."""
        digests = self.all_gather_digest(text)
        differ = [r for r, d in enumerate(digests) if d != digests[self.rank]]
        if differ:
            raise RuntimeError(f"DP rank {self.rank}: {what} differs from ranks {differ}")
