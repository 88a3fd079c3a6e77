"""`kdamesh bench serve` without a server: metrics on synthetic timelines with known answers, arrival schedules,
SSE parsing, the streamed request functions (against an in-process httpx transport), datasets and the result JSON."""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
import warnings

import httpx
import numpy as np
import pytest

from servebench import results
from servebench.cli import build_parser
from servebench.client import (REQUEST_FUNCS, RequestInput, SSEDecoder, request_chat_completions,
                                request_completions, request_func_for)
from servebench.datasets import (length_range, sample_custom, sample_prefix_repetition, sample_random,
                                  text_of_length, ordinary_ids)
from servebench.metrics import RequestOutput, calculate_metrics, parse_goodput, percentile_key, tpot_of
from servebench.runner import RunConfig, arrival_times, run_requests

# The documented field names of `vllm bench serve --save-result` (vllm/benchmarks/serve.py), for the default
# --percentile-metrics ttft,tpot,itl and --metric-percentiles 99.
VLLM_RUN_FIELDS = {"date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
                   "request_rate", "burstiness", "max_concurrency"}
VLLM_TOTAL_FIELDS = {"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                     "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                     "max_output_tokens_per_s", "max_concurrent_requests"}
VLLM_DETAILED_FIELDS = {"input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
                        "generated_texts", "errors"}
VLLM_PERCENTILE_FIELDS = {f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl")
                          for stat in ("mean", "median", "std", "p99")}


def ok(start, ttft, itl, output_tokens, prompt_len=10, latency=None, text="x"):
    return RequestOutput(generated_text=text, success=True, start_time=start, ttft=ttft, itl=list(itl),
                         latency=ttft + sum(itl) if latency is None else latency, output_tokens=output_tokens,
                         prompt_len=prompt_len)


def failed(prompt_len=10):
    return RequestOutput(success=False, prompt_len=prompt_len, error="boom")


@pytest.fixture
def timeline():
    """A: 4 tokens (usage), B: a single token, C: failed, D: 3 tokens counted from chunks (no usage)."""
    return [ok(0.0, 0.1, [0.02, 0.03, 0.05], 4, prompt_len=10, latency=0.2),
            ok(0.05, 0.2, [], 1, prompt_len=20, latency=0.2),
            failed(prompt_len=30),
            ok(0.2, 0.3, [0.01, 0.01], 0, prompt_len=40, latency=0.32)]


# -- metrics -------------------------------------------------------------------------------------------------------


def test_metrics_on_a_known_timeline(timeline):
    m, lens = calculate_metrics(timeline, dur_s=2.0, selected_percentiles=[50, 99])
    assert (m.completed, m.failed) == (3, 1)
    assert lens == [4, 1, 0, 3]  # failed: 0; D: 3 chunks (no usage)
    assert m.total_input == 10 + 20 + 40  # failed requests' prompts are not counted
    assert m.total_output == 8
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx((70 + 8) / 2.0)
    # TTFT over successful requests: 100, 200, 300 ms
    assert m.mean_ttft_ms == pytest.approx(200.0)
    assert m.median_ttft_ms == pytest.approx(200.0)
    assert m.std_ttft_ms == pytest.approx(math.sqrt((100**2 + 0 + 100**2) / 3))  # population std
    assert dict(m.percentiles_ttft_ms) == pytest.approx({50: 200.0, 99: 298.0})  # linear interpolation
    # TPOT = (E2EL - TTFT) / (output - 1): A (0.2-0.1)/3, D (0.32-0.3)/2; B (single token) has none
    tpots = [(0.2 - 0.1) / 3 * 1e3, (0.32 - 0.3) / 2 * 1e3]
    assert m.mean_tpot_ms == pytest.approx(statistics.mean(tpots))
    assert m.median_tpot_ms == pytest.approx(statistics.median(tpots))
    assert m.std_tpot_ms == pytest.approx(statistics.pstdev(tpots))
    # ITL pooled over all chunks of all requests
    itls = [20.0, 30.0, 50.0, 10.0, 10.0]
    assert m.mean_itl_ms == pytest.approx(24.0)
    assert m.median_itl_ms == pytest.approx(20.0)
    assert dict(m.percentiles_itl_ms)[99] == pytest.approx(np.percentile(itls, 99))
    assert m.mean_e2el_ms == pytest.approx((200 + 200 + 320) / 3)
    assert m.median_e2el_ms == pytest.approx(200.0)
    # all 8 chunks fall in the first second; A and B overlap, D starts exactly when A ends (half-open)
    assert m.max_output_tokens_per_s == 8
    assert m.max_concurrent_requests == 2


def test_tpot_excludes_single_token_outputs():
    only_single = [ok(0.0, 0.1, [], 1), ok(0.0, 0.3, [], 1)]
    m, lens = calculate_metrics(only_single, dur_s=1.0, selected_percentiles=[99])
    assert lens == [1, 1]
    assert m.mean_tpot_ms == m.median_tpot_ms == m.std_tpot_ms == 0.0  # no TPOT sample: zeros, as vLLM
    assert m.mean_itl_ms == 0.0
    assert m.mean_ttft_ms == pytest.approx(200.0)
    assert tpot_of(only_single[0], 1) is None
    assert tpot_of(ok(0, 0.1, [0.1, 0.1], 3), 3) == pytest.approx(0.1)


def test_usage_count_beats_chunk_count_for_tpot():
    """A chunk may carry several tokens: TPOT divides by the server's token count, ITL stays per chunk."""
    bundled = ok(0.0, 0.1, [0.2], output_tokens=5, latency=0.3)  # 2 chunks, 5 tokens
    m, lens = calculate_metrics([bundled], dur_s=1.0, selected_percentiles=[99])
    assert lens == [5]
    assert m.mean_tpot_ms == pytest.approx(0.2 / 4 * 1e3)
    assert m.mean_itl_ms == pytest.approx(200.0)


def test_all_requests_failed():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m, lens = calculate_metrics([failed(), failed()], dur_s=1.0, selected_percentiles=[99])
    assert any("All requests failed" in str(w.message) for w in caught)
    assert (m.completed, m.failed, m.total_input, m.total_output) == (0, 2, 0, 0)
    assert lens == [0, 0]
    assert m.request_throughput == m.mean_ttft_ms == m.max_output_tokens_per_s == 0.0
    assert m.max_concurrent_requests == 0


@pytest.mark.parametrize("slo, good", [
    ({"ttft": 250}, 2),  # A (100), B (200) meet; D (300) does not
    ({"tpot": 20}, 2),  # A's 33.3 ms misses; B (single token: TPOT 0) and D (10 ms) meet
    ({"ttft": 250, "tpot": 20}, 1),  # only B meets both
    ({"e2el": 200}, 2),  # equal to the SLO meets it: A and B (200 ms), not D (320)
    ({"ttft": 50}, 0),
])
def test_goodput(timeline, slo, good):
    m, _ = calculate_metrics(timeline, dur_s=2.0, selected_percentiles=[99], goodput_config=slo)
    assert m.request_goodput == pytest.approx(good / 2.0)


def test_parse_goodput_and_percentile_names():
    assert parse_goodput(["ttft:500", "tpot:50", "e2el:2000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 2000.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert [percentile_key(p) for p in (99, 50.0, 99.9)] == ["p99", "p50", "p99.9"]


# -- arrivals ------------------------------------------------------------------------------------------------------


def test_arrivals_infinite_rate_all_at_once():
    assert arrival_times(5, math.inf, 1.0, seed=0) == [0.0] * 5
    assert arrival_times(5, math.inf, 0.5, seed=0) == [0.0] * 5


def test_arrivals_are_seeded_and_end_at_n_over_rate():
    a = arrival_times(50, 4.0, 1.0, seed=7)
    assert a == arrival_times(50, 4.0, 1.0, seed=7)
    assert a != arrival_times(50, 4.0, 1.0, seed=8)
    assert a[-1] == pytest.approx(50 / 4.0)  # rescaled, as vLLM: the offered rate does not depend on the seed
    assert all(0 < x < y for x, y in zip(a, a[1:]))
    assert arrival_times(4, 2.0, math.inf, seed=0) == pytest.approx([0.5, 1.0, 1.5, 2.0])  # evenly spaced


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_is_the_gamma_shape(burstiness):
    """Gaps are gamma(shape=b, mean=1/rate): coefficient of variation 1/sqrt(b) (1: Poisson)."""
    times = np.array(arrival_times(20000, 10.0, burstiness, seed=1))
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert gaps.mean() == pytest.approx(0.1, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)


def test_arrival_arguments_are_checked():
    for rate, b in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            arrival_times(3, rate, b)


# -- SSE and the request functions ---------------------------------------------------------------------------------


def test_sse_decoder_handles_any_split():
    stream = ('data: {"a": 1}\n\n: ping\n\ndata: {"b": "é"}\r\n\r\ndata: line1\ndata: line2\n\n'
              'event: x\ndata:[DONE]').encode()
    expected = ['{"a": 1}', '{"b": "é"}', "line1\nline2", "[DONE]"]
    for size in (1, 2, 3, 7, len(stream)):
        decoder = SSEDecoder()
        events = []
        for i in range(0, len(stream), size):
            events += decoder.feed(stream[i:i + size])
        events += decoder.flush()
        assert events == expected, size


def _sse(*messages) -> list[bytes]:
    return [f"data: {json.dumps(m) if not isinstance(m, str) else m}\n\n".encode() for m in messages]


def _client(chunks: list[bytes], status: int = 200, delay_s: float = 0.0, seen: list | None = None):
    async def body():
        for c in chunks:
            if delay_s:
                await asyncio.sleep(delay_s)
            yield c

    def handler(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(json.loads(request.content))
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "no such model"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body())

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _completion(text, finish=None):
    return {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": finish}],
            "usage": None}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11,
                                  "prompt_tokens_details": {"cached_tokens": 5}}}


def _run(coro):
    return asyncio.run(coro)


def test_completions_request_is_timed_per_chunk():
    chunks = _sse(_completion("a"), _completion("bc"), _completion("d", "length"), USAGE, "[DONE]")
    seen: list = []

    async def go():
        async with _client(chunks, delay_s=0.02, seen=seen) as client:
            inp = RequestInput(prompt=[1, 2, 3], api_url="http://x/v1/completions", prompt_len=3, output_len=4,
                               model="m", ignore_eos=True, extra_body={"temperature": 0})
            return await request_completions(inp, client)

    out = _run(go())
    assert out.success and out.error == ""
    assert out.generated_text == "abcd"
    assert len(out.itl) == 2  # three choice chunks; the usage chunk is not a token
    assert out.ttft >= 0.015 and all(gap >= 0.015 for gap in out.itl)
    assert out.latency == pytest.approx(out.ttft + sum(out.itl))
    assert (out.output_tokens, out.prompt_len, out.cached_tokens) == (4, 7, 5)
    body = seen[0]
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 4 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["model"] == "m"


def test_chat_request_reads_deltas():
    def chat(delta):
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}

    chunks = _sse(chat({"role": "assistant", "content": ""}), chat({"reasoning_content": "hm "}),
                  chat({"content": "hi"}), USAGE, "[DONE]")
    seen: list = []

    async def go():
        async with _client(chunks, seen=seen) as client:
            inp = RequestInput(prompt="hello", api_url="http://x/v1/chat/completions", prompt_len=3, output_len=4,
                               model="m", model_name="served")
            return await request_chat_completions(inp, client)

    out = _run(go())
    assert out.success and out.generated_text == "hm hi" and len(out.itl) == 2 and out.output_tokens == 4
    assert seen[0]["messages"] == [{"role": "user", "content": "hello"}]
    assert seen[0]["max_completion_tokens"] == 4 and seen[0]["model"] == "served"


@pytest.mark.parametrize("chunks, status, reason", [
    ([], 404, "HTTP 404"),
    (_sse(_completion("a"), {"error": {"message": "deadline exceeded", "code": 504}}, "[DONE]"), 200,
     "deadline exceeded"),
    (_sse(USAGE, "[DONE]"), 200, "Never received a valid chunk"),
    ([b"data: {not json\n\n"], 200, "JSONDecodeError"),
])
def test_failed_requests_carry_the_reason(chunks, status, reason):
    async def go():
        async with _client(chunks, status=status) as client:
            inp = RequestInput(prompt="p", api_url="http://x/v1/completions", prompt_len=1, output_len=2, model="m")
            return await request_completions(inp, client)

    out = _run(go())
    assert not out.success and reason in out.error


def test_backend_and_endpoint_choose_the_request_function():
    assert request_func_for("openai", "/v1/completions") is request_completions
    assert request_func_for("vllm", "/v1/completions") is request_completions
    assert request_func_for("openai-chat", "/v1/chat/completions") is request_chat_completions
    assert request_func_for("openai", "/v1/chat/completions") is request_chat_completions
    assert set(REQUEST_FUNCS) == {"openai", "openai-chat", "vllm"}
    with pytest.raises(ValueError):
        request_func_for("tgi", "/generate")


def test_runner_caps_concurrency_and_keeps_order():
    """Four requests at rate inf with --max-concurrency 2: never more than two in flight; outputs in request order."""
    in_flight = {"now": 0, "peak": 0}

    async def fake(inp, client):
        started = time.perf_counter()
        in_flight["now"] += 1
        in_flight["peak"] = max(in_flight["peak"], in_flight["now"])
        await asyncio.sleep(0.02)
        in_flight["now"] -= 1
        return ok(started, 0.01, [0.01], 2, text=inp.request_id)

    from servebench.datasets import SampleRequest

    requests = [SampleRequest("p", 1, 2, f"r{i}") for i in range(4)]
    config = RunConfig(api_url="http://x/v1/completions", model_id="m", model_name=None, request_func=fake,
                       max_concurrency=2, num_warmups=1, log=lambda s: None)
    result = _run(run_requests(config, requests, client=None))
    assert in_flight["peak"] == 2
    assert [o.generated_text for o in result.outputs] == ["r0", "r1", "r2", "r3"]
    assert result.duration >= 0.04  # two waves
    assert max(o.client_queue_time for o in result.outputs) > 0.01  # the second wave waited for a slot


# -- datasets ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from engine.tokenizer import KimiTokenizer
    from engine.tokenizer_build import write_tokenizer

    return KimiTokenizer.from_pretrained(write_tokenizer(tmp_path_factory.mktemp("tok"), "kimi_k3"))


def test_random_prompts_have_exact_lengths_and_a_shared_prefix(tokenizer):
    reqs = sample_random(tokenizer, 12, input_len=40, output_len=6, prefix_len=16, seed=3)
    assert [len(tokenizer.encode(r.prompt)) for r in reqs] == [56] * 12  # text re-encodes to the asked length
    assert all(r.prompt_len == 56 and r.expected_output_len == 6 for r in reqs)
    assert len({tuple(r.prompt_token_ids[:8]) for r in reqs}) == 1  # the prefix (its start is never re-merged)
    assert len({r.prompt for r in reqs}) == 12
    again = sample_random(tokenizer, 12, input_len=40, output_len=6, prefix_len=16, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    special = tokenizer.special_token_ids
    ids = sample_random(tokenizer, 4, input_len=30, output_len=2, prefix_len=10, seed=0, token_ids=True)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 40 and not special & set(r.prompt) for r in ids)
    assert len({tuple(r.prompt[:10]) for r in ids}) == 1


def test_random_range_ratio(tokenizer):
    assert length_range(100, 0.25) == (75, 125)
    assert length_range(1, 0.5, minimum=1) == (1, 2)
    with pytest.raises(ValueError):
        length_range(10, 1.0)
    reqs = sample_random(tokenizer, 60, input_len=20, output_len=8, range_ratio=0.5, seed=1, token_ids=True)
    assert {r.prompt_len for r in reqs} <= set(range(10, 31)) and len({r.prompt_len for r in reqs}) > 5
    assert {r.expected_output_len for r in reqs} <= set(range(4, 13))


def test_text_of_length_round_trips(tokenizer):
    rng = np.random.default_rng(0)
    allowed = ordinary_ids(tokenizer)
    text, ids, mismatch = text_of_length(tokenizer, allowed[:50].tolist(), 50, allowed, rng)
    assert mismatch == 0 and tokenizer.encode(text) == ids and len(ids) == 50


def test_prefix_repetition(tokenizer):
    reqs = sample_prefix_repetition(tokenizer, 10, prefix_len=32, suffix_len=8, num_prefixes=3, output_len=5,
                                    seed=0, token_ids=True, shuffle=False)
    assert len(reqs) == 9  # 10 // 3 prompts per prefix
    prefixes = [tuple(r.prompt[:32]) for r in reqs]
    assert len(set(prefixes)) == 3 and prefixes[0] == prefixes[2] != prefixes[3]
    assert all(r.prompt_len == 40 and r.expected_output_len == 5 for r in reqs)
    text = sample_prefix_repetition(tokenizer, 6, prefix_len=24, suffix_len=8, num_prefixes=2, output_len=5, seed=0)
    assert all(isinstance(r.prompt, str) and r.prompt_len == 32 for r in text)
    with pytest.raises(ValueError):
        sample_prefix_repetition(tokenizer, 2, num_prefixes=3)


def test_custom_jsonl(tokenizer, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one two"}\n\n{"prompt": "three", "output_tokens": 9}\n')
    reqs = sample_custom(path, 5, tokenizer=tokenizer, output_len=4, seed=0)
    assert len(reqs) == 5  # oversampled to --num-prompts
    assert {r.prompt for r in reqs} == {"one two", "three"}
    assert {(r.prompt, r.expected_output_len) for r in reqs} == {("one two", 4), ("three", 9)}
    assert all(r.prompt_len == len(tokenizer.encode(r.prompt)) for r in reqs)
    assert len(sample_custom(path, 5, tokenizer=tokenizer, oversample=False)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError):
        sample_custom(bad, 1)


# -- the result JSON -----------------------------------------------------------------------------------------------


def _result(timeline, **kw):
    args = dict(goodput={"ttft": 250}, selected_metrics=["ttft", "tpot", "itl"], percentiles=[99.0],
                max_concurrency=None, request_rate=math.inf)
    args.update(kw)
    m, lens = calculate_metrics(timeline, 2.0, args["percentiles"], args["goodput"])
    measured = results.benchmark_result(m, timeline, lens, 2.0, **args)
    header = results.run_header(backend="openai", label=None, model_id="tiny-k3", tokenizer_id="/ckpt",
                                num_prompts=4, request_rate=args["request_rate"], burstiness=1.0,
                                max_concurrency=args["max_concurrency"])
    return {**header, **measured}


def test_result_fields_are_vllms(timeline, tmp_path):
    result = _result(timeline)
    assert set(result) == VLLM_RUN_FIELDS | VLLM_TOTAL_FIELDS | VLLM_DETAILED_FIELDS | VLLM_PERCENTILE_FIELDS
    assert set(results.strip_detailed(result)) == VLLM_RUN_FIELDS | VLLM_TOTAL_FIELDS | VLLM_PERCENTILE_FIELDS
    assert result["request_rate"] == "inf" and result["max_concurrency"] is None
    assert result["request_goodput"] == pytest.approx(1.0)
    assert result["output_lens"] == [4, 1, 0, 3] and result["errors"][2] == "boom"
    assert result["itls"][0] == [0.02, 0.03, 0.05]
    path = tmp_path / "r.json"
    results.save(result, str(path))
    assert json.loads(path.read_text()) == json.loads(json.dumps(result))
    text = results.summary(result, ["ttft", "tpot", "itl"], None, math.inf, True)
    assert "Successful requests:                     3" in text and "P99 TTFT (ms):" in text


def test_result_fields_with_more_metrics(timeline):
    result = _result(timeline, goodput={}, selected_metrics=["ttft", "e2el", "client_queue_time",
                                                             "e2el_including_client_queue"],
                     percentiles=[50.0, 99.9], max_concurrency=2, request_rate=4.0)
    assert result["request_goodput"] is None and result["request_rate"] == 4.0 and result["max_concurrency"] == 2
    for m in ("ttft", "e2el", "client_queue_time", "e2el_including_client_queue"):
        assert {f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms", f"p50_{m}_ms", f"p99.9_{m}_ms"} <= set(result)
    assert "mean_tpot_ms" not in result and "p99_ttft_ms" not in result


def test_result_filename(tmp_path):
    name = results.result_filename(result_filename=None, result_dir=str(tmp_path / "d"), label="openai",
                                   request_rate=math.inf, max_concurrency=4, model_id="/ckpt/tiny-k3",
                                   date="20260101-000000")
    assert name == str(tmp_path / "d" / "openai-infqps-concurrency4-tiny-k3-20260101-000000.json")
    assert (tmp_path / "d").is_dir()


def test_cli_flags_are_vllms():
    args = build_parser().parse_args([
        "--base-url", "http://h:1", "--model", "m", "--endpoint", "/v1/chat/completions", "--backend", "openai-chat",
        "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "64",
        "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2",
        "--prefix-repetition-output-len", "4", "--request-rate", "inf", "--burstiness", "0.5",
        "--max-concurrency", "4", "--num-prompts", "8", "--seed", "1", "--ignore-eos", "--percentile-metrics",
        "ttft,e2el", "--metric-percentiles", "50,99", "--goodput", "ttft:500", "tpot:50", "--save-result",
        "--result-dir", "d", "--result-filename", "f.json", "--disable-tqdm", "--tokenizer", "t",
        "--random-input-len", "16", "--random-output-len", "8", "--random-range-ratio", "0.1",
        "--random-prefix-len", "4"])
    assert math.isinf(args.request_rate) and args.goodput == ["ttft:500", "tpot:50"]
    assert args.prefix_repetition_prefix_len == 64 and args.max_concurrency == 4
    defaults = build_parser().parse_args([])
    assert (defaults.endpoint, defaults.backend, defaults.dataset_name, defaults.num_prompts) == \
        ("/v1/completions", "openai", "random", 1000)
    assert (defaults.random_input_len, defaults.random_output_len, defaults.metric_percentiles) == (1024, 128, "99")


def test_kdamesh_cli_has_bench_serve():
    from deploy.cli import build_parser as kdamesh_parser

    args = kdamesh_parser().parse_args(["bench", "serve", "--num-prompts", "3", "--port", "1"])
    assert args.command == "bench" and args.bench_command == "serve" and args.num_prompts == 3
    assert args.func.__name__ == "_bench_serve"
