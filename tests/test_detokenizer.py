"""IncrementalDetokenizer: streamed text equals the full decode, word boundaries, specials, stop strings."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from vllm_lite.config import ModelSource
from vllm_lite.frontend.detokenizer import IncrementalDetokenizer
from vllm_lite.tokenizer import _load

MIXED = "naïve café, 日本語のテキスト and 👍🏽 emoji: déjà vu. Ünïcödé — 中文也可以！"
PROMPT = "<|im_start|>user\nSay something.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(smol_source: ModelSource) -> Any:
    """SmolLM2's tokenizer: GPT-2 style byte-level BPE, built from the bundled GGUF (no download)."""
    return _load(smol_source)


class RecordingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.max_decode_len = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.max_decode_len = max(self.max_decode_len, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def stream(
    detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1
) -> tuple[list[str], str | None, int]:
    """Feed `ids` a chunk per step as the frontend does; returns deltas, the stop hit and its step."""
    deltas = []
    for step, i in enumerate(range(0, len(ids), chunk)):
        stop = detok.update(ids[i : i + chunk])
        deltas.append(detok.get_delta(finished=stop is not None))
        if stop is not None:
            return deltas, stop, step
    deltas.append(detok.get_delta(finished=True))
    return deltas, None, -1


def metaspace_tokenizer() -> Any:
    """A small sentencepiece-style tokenizer (Metaspace + byte fallback), trained here on a tiny corpus.

    CJK and emoji are not in the corpus, so they come out as <0xXX> byte tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "The answer is naïve café and the quick brown fox jumps over the lazy dog.",
        "Hello world, the answer is here. Café au lait is naïve; déjà vu.",
    ] * 3
    pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    trained.train_from_iterator(corpus, trainer)
    # The trainer knows nothing of byte fallback: add the 256 byte tokens and rebuild the model.
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(pair) for pair in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizer
    # Llama's decoder: the final Strip drops the space of a word that starts the decoded text.
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_multibyte_characters_wait_until_complete(tok: Any, chunk: int) -> None:
    ids = tok.encode(" " + MIXED)
    # The premise: byte-level BPE splits some of these characters across tokens.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    deltas, stop, _ = stream(detok, ids, chunk)
    assert stop is None
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == " " + MIXED
    assert detok.output_text == " " + MIXED
    assert detok.token_ids == ids and detok.num_tokens == len(ids)


def test_text_is_emitted_as_soon_as_characters_complete(tok: Any) -> None:
    ids = tok.encode("日本語")
    detok = IncrementalDetokenizer(tok, [])
    released = ""
    for n, token_id in enumerate(ids, 1):
        detok.update([token_id])
        released += detok.get_delta(finished=False)
        # Everything up to the last complete character is out; nothing else.
        assert released == tok.decode(ids[:n]).rstrip("\ufffd")
    assert released == "日本語"


def test_incomplete_character_at_finish_is_released_as_decoded(tok: Any) -> None:
    ids = tok.encode("ok 👍")[:-1]  # cut inside the emoji's bytes
    assert tok.decode(ids).endswith("\ufffd")
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    deltas, _, _ = stream(detok, ids)
    assert not any("\ufffd" in d for d in deltas[:-1])
    assert "".join(deltas) == tok.decode(ids)
    assert detok.get_delta(finished=True) == ""


def test_invalid_bytes_are_released_and_the_window_stays_bounded(tok: Any) -> None:
    lone_continuation = tok.convert_tokens_to_ids("Ĺ")  # byte 0x97 on its own: never valid UTF-8
    ids = tok.encode("before ") + [lone_continuation] * 300 + tok.encode(" 日本 after")
    recorder = RecordingTokenizer(tok)
    detok = IncrementalDetokenizer(recorder, tok.encode(PROMPT))
    released = ""
    for token_id in ids[:-3]:
        detok.update([token_id])
        released += detok.get_delta(finished=False)
    # Invalid bytes do not hold the stream back for good.
    assert released.count("\ufffd") >= 290
    detok.update(ids[-3:])
    released += detok.get_delta(finished=True)
    assert released == tok.decode(ids)
    # The previous chunk as context plus the pending tokens, however long the run of invalid bytes.
    assert recorder.max_decode_len <= 16


def test_prompt_context_keeps_the_leading_space_of_metaspace_tokens() -> None:
    tokenizer = metaspace_tokenizer()
    text = "The answer is naïve café 日本語 👍🏽 and the lazy dog"
    all_ids = tokenizer.encode(text, add_special_tokens=False)
    prompt_ids, ids = all_ids[:3], all_ids[3:]  # "The answer is" | " naïve café ..."
    # The premise: decoding the output alone loses its leading space, and CJK / emoji are byte tokens.
    assert tokenizer.decode(ids) == text[len("The answer is ") :]
    assert "<0xE6>" in tokenizer.convert_ids_to_tokens(ids)
    expected = text[len("The answer is") :]
    for chunk in (1, 2, 5):
        detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        deltas, _, _ = stream(detok, ids, chunk)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == expected


def test_metaspace_output_without_prompt_decodes_like_the_tokenizer() -> None:
    tokenizer = metaspace_tokenizer()
    ids = tokenizer.encode("Hello world 中文 the quick brown fox", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas, _, _ = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == "Hello world 中文 the quick brown fox"


def test_prompt_context_starting_inside_a_character(tok: Any) -> None:
    # The last five prompt tokens begin in the middle of a CJK character.
    prompt = tok.encode("語のテキスト")
    assert tok.decode(prompt[-5:]).startswith("\ufffd")
    ids = tok.encode(" 日本語 ok")
    deltas, _, _ = stream(IncrementalDetokenizer(tok, prompt), ids)
    assert "".join(deltas) == tok.decode(ids)
    # Byte fallback decodes a run of byte tokens as a whole, so a run that starts inside a character is
    # all U+FFFD; the context must start after that character to still give the next word its space.
    tokenizer = metaspace_tokenizer()
    prompt = tokenizer.encode("The answer is 日本語", add_special_tokens=False)
    assert tokenizer.decode(prompt[-5:]) == "\ufffd" * 5
    for text, expected in ((" and the lazy dog", " and the lazy dog"), ("中文", "中文")):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not text.startswith(" "):
            ids = ids[1:]  # no "▁": the prompt's run of byte tokens goes on
        deltas, _, _ = stream(IncrementalDetokenizer(tokenizer, prompt), ids)
        assert "".join(deltas) == expected


def test_prompt_ending_inside_a_character(tok: Any) -> None:
    all_ids = tok.encode("ok 👍🏽 done")
    cut = next(n for n in range(1, len(all_ids)) if tok.decode(all_ids[:n]).endswith("\ufffd"))
    prompt, ids = all_ids[:cut], all_ids[cut:]
    deltas, _, _ = stream(IncrementalDetokenizer(tok, prompt), ids)
    # The output's own bytes, decoded as the tokenizer does (its leading continuation bytes are invalid).
    assert "".join(deltas) == tok.decode(ids)
    assert "".join(deltas).endswith(" done")


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok: Any, skip: bool) -> None:
    ids = tok.encode("Hi there!<|im_end|>\n<|im_start|>user\nnaïve")
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT), skip_special_tokens=skip)
    deltas, _, _ = stream(detok, ids, chunk=2)
    text = "".join(deltas)
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) is not skip
    assert ("<|im_start|>" in text) is not skip


def test_stop_string_spanning_tokens(tok: Any) -> None:
    text = " The quick brown fox jumps over the lazy dog"
    ids = tok.encode(text)
    stop = "own fo"
    # The premise: no single token holds the stop string.
    assert not any(stop in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    deltas, hit, step = stream(detok, ids)
    assert hit == stop
    assert "".join(deltas) == detok.output_text == " The quick br"
    # Stopped at the token that completed the stop string; the rest are dropped.
    assert detok.token_ids == ids[: step + 1]
    assert tok.decode(detok.token_ids).endswith(" fox")
    assert detok.stop_str == stop
    # Later calls are no-ops.
    assert detok.update(ids[step + 1 :]) is None
    assert detok.num_tokens == step + 1 and detok.output_text == " The quick br"
    assert detok.get_delta(finished=True) == ""


def test_stop_string_included_in_output(tok: Any) -> None:
    ids = tok.encode(" The quick brown fox jumps over the lazy dog")
    detok = IncrementalDetokenizer(tok, [], stop=["own fo"], include_stop_str_in_output=True)
    deltas, hit, _ = stream(detok, ids, chunk=3)
    assert hit == "own fo"
    assert "".join(deltas) == detok.output_text == " The quick brown fo"


def test_earliest_stop_string_wins(tok: Any) -> None:
    ids = tok.encode(" The quick brown fox jumps over the lazy dog")
    # Both complete in the same token (" quick"); "qu" starts first.
    detok = IncrementalDetokenizer(tok, [], stop=["ck", "qu"])
    assert stream(detok, ids)[1] == "qu"
    assert detok.output_text == " The "
    # In one batch: "fox" comes first in the text, though "lazy" is listed first.
    detok = IncrementalDetokenizer(tok, [], stop=["lazy", "fox"])
    assert detok.update(ids) == "fox"
    assert detok.output_text == " The quick brown "
    assert detok.token_ids == tok.encode(" The quick brown fox")


def test_stop_string_in_multibyte_text_and_special_token(tok: Any) -> None:
    ids = tok.encode(" 日本語のテキスト 👍🏽 done")
    detok = IncrementalDetokenizer(tok, [], stop=["テキ", "🏽"])
    assert stream(detok, ids)[1] == "テキ"
    assert detok.output_text == " 日本語の"
    ids = tok.encode("Sure, café!<|im_end|>\nmore")
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False, stop=["<|im_end|>"])
    assert stream(detok, ids)[1] == "<|im_end|>"
    assert detok.output_text == "Sure, café!"


def test_held_back_text_never_leaks_a_partial_stop_string(tok: Any) -> None:
    text = " The quick brown fox jumps over the lazy dog and runs"
    ids = tok.encode(text)
    stop = "lazy dog"
    detok = IncrementalDetokenizer(tok, [], stop=[stop, "zz"])
    released = ""
    for token_id in ids:
        hit = detok.update([token_id])
        if hit is not None:
            break
        released += detok.get_delta(finished=False)
        # Everything but the last len(stop) - 1 characters is out.
        assert released == detok.output_text[: max(0, len(detok.output_text) - (len(stop) - 1))]
        assert "lazy" not in released
    assert hit == stop
    released += detok.get_delta(finished=True)
    assert released == " The quick brown fox jumps over the "


def test_no_stop_strings_hold_nothing_back(tok: Any) -> None:
    ids = tok.encode(" hello world")
    detok = IncrementalDetokenizer(tok, [], stop=[""])  # an empty stop string is ignored
    detok.update(ids)
    assert detok.get_delta(finished=False) == " hello world"


def test_cost_is_bounded_per_token(tok: Any) -> None:
    paragraph = f" {MIXED} The quick brown fox jumps over the lazy dog. 12345 <tag> \n"
    ids = tok.encode(paragraph * 200)[:2000]
    assert len(ids) == 2000
    recorder = RecordingTokenizer(tok)
    detok = IncrementalDetokenizer(recorder, tok.encode(PROMPT), stop=["never appears", "STOP!"])
    start = time.perf_counter()
    deltas = []
    for i in range(0, len(ids), 3):
        assert detok.update(ids[i : i + 3]) is None
        deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0  # about 30 ms when the machine is idle
    assert "".join(deltas) == tok.decode(ids)
    # The decode window does not grow with the output.
    assert recorder.max_decode_len <= 20
