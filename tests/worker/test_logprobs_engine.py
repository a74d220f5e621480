"""Logprobs from the engine against a log_softmax of transformers' logits on the same weights (fp32, CPU): sampled
tokens' and prompt tokens', raw and processed (temperature, penalties), with chunked prefills, the prefix cache,
preemption, n > 1 and both scheduling modes; and the sampler's rows of mixed modes against torch."""

from __future__ import annotations

import pytest
import torch

from tidal.worker.engine.config import EngineConfig
from tidal.worker.engine.llm_engine import LLMEngine
from tidal.worker.engine.logprobs import FLOOR_LOGPROB
from tidal.worker.engine.outputs import TokenLogprob
from tidal.worker.engine.sample_batch import SampleBatch
from tidal.worker.engine.sampler import Sampler
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.testing.hf_reference import load_reference_model, prompt_ids

ARCH = "llama"
ATOL = 2e-4


@pytest.fixture(scope="module")
def model_dir(tiny_model):
    return tiny_model(ARCH)


@pytest.fixture(scope="module")
def reference_logprobs(model_dir):
    model = load_reference_model(model_dir)

    @torch.no_grad()
    def get(token_ids: list[int]) -> torch.Tensor:
        """[len, V]: row p is the log_softmax of the logits after token p (it scores token p + 1)."""
        return model(torch.tensor([token_ids])).logits[0].float().log_softmax(dim=-1)

    return get


def engine_for(model_dir, **config) -> LLMEngine:
    return LLMEngine.from_config(
        EngineConfig(model_path=model_dir, device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, **config)
    )


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, n: int = 1, others=None):
    """-> {(prompt index, sample): (token ids, logprobs per token, prompt logprobs or None)}; `others` collects
    the outputs of requests added before."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params, n)
    got: dict[tuple[int, int], tuple[list[int], list[TokenLogprob], list | None]] = {
        (i, j): ([], [], None) for i in range(len(prompts)) for j in range(n)
    }
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.request_id.startswith("r"):
                others.append(out)
                continue
            key = (int(out.request_id[1:]), out.sample_index)
            tokens, logprobs, prompt_lp = got[key]
            tokens.extend(out.new_token_ids)
            logprobs.extend(out.logprobs or [])
            if out.prompt_logprobs is not None:
                assert prompt_lp is None, "prompt logprobs are handed out once"
                got[key] = (tokens, logprobs, out.prompt_logprobs)
    return got


def check_row(entry: TokenLogprob, expected: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(expected[token].item(), abs=ATOL)
    assert int((expected > expected[token] + ATOL).sum()) + 1 <= entry.rank
    assert entry.rank <= int((expected > expected[token] - ATOL).sum()) + 1
    top = expected.topk(k)
    assert [t for t, _ in entry.top] == top.indices.tolist()
    assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=ATOL)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_raw_logprobs_equal_transformers(model_dir, reference_logprobs, async_scheduling):
    prompts = prompt_ids(model_dir)[:4]
    engine = engine_for(model_dir, async_scheduling=async_scheduling)
    got = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=6, logprobs=5, prompt_logprobs=3))
    for i, prompt in enumerate(prompts):
        tokens, logprobs, prompt_lp = got[i, 0]
        assert len(logprobs) == len(tokens) == 6
        expected = reference_logprobs(prompt + tokens)
        for t, entry in enumerate(logprobs):
            check_row(entry, expected[len(prompt) + t - 1], tokens[t], 5)
            assert entry.rank == 1  # greedy: the argmax
        assert prompt_lp is not None and len(prompt_lp) == len(prompt) and prompt_lp[0] is None
        for p in range(1, len(prompt)):
            check_row(prompt_lp[p], expected[p - 1], prompt[p], 3)


def test_prompt_logprobs_with_chunked_prefill_and_a_warm_prefix_cache(model_dir, reference_logprobs):
    prompts = prompt_ids(model_dir)[:3]
    engine = engine_for(model_dir, max_num_batched_tokens=5, max_num_seqs=2)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    run(engine, prompts, plain)  # fills the prefix cache with the prompts' blocks
    got = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))
    for i, prompt in enumerate(prompts):
        _, logprobs, prompt_lp = got[i, 0]
        assert logprobs == []  # not asked for
        expected = reference_logprobs(prompt)
        assert prompt_lp is not None
        for p in range(1, len(prompt)):
            check_row(prompt_lp[p], expected[p - 1], prompt[p], 0)


def reference_penalised(logits: torch.Tensor, output: list[int], params: SamplingParams) -> torch.Tensor:
    out = logits.clone()
    for t in set(output):
        out[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return out


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_sampled_logprobs_raw_or_processed(model_dir, reference_logprobs, mode):
    prompt = prompt_ids(model_dir)[1]
    params = SamplingParams(
        temperature=0.7, presence_penalty=0.8, frequency_penalty=0.4, seed=3, max_tokens=8, logprobs=4,
        logprobs_mode=mode,
    )  # fmt: skip
    got = run(engine_for(model_dir), [prompt, prompt], params, n=2)
    for key, (tokens, logprobs, _) in got.items():
        assert len(logprobs) == len(tokens) == 8, key
        raw = reference_logprobs(prompt + tokens)
        for t, entry in enumerate(logprobs):
            expected = raw[len(prompt) + t - 1]
            if mode == "processed":
                expected = (reference_penalised(expected, tokens[:t], params) / params.temperature).log_softmax(-1)
            check_row(entry, expected, tokens[t], 4)


def test_plain_requests_beside_logprob_requests_get_none(model_dir):
    prompts = prompt_ids(model_dir)[:2]
    engine = engine_for(model_dir)
    engine.add_request("plain", prompts[0], SamplingParams(temperature=0.0, max_tokens=4))
    others: list = []
    got = run(engine, prompts[1:], SamplingParams(temperature=0.0, max_tokens=4, logprobs=0), others=others)
    assert [len(e.top) for e in got[0, 0][1]] == [0] * 4
    assert len(others) == 4 and all(o.logprobs is None and o.prompt_logprobs is None for o in others)


def test_logprobs_survive_preemption_and_recompute(model_dir, reference_logprobs):
    prompts = prompt_ids(model_dir)
    # 24 blocks of 4 tokens for 9 sequences of up to ~45 + 12 tokens: some are preempted and recomputed.
    engine = LLMEngine.from_config(
        EngineConfig(model_path=model_dir, device="cpu", dtype="float32", block_size=4, num_kv_blocks=24,
                     max_model_len=96)
    )  # fmt: skip
    got = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, prompt_logprobs=1))
    assert engine.stats().num_preemptions > 0
    for i, prompt in enumerate(prompts):
        tokens, logprobs, prompt_lp = got[i, 0]
        expected = reference_logprobs(prompt + tokens)
        assert len(logprobs) == len(tokens)
        for t, entry in enumerate(logprobs):
            check_row(entry, expected[len(prompt) + t - 1], tokens[t], 1)
        assert prompt_lp is not None and prompt_lp[0] is None
        for p in range(1, len(prompt)):
            check_row(prompt_lp[p], expected[p - 1], prompt[p], 1)


def test_one_batch_mixes_plain_raw_and_processed_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0.0),  # plain: no logprobs
        SamplingParams(temperature=0.5, top_k=3, seed=1, logprobs=4, logprobs_mode="processed"),
        SamplingParams(temperature=0.0, logprobs=2),  # raw
        SamplingParams(temperature=0.0, logprobs=1, logprobs_mode="processed"),
    ]
    batch = SampleBatch(params, [0, 1, 2, 3], logprob_rows=[1, 2, 3])
    tokens, device_logprobs = Sampler(torch.device("cpu"), seed=0).sample_with_logprobs(logits.clone(), batch)
    assert device_logprobs is not None
    rows = device_logprobs.read()
    scaled = logits[1] / 0.5
    kept = scaled.topk(3).indices
    truncated = torch.full_like(scaled, float("-inf"))
    truncated[kept] = scaled[kept]
    check_row(rows[0]._replace(top=rows[0].top[:3]), truncated.log_softmax(-1), int(tokens[1]), 3)
    assert rows[0].top[3][1] == FLOOR_LOGPROB  # a token top-k dropped: -inf, written as the floor
    check_row(rows[1], logits[2].log_softmax(-1), int(tokens[2]), 2)
    check_row(rows[2], logits[3].log_softmax(-1), int(tokens[3]), 1)  # greedy: processed is not scaled
    assert int(tokens[0]) == int(logits[0].argmax())
