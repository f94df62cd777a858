"""Our model code and weight loading against HF transformers, on tiny random models and the bundled GGUF."""

from __future__ import annotations

import logging
import os
import socket
import types

import pytest
import torch
import torch.nn.functional as F

from tests.model_factories import (
    PagedRunner,
    random_hf_model,
    save_model_config,
    tiny_llama_config,
    tiny_qwen2_config,
    tp_worker,
)
from vllm_lite.config import ModelConfig, ModelSource, load_hf_config, resolve_model
from vllm_lite.models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPContext,
    VocabParallelEmbedding,
)
from vllm_lite.models.layers.rotary import compute_inv_freq, rope_parameters
from vllm_lite.models.llama import LlamaForCausalLM
from vllm_lite.models.loader import load_model
from vllm_lite.models.qwen2 import Qwen2ForCausalLM
from vllm_lite.models.registry import get_model_class, supported_architectures

os.environ.setdefault("HF_HUB_OFFLINE", "1")
CPU = torch.device("cpu")
ATOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
TINY_MODELS = {
    "llama-gqa-untied": lambda: tiny_llama_config(),
    "llama-tied-llama3rope-bias": lambda: tiny_llama_config(
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_scaling=LLAMA3_ROPE
    ),
    "qwen2-qkvbias-untied": lambda: tiny_qwen2_config(),
    "qwen2-tied-mqa": lambda: tiny_qwen2_config(tie_word_embeddings=True, num_key_value_heads=1),
}


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    """(HF model, our model loaded from its saved checkpoint, ModelConfig) for each tiny variant."""
    hf_model = random_hf_model(TINY_MODELS[request.param](), seed=len(request.param))
    model_config = save_model_config(hf_model, tmp_path_factory.mktemp(request.param))
    return hf_model, load_model(model_config, CPU, torch.float32), model_config


def prompts(vocab_size: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_logits(hf_model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([tokens])).logits[0]


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff < ATOL, f"max abs diff {diff} (logits up to {ref.abs().max().item():.2f})"


def test_prefill_matches_hf(tiny: tuple) -> None:
    hf_model, model, _ = tiny
    runner = PagedRunner(model)
    for request, tokens in enumerate(prompts(model.config.vocab_size, [1, 17, 40])):
        (logits,) = runner.step([(request, tokens)])
        assert_close(logits, hf_logits(hf_model, tokens))


def test_decode_matches_hf_with_past(tiny: tuple) -> None:
    hf_model, model, _ = tiny
    prompt, continuation = prompts(model.config.vocab_size, [9, 20])  # crosses a block boundary
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        ref = [out.logits[0, -1]]
        for token in continuation:
            out = hf_model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
            ref.append(out.logits[0, -1])
    runner = PagedRunner(model)
    ours = [runner.step([(0, prompt)])[0][-1]]
    for token in continuation:
        ours.append(runner.step([(0, [token])])[0][0])
    assert_close(torch.stack(ours), torch.stack(ref))


def test_batched_and_mixed_steps_match_hf(tiny: tuple) -> None:
    """Two prompts in one flat step, then decodes + a chunked prefill + a new prompt in one step."""
    hf_model, model, _ = tiny
    a, b, b_rest, c = prompts(model.config.vocab_size, [13, 21, 11, 7])
    runner = PagedRunner(model)
    logits_a, logits_b = runner.step([(0, a), (1, b)])
    assert_close(logits_a, hf_logits(hf_model, a))
    assert_close(logits_b, hf_logits(hf_model, b))
    # Work listed prefill-first: the runner puts the decode first in the flat layout.
    chunk, decode, fresh = runner.step([(1, b_rest), (0, [5]), (2, c)])
    assert_close(chunk, hf_logits(hf_model, b + b_rest)[len(b) :])
    assert_close(decode, hf_logits(hf_model, a + [5])[-1:])
    assert_close(fresh, hf_logits(hf_model, c))


@pytest.mark.parametrize(
    "rope",
    [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3_ROPE, {"rope_type": "dynamic", "factor": 2.0}],
    ids=["default", "linear", "llama3", "dynamic"],
)
def test_rope_frequencies_match_hf(rope: dict | None) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = tiny_llama_config(rope_theta=50000.0, rope_scaling=rope)
    params = rope_parameters(config)
    if rope is None:
        ref = LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    else:
        ref = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, torch.device("cpu"))[0]
    assert torch.equal(compute_inv_freq(params, 64), ref)
    # The same settings in an old-style (pre transformers 5) config object.
    scaling = (
        None
        if rope is None
        else {"type": rope["rope_type"], **{k: v for k, v in rope.items() if k != "rope_type"}}
    )
    old_style = types.SimpleNamespace(rope_theta=50000.0, rope_scaling=scaling)
    assert torch.equal(compute_inv_freq(rope_parameters(old_style), 64), ref)


def test_bfloat16_model_runs_close_to_float32(tiny: tuple) -> None:
    _, model, model_config = tiny
    model_bf16 = load_model(model_config, CPU, torch.bfloat16)
    assert next(model_bf16.parameters()).dtype == torch.bfloat16
    tokens = prompts(model.config.vocab_size, [20])[0]
    runner16, runner32 = PagedRunner(model_bf16), PagedRunner(model)
    for work in ([(0, tokens[:-1])], [(0, tokens[-1:])]):  # a prefill, then a decode (torch path)
        (low,), (full,) = runner16.step(work), runner32.step(work)
        assert low.dtype == torch.float32
        assert (low - full).abs().max().item() < 0.05 * full.abs().max().item()


def test_tied_embeddings_share_one_tensor(tiny: tuple) -> None:
    _, model, _ = tiny
    shared = model.lm_head.weight is model.model.embed_tokens.weight
    assert shared == bool(model.config.tie_word_embeddings)


def test_bin_and_sharded_safetensors_load_the_same(tmp_path: os.PathLike) -> None:
    hf_model = random_hf_model(tiny_qwen2_config(), seed=3)
    config = save_model_config(hf_model, tmp_path / "single")
    reference = load_model(config, CPU, torch.float32, process_weights=False)
    sharded_dir = tmp_path / "sharded"
    hf_model.save_pretrained(sharded_dir, max_shard_size="100KB")
    assert (sharded_dir / "model.safetensors.index.json").exists()
    bin_dir = tmp_path / "bin"
    hf_model.config.save_pretrained(bin_dir)
    torch.save(hf_model.state_dict(), bin_dir / "pytorch_model.bin")
    expected = reference.state_dict()
    for directory in (sharded_dir, bin_dir):
        source = ModelSource(str(directory))
        config = ModelConfig(str(directory), source, load_hf_config(source), "float32", 128)
        loaded = load_model(config, CPU, torch.float32, process_weights=False).state_dict()
        assert loaded.keys() == expected.keys()
        assert all(torch.equal(loaded[name], expected[name]) for name in expected)


def test_load_weights_rejects_missing_unexpected_and_misshapen() -> None:
    config = tiny_llama_config()
    hf_state = random_hf_model(config).state_dict()
    model = LlamaForCausalLM(config)
    model.load_weights(hf_state.items())  # the complete checkpoint loads
    missing = {k: v for k, v in hf_state.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match=r"missing model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"):
        model.load_weights(missing.items())
    with pytest.raises(ValueError, match=r"unexpected model\.layers\.0\.self_attn\.q_norm\.weight"):
        model.load_weights([*hf_state.items(), ("model.layers.0.self_attn.q_norm.weight", torch.ones(64))])
    misshapen = dict(hf_state, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: .*shape"):
        model.load_weights(misshapen.items())
    # rotary buffers of old checkpoints are ignored
    model.load_weights([*hf_state.items(), ("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(32))])


def test_registry() -> None:
    assert get_model_class("LlamaForCausalLM") is LlamaForCausalLM
    assert get_model_class("MistralForCausalLM") is LlamaForCausalLM
    assert get_model_class("Qwen2ForCausalLM") is Qwen2ForCausalLM
    assert supported_architectures() == ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"]
    with pytest.raises(
        ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"
    ):
        get_model_class("GPT2LMHeadModel")


def test_sliding_window(caplog: pytest.LogCaptureFixture) -> None:
    from transformers import MistralConfig

    from tests.model_factories import TINY_DIMS

    with pytest.raises(NotImplementedError, match="sliding-window"):
        LlamaForCausalLM(MistralConfig(**TINY_DIMS, sliding_window=64), max_model_len=128)
    with caplog.at_level(logging.WARNING):
        LlamaForCausalLM(MistralConfig(**TINY_DIMS, sliding_window=128), max_model_len=128)
    assert "ignoring sliding_window=128" in caplog.text


def test_tp_layers_shard_like_the_full_layer() -> None:
    """Each rank's shard, recombined, reproduces the unsharded layer (the collectives' job)."""
    torch.manual_seed(0)
    x = torch.randn(5, 32)
    w_q, w_k, w_v = torch.randn(64, 32), torch.randn(16, 32), torch.randn(16, 32)  # 4 heads, 1 kv head
    ranks = [TPContext(rank, 2) for rank in range(2)]

    column = [ColumnParallelLinear(32, 64, bias=True, tp=tp) for tp in ranks]
    merged = [MergedColumnParallelLinear(32, [64, 16], tp=tp) for tp in ranks]
    qkv = [QKVParallelLinear(32, 16, 4, 1, tp=tp) for tp in ranks]  # the kv head is replicated
    bias = torch.randn(64)
    for c, m, q in zip(column, merged, qkv, strict=True):
        c.weight.weight_loader(c.weight, w_q)
        c.bias.weight_loader(c.bias, bias)
        m.weight.weight_loader(m.weight, w_q, 0)
        m.weight.weight_loader(m.weight, w_k, 1)
        for shard_id, w in zip("qkv", (w_q, w_k, w_v), strict=True):
            q.weight.weight_loader(q.weight, w, shard_id)
    assert torch.allclose(torch.cat([c(x) for c in column], -1), F.linear(x, w_q, bias), atol=1e-5)
    gate = torch.cat([m(x)[:, :32] for m in merged], -1)
    up = torch.cat([m(x)[:, 32:] for m in merged], -1)
    assert torch.allclose(gate, x @ w_q.T, atol=1e-5) and torch.allclose(up, x @ w_k.T, atol=1e-5)
    for q in qkv:
        assert (q.num_heads, q.num_kv_heads, q.kv_replicas) == (2, 1, 2)
        assert torch.equal(q.weight[32:48], w_k) and torch.equal(q.weight[48:], w_v)
    assert torch.equal(torch.cat([q.weight[:32] for q in qkv]), w_q)

    w_o, b_o = torch.randn(32, 64), torch.randn(32)
    rows = [RowParallelLinear(64, 32, bias=True, tp=tp) for tp in ranks]
    for r in rows:
        r.weight.weight_loader(r.weight, w_o)
        r.bias.weight_loader(r.bias, b_o)
    h = torch.randn(5, 64)
    partial = sum(
        F.linear(h.chunk(2, -1)[i], r.weight, r.bias if i == 0 else None) for i, r in enumerate(rows)
    )
    assert torch.allclose(partial, F.linear(h, w_o, b_o), atol=1e-4)

    table = torch.randn(7, 8)  # 7 rows over 2 ranks: 4 + 3 and one zero padding row
    embeds = [VocabParallelEmbedding(7, 8, tp=tp) for tp in ranks]
    for e in embeds:
        e.weight.weight_loader(e.weight, table)
    assert torch.equal(torch.cat([e.weight for e in embeds])[:7], table)
    assert not embeds[1].weight[3:].any()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("tiny", ["llama-tied-llama3rope-bias"], indirect=True)
def test_tensor_parallel_two_ranks_match_one(tiny: tuple, tmp_path: os.PathLike) -> None:
    """A real 2-rank gloo group: all-reduces, vocab-parallel embedding and tied head, KV heads split."""
    _, model, model_config = tiny
    prompt = prompts(model.config.vocab_size, [12])[0]
    runner = PagedRunner(model)
    prefill, decode = runner.step([(0, prompt[:-1])])[0], runner.step([(0, prompt[-1:])])[0]
    out_path = str(tmp_path / "rank0.pt")
    ctx = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    # A plain-dict config keeps transformers out of the workers (and exercises non-HF config objects).
    args = (2, port, model_config.source.directory, model_config.hf_config.to_dict(), prompt, out_path)
    procs = [ctx.Process(target=tp_worker, args=(rank, *args)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    result = torch.load(out_path)
    assert_close(result["prefill"], prefill)
    assert_close(result["decode"], decode)


def _hf_reference_from_gguf(source: ModelSource, hf_config: object) -> torch.nn.Module:
    """HF transformers' own model holding HF's own GGUF conversion of the file.

    This is what `from_pretrained(directory, gguf_file=...)` does (config, `load_gguf_checkpoint`
    with the HF model as `model_to_load`, then the state dict; checked tensor for tensor against it),
    minus a second metadata parse and the `accelerate` dependency from_pretrained needs for GGUF.
    """
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hf_model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(source.weights_path, return_tensors=True, model_to_load=hf_model)[
        "tensors"
    ]
    missing, unexpected = hf_model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf_model


def test_bundled_gguf_matches_hf() -> None:
    source = resolve_model("smollm2-135m")
    hf_config = load_hf_config(source)
    model_config = ModelConfig("smollm2-135m", source, hf_config, "float32", max_model_len=256)
    model = load_model(model_config, CPU, torch.float32)
    hf_model = _hf_reference_from_gguf(source, hf_config)
    prompt = [1, 504, 3458, 282, 4649, 314, 216, 30, 28, 15, 451, 198]  # "<s>The capital of France is..."
    ours = PagedRunner(model).step([(0, prompt)])[0]
    ref = hf_logits(hf_model, prompt)
    assert (ours[-1] - ref[-1]).abs().max().item() < 1e-3
    assert ours[-1].argmax() == ref[-1].argmax()
    assert (ours - ref).abs().max().item() < 1e-3


def test_packed_weights_replace_the_originals(tmp_path: os.PathLike) -> None:
    """On CPU fp32 only the packed GEMM copy stays in memory; parameter counts and outputs don't change."""
    from vllm_lite.models.layers import gemm

    hf_model = random_hf_model(tiny_llama_config(tie_word_embeddings=False), seed=5)
    config = save_model_config(hf_model, tmp_path / "m")
    plain = load_model(config, CPU, torch.float32, process_weights=False)
    packed = load_model(config, CPU, torch.float32)
    if gemm.prepack(torch.zeros(2, 2)) is None:
        pytest.skip("no oneDNN packed GEMM in this torch build")
    qkv = packed.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.device.type == "meta" and qkv.packed_weight is not None
    assert packed.lm_head.weight.device.type == "meta"
    assert packed.model.embed_tokens.weight.device.type == "cpu"
    assert sum(p.numel() for p in packed.parameters()) == sum(p.numel() for p in plain.parameters())
    x = torch.randn(5, qkv.packed_weight.shape[1])
    assert_close(qkv(x), plain.model.layers[0].self_attn.qkv_proj(x))
