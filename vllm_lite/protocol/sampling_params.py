"""Per-request sampling parameters: vLLM's names and defaults, validated wherever they are built.

`SamplingParams` travels on ZMQ sockets (msgspec), so validation lives in `__post_init__`, which
msgspec runs both on construction and on decode: a bad value can never reach an engine, whichever
way it came. Every error is a `ValueError` (msgspec wraps it in `msgspec.ValidationError`, itself a
`ValueError`, on decode) whose message names the parameter and the allowed range.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable

import msgspec

# vLLM's rule: temperatures this small are treated as greedy (dividing by them would overflow).
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MASK64 = 2**64 - 1
# Salt so that child seeds of an n>1 fan-out come from another stream than the sampler's draws.
_CLONE_SALT = 0x5EED_C10E_5A17_0001


class RequestOutputKind(enum.StrEnum):
    """What each output of a streaming request carries (the frontend's concern, not the engine's)."""

    CUMULATIVE = "cumulative"  # everything generated so far
    DELTA = "delta"  # only what is new since the previous output
    FINAL_ONLY = "final_only"  # one output, when the request has finished


def _in_2(v: float) -> bool:
    return -2 <= v <= 2


def splitmix64(x: int) -> int:
    """One round of splitmix64: a cheap, well-mixed bijection on 64-bit integers."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def _int(name: str, value: object, lo: int, hi: int | None, allowed: str) -> None:
    # bool is an int subclass; True as a count or a seed is a client bug, not a value.
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be an integer {allowed}; got {value!r}")


def _float(name: str, value: object, ok: Callable[[float], bool], allowed: str) -> float:
    """Return `value` as a float, or raise if it is not a finite number for which `ok` holds."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not ok(float(value))
    ):
        raise ValueError(f"{name} must be {allowed} and finite; got {value!r}")
    return float(value)


class SamplingParams(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """How to pick the tokens of one request (the OpenAI/vLLM sampling knobs).

    - temperature: 0 (or below 1e-5) means greedy; top_k 0 or -1 disables it (-1 is stored as 0).
    - repetition_penalty follows HF: it applies to prompt and output tokens (logit > 0: divided by
      it, else multiplied). presence/frequency_penalty follow OpenAI: output tokens only, in [-2, 2].
    - seed: any signed 64-bit integer (negatives accepted, as OpenAI clients may send them); the
      sampler mixes it as 64 bits. None means the engine draws one.
    - max_tokens None means "until max_model_len"; min_tokens suppresses EOS and stop_token_ids.
    - stop strings are applied by the frontend; stop_token_ids by the engine.
    - logprobs: number of top alternatives to report (0 = only the sampled token), at most 20.
    - output_kind: what `AsyncEngineClient.generate` yields (cumulative, delta or final only).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = []
    stop_token_ids: list[int] = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        set_ = msgspec.structs.force_setattr
        _int("n", self.n, 1, None, ">= 1")
        floats = {
            "temperature": _float("temperature", self.temperature, lambda v: v >= 0, ">= 0"),
            "top_p": _float("top_p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
            "min_p": _float("min_p", self.min_p, lambda v: 0 <= v <= 1, "in [0, 1]"),
            "repetition_penalty": _float(
                "repetition_penalty", self.repetition_penalty, lambda v: v > 0, "> 0"
            ),
            "presence_penalty": _float("presence_penalty", self.presence_penalty, _in_2, "in [-2, 2]"),
            "frequency_penalty": _float("frequency_penalty", self.frequency_penalty, _in_2, "in [-2, 2]"),
        }
        _int("top_k", self.top_k, -1, None, ">= 1, or 0 or -1 to disable")
        if self.seed is not None:
            _int("seed", self.seed, _INT64_MIN, _INT64_MAX, "in [-2**63, 2**63 - 1] or None")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, 1, None, ">= 1 or None")
        upper = "" if self.max_tokens is None else f", max_tokens={self.max_tokens}"
        _int("min_tokens", self.min_tokens, 0, self.max_tokens, f"in [0{upper}]")
        if isinstance(self.stop, str):  # a lone string is a common client shorthand for [string]
            set_(self, "stop", [self.stop])
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings; got {self.stop!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0; got {ids!r}")
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            if type(getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be a bool; got {getattr(self, name)!r}")
        try:
            set_(self, "output_kind", RequestOutputKind(self.output_kind))
        except ValueError:
            kinds = ", ".join(k.value for k in RequestOutputKind)
            raise ValueError(f"output_kind must be one of {kinds}; got {self.output_kind!r}") from None
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, 0, MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}] or None")
        # Normalize once so every consumer sees one spelling: floats as float, "disabled" as 0.
        for name, v in floats.items():
            set_(self, name, v)
        if self.top_k == -1:
            set_(self, "top_k", 0)

    @property
    def is_greedy(self) -> bool:
        """True when the sampler takes the argmax (temperature below 1e-5, as in vLLM)."""
        return self.temperature < GREEDY_TEMPERATURE

    def clone_for_sample(self, index: int) -> SamplingParams:
        """Params of the index-th of the n samples of a fan-out: n=1 and a per-sample seed.

        Sample 0 keeps the seed as is (so n=1 and the first of n agree); the others get a
        deterministic mix of (seed, index) in [0, 2**63). An unseeded request stays unseeded.
        """
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < self.n:
            raise ValueError(f"index must be an integer in [0, n={self.n}); got {index!r}")
        seed = self.seed
        if seed is not None and index > 0:
            seed = splitmix64(splitmix64((seed & MASK64) ^ _CLONE_SALT) ^ index) >> 1
        return msgspec.structs.replace(self, n=1, seed=seed)
