"""`AsyncEngineClient`: the Python API of a running deployment of engine cores.

    async with AsyncEngineClient.from_engine_args(EngineArgs(model="smollm2-135m")) as client:
        async for out in client.generate("Hello", SamplingParams(max_tokens=16)):
            print(out.outputs[0].text)

Every request is tokenized and validated here (a ValueError before anything is sent), runs on one
engine core (DP rank), and streams back through the output processor on this client's event loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from vllm_lite.config import EngineArgs, EngineConfig, ModelConfig
from vllm_lite.dp.balancer import LoadBalancer
from vllm_lite.errors import EngineDeadError, RequestError
from vllm_lite.frontend.core_client import SILENCE_TIMEOUT_S, EngineCoreClient
from vllm_lite.frontend.input_processor import InputProcessor
from vllm_lite.frontend.metrics import Metrics
from vllm_lite.frontend.output_processor import OutputProcessor, RequestState
from vllm_lite.inputs import PromptType
from vllm_lite.launchers.base import EngineLauncher
from vllm_lite.outputs import RequestOutput
from vllm_lite.protocol.messages import (
    EngineCoreAbort,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    FinishReason,
    FromEngine,
    UtilityCall,
    UtilityResult,
)
from vllm_lite.protocol.sampling_params import SamplingParams
from vllm_lite.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

UTILITY_TIMEOUT_S = 30.0


class AsyncEngineClient:
    """Streams requests to engine cores started by a launcher (one per DP rank)."""

    def __init__(
        self,
        config: EngineConfig,
        launcher: EngineLauncher | None = None,
        skip_tokenizer_init: bool = False,
        log_level: str = "WARNING",
        startup_timeout_s: float = 600.0,
        metrics: Metrics | None = None,
        silence_timeout_s: float = SILENCE_TIMEOUT_S,
    ) -> None:
        """Start the engine cores and wait until every one is ready (blocks; model loading takes
        seconds). Raises EngineStartupError if any of them fails. An engine silent for
        `silence_timeout_s` (it sends a heartbeat every second) is declared dead."""
        from vllm_lite.launchers.mp import MPLauncher

        self.config = config
        pc = config.parallel_config
        if pc.data_parallel_start_rank != 0:
            raise ValueError(
                "the API server's node runs the DP ranks from 0 (--data-parallel-start-rank is for --headless)"
            )
        self._launcher = launcher or MPLauncher(
            pc.data_parallel_size,
            log_level=log_level,
            dp_size_local=pc.local_size,
            master_ip=pc.data_parallel_address,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._dead: dict[int, str] = {}
        self._dead_lock = threading.Lock()
        self._shutdown = False
        self._ids = itertools.count()
        # call id -> (engine rank, future of the msgpack-encoded result)
        self._utility_calls: dict[int, tuple[int, asyncio.Future[bytes]]] = {}
        self.metrics = metrics
        self.output_processor = OutputProcessor(metrics)
        # The tokenizer (seconds for a GGUF) loads while the engines load their models.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            tokenizer = None if skip_tokenizer_init else pool.submit(load_tokenizer, config.model_config)
            self._core = EngineCoreClient(
                config,
                self._launcher,
                self._on_message,
                self._on_engine_dead,
                startup_timeout_s,
                silence_timeout_s,
            )
            self.tokenizer = tokenizer.result() if tokenizer is not None else None
        ready = self._core.ready[min(self._core.ready)]
        self.max_model_len = ready.max_model_len
        self.num_kv_blocks = {rank: r.num_kv_blocks for rank, r in self._core.ready.items()}
        self.input_processor = InputProcessor(config.model_config, self.max_model_len, self.tokenizer)
        self.balancer = LoadBalancer(sorted(self._core.ready))
        atexit.register(self.shutdown)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncEngineClient:
        """Build the config from `engine_args` and start the engines (see `__init__` for kwargs)."""
        return cls(engine_args.create_engine_config(), **kwargs)

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ---------------------------------------------------------------- public API

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        chat_template: str | None = None,
        data_parallel_rank: int | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request: text, token ids or chat messages.

        What each output holds follows `sampling_params.output_kind` (cumulative, delta or final
        only); the last one has `finished=True`. Raises ValueError for a bad request (before
        anything is sent), EngineDeadError if its engine dies, RequestError if the engine refused
        it. Stopping the iteration or cancelling the consuming task aborts the request.
        `data_parallel_rank` pins the request to one engine core; by default the least loaded
        one serves it.
        """
        self._bind_loop()
        self._check_usable()
        params = sampling_params if sampling_params is not None else SamplingParams()
        token_ids, text = self.input_processor.process(prompt, params, chat_template)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        engine_index = self._choose_engine(data_parallel_rank)
        seq = next(self._ids)
        engine_req_ids = [f"{request_id}/{i}/{seq}" for i in range(params.n)]
        state = RequestState(
            request_id, text, token_ids, params, self.tokenizer, engine_req_ids, engine_index
        )
        self.output_processor.add_request(state)
        try:
            now = time.time()
            for req_id, sample in state.samples.items():
                self._core.send(engine_index, EngineCoreRequest(req_id, token_ids, sample.params, now))
            while True:
                output = await state.collector.get()
                yield output
                if output.finished:
                    return
        finally:
            if self.output_processor.remove_request(request_id) is state:
                # Still in flight: the consumer went away (cancelled, broke out, or errored).
                self._abort_engine_requests(state)

    async def abort(self, request_id: str) -> None:
        """Abort a request: the engine frees its KV blocks; its stream ends with finish_reason
        'abort'. Unknown or finished ids are ignored."""
        state = self.output_processor.remove_request(request_id)
        if state is None:
            return
        self._abort_engine_requests(state)
        for sample in state.samples.values():
            if not sample.finished:
                sample.finish_reason = FinishReason.ABORT.value
                sample.changed = True
        output = state.make_output()
        if output is not None:
            state.collector.put(output)

    async def check_health(self) -> None:
        """Raise EngineDeadError if the client is shut down or an engine core has died."""
        self._check_usable()

    async def get_model_config(self) -> ModelConfig:
        return self.config.model_config

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def get_engine_stats(self, engine_index: int = 0) -> EngineStats:
        """Fresh load figures from one engine core (a round trip through its busy loop)."""
        raw = await self._call_utility(engine_index, "get_stats")
        stats = msgspec.msgpack.decode(raw, type=EngineStats)
        self._record_stats(engine_index, stats)
        return stats

    async def reset_prefix_cache(self) -> None:
        """Drop every engine's cached prefix blocks that no running request uses."""
        for rank in self.live_engines():
            await self._call_utility(rank, "reset_prefix_cache")

    @property
    def is_running(self) -> bool:
        return not self._shutdown and not self._dead

    @property
    def dead_engines(self) -> dict[int, str]:
        with self._dead_lock:
            return dict(self._dead)

    def shutdown(self) -> None:
        """Stop every engine core and fail whatever is still in flight (idempotent)."""
        if self._shutdown:
            return
        self._shutdown = True
        atexit.unregister(self.shutdown)
        self._core.close()
        error = EngineDeadError("the client was shut down")
        if self._loop is not None and not self._loop.is_closed():
            self._call_in_loop(self._fail_everything, error)

    # ---------------------------------------------------------------- internals

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            if self.output_processor.requests:
                raise RuntimeError("AsyncEngineClient is in use on another event loop")
            self._loop = loop

    def _check_usable(self) -> None:
        if self._shutdown:
            raise EngineDeadError("the client was shut down")
        dead = self.dead_engines
        if dead:
            rank, why = min(dead.items())
            raise EngineDeadError(f"engine core {rank} is dead ({why})")

    def live_engines(self) -> list[int]:
        """The DP ranks whose engine core is alive."""
        dead = self.dead_engines
        return [rank for rank in sorted(self._core.ready) if rank not in dead]

    def _choose_engine(self, pinned: int | None) -> int:
        """The pinned rank, or the least-loaded live one."""
        if pinned is not None:
            if pinned not in self._core.ready:
                raise ValueError(
                    f"data_parallel_rank must be one of {sorted(self._core.ready)}; got {pinned!r}"
                )
            if pinned in self.dead_engines:
                raise EngineDeadError(f"engine core {pinned} is dead ({self.dead_engines[pinned]})")
            return pinned
        live = self.live_engines()
        if not live:
            raise EngineDeadError("every engine core is dead")
        return self.balancer.choose(live)

    def _abort_engine_requests(self, state: RequestState) -> None:
        self._send_abort(state.engine_index, state.unfinished_engine_req_ids())

    def _send_abort(self, rank: int, req_ids: list[str]) -> None:
        if req_ids and rank not in self.dead_engines and not self._shutdown:
            try:
                self._core.send(rank, EngineCoreAbort(req_ids))
            except EngineDeadError:
                pass  # a dead engine holds no blocks to free

    async def _call_utility(self, rank: int, method: str, *args: Any) -> bytes:
        self._bind_loop()
        self._check_usable()
        call_id = next(self._ids)
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = (rank, future)
        try:
            raw_args = [msgspec.Raw(msgspec.msgpack.encode(a)) for a in args]
            self._core.send(rank, UtilityCall(call_id=call_id, method=method, args=raw_args))
            return await asyncio.wait_for(future, UTILITY_TIMEOUT_S)
        finally:
            self._utility_calls.pop(call_id, None)

    def _call_in_loop(self, fn: Any, *args: Any) -> None:
        """Run `fn(*args)` on the client's loop (from any thread); dropped if no loop is alive."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop closed meanwhile: nobody is waiting on it

    # Called on the output thread.
    def _on_message(self, message: FromEngine) -> None:
        self._call_in_loop(self._handle_message, message)

    # Called on the launcher's monitor thread or the output thread.
    def _on_engine_dead(self, rank: int, reason: str) -> None:
        with self._dead_lock:
            if rank in self._dead:
                return
            self._dead[rank] = reason
        logger.error("engine core %d is dead: %s", rank, reason)
        self._call_in_loop(self._fail_engine, rank, reason)

    def _handle_message(self, message: FromEngine) -> None:
        if isinstance(message, EngineCoreOutputs):
            if message.stats is not None:
                self._record_stats(message.engine_index, message.stats)
            to_abort = self.output_processor.process_outputs(message.outputs)
            self._send_abort(message.engine_index, to_abort)
        elif isinstance(message, UtilityResult):
            rank, future = self._utility_calls.get(message.call_id, (None, None))
            if future is None or future.done():
                return
            if message.error is not None:
                future.set_exception(RequestError(message.error))
            else:
                future.set_result(message.result)

    def _record_stats(self, rank: int, stats: EngineStats) -> None:
        """Fresh load figures of a rank, for the balancer and the metrics."""
        self.balancer.update_stats(rank, stats)
        if self.metrics is not None:
            self.metrics.update_engine_stats(rank, stats)

    def _fail_engine(self, rank: int, reason: str) -> None:
        error = EngineDeadError(f"engine core {rank} died: {reason}")
        self.output_processor.fail_engine(rank, error)
        for call_rank, future in self._utility_calls.values():
            if call_rank == rank and not future.done():
                future.set_exception(error)

    def _fail_everything(self, error: BaseException) -> None:
        for state in list(self.output_processor.requests.values()):
            self.output_processor.fail_engine(state.engine_index, error)
        for _, future in self._utility_calls.values():
            if not future.done():
                future.set_exception(error)
