"""The DP env vars: the launch contract between every launcher and every engine core.

Each engine core reads its DP identity from these (and only these) variables, so that a rank
started by the mp launcher, by Ray or by hand on another node behaves the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DP_SIZE = "VLLM_LITE_DP_SIZE"
DP_RANK = "VLLM_LITE_DP_RANK"
DP_RANK_LOCAL = "VLLM_LITE_DP_RANK_LOCAL"
DP_MASTER_IP = "VLLM_LITE_DP_MASTER_IP"
DP_MASTER_PORT = "VLLM_LITE_DP_MASTER_PORT"


@dataclass(frozen=True)
class DPEnv:
    """One rank's place in the DP group."""

    size: int
    rank: int
    rank_local: int
    master_ip: str
    master_port: int

    def to_env(self) -> dict[str, str]:
        """The variables a launcher sets for this rank's engine-core process."""
        return {
            DP_SIZE: str(self.size),
            DP_RANK: str(self.rank),
            DP_RANK_LOCAL: str(self.rank_local),
            DP_MASTER_IP: self.master_ip,
            DP_MASTER_PORT: str(self.master_port),
        }

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> DPEnv:
        """This process's DP identity; a process started without the variables is rank 0 of 1."""
        env = os.environ if environ is None else environ
        return cls(
            size=int(env.get(DP_SIZE, "1")),
            rank=int(env.get(DP_RANK, "0")),
            rank_local=int(env.get(DP_RANK_LOCAL, "0")),
            master_ip=env.get(DP_MASTER_IP, "127.0.0.1"),
            master_port=int(env.get(DP_MASTER_PORT, "0")),
        )
