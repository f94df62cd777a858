"""Build a model from its config and stream its weights in from safetensors, .bin or GGUF files."""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from vllm_lite.config import ModelConfig, ModelSource
from vllm_lite.models.layers import SINGLE_RANK, TPContext
from vllm_lite.models.registry import get_model_class

logger = logging.getLogger(__name__)

Weights = Iterator[tuple[str, torch.Tensor]]


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    tp: TPContext = SINGLE_RANK,
    process_weights: bool = True,
) -> nn.Module:
    """The model named by `model_config`, on `device` in `dtype`, holding this TP rank's weights.

    With `process_weights` (the default) layers then derive their run-time form (packed GEMM
    weights on CPU, dropping the originals); without it the checkpoint weights stay as loaded.
    """
    model_class = get_model_class(model_config.architecture)
    model = model_class(
        model_config.hf_config, tp=tp, dtype=dtype, device=device, max_model_len=model_config.max_model_len
    )
    model.load_weights(iter_weights(model_config.source, model, dtype))
    if process_weights:
        process_weights_after_loading(model)
    return model.eval()


def process_weights_after_loading(model: nn.Module) -> None:
    """Let each layer derive its run-time form of the loaded weights (e.g. packed GEMM weights)."""
    with torch.no_grad():
        for module in model.modules():
            hook = getattr(module, "process_weights_after_loading", None)
            if callable(hook):
                hook()


def iter_weights(source: ModelSource, model: nn.Module, dtype: torch.dtype) -> Weights:
    """(HF tensor name, tensor) pairs from a GGUF file or a HF directory, one tensor at a time."""
    if source.gguf_file is not None:
        return gguf_weights(source.weights_path, model, dtype)
    return hf_directory_weights(source.directory)


def hf_directory_weights(directory: str) -> Weights:
    """Tensors of a HF checkpoint directory: *.safetensors shards, else pytorch_model*.bin files."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        # Only the shards the index names: some repos also ship a consolidated copy of the weights.
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(directory, shard) for shard in shards]
    else:
        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if files:
        return _safetensors_weights(files)
    bins = sorted(glob.glob(os.path.join(directory, "pytorch_model*.bin")))
    if bins:
        return _torch_bin_weights(bins)
    raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {directory}")


def _safetensors_weights(files: list[str]) -> Weights:
    from safetensors import safe_open

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _torch_bin_weights(files: list[str]) -> Weights:
    for path in files:
        state = torch.load(path, map_location="cpu", weights_only=True)
        yield from state.items()
        del state


class _CheckpointNames:
    """Stands in for the HF model whose parameter names transformers maps GGUF tensor names onto.

    The mapping only asks for the config and the state-dict names; giving it the names our model
    loads keeps HF modeling code out of the load path.
    """

    def __init__(self, config: Any, names: list[str]) -> None:
        self.config = config
        self._names = names

    def state_dict(self) -> dict[str, None]:
        return dict.fromkeys(self._names)

    def named_children(self) -> list[tuple[str, Any]]:
        return []


def gguf_weights(path: str, model: nn.Module, dtype: torch.dtype) -> Weights:
    """Dequantized, HF-named tensors of a GGUF file, one at a time.

    This is the tensor half of transformers' `load_gguf_checkpoint`, built from its own pieces
    (the GGUF reader and dequantizer, the per-architecture tensor processor that undoes llama.cpp's
    q/k permutation, the GGUF -> HF name map), so the tensors are the ones HF transformers loads.
    Calling `load_gguf_checkpoint` itself would parse all metadata again (the tokenizer's vocabulary
    included; seconds, already done for the config) and hold every dequantized tensor at once.
    """
    import numpy as np
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        read_field,
    )

    reader = GGUFReader(path)
    architecture = read_field(reader, "general.architecture")[0]
    config = model.config.to_dict()
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config)
    name_map = get_gguf_hf_weights_map(
        _CheckpointNames(model.config, model.checkpoint_weight_names()), processor
    )
    parsed: dict[str, Any] = {"config": config, "tensors": {}}
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=weights, name=tensor.name, tensor_key_mapping=name_map, parsed_parameters=parsed
        )
        if result.name not in name_map:
            # transformers drops these too (e.g. llama.cpp's precomputed rope_freqs).
            logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        yield name_map[result.name], torch.from_numpy(np.copy(result.weights)).to(dtype)
