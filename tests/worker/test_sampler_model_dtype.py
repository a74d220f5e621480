"""Logits in the model's dtype (bf16): the LM head no longer widens them, so the sampler must pick the same tokens as
over their exact fp32 widening, apply edits and penalties in fp32, and score logprobs in fp32 (CPU)."""

from __future__ import annotations

import torch

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.sample_batch import SampleBatch
from tidal.worker.engine.sampler import Sampler
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.layers.embedding import LMHead
from tidal.worker.testing.hf_reference import prompt_ids

CPU = torch.device("cpu")
VOCAB = 64


def bf16_logits(rows: int, seed: int) -> torch.Tensor:
    """Rows with many exact ties at the top: bf16 keeps 8 bits of mantissa, so values rounded to 1/4 collide."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, VOCAB, generator=gen) * 2).mul(4).round().div(4).to(torch.bfloat16)


def test_the_lm_head_keeps_the_weights_dtype():
    head = LMHead(VOCAB, 16, torch.bfloat16, CPU)
    head.weight.data.normal_()
    logits = head(torch.randn(3, 16, dtype=torch.bfloat16))
    assert logits.dtype == torch.bfloat16 and logits.shape == (3, VOCAB)


def test_greedy_over_bf16_picks_what_greedy_over_its_widening_picks():
    logits = bf16_logits(32, seed=1)
    top = logits.float().max(dim=-1, keepdim=True).values
    assert int((logits.float() == top).sum(dim=-1).gt(1).sum()) >= 3, "the rows must hold ties at the top"
    plain = SampleBatch([SamplingParams(temperature=0)] * 32, list(range(32)))
    assert Sampler(CPU, 0).sample(logits, plain) == Sampler(CPU, 0).sample(logits.float(), plain)


def test_a_seeded_row_draws_the_same_from_bf16_as_from_its_widening():
    logits = bf16_logits(2, seed=2)
    rows = [SamplingParams(temperature=0.8, seed=7, top_p=0.9), SamplingParams(temperature=0)]
    batch = SampleBatch(rows, [0, 1])
    narrow, wide = Sampler(CPU, 0), Sampler(CPU, 0)
    for _ in range(20):
        assert narrow.sample(logits, batch) == wide.sample(logits.float(), batch)


def with_controls(params: list[SamplingParams]) -> SampleBatch:
    return SampleBatch(params, list(range(len(params))), [3] * len(params), [[1, 2, 3]] * len(params))


def test_a_bias_below_bf16s_spacing_still_breaks_a_tie():
    # 8.0 and 8.0: bf16's spacing there is 1/16, so a bias of 0.01 added in bf16 would vanish and leave token 0.
    logits = torch.zeros(1, VOCAB, dtype=torch.bfloat16)
    logits[0, :2] = 8.0
    biased = with_controls([SamplingParams(temperature=0, logit_bias={1: 0.01})])
    assert Sampler(CPU, 0).sample(logits, biased) == [1]


def test_penalties_and_bans_over_bf16_equal_those_over_fp32():
    logits = bf16_logits(3, seed=3)
    params = [
        SamplingParams(temperature=0, presence_penalty=0.03, repetition_penalty=1.01),
        SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[int(logits[1].float().argmax())]),
        SamplingParams(temperature=0),
    ]
    narrow, wide = Sampler(CPU, 0), Sampler(CPU, 0)
    for _ in range(4):
        assert narrow.sample(logits, with_controls(params)) == wide.sample(logits.float(), with_controls(params))


def test_logprobs_of_bf16_logits_are_scored_in_fp32():
    logits = bf16_logits(2, seed=4) * 3
    params = [
        SamplingParams(temperature=0, logprobs=3),
        SamplingParams(temperature=0, logprobs=3, logprobs_mode="processed"),
    ]
    _, device_logprobs = Sampler(CPU, 0).sample_with_logprobs(logits, SampleBatch(params, [0, 1], logprob_rows=[0, 1]))
    assert device_logprobs is not None and device_logprobs.values.dtype == torch.float32
    expected = logits.float().log_softmax(dim=-1)
    for row, record in enumerate(device_logprobs.read()):
        assert record.token_id == int(expected[row].argmax())
        # bf16's own log_softmax would be off by up to ~0.03 at these magnitudes.
        assert abs(record.logprob - float(expected[row, record.token_id])) < 1e-5
        assert [round(v, 5) for _, v in record.top] == [round(v, 5) for v in expected[row].topk(3).values.tolist()]


def test_a_bf16_engine_scores_prompt_logprobs_in_fp32(tiny_model):
    model_dir = tiny_model("llama")
    engine = LLMEngine.from_config(
        EngineConfig(model_path=model_dir, device="cpu", dtype="bfloat16", block_size=4, num_kv_blocks=64)
    )
    seen: list[torch.Tensor] = []
    execute = engine.runner.execute

    def keeping(plan, previous_tokens=None):
        logits = execute(plan, previous_tokens)
        if logits is not None:
            seen.append(logits)
        return logits

    engine.runner.execute = keeping  # type: ignore[method-assign]
    prompt = prompt_ids(model_dir)[0]
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    records = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            records = out.prompt_logprobs if out.prompt_logprobs is not None else records
    assert seen[0].dtype == torch.bfloat16  # the model's dtype, as the head made them
    # The first step's logits: the sampled last position, then the prompt's positions 0 .. len - 2.
    expected = seen[0][1:].float().log_softmax(dim=-1)
    assert records is not None and records[0] is None
    for p in range(1, len(prompt)):
        assert abs(records[p].logprob - float(expected[p - 1, prompt[p]])) < 1e-5
