"""Real weights under the operator: examples/smollm2.yaml, pointed at this session's link to the cached SmolLM2
directory, comes up Ready and answers a chat question through its pod with transformers' own greedy answer."""

import httpx
import pytest
import yaml
from operator_e2e import REPO, create_model, install_operator, model_pods, phase_is, wait_model
from transformers import AutoTokenizer

from tidal.worker.packaged_models.smollm2 import smollm2_dir
from tidal.worker.testing.hf_reference import transformers_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

QUESTION = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 24


def test_smollm2_example_answers_as_transformers(devcluster, namespace, tmp_path):
    install_operator(devcluster)
    model_dir = smollm2_dir()
    # The example's hostPath holds a link to the cache entry, as `make demo` makes it (pods are host processes).
    (tmp_path / "smollm2-135m-instruct").symlink_to(model_dir)
    manifest = yaml.safe_load((REPO / "examples" / "smollm2.yaml").read_text())
    manifest["spec"]["model"]["volume"]["hostPath"]["path"] = str(tmp_path)
    create_model(devcluster, namespace, manifest)
    wait_model(devcluster, namespace, "smollm2", phase_is("Ready"), timeout_s=300, what="phase Ready")

    (pod,) = model_pods(devcluster, namespace, "smollm2").values()
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    response = httpx.post(f"http://{pod.status.pod_ip}:8000/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    answer = response.json()["choices"][0]["message"]["content"]

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, return_dict=False)
    (expected,) = transformers_greedy(model_dir, [prompt], MAX_TOKENS)
    assert answer == tokenizer.decode(expected, skip_special_tokens=True)
    assert "Paris" in answer
