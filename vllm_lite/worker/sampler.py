"""Batched per-request sampling: penalties, temperature, top-k/top-p/min-p, seeded inverse-CDF draws.

Each row is sampled as if it were alone: every filter works per row, and the one uniform number a
row consumes is a pure function of (seed, position), so seeded sampling reproduces regardless of
the batch around it and after a recomputation (preemption). Work is done only for the rows that
need it; an all-greedy batch with nothing else to do is a single argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_lite.protocol.step import SampleLogprobs
from vllm_lite.worker.sampling_metadata import (
    TOP_P_CANDIDATES,
    Filters,
    RowChunk,
    SamplingMetadata,
    SamplingRow,
    uniform_for,
)

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "SamplingRow", "uniform_for"]

# Long rows are scanned in blocks: a per-block reduction (sum, amax) is one fast vectorized pass,
# after which only the few blocks of interest in each row are looked at again. On a CPU this makes
# the inverse CDF, argmax and small top-k several times faster than their one-level versions.
_CDF_BLOCK = 256
_ARGMAX_BLOCK = 128
_TOPK_BLOCK = 64


@dataclass
class SamplerOutput:
    """One sampled token per row and, where asked for, its logprobs."""

    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]


class Sampler:
    """Picks one token per row of the logits; never modifies the logits it is given."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample from `logits` [num_rows, vocab_size]; row i follows the parameters of row i."""
        if meta.argmax_only:
            return SamplerOutput(_argmax(logits).tolist(), [None] * meta.num_rows)
        out = SamplerOutput([], [])
        for chunk in meta.chunks:
            token_ids, logprobs = _sample_chunk(logits[chunk.start : chunk.start + chunk.num_rows], chunk)
            out.token_ids += token_ids
            out.logprobs += logprobs
        return out


def _sample_chunk(logits: torch.Tensor, meta: RowChunk) -> tuple[list[int], list[SampleLogprobs | None]]:
    """Logprobs of the raw logits, then min_tokens, penalties, and greedy or random picks."""
    raw_logprobs = None
    if meta.logprob_rows:
        raw = logits if len(meta.logprob_rows) == meta.num_rows else logits[meta.logprob_rows]
        raw_logprobs = torch.log_softmax(raw, dim=-1, dtype=torch.float32)
    work = logits
    if meta.suppressed is not None or meta.penalties is not None:
        work = logits.clone(memory_format=torch.contiguous_format)
        if meta.suppressed is not None:
            minus_inf = torch.tensor(float("-inf"), dtype=work.dtype, device=work.device)
            work.index_put_(meta.suppressed, minus_inf)
        if meta.penalties is not None:
            meta.penalties.apply(work)

    if meta.greedy_rows is None:
        token_ids = _sample(work if meta.all_sampled else work[meta.sample_rows], meta)
    elif meta.sample_rows is None:
        token_ids = _argmax(work)
    else:
        token_ids = torch.empty(meta.num_rows, dtype=torch.long, device=work.device)
        token_ids[meta.greedy_rows] = _argmax(work[meta.greedy_rows])
        token_ids[meta.sample_rows] = _sample(work[meta.sample_rows], meta)
    logprobs: list[SampleLogprobs | None] = [None] * meta.num_rows
    if raw_logprobs is not None:
        rows = meta.logprob_rows
        entries = _gather_logprobs(raw_logprobs, token_ids[rows], meta.logprob_counts)
        for row, entry in zip(rows, entries, strict=True):
            logprobs[row] = entry
    return token_ids.tolist(), logprobs


def _sample(logits: torch.Tensor, meta: RowChunk) -> torch.Tensor:
    """Temperature, filters and one inverse-CDF draw per row, for the non-greedy rows."""
    if meta.temperature is not None:
        logits = logits / meta.temperature
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # a fresh tensor: safe to edit in place
    if meta.filters is not None:
        _apply_filters(probs, meta.filters)
    return _inverse_cdf(probs, meta.uniforms)


def _apply_filters(probs: torch.Tensor, f: Filters) -> None:
    """Zero what top-k, top-p (on the top-k renormalized distribution) and min-p reject.

    Each of them keeps the tokens whose probability reaches a per-row threshold, so they combine
    into one threshold (the largest) and one masking pass; ties at a threshold are all kept.
    """
    p = probs if f.rows is None else probs[f.rows]
    threshold = torch.zeros_like(f.top_p)
    if f.first_candidates:
        threshold = _top_k_top_p_threshold(p, f)
    if f.min_p is not None:
        threshold = torch.maximum(threshold, f.min_p * p.amax(dim=-1, keepdim=True))
    # p / threshold >= 1 exactly when p >= threshold (division is correctly rounded), and scaling a
    # row does not change its distribution; this is several times faster than masked_fill_.
    p.div_(threshold.clamp(min=torch.finfo(p.dtype).tiny))
    torch.nn.functional.threshold_(p, 1.0 - 2.0**-24, 0.0)  # the largest float32 below 1
    if f.rows is not None:
        probs[f.rows] = p


def _top_k_top_p_threshold(p: torch.Tensor, f: Filters) -> torch.Tensor:
    """Smallest kept probability per row, searched among ever more candidates until it is found."""
    V = p.shape[-1]
    threshold = torch.zeros_like(f.top_p)
    pending = torch.arange(p.shape[0], device=p.device)
    ladder = [f.first_candidates] + [c for c in TOP_P_CANDIDATES if f.first_candidates < c < V] + [V]
    for step, k in enumerate(dict.fromkeys(ladder)):  # ordered and without repeats
        rows = p if step == 0 else p[pending]
        top_k, top_p = f.top_k[pending], f.top_p[pending]
        vals = _topk(rows, k)[0]  # descending
        # A cutoff depends only on a prefix of the row's own sorted probabilities, whose cumsum is
        # the same whatever k is: the result does not depend on the candidate count (other rows).
        cum = vals.cumsum(dim=-1)
        total = torch.where(top_k >= V, rows.sum(-1, keepdim=True), cum.gather(1, top_k.clamp(max=k) - 1))
        in_k = torch.arange(k, device=p.device) < top_k
        keep = in_k & ((cum - vals < top_p * total) | (top_p >= 1.0))
        row_thr = vals.gather(1, keep.sum(-1, keepdim=True).clamp(min=1) - 1)
        trivial = (top_k >= V) & (top_p >= 1.0)  # min-p-only rows: no cutoff here
        row_thr = torch.where(trivial, 0.0, row_thr)
        # Found when the row's top-k set lies within the candidates, or the nucleus ends inside them.
        found = (trivial | (top_k <= k) | (cum[:, -1:] >= top_p * total)).squeeze(1)
        threshold[pending[found]] = row_thr[found]
        pending = pending[~found]
        if pending.numel() == 0:
            break
    return threshold


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """First token whose cumulative (unnormalized) probability exceeds u * total, per row.

    Two levels: block sums locate the block, then a cumulative sum inside that block alone.
    """
    S, V = probs.shape
    B = min(_CDF_BLOCK, V)
    nb = V // B
    sums = probs[:, : nb * B].reshape(S, nb, B).sum(-1)
    if nb * B < V:
        sums = torch.cat([sums, probs[:, nb * B :].sum(-1, keepdim=True)], dim=-1)
    cum_blocks = sums.cumsum(dim=-1)
    total = cum_blocks[:, -1:]
    # Stay strictly below the total: rounding must never step past the last token with mass.
    target = torch.minimum(uniforms.unsqueeze(1) * total, total * (1.0 - 2.0**-23))
    block = torch.searchsorted(cum_blocks, target, right=True).clamp(max=sums.shape[1] - 1)
    before = torch.where(block > 0, cum_blocks.gather(1, (block - 1).clamp(min=0)), 0.0)
    idx = block * B + torch.arange(B, device=probs.device)
    in_vocab = idx < V
    inner = torch.where(in_vocab, probs.gather(1, idx.clamp(max=V - 1)), 0.0).cumsum(dim=-1)
    local = torch.searchsorted(inner, target - before, right=True)
    # The block sum and the in-block cumsum round differently; never go past the block's last mass.
    local = torch.minimum(local, (inner < inner[:, -1:]).sum(-1, keepdim=True))
    return (block * B + local).squeeze(1).clamp(max=V - 1)


def _gather_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, counts: list[int]
) -> list[SampleLogprobs]:
    """The sampled token's logprob and 1-based rank, and the top-N alternatives, per row."""
    token_lp = logprobs.gather(1, token_ids.unsqueeze(1))
    # Rank 1 + number of strictly more likely tokens: tied tokens share the best rank.
    ranks = ((logprobs > token_lp).sum(-1) + 1).tolist()
    top_vals: list[list[float]] = [[] for _ in counts]
    top_ids: list[list[int]] = [[] for _ in counts]
    if max(counts) > 0:
        values, indices = _topk(logprobs, max(counts))
        top_vals, top_ids = values.tolist(), indices.tolist()
    return [
        SampleLogprobs(token_id=t, logprob=lp, rank=r, top_token_ids=ids[:n], top_logprobs=vals[:n])
        for t, lp, r, ids, vals, n in zip(
            token_ids.tolist(), token_lp.squeeze(1).tolist(), ranks, top_ids, top_vals, counts, strict=True
        )
    ]


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1), the first index of each row's maximum."""
    N, V = x.shape
    B = _ARGMAX_BLOCK
    if x.device.type != "cpu" or V % B or V < 8 * B:  # accelerators have fast native kernels
        return x.argmax(dim=-1)
    block = x.reshape(N, V // B, B).amax(dim=-1).argmax(dim=-1, keepdim=True)  # first block with it
    in_block = x.gather(1, block * B + torch.arange(B, device=x.device)).argmax(dim=-1, keepdim=True)
    return (block * B + in_block).squeeze(1)


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) values and indices, descending; tied values may come in another order.

    The k largest values lie in the k blocks with the largest maxima, so only those are searched.
    """
    N, V = x.shape
    B = _TOPK_BLOCK
    if x.device.type != "cpu" or V % B or k * B * 8 > V:
        return x.topk(k, dim=-1)
    blocks = x.reshape(N, V // B, B).amax(dim=-1).topk(k, dim=-1).indices
    idx = (blocks.unsqueeze(-1) * B + torch.arange(B, device=x.device)).view(N, k * B)
    values, j = x.gather(1, idx).topk(k, dim=-1)
    return values, idx.gather(1, j)
