"""lm-evaluation-harness against the worker: its OpenAI-compatible model types (`local-completions` for
log-likelihood, `local-chat-completions` for greedy generation) score a small local task exactly as its `hf` backend
does over the same weights (SmolLM2-135M-Instruct, fp32 on CPU: real weights give scores that are not all zero).
Nothing is downloaded: the tasks read JSONL files written here, and the hub and datasets libraries are kept offline."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tidal.worker.packaged_models.smollm2 import smollm2_dir
from tidal.worker.testing.in_process import serving_worker

pytestmark = pytest.mark.slow

MODEL = "smollm2"

MC_DOCS = [
    {"question": "The tide comes in", "choices": ["twice a day", "at noon", "on Friday"], "answer": 0},
    {"question": "Boats wait at the mouth of the", "choices": ["river", "window", "cache"], "answer": 0},
    {"question": "The quick brown fox jumps over the", "choices": ["lazy dog", "bar", "harbour"], "answer": 0},
    {"question": "Questions, answers, lists: one, two,", "choices": ["three", "blue", "west"], "answer": 0},
    {"question": "red, green,", "choices": ["blue", "north", "two"], "answer": 0},
    {"question": "north, south, east and", "choices": ["west", "noon", "night"], "answer": 0},
    {"question": "She said hello and he said", "choices": ["good morning", "goodbye", "the weather"], "answer": 0},
    {"question": "When the cache is full, the newest", "choices": ["guest", "request", "block"], "answer": 0},
    {"question": "Reading, writing and", "choices": ["arithmetic", "hardware", "software"], "answer": 0},
    {"question": "The cat watches from the warm", "choices": ["window sill", "slate", "river"], "answer": 0},
    {"question": "Numbers like 1024, 4096 and", "choices": ["65536", "27", "12"], "answer": 0},
    {"question": "On Monday 3 ships came in, on Tuesday", "choices": ["12", "27", "3"], "answer": 0},
]
GEN_DOCS = [
    {"question": "What is the capital of France? Answer with one word.", "answer": "Paris"},
    {"question": "What is 2 + 3? Answer with the number only.", "answer": "5"},
    {"question": "What colour is the sky on a clear day? Answer with one word.", "answer": "Blue"},
    {"question": "How many days are in a week? Answer with the number only.", "answer": "7"},
    {"question": "What is the opposite of hot? Answer with one word.", "answer": "Cold"},
    {"question": "Which animal says meow? Answer with one word.", "answer": "Cat"},
    {"question": "What is the largest planet in our solar system? Answer with one word.", "answer": "Jupiter"},
    {"question": "What is 10 minus 4? Answer with the number only.", "answer": "6"},
]
MC_TASK = """
task: tidal_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_TASK = """
task: tidal_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
filter_list:
  # The model answers in a sentence ("The capital of France is Paris."): score its last word.
  - name: last_word
    filter:
      - function: regex
        regex_pattern: '(\\w+)'
        group_select: -1
      - function: take_first
"""


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """lm_eval with the hub and datasets offline; set before `datasets` is first imported, which reads them once."""
    with pytest.MonkeyPatch.context() as env:
        for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env.setenv(name, "1")
        env.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
        import lm_eval
        from lm_eval.tasks import TaskManager

        tasks = tmp_path_factory.mktemp("lm-eval-tasks")
        for name, docs, task in (("mc", MC_DOCS, MC_TASK), ("gen", GEN_DOCS, GEN_TASK)):
            data = tasks / f"{name}.jsonl"
            data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
            (tasks / f"{name}.yaml").write_text(task.format(data=data))
        yield lm_eval, TaskManager(include_path=str(tasks))


@pytest.fixture(scope="module")
def model_dir():
    return smollm2_dir()


@pytest.fixture(scope="module")
def worker_url(model_dir):
    with serving_worker(model_dir, MODEL) as worker:
        yield worker.url()


@pytest.fixture(scope="module")
def hf_model(harness, model_dir):
    """The `hf` backend, loaded once for both tasks; after `harness`, which takes the hub offline."""
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(model_dir), device="cpu", dtype="float32", batch_size=4)


def evaluate(harness, model: Any, task: str, **kwargs: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The task's metrics and its logged samples, in document order."""
    lm_eval, task_manager = harness
    results = lm_eval.simple_evaluate(
        model=model, tasks=[task], task_manager=task_manager, log_samples=True, random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0, **kwargs,
    )  # fmt: skip
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return results["results"][task], samples


def test_log_likelihood_ranking_equals_hf(harness, hf_model, model_dir, worker_url):
    args = {
        "model": MODEL, "base_url": f"{worker_url}/v1/completions", "tokenizer": str(model_dir),
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "batch_size": 4, "max_retries": 1,
    }  # fmt: skip
    served, served_samples = evaluate(harness, "local-completions", "tidal_mc", model_args=args)
    reference, reference_samples = evaluate(harness, hf_model, "tidal_mc")
    print(f"acc: worker {served['acc,none']}, hf {reference['acc,none']}")
    assert served["acc,none"] == reference["acc,none"] > 0
    assert len(served_samples) == len(MC_DOCS)
    for ours, theirs in zip(served_samples, reference_samples, strict=True):
        assert ours["doc_id"] == theirs["doc_id"] and ours["acc"] == theirs["acc"]
        # [choice] of (log-likelihood, is greedy): the ranking and greediness exactly, the values to fp32 rounding.
        ours_ll, theirs_ll = ([float(ll) for ll, _ in s["filtered_resps"]] for s in (ours, theirs))
        assert ours_ll == pytest.approx(theirs_ll, abs=1e-4)
        assert ranking(ours_ll) == ranking(theirs_ll)
        assert [bool(g) for _, g in ours["filtered_resps"]] == [bool(g) for _, g in theirs["filtered_resps"]]


def ranking(values: list[float]) -> list[int]:
    return sorted(range(len(values)), key=lambda i: -values[i])


def test_greedy_chat_generation_equals_hf(harness, hf_model, worker_url):
    args = {"model": MODEL, "base_url": f"{worker_url}/v1/chat/completions", "max_retries": 1}
    served, served_samples = evaluate(
        harness, "local-chat-completions", "tidal_gen", model_args=args, apply_chat_template=True
    )
    reference, reference_samples = evaluate(harness, hf_model, "tidal_gen", apply_chat_template=True)
    metric = "exact_match,last_word"
    print(f"exact_match: worker {served[metric]}, hf {reference[metric]}")
    assert served[metric] == reference[metric] > 0
    assert len(served_samples) == len(GEN_DOCS)
    for ours, theirs in zip(served_samples, reference_samples, strict=True):
        assert ours["resps"] == theirs["resps"]  # the whole greedy answer, before the filter
        assert ours["filtered_resps"] == theirs["filtered_resps"]
