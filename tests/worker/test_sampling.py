"""Sampling and stopping through the whole engine: seeds, top-k/top-p, max_tokens, stop strings and ids, EOS."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.errors import InvalidLogitBiasError
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.testing.hf_reference import prompt_ids


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model("qwen3")


@pytest.fixture
def engine(model_dir) -> Iterator[LLMEngine]:
    engine = LLMEngine.from_config(EngineConfig(model_path=model_dir, device="cpu", num_kv_blocks=256, seed=7))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(model_dir):
    return prompt_ids(model_dir)


def tokens(engine, prompts, params):
    return [r.output_token_ids for r in engine.generate(prompts, params)]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine, prompts):
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=16, ignore_eos=True)
    alone = tokens(engine, [prompts[1]], seeded)[0]
    others = SamplingParams(temperature=0.8, max_tokens=12)  # unseeded neighbours draw from the shared generator
    mixed = engine.generate(prompts[:4], [others, seeded, others, others])[1].output_token_ids
    assert alone == mixed
    other_seed = tokens(engine, [prompts[1]], seeded.model_copy(update={"seed": 124}))[0]
    assert other_seed != alone


def test_unseeded_sampling_follows_the_engine_seed(model_dir, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)

    def run(seed):
        engine = LLMEngine.from_config(EngineConfig(model_path=model_dir, device="cpu", num_kv_blocks=128, seed=seed))
        return tokens(engine, prompts[:3], params)

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_top_k_1_and_tiny_top_p_are_greedy(engine, prompts):
    greedy = tokens(engine, prompts[:4], SamplingParams(temperature=0, max_tokens=10))
    assert tokens(engine, prompts[:4], SamplingParams(temperature=1.5, top_k=1, max_tokens=10, seed=1)) == greedy
    assert tokens(engine, prompts[:4], SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=10)) == greedy


def test_max_tokens_and_length_reason(engine, prompts):
    results = engine.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [len(r.output_token_ids) for r in results] == [5, 5, 5]
    assert {r.finish_reason for r in results} == {"length"}


def test_stop_token_ids(engine, prompts):
    full = tokens(engine, [prompts[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_id = full[4]
    out = engine.generate([prompts[2]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))[0]
    assert out.output_token_ids == full[: full.index(stop_id) + 1]
    assert out.finish_reason == "stop"


def test_eos_stops_unless_ignored(engine, prompts):
    full = tokens(engine, [prompts[3]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    engine.eos_token_ids = {full[3]}  # pretend the model's EOS is the 4th token it generates
    out = engine.generate([prompts[3]], SamplingParams(temperature=0, max_tokens=10))[0]
    assert out.output_token_ids == full[: full.index(full[3]) + 1] and out.finish_reason == "stop"
    ignored = engine.generate([prompts[3]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert ignored.output_token_ids == full and ignored.finish_reason == "length"


def test_stop_strings(engine, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    full = engine.generate([prompts[7]], params)[0]
    text = full.text
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if "\ufffd" not in text[i : i + 2])
    cut = engine.generate([prompts[7]], params.model_copy(update={"stop": [stop, "never appears"]}))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    assert len(cut.output_token_ids) < len(full.output_token_ids)
    kept = engine.generate([prompts[7]], params.model_copy(update={"stop": [stop], "include_stop_str_in_output": True}))
    assert kept[0].text == text[: text.index(stop) + len(stop)]


def test_streamed_text_equals_the_decoded_output(engine, prompts):
    """The deltas of the incremental detokenizer add up to decoding all output tokens at once."""
    results = engine.generate(prompts[:5], SamplingParams(temperature=0.9, max_tokens=20, seed=5, ignore_eos=True))
    for r in results:
        assert r.text == engine.tokenizer.decode(r.output_token_ids, skip_special_tokens=True)


CONTROLS = [
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0),
    SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, repetition_penalty=1.5, top_k=20),
    SamplingParams(temperature=1.0, seed=6, max_tokens=10, ignore_eos=True, min_p=0.05, logit_bias={17: 4.0}),
    SamplingParams(temperature=0, max_tokens=10, min_tokens=6, frequency_penalty=0.5),
]


def test_controls_in_one_batch_match_each_request_alone(engine, prompts):
    together = tokens(engine, prompts[:5], CONTROLS)
    for prompt, params, mixed in zip(prompts[:5], CONTROLS, together, strict=True):
        assert tokens(engine, [prompt], params)[0] == mixed


def test_controls_do_not_depend_on_async_scheduling(model_dir, prompts):
    def run(async_scheduling):
        config = EngineConfig(
            model_path=model_dir, device="cpu", num_kv_blocks=256, seed=7, async_scheduling=async_scheduling
        )
        return tokens(LLMEngine.from_config(config), prompts[:5], CONTROLS)

    assert run(True) == run(False)


def test_penalties_change_greedy_output(engine, prompts):
    plain = tokens(engine, prompts[:3], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    penalised = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=3.0)
    assert tokens(engine, prompts[:3], penalised) != plain
    present = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, presence_penalty=2.0, logit_bias={9: 3.0})
    assert tokens(engine, prompts[:3], present) != plain


def test_logit_bias_forces_and_forbids(engine, prompts):
    forced = tokens(engine, prompts[:2], SamplingParams(temperature=0, max_tokens=6, logit_bias={42: 100.0}))
    assert forced == [[42] * 6, [42] * 6]
    plain = tokens(engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    banned = {t: -100.0 for t in plain}
    out = tokens(engine, [prompts[0]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias=banned))
    assert not set(out[0]) & set(plain)


def test_min_tokens_holds_back_stop_tokens(engine, prompts):
    full = tokens(engine, [prompts[2]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    stop_id = full[1]
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=5, stop_token_ids=[stop_id], ignore_eos=True)
    out = engine.generate([prompts[2]], params)[0]
    assert len(out.output_token_ids) >= 5 and stop_id not in out.output_token_ids[:5]
    assert out.finish_reason == "length" or out.output_token_ids[-1] == stop_id


def test_a_bias_key_outside_the_vocabulary_is_refused(engine, prompts):
    with pytest.raises(InvalidLogitBiasError, match=f"logit_bias key {engine.vocab_size}"):
        engine.add_request("r", prompts[0], SamplingParams(logit_bias={engine.vocab_size: 1.0}))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_controls_survive_preemption(model_dir, prompts, async_scheduling):
    # 24 blocks of 4 tokens cannot hold all eight sequences: some are preempted and recomputed, and their token
    # histories on the device (penalties) and their bans must carry on where they were.
    params = [CONTROLS[i % len(CONTROLS)].model_copy(update={"max_tokens": 16}) for i in range(8)]
    roomy = LLMEngine.from_config(EngineConfig(model_path=model_dir, device="cpu", num_kv_blocks=256, seed=7))
    tight = LLMEngine.from_config(
        EngineConfig(
            model_path=model_dir, device="cpu", block_size=4, num_kv_blocks=24, max_model_len=96, seed=7,
            async_scheduling=async_scheduling,
        )
    )  # fmt: skip
    short = [p[:30] for p in prompts[:8]]
    assert tokens(tight, short, params) == tokens(roomy, short, params)
    assert tight.stats().num_preemptions > 0
