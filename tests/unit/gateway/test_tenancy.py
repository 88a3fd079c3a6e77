"""Tenancy: API-key parsing (env and file), Bearer authentication, and tenant isolation of cache salts."""

from __future__ import annotations

import json

import pytest

from gateway.ratelimit import TenantLimits
from gateway.tenancy import (ANONYMOUS, AuthError, CacheSalter, Principal, TenantConfigError, TenantDirectory,
                             parse_api_keys, parse_api_keys_json)

SECRET = b"s" * 32


def directory(text: str) -> TenantDirectory:
    return TenantDirectory(parse_api_keys(text))


# ---- parsing: environment ------------------------------------------------------------------------------------------


def test_env_parses_keys_and_tenants():
    d = directory(" key1=tenantA , key2=tenantB,key3=tenantA")
    assert not d.is_open
    assert d.tenants == ("tenantA", "tenantB")
    assert d.authenticate("Bearer key1") == Principal("tenantA")
    assert d.authenticate("Bearer key2") == Principal("tenantB")
    assert d.authenticate("Bearer key3") == Principal("tenantA")


def test_env_key_may_contain_equals_sign():
    d = directory("c2VjcmV0==t1")
    assert d.authenticate("Bearer c2VjcmV0=") == Principal("t1")


@pytest.mark.parametrize("text", ["", "   ", None])
def test_blank_env_is_open(text):
    d = TenantDirectory.from_config(api_keys=text)
    assert d.is_open
    assert d.tenants == (ANONYMOUS.tenant,)
    assert "gateway is open" in d.describe()


@pytest.mark.parametrize("text, message", [
    ("key1", "entry 1 has no '='"),
    ("key1=a,,key2=b", "entry 2 is empty"),
    ("key1=a,", "entry 2 is empty"),
    ("=tenantA", "entry 1: the API key is empty"),
    ("key1=", "entry 1: tenant name ''"),
    ("key1=ten ant", "entry 1: tenant name"),
    ("key1=-lead", "entry 1: tenant name"),
    ("key 1=a", "whitespace"),
    ("key1=a,key1=b", "entry 2 repeats the key of KDAMESH_API_KEYS entry 1"),
])
def test_env_malformed(text, message):
    with pytest.raises(TenantConfigError, match=message):
        parse_api_keys(text)


def test_errors_never_echo_the_key():
    with pytest.raises(TenantConfigError) as e:
        parse_api_keys("sk-very-secret=a,sk-very-secret=b")
    assert "sk-very-secret" not in str(e.value)


# ---- parsing: file -------------------------------------------------------------------------------------------------


def test_file_with_tenants_and_limits(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({
        "ka": "alpha",
        "kb": {"tenant": "beta", "rpm": 10, "tpm": 1000, "max_concurrency": 2},
        "kc": {"tenant": "gamma", "rpm": None},
        "kd": {"tenant": "beta"},
    }))
    default = TenantLimits(rpm=60, tpm=5000, max_concurrency=8)
    d = TenantDirectory.from_config(api_keys_file=path, default_limits=default)
    assert d.tenants == ("alpha", "beta", "gamma")
    assert d.limits() == {
        "alpha": default,
        "beta": TenantLimits(rpm=10, tpm=1000, max_concurrency=2),
        "gamma": TenantLimits(rpm=None, tpm=5000, max_concurrency=8),  # null = unlimited, absent = default
    }
    assert d.authenticate("Bearer kd") == Principal("beta")


def test_env_and_file_merge(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text('{"kf": "fromfile"}')
    d = TenantDirectory.from_config(api_keys="ke=fromenv", api_keys_file=path)
    assert d.tenants == ("fromenv", "fromfile")
    path.write_text('{"ke": "other"}')
    with pytest.raises(TenantConfigError, match="repeats the key of KDAMESH_API_KEYS entry 1"):
        TenantDirectory.from_config(api_keys="ke=fromenv", api_keys_file=path)


@pytest.mark.parametrize("data, message", [
    (["k", "t"], "expected a JSON object"),
    ({}, "has no keys"),
    ({"k": 3}, "expected a tenant name or an object, got int"),
    ({"k": {"rpm": 3}}, "has no 'tenant'"),
    ({"k": {"tenant": "t", "rps": 3}}, r"unknown field\(s\) \['rps'\]"),
    ({"k": {"tenant": "t", "rpm": 0}}, "rpm must be a positive integer"),
    ({"k": {"tenant": "t", "tpm": 1.5}}, "tpm must be a positive integer"),
    ({"k": {"tenant": "t", "max_concurrency": True}}, "max_concurrency must be a positive integer"),
    ({"k": {"tenant": ""}}, "tenant name"),
    ({"": "t"}, "the API key is empty"),
])
def test_file_malformed(data, message):
    with pytest.raises(TenantConfigError, match=message):
        parse_api_keys_json(data)


def test_conflicting_limits_for_one_tenant():
    entries = parse_api_keys_json({"k1": {"tenant": "t", "rpm": 1}, "k2": {"tenant": "t", "rpm": 2}})
    with pytest.raises(TenantConfigError, match="entry 2 gives tenant 't' limits that differ from .* entry 1"):
        TenantDirectory(entries)


def test_unreadable_or_invalid_file(tmp_path):
    with pytest.raises(TenantConfigError, match="cannot read"):
        TenantDirectory.from_config(api_keys_file=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(TenantConfigError, match="not valid JSON"):
        TenantDirectory.from_config(api_keys_file=bad)


# ---- authentication ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("header, kind", [
    (None, "missing"),
    ("", "missing"),
    ("   ", "missing"),
    ("Bearer", "missing"),
    ("Bearer    ", "missing"),
    ("Basic a2V5MTo=", "bad_scheme"),
    ("key1", "bad_scheme"),
    ("Token key1", "bad_scheme"),
    ("Bearer key2", "invalid_key"),
    ("Bearer key", "invalid_key"),  # a prefix of a key
    ("Bearer key1x", "invalid_key"),
    ("Bearer KEY1", "invalid_key"),
])
def test_auth_errors(header, kind):
    with pytest.raises(AuthError) as e:
        directory("key1=a").authenticate(header)
    assert e.value.kind == kind


def test_bearer_scheme_is_case_insensitive_and_trimmed():
    d = directory("key1=a")
    assert d.authenticate("bearer key1") == Principal("a")
    assert d.authenticate("  BEARER   key1  ") == Principal("a")


def test_open_mode_accepts_anything():
    d = TenantDirectory()
    for header in (None, "", "Bearer whatever", "Basic x"):
        assert d.authenticate(header) is ANONYMOUS


# ---- cache salts ---------------------------------------------------------------------------------------------------


def test_salts_isolate_tenants():
    salter = CacheSalter(SECRET)
    a, b = Principal("A"), Principal("B")
    assert salter.cache_salt(a, None) == salter.cache_salt(a, None)
    assert salter.cache_salt(a, None) != salter.cache_salt(b, None)
    # tenant B sending tenant A's client salt (or A's derived salt itself) never gets A's salt
    assert salter.cache_salt(b, "shared") != salter.cache_salt(a, "shared")
    assert salter.cache_salt(b, salter.cache_salt(a, None)) != salter.cache_salt(a, None)
    # the client salt mixes in: same tenant, different client salt → different salt; same → same
    assert salter.cache_salt(a, "x") != salter.cache_salt(a, None)
    assert salter.cache_salt(a, "x") != salter.cache_salt(a, "y")
    assert salter.cache_salt(a, "x") == salter.cache_salt(a, "x")
    assert salter.cache_salt(a, "") == salter.cache_salt(a, None)
    assert len(salter.cache_salt(a, "x")) == 64 and int(salter.cache_salt(a, "x"), 16) >= 0


def test_anonymous_salt_differs_from_a_tenant_named_anonymous():
    salter = CacheSalter(SECRET)
    assert salter.cache_salt(ANONYMOUS, None) != salter.cache_salt(Principal(ANONYMOUS.tenant), None)


def test_salt_depends_on_the_secret_and_is_pinned():
    a = Principal("A")
    assert CacheSalter(SECRET).cache_salt(a) != CacheSalter(b"t" * 32).cache_salt(a)
    env = {"KDAMESH_CACHE_SALT_SECRET": "s" * 32}
    # stable across processes when the secret is configured
    assert CacheSalter.from_env(env).cache_salt(a) == CacheSalter(SECRET).cache_salt(a)
    assert not CacheSalter.from_env(env).ephemeral


def test_random_secret_per_process():
    first = CacheSalter.from_env({})
    second = CacheSalter.from_env({})
    assert first.ephemeral and second.ephemeral
    assert first.cache_salt(Principal("A")) != second.cache_salt(Principal("A"))
    fixed = CacheSalter.from_env({}, random_bytes=lambda n: b"r" * n)
    assert fixed.cache_salt(Principal("A")) == CacheSalter(b"r" * 32).cache_salt(Principal("A"))
    assert "r" * 8 not in repr(fixed)


def test_short_secret_rejected():
    with pytest.raises(TenantConfigError, match="at least 16 bytes"):
        CacheSalter.from_env({"KDAMESH_CACHE_SALT_SECRET": "short"})


# ---- fair-share weights ----------------------------------------------------------------------------------------------


def test_a_key_entry_sets_its_tenants_fair_share_weight():
    d = TenantDirectory(parse_api_keys_json({"ka": {"tenant": "a", "weight": 3}, "kb": "b",
                                             "kc": {"tenant": "a", "weight": 3.0, "rpm": 5}}))
    assert d.authenticate("Bearer ka") == Principal("a", weight=3.0)
    assert d.authenticate("Bearer kc").weight == 3.0 and d.authenticate("Bearer kb").weight == 1.0
    assert TenantDirectory().authenticate(None).weight == 1.0  # open gateway


@pytest.mark.parametrize("weight", [0, -2, True, "2", None, float("inf")])
def test_a_bad_weight_is_refused(weight):
    with pytest.raises(TenantConfigError, match="entry 1: weight must be a positive number"):
        parse_api_keys_json({"k": {"tenant": "t", "weight": weight}})


def test_conflicting_weights_for_one_tenant():
    entries = parse_api_keys_json({"k1": {"tenant": "t", "weight": 1}, "k2": {"tenant": "t", "weight": 2}})
    with pytest.raises(TenantConfigError, match="entry 2 gives tenant 't' a weight that differs from .* entry 1"):
        TenantDirectory(entries)
