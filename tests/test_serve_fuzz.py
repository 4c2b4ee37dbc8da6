"""``colibri serve`` fuzzed from its own OpenAPI document with schemathesis: request bodies
that fit the schema and ones that break it, for every operation, against a live server of
the embedded model on 127.0.0.1. No answer may be a 5xx. Hypothesis is derandomised (the
same cases every run) and bounded (``MAX_EXAMPLES`` per operation and phase), and the
server's context is 64 tokens, so each generation is short."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from helpers.serve import Live, start_server, stop_server
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode

#: Cases per operation and generation phase (the document has nine operations).
MAX_EXAMPLES = 60


@pytest.fixture(scope="module")
def fuzzed() -> Iterator[Live]:
    live = start_server("--max-context", "64", "--max-queue", "64", "--sessions", "2")
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def api_schema(fuzzed: Live) -> Any:
    return schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")


def test_the_document_describes_every_route(fuzzed: Live) -> None:
    doc = httpx.get(fuzzed.url + "/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {
        "/health", "/metrics", "/stats", "/v1/models", "/v1/models/{name}",
        "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
    }  # fmt: skip
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
    fields = body["application/json"]["schema"]["properties"]
    assert {"prompt", "max_tokens", "temperature", "echo", "repeat_penalty"} <= set(fields)
    assert "messages" not in fields


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_request_is_a_server_error(fuzzed: Live, mode: str) -> None:
    """Every operation, ``MAX_EXAMPLES`` cases each (the same ones every run): none is a
    5xx. Negative cases break the schema (wrong types, missing or unknown fields, values
    out of range): each must be a 4xx."""
    schema = schemathesis.openapi.from_url(fuzzed.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 9
    statuses: dict[int, int] = {}
    for operation in operations:
        raw = operation.definition.raw
        if mode == "negative" and "requestBody" not in raw:
            continue  # no input to break (a path's name may be any string)

        @settings(
            max_examples=MAX_EXAMPLES,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
        def run(case: Any) -> None:
            response = case.call(timeout=60)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            case.validate_response(response, checks=[not_a_server_error])

        run()
    assert sum(statuses.values()) >= 100, statuses
    assert not any(code >= 500 for code in statuses), statuses
    if mode == "positive":  # the document leads to requests that are answered
        assert statuses.get(200, 0) >= 40, statuses
    else:  # and the cases it refuses, the server refuses too
        assert set(statuses) <= set(range(400, 500)), statuses
