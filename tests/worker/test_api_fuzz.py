"""Both OpenAPI documents fuzzed against a real worker (tiny Llama on the CPU) with schemathesis: a fixed seed and a
bounded number of cases per route, so the run is the same every time and takes well under a minute.

Every answer must be what the document says: no 5xx, a documented status, content type and body, and a request the
document calls invalid is refused. A request the document calls valid may still be refused (`positive_data_acceptance`
is not checked): a rule across fields (max_tokens against max_completion_tokens, min_tokens against the limit) or
one that needs what a document cannot know (a control call naming a directory that does not exist, a group this
worker was not started for). Fields the server refuses whatever their value are documented as accepting only their
default (test_api_contract.py checks that).
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from schemathesis.checks import positive_data_acceptance

from tidal.worker.testing.in_process import TEST_TOKEN, ControlledWorker

pytestmark = [pytest.mark.slow]

CASES_PER_ROUTE = 25
SEED = 20261201
FUZZ_SETTINGS = settings(
    max_examples=CASES_PER_ROUTE,
    derandomize=True,  # with the seed below: the same cases every run
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture(scope="module")
def worker(tiny_model):
    with ControlledWorker(model_path=tiny_model("llama"), num_kv_blocks=256, max_model_len=128) as running:
        yield running


@pytest.fixture(scope="module")
def serving_schema(worker):
    return schemathesis.openapi.from_url(f"{worker.background.url('serving')}/openapi.json")


@pytest.fixture(scope="module")
def control_schema(worker):
    headers = {"Authorization": f"Bearer {TEST_TOKEN}"}
    return schemathesis.openapi.from_url(f"{worker.background.url('control')}/openapi.json", headers=headers)


def _fuzz(schema, headers: dict[str, str] | None = None) -> None:
    """Every operation of `schema`, CASES_PER_ROUTE cases each; the first failure names its operation and case."""
    operations = [result.ok() for result in schema.get_all_operations()]
    assert operations
    for operation in operations:

        @seed(SEED)
        @FUZZ_SETTINGS
        @given(case=operation.as_strategy())
        def check(case) -> None:
            case.call_and_validate(headers=headers, excluded_checks=[positive_data_acceptance], timeout=60)

        check()


def test_the_serving_api_answers_as_documented(serving_schema):
    _fuzz(serving_schema)


def test_the_control_api_answers_as_documented(control_schema):
    _fuzz(control_schema, {"Authorization": f"Bearer {TEST_TOKEN}"})
