"""Output processing without engines: collectors merge what a slow consumer has not taken, and a
request whose output cannot be processed ends with an error instead of hanging."""

from __future__ import annotations

import asyncio

import pytest

from vllm_lite.errors import RequestError
from vllm_lite.frontend.output_processor import OutputProcessor, RequestOutputCollector, RequestState
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.protocol.messages import EngineCoreOutput, FinishReason
from vllm_lite.protocol.sampling_params import RequestOutputKind, SamplingParams


def output(text: str, ids: list[int], finished: bool = False) -> RequestOutput:
    reason = "length" if finished else None
    return RequestOutput("r", None, [1], [CompletionOutput(0, text, ids, reason)], finished=finished)


def test_delta_collector_merges_untaken_outputs():
    async def main():
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        collector.put(output("a", [1]))
        collector.put(output("b", [2]))
        collector.put(output("c", [3], finished=True))
        merged = await collector.get()
        assert (merged.outputs[0].text, merged.outputs[0].token_ids, merged.finished) == (
            "abc",
            [1, 2, 3],
            True,
        )
        assert collector.get_nowait() is None

    asyncio.run(main())


def test_cumulative_collector_keeps_the_latest_and_errors_win():
    async def main():
        collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
        collector.put(output("a", [1]))
        collector.put(output("ab", [1, 2]))
        assert (await collector.get()).outputs[0].text == "ab"
        collector.put(RequestError("boom"))
        collector.put(output("abc", [1, 2, 3]))
        with pytest.raises(RequestError, match="boom"):
            await collector.get()

    asyncio.run(main())


class BrokenTokenizer:
    """Decodes the prompt context fine, then fails on generated tokens."""

    broken = False

    def decode(self, ids, **kwargs):
        if self.broken:
            raise RuntimeError("tokenizer exploded")
        return "x" * len(ids)


def test_a_request_whose_output_cannot_be_processed_fails_alone():
    async def main():
        processor = OutputProcessor()
        params = SamplingParams(max_tokens=4)
        tokenizer = BrokenTokenizer()
        broken = RequestState("bad", None, [1, 2], params, tokenizer, ["bad/0"], 0)
        tokenizer.broken = True
        fine = RequestState("ok", None, [1, 2], params, None, ["ok/0"], 0)
        processor.add_request(broken)
        processor.add_request(fine)
        to_abort = processor.process_outputs(
            [
                EngineCoreOutput("bad/0", [5]),
                EngineCoreOutput("ok/0", [6], finish_reason=FinishReason.LENGTH),
            ]
        )
        assert to_abort == ["bad/0"]
        with pytest.raises(RequestError, match="tokenizer exploded"):
            await broken.collector.get()
        done = await fine.collector.get()
        assert done.finished and done.outputs[0].token_ids == [6]
        assert not processor.requests

    asyncio.run(main())
