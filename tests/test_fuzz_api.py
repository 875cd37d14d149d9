"""schemathesis against the server's own OpenAPI document: generated valid and invalid
requests to every operation never get a 5xx and never hang.

Every case runs with the admin key (so it reaches the handlers, not the key check). Each
case stands alone: after it, generation is continued (a fuzzed ``/pause_generation`` must not
stall the next case), and the server must still generate and hold nothing (no request
running, queued or in flight). The server's request timeout bounds every generation the
fuzzer asks for. Not fuzzed: ``/init_weights_update_group``,
``/update_weights_from_distributed`` and ``/init_weight_transfer_engine``, whose replies by
contract wait (up to ``timeout_s``, default 120 s) until rank 0 of a torch.distributed group
connects; serving goes on meanwhile (their input checks are tested in test_server_errors /
test_server_weights).
``TLT_FUZZ_EXAMPLES`` sets the cases per operation (default 20).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from tests.harness import Served, engine_counts, serve, wait_for

USER, ADMIN = "fuzz-user", "fuzz-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
EXAMPLES = int(os.environ.get("TLT_FUZZ_EXAMPLES", "20"))
HANG_S = 60.0  # no single response may take longer (the request timeout is 5 s)
BLOCKING = ("/init_weights_update_group", "/update_weights_from_distributed",
            "/init_weight_transfer_engine")


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_dir) -> Iterator[Served]:
    s = serve(tiny_model_dir, api_key=USER, max_num_seqs=8,
              server_kw={"admin_key": ADMIN, "request_timeout_s": 5.0})
    yield s
    s.stop()


@pytest.fixture(scope="module")
def admin_http(fuzz_server: Served) -> Iterator[httpx.Client]:
    """One client for every case's checks: a new one per case cost ~50 ms (its SSL context),
    half the module's time."""
    with httpx.Client(base_url=fuzz_server.base_url, headers=AUTH, timeout=60) as http:
        yield http


@pytest.fixture(scope="module")
def api_schema(fuzz_server: Served) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json", headers=AUTH)


schema = schemathesis.pytest.from_fixture("api_schema").exclude(path=list(BLOCKING))


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_5xx_no_hang_and_nothing_left_behind(case, fuzz_server: Served,
                                               admin_http: httpx.Client) -> None:
    try:
        resp = case.call(base_url=fuzz_server.base_url, headers=AUTH, timeout=HANG_S)
        case.validate_response(resp, checks=[not_a_server_error])
        assert resp.status_code < 500, resp.text
    finally:
        assert admin_http.post("/continue_generation").status_code == 200
        still_serving(admin_http)


def still_serving(http: httpx.Client) -> None:
    """The server generates, and once that is done nothing is running, queued or in flight."""
    out = http.post("/generate", json={"text": "hi", "sampling_params": {
        "max_new_tokens": 1, "temperature": 0}})
    assert out.status_code == 200 and len(out.json()["output_ids"]) == 1, out.text
    wait_for(lambda: engine_counts(http) == (0, 0, 0), timeout=60)
