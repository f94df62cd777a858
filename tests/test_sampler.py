"""Sampler: greedy, seeded reproducibility, filters and penalties against float64 references, logprobs."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from vllm_lite.protocol.sampling_params import SamplingParams
from vllm_lite.worker.sampler import (
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    SamplingRow,
    _argmax,
    _inverse_cdf,
    _topk,
    uniform_for,
)

CPU = torch.device("cpu")
EOS = 3


def row(
    params: SamplingParams | None = None,
    seed: int = 0,
    prompt: Sequence[int] = (1, 2),
    output: Sequence[int] = (),
) -> SamplingRow:
    return SamplingRow(params or SamplingParams(), seed, list(prompt), list(output))


def sample(logits: torch.Tensor, rows: list[SamplingRow], eos: Sequence[int] = (EOS,)) -> SamplerOutput:
    meta = SamplingMetadata.build(rows, logits.shape[1], eos, CPU)
    return Sampler()(logits, meta)


def at_position(r: SamplingRow, pos: int) -> SamplingRow:
    """The same request with `pos` tokens already generated."""
    return SamplingRow(r.params, r.seed, r.prompt_token_ids, [5] * pos)


def reference_token(logits: torch.Tensor, sp: SamplingParams, seed: int, pos: int) -> int:
    """Straightforward float64 version of the documented semantics (no penalties)."""
    x = logits.double()
    if sp.is_greedy:
        return int(x.argmax())
    p = torch.softmax(x / sp.temperature, dim=-1)
    if 0 < sp.top_k < p.numel():
        p[p < p.sort(descending=True).values[sp.top_k - 1]] = 0.0
    if sp.top_p < 1.0:
        s = p.sort(descending=True).values / p.sum()
        n_keep = int(((s.cumsum(0) - s) < sp.top_p).sum())
        p[p / p.sum() < s[n_keep - 1]] = 0.0
    if sp.min_p > 0.0:
        p[p < sp.min_p * p.max()] = 0.0
    c = p.cumsum(0)
    return int(torch.searchsorted(c, uniform_for(seed, pos) * c[-1], right=True))


def reference_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = logits.clone()
    for i, r in enumerate(rows):
        sp = r.params
        for tok in set(r.prompt_token_ids) | set(r.output_token_ids):
            v = out[i, tok]
            out[i, tok] = v / sp.repetition_penalty if v > 0 else v * sp.repetition_penalty
        for tok, count in Counter(r.output_token_ids).items():
            out[i, tok] -= sp.frequency_penalty * count + sp.presence_penalty
    return out


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 300)
    greedy = SamplingParams(temperature=0.0)
    assert sample(logits, [row(greedy, seed=i) for i in range(8)]).token_ids == logits.argmax(-1).tolist()
    # Greedy rows mixed with sampled ones still take the argmax.
    rows = [row(greedy if i % 2 else SamplingParams(temperature=1.5), seed=i) for i in range(8)]
    tokens = sample(logits, rows).token_ids
    assert tokens[1::2] == logits[1::2].argmax(-1).tolist()
    out = sample(logits, [row(greedy)] * 8)
    assert out.logprobs == [None] * 8


# 1000 is not a multiple of any block size (tail paths); 4096 takes the blocked argmax and top-k.
@pytest.mark.parametrize("V", [1000, 4096])
def test_matches_float64_reference_with_mixed_params(V: int) -> None:
    torch.manual_seed(1)
    choices = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, top_k=300, top_p=0.95),
        SamplingParams(temperature=1.1, min_p=0.05),
        SamplingParams(temperature=2.0, top_k=50, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=1.5, min_p=0.001),  # min-p alone must not inherit others' top-k
    ]
    rows = [row(choices[i % len(choices)], seed=1000 + i, output=[7] * (i % 5)) for i in range(32)]
    checked = 0
    for trial in range(5):
        logits = torch.randn(len(rows), V) * (1 + trial)
        tokens = sample(logits, rows).token_ids
        for i, r in enumerate(rows):
            assert tokens[i] == reference_token(logits[i], r.params, r.seed, len(r.output_token_ids)), (
                trial,
                i,
            )
            checked += 1
    assert checked == 160


@pytest.mark.parametrize("spread", [1.0, 0.01])
def test_large_nucleus_matches_reference(spread: float) -> None:
    # Nearly flat logits over 5000 tokens: the nucleus outgrows the first candidate sets, so the
    # larger candidate count and the full sort are used; results must not change.
    torch.manual_seed(2)
    logits = torch.randn(4, 5000) * spread
    rows = [row(SamplingParams(top_p=0.95), seed=s, output=[1] * s) for s in range(4)]
    tokens = sample(logits, rows).token_ids
    assert tokens == [reference_token(logits[i], r.params, r.seed, i) for i, r in enumerate(rows)]


def test_seeded_row_is_independent_of_batch_and_position_matters() -> None:
    torch.manual_seed(3)
    V = 700
    target = row(SamplingParams(temperature=0.9, top_p=0.9, top_k=100), seed=42)
    others = [
        row(SamplingParams(temperature=0.0), seed=1, output=[4] * 9),
        row(SamplingParams(temperature=1.5, top_k=600, min_p=0.01), seed=2, output=[4] * 3),
        row(SamplingParams(temperature=0.5, repetition_penalty=1.3, logprobs=3), seed=3, output=[9, 9]),
        row(SamplingParams(top_p=0.2, min_tokens=5), seed=4),
    ]
    alone, batched = [], []
    for pos in range(40):
        logits_row = torch.randn(V) * 2
        t = at_position(target, pos)
        alone += sample(logits_row[None], [t]).token_ids
        batch = torch.randn(5, V) * 3
        batch[2] = logits_row
        batched.append(sample(batch, others[:2] + [t] + others[2:]).token_ids[2])
    assert alone == batched
    # The same logits at different positions give different draws (one uniform per position).
    flat = torch.zeros(1, V)
    draws = [sample(flat, [at_position(row(seed=7), pos)]).token_ids[0] for pos in range(50)]
    assert len(set(draws)) > 40
    # And the same position with the same seed gives the same draw (recomputation is exact).
    assert draws[:5] == [sample(flat, [at_position(row(seed=7), pos)]).token_ids[0] for pos in range(5)]
    assert draws != [sample(flat, [at_position(row(seed=8), pos)]).token_ids[0] for pos in range(50)]


def test_batch_split_into_chunks_equals_rows_alone() -> None:
    # 65536 logits per row: the CPU sampler works in chunks of 32 rows; 70 rows make three chunks.
    torch.manual_seed(9)
    V = 65536
    choices = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, top_k=40, logprobs=1),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=1.0, presence_penalty=1.0, min_tokens=2),
    ]
    rows = [row(choices[i % 4], seed=i, output=[i % 7] * (i % 3)) for i in range(70)]
    logits = torch.randn(70, V) * 2
    meta = SamplingMetadata.build(rows, V, [EOS], CPU)
    assert len(meta.chunks) == 3
    out = Sampler()(logits, meta)
    assert len(out.token_ids) == len(out.logprobs) == 70
    for i, r in enumerate(rows):
        alone = sample(logits[i : i + 1], [r])
        assert (out.token_ids[i], out.logprobs[i]) == (alone.token_ids[0], alone.logprobs[0]), i


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    torch.manual_seed(4)
    logits = torch.randn(16, 500) * 2
    argmax = logits.argmax(-1).tolist()
    for params in (SamplingParams(top_k=1, temperature=2.0), SamplingParams(top_p=1e-6, temperature=2.0)):
        for pos in range(5):
            rows = [row(params, seed=i, output=[1] * pos) for i in range(16)]
            assert sample(logits, rows).token_ids == argmax


def draws(probs: list[float], params: SamplingParams, n: int = 2000, seed: int = 11) -> Counter:
    logits = torch.tensor(probs).log()[None]
    return Counter(
        sample(logits, [at_position(row(params, seed=seed), pos)]).token_ids[0] for pos in range(n)
    )


def test_distribution_matches_probabilities() -> None:
    counts = draws([0.2, 0.5, 0.3], SamplingParams())
    assert set(counts) == {0, 1, 2}
    for tok, p in enumerate([0.2, 0.5, 0.3]):
        assert abs(counts[tok] / 2000 - p) < 0.04, counts
    # Temperature 2 flattens: p ~ sqrt(p) renormalized.
    counts = draws([0.1, 0.9], SamplingParams(temperature=2.0))
    expected = math.sqrt(0.1) / (math.sqrt(0.1) + math.sqrt(0.9))
    assert abs(counts[0] / 2000 - expected) < 0.04, counts


def test_distribution_across_cdf_blocks() -> None:
    probs = [0.0] * 1000
    probs[10], probs[300], probs[999] = 0.25, 0.25, 0.5  # first block, a middle one, the tail
    counts = draws(probs, SamplingParams(), n=1200)
    assert set(counts) == {10, 300, 999}
    assert abs(counts[999] / 1200 - 0.5) < 0.05 and abs(counts[10] / 1200 - 0.25) < 0.05


def test_top_k_top_p_min_p_keep_the_right_tokens() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]
    assert set(draws(probs, SamplingParams(top_k=2), n=400)) == {1, 3}
    counts = draws(probs, SamplingParams(top_p=0.7), n=1000)  # mass before token 2 is 0.8 >= 0.7
    assert set(counts) == {1, 3}
    assert abs(counts[1] / 1000 - 0.5 / 0.8) < 0.05
    # min_p 0.2 keeps tokens with p >= 0.1: the three largest.
    assert set(draws(probs, SamplingParams(min_p=0.2), n=600)) == {1, 2, 3}
    # top_p applies to the top-k renormalized distribution: within {1, 3}, token 1 has 0.625.
    assert set(draws(probs, SamplingParams(top_k=2, top_p=0.6), n=200)) == {1}


def test_penalties_match_reference_loop() -> None:
    torch.manual_seed(5)
    V = 50
    logits = torch.randn(4, V) * 3
    rows = [
        row(SamplingParams(repetition_penalty=1.5), prompt=[1, 2, 2, 8], output=[8, 9, 9]),
        row(SamplingParams(frequency_penalty=0.7, presence_penalty=0.3), prompt=[1, 4], output=[4, 4, 4, 6]),
        row(SamplingParams(), prompt=[1, 2], output=[2, 2]),  # no penalty: untouched
        row(
            SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=1.2),
            prompt=[0, 49, 77],  # 77 is outside the vocabulary: ignored
            output=[10, 10, 49],
        ),
    ]
    meta = SamplingMetadata.build(rows, V, [EOS], CPU)
    penalized = logits.clone()
    meta.chunks[0].penalties.apply(penalized)
    rows[3] = SamplingRow(rows[3].params, 0, [0, 49], rows[3].output_token_ids)
    expected = reference_penalties(logits, rows)
    torch.testing.assert_close(penalized, expected)
    assert not torch.equal(penalized, logits)
    # Through the sampler: a repeated token loses the argmax it had.
    x = torch.tensor([[0.0, 2.0, 1.9, 0.0]])
    greedy = SamplingParams(temperature=0.0)
    assert sample(x, [row(greedy, output=[1])]).token_ids == [1]
    for params in (
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, presence_penalty=0.5),
    ):
        assert sample(x, [row(params, prompt=[0], output=[1])]).token_ids == [2]


def test_min_tokens_suppresses_eos_and_stop_ids() -> None:
    logits = torch.zeros(2, 20)
    logits[:, EOS], logits[:, 11], logits[:, 7] = 10.0, 9.0, 5.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[11]),
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[11]),
    ]
    for pos in range(3):
        for seed in range(20):
            out = sample(logits, [row(p, seed=seed, output=[1] * pos) for p in params]).token_ids
            assert out[0] == 7 and EOS not in out and 11 not in out
    assert sample(logits[:1], [row(params[0], output=[1] * 3)]).token_ids == [EOS]


@pytest.mark.parametrize("V", [200, 16384])
def test_logprobs_are_raw_and_ordered(V: int) -> None:
    torch.manual_seed(6)
    logits = torch.randn(4, V) * 2
    rows = [
        row(SamplingParams(temperature=0.5, top_k=5, repetition_penalty=1.3, logprobs=5), output=[0, 1]),
        row(SamplingParams(temperature=0.0)),
        row(SamplingParams(temperature=0.0, logprobs=0)),
        row(SamplingParams(temperature=1.2, logprobs=20), seed=9),
    ]
    before = logits.clone()
    out = sample(logits, rows)
    assert torch.equal(logits, before)  # the sampler never edits its input
    expected = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[1] is None
    for i, n in ((0, 5), (2, 0), (3, 20)):
        lp = out.logprobs[i]
        tok = out.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(expected[i, tok].item(), abs=1e-5)
        assert lp.rank == 1 + int((expected[i] > expected[i, tok]).sum())
        top = expected[i].topk(n) if n else None
        assert len(lp.top_token_ids) == len(lp.top_logprobs) == n
        if n:
            assert lp.top_token_ids == top.indices.tolist()
            assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
            assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert out.logprobs[2].rank == 1  # greedy picks the most likely raw token


def test_inverse_cdf_never_picks_a_token_without_mass() -> None:
    # The largest uniform, rows whose tail (and parts of every block) have no mass: rounding in the
    # block sums must never push the draw onto a zero-probability token.
    torch.manual_seed(7)
    probs = torch.rand(256, 1000) ** 8
    probs[:, 900:] = 0.0
    probs[:, 200:256] = 0.0
    for u in (1.0 - 2.0**-24, 0.999999, 0.5, 0.0):
        tokens = _inverse_cdf(probs, torch.full((256,), u))
        assert bool((probs.gather(1, tokens[:, None]) > 0).all()), u


@pytest.mark.parametrize("V", [1000, 4096, 65536])
def test_blocked_argmax_and_topk_match_torch(V: int) -> None:
    torch.manual_seed(8)
    x = torch.randint(-50, 50, (8, V)).float()  # many ties
    x[3] = 0.0
    x[4, V - 1] = 100.0  # the maximum in the very last block
    assert torch.equal(_argmax(x), x.argmax(-1))  # first index of the maximum, like torch
    for k in (1, 5, 20, 64):
        values, indices = _topk(x, k)
        assert torch.equal(values, x.topk(k).values)
        assert torch.equal(x.gather(1, indices), values)
        assert all(len(set(r)) == k for r in indices.tolist())


def test_uniform_for() -> None:
    us = [uniform_for(123, pos) for pos in range(1000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert abs(sum(us) / len(us) - 0.5) < 0.03
    assert len(set(us)) > 990
    assert uniform_for(123, 5) == us[5] and uniform_for(124, 5) != us[5]
    assert 0.0 <= uniform_for(-1, 0) < 1.0  # negative seeds are accepted
