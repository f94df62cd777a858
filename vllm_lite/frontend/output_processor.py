"""Output processing on the client loop: engine tokens -> text, stop strings, RequestOutputs.

One `RequestState` per user request; an `n > 1` request has n samples, each its own engine
request. Each engine step arrives as one batch (`EngineCoreOutputs`), is applied to every
affected request, and at most one `RequestOutput` per request is handed to its collector, which
merges outputs a slow consumer has not taken yet (so memory does not grow with its lag).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from vllm_lite.errors import RequestError
from vllm_lite.frontend.detokenizer import IncrementalDetokenizer
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.protocol.messages import EngineCoreOutput, FinishReason
from vllm_lite.protocol.sampling_params import RequestOutputKind, SamplingParams
from vllm_lite.protocol.step import SampleLogprobs

if TYPE_CHECKING:
    from vllm_lite.frontend.metrics import Metrics


class RequestOutputCollector:
    """Hands a request's outputs from the output processor to its `generate()` consumer."""

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput | BaseException) -> None:
        pending = self._pending
        if isinstance(pending, RequestOutput) and isinstance(output, RequestOutput):
            if self.kind == RequestOutputKind.DELTA:
                _merge_delta(pending, output)
            else:
                self._pending = output
        elif not isinstance(pending, BaseException):
            # An error replaces anything pending; nothing replaces an error.
            self._pending = output
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output; raises the error the request ended with."""
        await self._ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | None:
        return self._take() if self._ready.is_set() else None

    def _take(self) -> RequestOutput:
        output, self._pending = self._pending, None
        self._ready.clear()
        if isinstance(output, BaseException):
            raise output
        assert output is not None
        return output


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Append a later delta to one the consumer has not taken yet."""
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            continue
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens


class SampleState:
    """One of a request's n sequences: its tokens, text and how much of them was already sent."""

    def __init__(
        self, index: int, params: SamplingParams, detokenizer: IncrementalDetokenizer | None
    ) -> None:
        self.index = index
        self.params = params
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.logprobs: list[SampleLogprobs] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # Delta bookkeeping: what the consumer has not been given yet.
        self.new_text = ""
        self.num_sent_tokens = 0
        self.changed = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out: EngineCoreOutput) -> str | None:
        """Apply one engine output; returns 'abort' when the engine must drop the request (a stop
        string ended it here, in the frontend)."""
        self.changed = True
        self.token_ids.extend(out.new_token_ids)
        if out.new_logprobs:
            self.logprobs.extend(out.new_logprobs)
        stop_hit = None
        if self.detokenizer is not None:
            stop_hit = self.detokenizer.update(out.new_token_ids)
        if stop_hit is not None:
            # Tokens after the one that completed the stop string are not part of the output.
            del self.token_ids[self.detokenizer.num_tokens :]
            del self.logprobs[self.detokenizer.num_tokens :]
            self.finish_reason, self.stop_reason = FinishReason.STOP.value, stop_hit
        elif out.finish_reason is not None:
            self.finish_reason, self.stop_reason = out.finish_reason.value, out.stop_reason
        if self.detokenizer is not None:
            delta = self.detokenizer.get_delta(finished=self.finished)
            self.text += delta
            self.new_text += delta
        return "abort" if stop_hit is not None and out.finish_reason is None else None

    def completion(self, kind: RequestOutputKind) -> CompletionOutput:
        """This sample's output in the request's kind; resets the delta bookkeeping."""
        want_logprobs = self.params.logprobs is not None
        if kind == RequestOutputKind.DELTA:
            tokens = self.token_ids[self.num_sent_tokens :]
            logprobs = self.logprobs[self.num_sent_tokens :] if want_logprobs else None
            text = self.new_text
        else:
            tokens, text = list(self.token_ids), self.text
            logprobs = list(self.logprobs) if want_logprobs else None
        self.num_sent_tokens = len(self.token_ids)
        self.new_text = ""
        self.changed = False
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=tokens,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=logprobs,
        )


class RequestState:
    """A user request in flight: its samples, the engine it runs on and its collector."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        engine_req_ids: list[str],
        engine_index: int,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.kind = params.output_kind
        self.engine_index = engine_index
        self.num_cached_tokens = 0
        self.arrival_time = time.monotonic()
        self.last_token_time: float | None = None
        self.queue_time_s: float | None = None
        self.collector = RequestOutputCollector(self.kind)
        self.samples: dict[str, SampleState] = {}
        for i, req_id in enumerate(engine_req_ids):
            child = params.clone_for_sample(i)
            detok = None
            if tokenizer is not None:
                detok = IncrementalDetokenizer(
                    tokenizer,
                    prompt_token_ids,
                    skip_special_tokens=child.skip_special_tokens,
                    stop=child.stop,
                    include_stop_str_in_output=child.include_stop_str_in_output,
                )
            self.samples[req_id] = SampleState(i, child, detok)

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples.values())

    def unfinished_engine_req_ids(self) -> list[str]:
        return [req_id for req_id, s in self.samples.items() if not s.finished]

    def make_output(self) -> RequestOutput | None:
        """The output to hand to the consumer now, or None (FINAL_ONLY before the end)."""
        finished = self.finished
        if self.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        samples = self.samples.values()
        if self.kind == RequestOutputKind.DELTA:
            samples = [s for s in samples if s.changed]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.completion(self.kind) for s in samples],
            num_cached_tokens=self.num_cached_tokens,
            finished=finished,
        )


class OutputProcessor:
    """Routes engine outputs to request states; knows every request in flight."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self.requests: dict[str, RequestState] = {}  # by user request id
        self._by_engine_req: dict[str, RequestState] = {}
        self.metrics = metrics

    def add_request(self, state: RequestState) -> None:
        if state.request_id in self.requests:
            raise ValueError(f"request id {state.request_id!r} is already in flight")
        self.requests[state.request_id] = state
        for req_id in state.samples:
            self._by_engine_req[req_id] = state

    def remove_request(self, request_id: str, finish_reason: str | None = "abort") -> RequestState | None:
        """Forget a request; `finish_reason` is what the metrics count it as."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            for req_id in state.samples:
                self._by_engine_req.pop(req_id, None)
            if self.metrics is not None:
                self.metrics.observe_finished(
                    time.monotonic() - state.arrival_time,
                    state.queue_time_s,
                    len(state.prompt_token_ids),
                    finish_reason,
                )
        return state

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """Apply one engine step; returns engine request ids the engine must abort (stop strings,
        failed requests)."""
        to_abort: list[str] = []
        touched: dict[str, RequestState] = {}
        now = time.monotonic()
        for out in outputs:
            state = self._by_engine_req.get(out.req_id)
            if state is None or state.samples[out.req_id].finished:
                continue  # aborted or ended by a stop string since the engine sent this
            try:
                if out.error is not None:
                    raise RequestError(out.error)
                if self._apply(state, out, now):
                    to_abort.append(out.req_id)
                touched[state.request_id] = state
            except Exception as exc:
                # A request that cannot be processed ends with an error; it never hangs.
                touched.pop(state.request_id, None)
                to_abort.extend(state.unfinished_engine_req_ids())
                self._fail(
                    state,
                    exc
                    if isinstance(exc, RequestError)
                    else RequestError(f"output processing failed: {exc!r}"),
                )
        for state in touched.values():
            output = state.make_output()
            if output is not None:
                state.collector.put(output)
            if state.finished:
                first = next(iter(state.samples.values()))
                self.remove_request(state.request_id, first.finish_reason)
        return to_abort

    def _apply(self, state: RequestState, out: EngineCoreOutput, now: float) -> bool:
        """Apply one output to its request; True if the engine must abort that sample."""
        if out.num_cached_tokens:
            state.num_cached_tokens = out.num_cached_tokens
        if out.queue_time_s is not None and state.queue_time_s is None:
            state.queue_time_s = out.queue_time_s
        if out.new_token_ids:
            last = state.last_token_time
            if self.metrics is not None:
                since = now - (last if last is not None else state.arrival_time)
                self.metrics.observe_tokens(len(out.new_token_ids), last is None, since)
            state.last_token_time = now
        return state.samples[out.req_id].apply(out) == "abort"

    def fail_engine(self, engine_index: int, error: BaseException) -> None:
        """End every request of a dead engine with `error`."""
        for state in [s for s in self.requests.values() if s.engine_index == engine_index]:
            self._fail(state, error)

    def _fail(self, state: RequestState, error: BaseException) -> None:
        state.collector.put(error)
        self.remove_request(state.request_id, "error")
