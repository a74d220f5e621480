"""The sampler's controls against plain torch references: penalties, logit_bias, min_tokens, top-k / min-p, seeds,
and a mixed batch that must equal each of its rows sampled alone."""

from __future__ import annotations

import pytest
import torch

from tidal.worker.engine.logit_edits import LogitEdits
from tidal.worker.engine.penalties import Penalties
from tidal.worker.engine.sample_batch import SampleBatch
from tidal.worker.engine.sampler import Sampler
from tidal.worker.engine.sampling_params import SamplingParams
from tidal.worker.engine.truncation import truncate

CPU = torch.device("cpu")
VOCAB = 50


def batch(*rows: tuple[int, SamplingParams, list[int], int]) -> SampleBatch:
    """Rows of (seq_id, params, prompt, tokens generated so far), with the columns the controls read."""
    return SampleBatch(
        [r[1] for r in rows], [r[0] for r in rows], [len(r[2]) + r[3] for r in rows], [r[2] for r in rows]
    )


def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """One row, token by token: HF's repetition penalty over prompt + output, then OpenAI's over the output."""
    out = logits.clone()
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t in set(output):
        out[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return out


PENALISED = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(presence_penalty=-0.5, frequency_penalty=0.3, repetition_penalty=0.8),
    SamplingParams(),  # a plain row among them
]


def test_penalties_match_the_reference_step_by_step():
    gen = torch.Generator().manual_seed(0)
    prompts = [[int(t) for t in torch.randint(0, VOCAB, (n,), generator=gen)] for n in (3, 7, 12, 5, 4)]
    outputs: list[list[int]] = [[] for _ in PENALISED]
    penalties = Penalties(CPU)
    for _ in range(12):
        logits = torch.randn(len(PENALISED), VOCAB, generator=gen) * 3
        rows = batch(*[(i, p, prompts[i], len(outputs[i])) for i, p in enumerate(PENALISED)])
        expected = torch.stack(
            [reference_penalties(logits[i], prompts[i], outputs[i], p) for i, p in enumerate(PENALISED)]
        )
        edited = logits.clone()
        step = penalties.apply(edited, rows)
        torch.testing.assert_close(edited, expected)
        # Tokens that repeat often, so the counts grow past 1.
        chosen = torch.randint(0, 6, (len(PENALISED),), generator=gen)
        penalties.record(step, chosen)
        for i, t in enumerate(chosen.tolist()):
            outputs[i].append(t)


def test_a_forgotten_row_is_reused_clean():
    penalties = Penalties(CPU)
    params = SamplingParams(frequency_penalty=1.0)
    step = penalties.apply(torch.zeros(1, VOCAB), batch((1, params, [0], 0)))
    penalties.record(step, torch.tensor([3]))
    penalties.forget(1)
    penalties.apply(torch.zeros(1, VOCAB), batch((0, SamplingParams(presence_penalty=1.0), [0], 0)))  # keeps a row
    step = penalties.apply(torch.zeros(1, VOCAB), batch((2, params, [0], 0)))  # may take seq 1's old row
    penalties.record(step, torch.tensor([4]))
    logits = torch.zeros(1, VOCAB)
    penalties.apply(logits, batch((2, params, [0], 1)))
    expected = torch.zeros(VOCAB)
    expected[4] = -1.0
    torch.testing.assert_close(logits[0], expected)


def test_logit_bias_and_min_tokens_bans():
    edits = LogitEdits(CPU, eos_token_ids=frozenset({7}))
    biased = SamplingParams(logit_bias={3: 5.0, 9: -100.0})
    waiting = SamplingParams(min_tokens=2, stop_token_ids=[11, 999])  # 999: past the vocabulary, never banned
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True, logit_bias={7: 1.0})
    logits = torch.randn(4, VOCAB)
    prompt = [1, 2, 3, 4]
    rows = batch(
        (0, biased, prompt, 0),
        (1, waiting, prompt, 1),  # 1 token generated: below min_tokens
        (2, waiting, prompt, 2),  # 2 generated: free to stop
        (3, ignoring, prompt, 0),
    )
    expected = logits.clone()
    expected[0, 3] += 5.0
    expected[0, 9] -= 100.0
    expected[1, [7, 11]] = float("-inf")
    expected[3, 7] += 1.0  # EOS ignored: not banned, and the bias still applies
    edits.apply(logits, rows)
    torch.testing.assert_close(logits, expected)


def reference_truncation(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    out = logits.clone()
    probs = logits.softmax(-1)
    out[probs < min_p * probs.max()] = float("-inf")
    order = out.argsort(descending=True)
    if top_k != -1:
        out[order[top_k:]] = float("-inf")
    kept = out.softmax(-1)
    mass = 0.0
    for rank, t in enumerate(order.tolist()):
        if rank > 0 and mass >= top_p:
            out[t] = float("-inf")
        mass += float(kept[t])
    return out


@pytest.mark.parametrize(("top_k", "top_p", "min_p"), [(-1, 1.0, 0.2), (5, 1.0, 0.0), (8, 0.7, 0.05), (-1, 0.5, 0.0)])
def test_truncation_matches_the_reference(top_k, top_p, min_p):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(top_k + 10))
    expected = torch.stack([reference_truncation(row, top_k, top_p, min_p) for row in logits])
    k = torch.full((3,), VOCAB if top_k == -1 else top_k)
    got = truncate(logits, k, torch.full((3,), top_p), torch.full((3,), min_p), sort=top_k != -1 or top_p < 1)
    assert torch.equal(got.isinf(), expected.isinf())
    torch.testing.assert_close(got[~got.isinf()], expected[~expected.isinf()])


def test_min_p_draws_only_tokens_near_the_top():
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0, -1.0, 2.5]])
    sampler = Sampler(CPU, 0)
    params = SamplingParams(temperature=1.0, min_p=0.5)  # keeps p >= half of token 1's: tokens 1, 2, 5
    drawn = {sampler.sample(logits.clone(), SampleBatch([params], [0]))[0] for _ in range(300)}
    assert drawn == {1, 2, 5}


# Rows of every kind, sampled for several steps: alone (each its own sampler) and all in one batch must agree.
MIXED = [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0, presence_penalty=1.0, frequency_penalty=0.5),
    SamplingParams(temperature=0.9, seed=1, repetition_penalty=1.2, top_k=10),
    SamplingParams(temperature=1.1, seed=2, logit_bias={4: 3.0, 5: -2.0}, min_p=0.1),
    SamplingParams(temperature=0, min_tokens=4, stop_token_ids=[1, 2, 3], logit_bias={1: 8.0}),
    SamplingParams(temperature=0.7, seed=3, top_p=0.8, frequency_penalty=-0.4, min_tokens=2),
]


def run_rows(params: list[SamplingParams], logits_per_step: list[torch.Tensor], seq_ids: list[int]) -> list[list[int]]:
    sampler = Sampler(CPU, 0, eos_token_ids=frozenset({0}))
    prompt = [5, 6, 5]
    tokens: list[list[int]] = [[] for _ in params]
    for logits in logits_per_step:
        rows = batch(*[(s, p, prompt, len(tokens[i])) for i, (s, p) in enumerate(zip(seq_ids, params, strict=True))])
        for i, t in enumerate(sampler.sample(logits.clone(), rows)):
            tokens[i].append(t)
    return tokens


def test_a_mixed_batch_equals_each_row_alone():
    gen = torch.Generator().manual_seed(5)
    steps = [torch.randn(len(MIXED), VOCAB, generator=gen) * 2 for _ in range(10)]
    together = run_rows(MIXED, steps, [10 + i for i in range(len(MIXED))])
    for i, params in enumerate(MIXED):
        alone = run_rows([params], [s[i : i + 1] for s in steps], [i])[0]
        assert alone == together[i], f"row {i} ({params})"
    # The controls had an effect: min_tokens kept row 4's favoured stop token 1 out of its first 4 tokens.
    assert 1 not in together[4][:4] and together[4][4] == 1


def test_seeded_rows_repeat_and_ignore_their_batch_mates():
    gen = torch.Generator().manual_seed(6)
    steps = [torch.randn(3, VOCAB, generator=gen) for _ in range(8)]
    seeded = SamplingParams(temperature=1.0, seed=42, presence_penalty=0.5, logit_bias={2: 1.0})
    first = run_rows([seeded], [s[:1] for s in steps], [0])[0]
    mates = [SamplingParams(temperature=1.5), SamplingParams(temperature=0.5, frequency_penalty=1.0)]
    mixed = run_rows([seeded, *mates], steps, [7, 8, 9])[0]
    assert first == mixed
    assert run_rows([seeded.model_copy(update={"seed": 43})], [s[:1] for s in steps], [0])[0] != first


def test_plain_greedy_batches_skip_every_control():
    sampler = Sampler(CPU, 0)
    logits = torch.randn(4, VOCAB)
    rows = batch(*[(i, SamplingParams(temperature=0), [1, 2], 0) for i in range(4)])
    assert sampler.sample(logits.clone(), rows) == logits.argmax(-1).tolist()
    assert sampler._penalties._history is None  # no device state made for requests that do not need it
