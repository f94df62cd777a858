"""Per-step sampling metadata: each row's parameters, seeded uniform and penalty/filter tensors.

Built once per step by the model runner from the rows that sample; `Sampler` consumes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vllm_lite.protocol.sampling_params import MASK64, SamplingParams, splitmix64

# Top-p first looks for its cutoff among this many candidates (topk is far cheaper than a full sort
# on a CPU); rows whose nucleus is larger retry with more candidates, then a full sort.
TOP_P_CANDIDATES = (64, 1024, 4096)
# Rows are processed in chunks of about this many logits on a CPU (8 MiB of float32 temporaries).
_CPU_CHUNK_ELEMENTS = 2**21


def uniform_for(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that a row with this seed uses at this output position.

    24 bits, so that it is exactly representable in float32 on any device (and stays below 1).
    """
    return (splitmix64(splitmix64(seed & MASK64) ^ position) >> 40) * 2.0**-24


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one request in this step."""

    params: SamplingParams
    seed: int  # resolved seed of the request (never None here)
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # generated so far; len() is the position being sampled now


@dataclass(frozen=True)
class Penalties:
    """Penalties as sparse edits: flat logit indices (row * vocab + token), each listed once."""

    repeated: torch.Tensor | None  # tokens seen in the prompt or output of repetition-penalized rows
    repetition: torch.Tensor | None  # that row's repetition penalty, per entry
    generated: torch.Tensor | None  # tokens in the output of frequency/presence-penalized rows
    subtract: torch.Tensor | None  # frequency * count + presence, per entry

    @classmethod
    def build(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> Penalties | None:
        """Only the tokens that occur are touched: O(tokens), never O(rows * vocab)."""
        rep_rows, rep_lens, rep_tokens, fp_rows, fp_lens, fp_tokens = [], [], [], [], [], []
        rep, freq, pres = [1.0] * len(rows), [0.0] * len(rows), [0.0] * len(rows)
        for i, row in enumerate(rows):
            sp = row.params
            if sp.repetition_penalty != 1.0:
                rep[i] = sp.repetition_penalty
                rep_rows.append(i)
                rep_lens.append(len(row.prompt_token_ids) + len(row.output_token_ids))
                rep_tokens += row.prompt_token_ids
                rep_tokens += row.output_token_ids
            if sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0:
                freq[i], pres[i] = sp.frequency_penalty, sp.presence_penalty
                fp_rows.append(i)
                fp_lens.append(len(row.output_token_ids))
                fp_tokens += row.output_token_ids
        if not rep_rows and not fp_rows:
            return None

        def unique_flat(rows_: list[int], lens: list[int], tokens: list[int]) -> tuple[torch.Tensor, ...]:
            row = torch.tensor(rows_, device=device).repeat_interleave(torch.tensor(lens, device=device))
            tok = torch.tensor(tokens, dtype=torch.long, device=device)
            ok = (tok >= 0) & (tok < vocab_size)  # prompt ids beyond the model's vocabulary have no logit
            flat, counts = torch.unique(row[ok] * vocab_size + tok[ok], return_counts=True)
            return flat, flat // vocab_size, counts

        repeated = repetition = generated = subtract = None
        if rep_rows:
            repeated, row, _ = unique_flat(rep_rows, rep_lens, rep_tokens)
            repetition = torch.tensor(rep, device=device)[row]
        if fp_rows:
            generated, row, counts = unique_flat(fp_rows, fp_lens, fp_tokens)
            f, p = torch.tensor(freq, device=device)[row], torch.tensor(pres, device=device)[row]
            subtract = f * counts + p
        return cls(repeated, repetition, generated, subtract)

    def apply(self, logits: torch.Tensor) -> None:
        """Repetition (HF: prompt + output), then frequency and presence (OpenAI: output only)."""
        flat = logits.view(-1)
        if self.repeated is not None:
            x = flat[self.repeated]
            flat[self.repeated] = torch.where(x > 0, x / self.repetition, x * self.repetition)
        if self.generated is not None:
            flat[self.generated] -= self.subtract.to(flat.dtype)


@dataclass(frozen=True)
class Filters:
    """Top-k / top-p / min-p settings of the sampled rows that use any of them."""

    rows: torch.Tensor | None  # [F] indices into the sampled rows; None means all of them
    top_k: torch.Tensor  # [F, 1] long; vocab_size where disabled
    top_p: torch.Tensor  # [F, 1]; 1.0 where disabled
    min_p: torch.Tensor | None  # [F, 1]; None when no row uses it
    first_candidates: int  # 0 when no row uses top-k or top-p


@dataclass(frozen=True)
class SamplingMetadata:
    """Per-step sampling tensors, built once by the model runner with `build`."""

    num_rows: int
    argmax_only: bool  # every row greedy, nothing else to do: one argmax for the whole batch
    chunks: tuple[RowChunk, ...]  # consecutive row ranges, sampled one after the other

    @classmethod
    def build(
        cls, rows: list[SamplingRow], vocab_size: int, eos_token_ids: Sequence[int], device: torch.device
    ) -> SamplingMetadata:
        """Gather the per-row parameters into device tensors; rows[i] is row i of the logits.

        eos_token_ids (and each row's stop_token_ids) are suppressed while a row is below min_tokens.
        """
        # On a CPU, temporaries above glibc's mmap threshold (32 MiB at most) are fresh mappings
        # that page-fault on every step (4x slower at 256 x 49152); smaller chunks reuse memory.
        step = max(1, _CPU_CHUNK_ELEMENTS // vocab_size) if device.type == "cpu" else max(1, len(rows))
        chunks = tuple(
            RowChunk.build(start, rows[start : start + step], vocab_size, eos_token_ids, device)
            for start in range(0, len(rows), step)
        )
        return cls(len(rows), all(c.argmax_only for c in chunks), chunks)


@dataclass(frozen=True)
class RowChunk:
    """The sampling tensors of rows [start, start + num_rows) of a step."""

    start: int
    num_rows: int
    vocab_size: int
    argmax_only: bool
    greedy_rows: torch.Tensor | None
    sample_rows: torch.Tensor | None
    all_sampled: bool
    temperature: torch.Tensor | None  # [S, 1]; None when every sampled row has 1.0
    uniforms: torch.Tensor  # [S] float32
    filters: Filters | None
    penalties: Penalties | None
    suppressed: tuple[torch.Tensor, torch.Tensor] | None  # (row, token) pairs set to -inf
    logprob_rows: list[int]
    logprob_counts: list[int]

    @classmethod
    def build(
        cls,
        start: int,
        rows: list[SamplingRow],
        vocab_size: int,
        eos_token_ids: Sequence[int],
        device: torch.device,
    ) -> RowChunk:
        V = vocab_size
        greedy, sampled, temps, uniforms = [], [], [], []
        f_rows, f_k, f_p, f_min_p = [], [], [], []
        sup_r, sup_t = [], []
        lp_rows, lp_counts = [], []
        for i, row in enumerate(rows):
            sp = row.params
            pos = len(row.output_token_ids)
            if pos < sp.min_tokens:
                ids = {t for t in (*eos_token_ids, *sp.stop_token_ids) if 0 <= t < V}
                sup_r += [i] * len(ids)
                sup_t += ids
            if sp.logprobs is not None:
                lp_rows.append(i)
                lp_counts.append(sp.logprobs)
            if sp.is_greedy:
                greedy.append(i)
                continue
            k = sp.top_k if 0 < sp.top_k < V else V
            if k < V or sp.top_p < 1.0 or sp.min_p > 0.0:
                f_rows.append(len(sampled))
                f_k.append(k)
                f_p.append(sp.top_p)
                f_min_p.append(sp.min_p)
            sampled.append(i)
            temps.append(sp.temperature)
            uniforms.append(uniform_for(row.seed, pos))

        def tensor(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        def column(values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return tensor(values, dtype).unsqueeze(1)

        filters = None
        if f_rows:
            uses_k = [k for k in f_k if k < V]
            first = max(uses_k + [TOP_P_CANDIDATES[0]] * any(p < 1.0 for p in f_p), default=0)
            filters = Filters(
                rows=None if len(f_rows) == len(sampled) else tensor(f_rows, torch.long),
                top_k=column(f_k, torch.long),
                top_p=column(f_p),
                min_p=column(f_min_p) if any(m > 0.0 for m in f_min_p) else None,
                first_candidates=min(first, V),
            )
        penalties = Penalties.build(rows, V, device)
        return cls(
            start=start,
            num_rows=len(rows),
            vocab_size=V,
            argmax_only=not sampled and not sup_r and penalties is None and not lp_rows,
            greedy_rows=tensor(greedy, torch.long) if greedy else None,
            sample_rows=tensor(sampled, torch.long) if sampled else None,
            all_sampled=len(sampled) == len(rows),
            temperature=column(temps) if any(t != 1.0 for t in temps) else None,
            uniforms=tensor(uniforms),
            filters=filters,
            penalties=penalties,
            suppressed=(tensor(sup_r, torch.long), tensor(sup_t, torch.long)) if sup_r else None,
            logprob_rows=lp_rows,
            logprob_counts=lp_counts,
        )
