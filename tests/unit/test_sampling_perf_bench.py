"""benchmarks/sampling_perf.py: its request mixes, its grammar vocabulary, its ratios, and its smallest run end to
end on the CPU."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

from perf import grammar_vocab, sampling_report, sampling_side  # noqa: E402

from tidal.worker.engine.structured_output import StructuredOutput  # noqa: E402
from tidal.worker.testing.tiny_tokenizer import save_tokenizer  # noqa: E402


def test_featured_rows_are_half_the_plain_rows_with_every_feature():
    mixes = sampling_side.decode_mixes(8)
    plain, featured = mixes["plain"], mixes["featured"]
    assert [p.is_greedy for p in plain] == [True, False] * 4
    assert all(p.ignore_eos and p.logprobs is None and not p.has_controls for p in plain + mixes["greedy"])
    changed = [i for i, (p, f) in enumerate(zip(plain, featured, strict=True)) if p != f]
    assert changed == [0, 1, 4, 5]
    for i in changed:
        f = featured[i]
        assert f.logprobs == 5 and f.has_penalties and f.logit_bias and f.temperature == plain[i].temperature


def test_synthetic_tokens_are_distinct_seeded_and_avoid_the_taken_ones():
    taken = [b"ab", b" the"]
    tokens = grammar_vocab.synthetic_tokens(5000, seed=3, taken=taken)
    assert len(set(tokens)) == 5000 and not set(taken) & set(tokens)
    assert tokens == grammar_vocab.synthetic_tokens(5000, seed=3, taken=taken)
    assert sum(b'"' in t for t in tokens) > 20  # quotes: the tokens a JSON string's mask must look at


def test_full_vocabulary_grammar_allows_synthetic_tokens_inside_a_string():
    import torch
    import xgrammar

    tokenizer = save_tokenizer(Path(tempfile.mkdtemp()))
    vocab = 4096
    engine = SimpleNamespace(tokenizer=tokenizer, vocab_size=vocab, eos_token_ids={1})
    grammars = grammar_vocab.FullVocabularyGrammars(engine)  # type: ignore[arg-type]
    compiled = grammars.compile(StructuredOutput.json_schema(sampling_side.long_json_schema(4)))
    assert grammars.num_synthetic_tokens == vocab - len(tokenizer)
    matcher = xgrammar.GrammarMatcher(compiled)
    for token in tokenizer.encode('{"lines": ["', add_special_tokens=False):  # keys sorted: lines first
        assert matcher.accept_token(token)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask, 0)
    allowed = ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(-1)[:vocab].nonzero()
    assert int((allowed >= len(tokenizer)).sum()) > (vocab - len(tokenizer)) // 2  # most word pieces fit a string
    grammars.shutdown()


def test_ratios_and_targets_read_medians_and_the_recorded_run(tmp_path):
    recorded = tmp_path / "perf.json"
    recorded.write_text(
        json.dumps(
            {
                "environment": {"date": "d"},
                "engine": {"decode": [{"batch": 64, "ms_per_step": 5.0}], "offline": {"output_tokens_per_s": 1000.0}},
            }
        )
    )
    report = {
        "decode": {
            "greedy": [{"ms_per_step": 5.0}],
            "plain": [{"ms_per_step": 5.0}, {"ms_per_step": 9.0}, {"ms_per_step": 5.2}],
            "featured": [{"ms_per_step": 6.0}],
        },
        "offline": {"plain": {"output_tokens_per_s": 1000.0}, "structured": {"output_tokens_per_s": 800.0}},
        "recorded": sampling_report.recorded_figures(recorded, 64),
    }
    report["ratios"] = r = sampling_report.ratios(report)
    assert r["featured_over_plain_decode"] == pytest.approx(6.0 / 5.2)
    assert r["plain_over_structured_offline"] == pytest.approx(1.25)
    assert r["greedy_now_over_recorded_decode"] == pytest.approx(1.0)
    verdicts = [t["verdict"] for t in sampling_report.targets(report, judged=True)]
    assert verdicts == ["MISS", "MISS", "PASS", "PASS"]
    assert sampling_report.recorded_figures(tmp_path / "absent.json", 64) is None


@pytest.mark.slow
def test_smoke_run_on_cpu_writes_a_consistent_report(tmp_path):
    command = ["benchmarks/sampling_perf.py", "--preset", "tiny", "--device", "cpu", "--smoke", "--out", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "sampling-perf-tiny-cpu-smoke.json").read_text())
    w = report["workload"]
    for mix in ("greedy", "plain", "featured"):
        runs = report["decode"][mix]
        assert len(runs) == w["decode_repeats"] and all(r["ms_per_step"] > 0 for r in runs)
    for mix in ("plain", "structured"):  # the grammar never ends a request before max_tokens
        assert report["offline"][mix]["mean_output_tokens"] == w["offline_output_len"]
    assert report["ratios"]["featured_over_plain_decode"] > 0
    assert report["ratios"]["plain_over_structured_offline"] > 0
    assert all(t["verdict"].startswith("not judged") for t in report["targets"])
    markdown = (tmp_path / "sampling-perf-tiny-cpu-smoke.md").read_text()
    assert "featured_over_plain_decode" in markdown and "JSON schema" in markdown
