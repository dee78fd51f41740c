"""`/openapi.json` matches reality: schemathesis fuzzes every operation and finds no 5xx, no undocumented
status code or content type, no response that breaks its schema, and no schema-invalid input accepted."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from hasten.server.app import build_app  # noqa: E402

from .fake_engine import FakeAsyncLLM  # noqa: E402
from .harness import ServerThread  # noqa: E402

schema = schemathesis.openapi.from_dict(build_app(lambda: None).openapi())
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
statuses: Counter = Counter()


@pytest.fixture(scope="module")
def fuzz_server(fake_tokenizer) -> Iterator[ServerThread]:
    engine = FakeAsyncLLM(fake_tokenizer, max_model_len=96, max_num_seqs=32, step_time=0.0005, eos_after=8)
    with ServerThread(lambda: engine) as srv:
        yield srv


def test_served_schema_is_the_documented_one(fuzz_server: ServerThread) -> None:
    with fuzz_server.client() as c:
        served = c.get("/openapi.json").json()
    assert served["paths"].keys() == schema.raw_schema["paths"].keys()
    for path in served["paths"].values():
        for op in path.values():
            assert "422" not in op["responses"]


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzz_server: ServerThread) -> None:
    response = case.call(base_url=fuzz_server.url, timeout=30)
    statuses[response.status_code] += 1
    case.validate_response(response, checks=CHECKS)


def test_fuzzing_reached_both_success_and_rejection() -> None:
    if not statuses:
        pytest.skip("fuzz cases did not run")
    assert statuses[200] > 0 and statuses[400] > 0, statuses
    assert not [s for s in statuses if s >= 500], statuses
