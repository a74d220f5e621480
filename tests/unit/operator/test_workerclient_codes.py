"""The worker client's error codes: the worker's own come through as `ErrorCode`s, an answer the client cannot read
gets one of the client's `CallErrorCode`s, and which of them mean "not now"."""

import asyncio

import httpx
import pytest
from pydantic import SecretStr

from tidal.contract.error_codes import ErrorCode
from tidal.operator.runtime.workers import TRANSIENT_CODES, CallFailure
from tidal.operator.workerclient import CallErrorCode, WorkerCallError, WorkerClient

TOKEN = SecretStr("s" * 40)


def _state_call_error(answer: httpx.Response) -> WorkerCallError:
    async def main() -> WorkerCallError:
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda _: answer)) as http:
            with pytest.raises(WorkerCallError) as err:
                await WorkerClient(http, "10.0.0.1", 8001, TOKEN).state()
            return err.value

    return asyncio.run(main())


def test_the_workers_code_arrives_as_a_member_of_the_contracts_enum():
    error = _state_call_error(httpx.Response(409, json={"code": "busy", "message": "an update runs"}))
    assert error.code is ErrorCode.BUSY and error.message == "an update runs"


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(409, json={"code": "code_added_later", "message": "a newer worker"}),
        httpx.Response(502, text="<html>bad gateway</html>"),
    ],
    ids=["unknown-code", "not-a-control-error"],
)
def test_an_error_answer_the_client_cannot_read_keeps_its_status_and_text(answer):
    error = _state_call_error(answer)
    assert error.code is CallErrorCode.UNRECOGNIZED_ERROR
    assert f"HTTP {answer.status_code}" in error.message and answer.text[:20] in error.message


def test_a_success_that_does_not_fit_the_contract_is_a_bad_response():
    error = _state_call_error(httpx.Response(200, json={"sleep_state": "dozing"}))
    assert error.code is CallErrorCode.BAD_RESPONSE and "sleep_state" in error.message


def test_client_codes_are_apart_from_the_workers_and_only_not_now_is_retried():
    assert not {code.value for code in CallErrorCode} & {code.value for code in ErrorCode}
    assert set(ErrorCode) | set(CallErrorCode) >= TRANSIENT_CODES

    def transient(code: ErrorCode | CallErrorCode) -> bool:
        return CallFailure("pod", "weights/update", "message", code).transient

    # A rank busy, starting, draining or out of reach is asked again next pass; the roll goes on.
    assert all(transient(code) for code in (ErrorCode.BUSY, ErrorCode.NOT_LOADED, CallErrorCode.UNREACHABLE))
    # A refused checkpoint, a wrong token or an answer nobody understands stops it and is reported.
    assert not any(
        transient(code) for code in (ErrorCode.BAD_CHECKPOINT, ErrorCode.UNAUTHORIZED, CallErrorCode.UNRECOGNIZED_ERROR)
    )
