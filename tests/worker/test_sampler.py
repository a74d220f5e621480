"""The sampler on hand-made logits: greedy, top-k, top-p, temperature and per-request generators."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from tidal.worker.engine.sample_batch import SampleBatch
from tidal.worker.engine.sampler import Sampler
from tidal.worker.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
LOGITS = torch.tensor([[0.0, 3.0, 2.9, 1.0, -1.0, 2.5]])  # ranks: 1, 2, 5, 3, 0, 4


def draws(params: SamplingParams, n: int = 400, seed: int = 0) -> list[int]:
    sampler = Sampler(CPU, seed)
    return [sampler.sample(LOGITS.clone(), SampleBatch([params], [0]))[0] for _ in range(n)]


def test_greedy_takes_the_argmax():
    assert draws(SamplingParams(temperature=0), n=3) == [1, 1, 1]


def test_top_k_limits_to_the_k_most_likely():
    assert set(draws(SamplingParams(temperature=50.0, top_k=2))) == {1, 2}
    assert set(draws(SamplingParams(temperature=50.0, top_k=3))) == {1, 2, 5}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = LOGITS.softmax(-1)[0]
    p_top2 = float(probs[1] + probs[2])
    assert set(draws(SamplingParams(top_p=p_top2 - 1e-3))) == {1, 2}
    assert set(draws(SamplingParams(top_p=1e-4))) == {1}


def test_sampling_follows_the_distribution():
    counts = torch.bincount(torch.tensor(draws(SamplingParams(temperature=1.0), n=4000)), minlength=6).float()
    assert torch.allclose(counts / 4000, LOGITS.softmax(-1)[0], atol=0.03)


def test_high_temperature_flattens():
    assert len(set(draws(SamplingParams(temperature=100.0)))) == 6


def test_seeded_rows_do_not_depend_on_neighbours():
    seeded = SamplingParams(temperature=1.0, seed=9)
    noisy = SamplingParams(temperature=1.0)
    alone, mixed = Sampler(CPU, 0), Sampler(CPU, 1)
    for _ in range(20):
        a = alone.sample(LOGITS.clone(), SampleBatch([seeded], [5]))
        b = mixed.sample(LOGITS.repeat(3, 1), SampleBatch([noisy, seeded, noisy], [1, 5, 2]))
        assert a[0] == b[1]


def test_forget_restarts_a_seeded_stream():
    sampler = Sampler(CPU, 0)
    params = SamplingParams(temperature=1.0, seed=4)
    first = [sampler.sample(LOGITS.clone(), SampleBatch([params], [0]))[0] for _ in range(10)]
    sampler.forget(0)
    assert [sampler.sample(LOGITS.clone(), SampleBatch([params], [0]))[0] for _ in range(10)] == first


def test_every_seed_and_top_k_the_params_accept_can_be_sampled():
    # A value accepted here but unusable by torch would fail the step of the whole batch, not just this request.
    for params in (SamplingParams(seed=2**64 - 1), SamplingParams(top_k=2**63 - 1)):
        assert Sampler(CPU, 0).sample(LOGITS.clone(), SampleBatch([params], [0]))[0] in range(6)
    for field, value in (("seed", 2**64), ("top_k", 2**63)):
        with pytest.raises(ValidationError, match=field):
            SamplingParams(**{field: value})


def test_a_vanishing_temperature_is_greedy():
    # 1e-40 is a denormal in fp32: logits / it overflow to inf, the softmax turns to NaN, and argmax picked token 0.
    for temperature in (1e-40, 1e-30, 1e-9):
        assert draws(SamplingParams(temperature=temperature), n=5) == [1] * 5
