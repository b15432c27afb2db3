"""Conformance with vLLM's API: each request kind of tests/data/conformance/cases.json gets vLLM 0.32's status and
its response has the keys and value types of vLLM's response models (tests/data/conformance/vllm_shapes.json,
recorded from vLLM's source by benchmarks/vllm_conformance.py), never compared on ids or values that vary.
pagellm's deliberate differences (the `deviations` there) are allowed, and only they."""

from __future__ import annotations

import httpx
import pytest

from benchmarks.vllm_conformance import Case, Result, Shapes, case_differences, load_cases, run_case

CASES = load_cases()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def shapes() -> Shapes:
    return Shapes.load()


@pytest.mark.parametrize("case", CASES, ids=[case.kind for case in CASES])
def test_request_kind_has_vllms_status_and_shape(http, shapes, case: Case):
    result = run_case(http, case, "tiny")
    assert case_differences(shapes, case, result) == [], (result.body, result.events)


def test_the_checker_sees_a_missing_key_a_wrong_type_and_an_unexpected_key(shapes):
    """The comparison itself: a response that drifts from vLLM's shape in any of three ways is caught."""
    case = next(c for c in CASES if c.shape == "CompletionResponse")
    good = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m", "service_tier": None,
            "system_fingerprint": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, "prompt_tokens_details": None,
                      "completion_tokens_details": None},
            "choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                         "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None,
                         "routed_experts": None}]}
    assert case_differences(shapes, case, Result(200, good)) == []
    missing = {**good, "choices": [{k: v for k, v in good["choices"][0].items() if k != "stop_reason"}]}
    wrong_type = {**good, "usage": {**good["usage"], "total_tokens": "2"}}
    unexpected = {**good, "extra": 1}
    assert case_differences(shapes, case, Result(200, missing)) == [".choices[0].stop_reason: missing"]
    assert case_differences(shapes, case, Result(200, wrong_type)) == [".usage.total_tokens: str, expected int"]
    assert case_differences(shapes, case, Result(200, unexpected)) == [".extra: unexpected key"]
    assert case_differences(shapes, case, Result(400, {})) == ["status 400, expected 200"]
    # Without pagellm's deviations, its `kv` is reported.
    strict = Shapes.load(allow_deviations=False)
    assert case_differences(strict, case, Result(200, {**good, "kv": {}})) == [".kv: unexpected key"]
