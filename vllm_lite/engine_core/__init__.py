"""The per-rank engine core: scheduler, KV-cache (block) manager, request state, executors."""
