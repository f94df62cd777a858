"""The client's DP load balancer: each request goes to the least-loaded live rank.

Load is 4 x waiting + running (a queued request delays everything behind it; a running one only
shares the batch), then KV-cache usage, from the stats each engine publishes with its outputs,
plus the requests this client sent to the rank since that rank's last stats (so a burst of
arrivals between two engine steps spreads out instead of all landing on one rank). Ties rotate.
"""

from __future__ import annotations

import itertools

from vllm_lite.protocol.messages import EngineStats


class LoadBalancer:
    """Chooses a rank per request; knows each rank's last stats and what was sent since."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = sorted(ranks)
        self._stats: dict[int, EngineStats] = {}
        self._sent_since_stats = dict.fromkeys(self.ranks, 0)
        self._rotation = itertools.count()

    def update_stats(self, rank: int, stats: EngineStats) -> None:
        """Fresh figures from a rank: they include everything it has received so far."""
        self._stats[rank] = stats
        self._sent_since_stats[rank] = 0

    def load(self, rank: int) -> tuple[int, float]:
        """(4 x waiting + running, KV usage); requests sent since the rank's last stats count as
        waiting."""
        stats = self._stats.get(rank)
        pending = self._sent_since_stats.get(rank, 0)
        if stats is None:
            return (4 * pending, 0.0)
        return (4 * (stats.num_waiting + pending) + stats.num_running, stats.kv_cache_usage)

    def choose(self, live: list[int]) -> int:
        """The least-loaded of the live ranks (rotating among equals); counts the request."""
        if not live:
            raise ValueError("no live rank to choose from")
        start = next(self._rotation) % len(live)
        rotated = live[start:] + live[:start]
        rank = min(rotated, key=self.load)
        self._sent_since_stats[rank] = self._sent_since_stats.get(rank, 0) + 1
        return rank
