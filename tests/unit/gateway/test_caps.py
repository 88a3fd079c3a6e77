"""Per-request caps (gateway/caps.py) and the default tenant limits (gateway/config.py)."""

from __future__ import annotations

import pytest

from gateway.caps import RequestCaps
from gateway.config import DEFAULT_TENANT_LIMITS, GatewayConfig
from gateway.protocol import ApiError
from gateway.ratelimit import TenantLimits


def _refusal(caps: RequestCaps, lengths, n: int) -> tuple[int, str | None, str | None]:
    with pytest.raises(ApiError) as err:
        caps.check(lengths, n, "messages")
    return err.value.status, err.value.code, err.value.param


def test_caps_refuse_what_is_over_them_and_pass_the_rest():
    caps = RequestCaps(max_prompts=4, max_sequences=8, max_prompt_tokens=50)
    caps.check([50, 1, 1, 1], 2, "prompt")  # at every limit: fine
    assert _refusal(caps, [1] * 5, 1) == (400, "too_many_prompts", "prompt")
    assert _refusal(caps, [1] * 3, 3) == (400, "too_many_sequences", "n")
    assert _refusal(caps, [51], 1) == (413, "prompt_too_large", "messages")
    RequestCaps(max_prompt_tokens=None).check([10 ** 7], 1, "prompt")  # no token cap: the context decides


def test_the_issue_request_is_refused_by_the_default_caps():
    assert _refusal(RequestCaps(), [3] * 100, 128) == (400, "too_many_sequences", "n")  # 12,800 sequences


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_caps_must_be_positive_integers(bad):
    with pytest.raises(ValueError):
        RequestCaps(max_sequences=bad)


def test_tenant_limits_default_unless_set_and_zero_is_unlimited():
    base = dict(model="/m/tiny", decode_addresses=("d:1",), mode="colocated")
    assert GatewayConfig(**base).tenant_limits() == DEFAULT_TENANT_LIMITS
    assert DEFAULT_TENANT_LIMITS.max_concurrency and DEFAULT_TENANT_LIMITS.tpm
    assert GatewayConfig(**base, tenant_max_concurrency=0, tenant_tpm=0, tenant_rpm=7).tenant_limits() == \
        TenantLimits(rpm=7, tpm=None, max_concurrency=None)
    with pytest.raises(ValueError):
        GatewayConfig(**base, max_prompts_per_request=0)
