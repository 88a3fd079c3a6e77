"""worker/codec.py: one `GenerationRequest` decodes into one `GenerationJob` for both workers, and a per-request field
(`logit_bias`) travels from the proto to the engine's `SamplingParams` and into the sampler."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampling import MAX_LOGIT_BIAS, SampleRow, Sampler, SamplingParams
from protos import common_pb2, decode_pb2, prefill_pb2
from worker.codec import GenerationJob, generation_from_proto


def _request(**sampling) -> common_pb2.GenerationRequest:
    return common_pb2.GenerationRequest(
        request_id="r1", model="m", prompt=common_pb2.TokenIds(ids=[5, 6, 7]), tenant_salt=b"salt", priority=3,
        snapshot_hints=[2], sampling=common_pb2.SamplingParams(max_tokens=4, temperature=0.0, **sampling))


def test_one_message_decodes_into_one_job():
    job = generation_from_proto(_request(logit_bias={9: 2.5}), deadline=12.0)
    assert job == GenerationJob(request_id="r1", prompt_token_ids=(5, 6, 7), params=job.params, tenant_salt=b"salt",
                                priority=3, media=(), snapshot_hints=(2,), deadline=12.0)
    assert job.params.logit_bias == {9: 2.5} and job.params.max_tokens == 4
    assert generation_from_proto(_request(), None).params.logit_bias is None  # unset: off
    # both roles embed the same message (new field numbers; the old per-role fields are reserved)
    prefill = prefill_pb2.PrefillRequest(generation=_request())
    decode = decode_pb2.DecodeRequest(generation=_request(), local=decode_pb2.LocalPrefill())
    assert prefill.generation == decode.generation
    assert prefill_pb2.PrefillRequest.DESCRIPTOR.fields_by_name["generation"].number == 10
    assert decode_pb2.DecodeRequest.DESCRIPTOR.fields_by_name["generation"].number == 10
    assert "prompt" not in prefill_pb2.PrefillRequest.DESCRIPTOR.fields_by_name


def test_an_empty_prompt_is_refused_once_for_both_roles():
    request = _request()
    del request.prompt.ids[:]
    with pytest.raises(InvalidRequestError) as err:
        generation_from_proto(request, None)
    assert err.value.param == "prompt"


@pytest.mark.parametrize("bias", [{1: 101.0}, {-1: 1.0}, {1: float("nan")},
                                  {t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)}])
def test_logit_bias_out_of_range_is_refused(bias):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(logit_bias=bias)
    assert err.value.param == "logit_bias"


def test_logit_bias_ids_beyond_the_vocabulary_are_refused():
    params = SamplingParams(logit_bias={3: 1.0, 99: 1.0})
    params.check_vocab(100)
    with pytest.raises(InvalidRequestError):
        SamplingParams(logit_bias={100: 1.0}).check_vocab(100)


def test_the_sampler_adds_the_bias_before_choosing():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])  # [1, V]: greedy picks 1
    sampler = Sampler()

    def greedy(bias):
        params = SamplingParams(temperature=0.0, logit_bias=bias)
        return sampler.sample(logits, [SampleRow(params, [0], [], None, ())])[0].token_id

    assert greedy(None) == 1  # control: no bias
    assert greedy({2: 4.5}) == 2 and greedy({3: 2.9}) == 1 and greedy({1: -100.0}) == 3


def test_the_tenant_share_decodes_with_weight_one_when_unset():
    from engine.fair_share import TenantShare

    request = _request()
    assert generation_from_proto(request, None).tenant == TenantShare()
    request.tenant.CopyFrom(common_pb2.TenantShare(name="acme", weight=2.5))
    assert generation_from_proto(request, None).tenant == TenantShare("acme", 2.5)
    request.tenant.weight = 0  # unset reads as 1
    assert generation_from_proto(request, None).tenant == TenantShare("acme", 1.0)


@pytest.mark.parametrize("name, weight", [("acme", -1.0), ("acme", float("nan")), ("acme", float("inf")),
                                          ("x" * 129, 1.0), ("bad\nname", 1.0)])
def test_a_bad_tenant_share_is_refused(name, weight):
    request = _request()
    request.tenant.CopyFrom(common_pb2.TenantShare(name=name, weight=weight))
    with pytest.raises(InvalidRequestError) as err:
        generation_from_proto(request, None)
    assert err.value.param in ("tenant", "tenant_weight")
