"""`kdamesh bench serve` / `python -m servebench`: the flags of `vllm bench serve`, and one run.

`add_cli_args(parser)` declares the flags (the `kdamesh` CLI puts them on its `bench serve` subcommand);
`main(args)` runs the benchmark, prints vLLM's summary and returns the result dict; `run_cli(argv)` does both.
Flags beyond vLLM's (kdamesh extensions): `--prompt-token-ids` (send random prompts as token ids on
/v1/completions: exact lengths, exact shared prefixes), `--metrics-url URL` (repeatable: where the speculative
decoding counters are read, e.g. a mesh's decode workers; servebench/spec_metrics.py). Flags of vLLM that do not
apply here (multimodal, LoRA, ramp-up, profiling, HF datasets) are not offered.
Tokenizer: `--tokenizer DIR`, else `--model` when it is a local checkpoint folder, else the served model's `root`
from `/v1/models` when that is a local folder (kdamesh reports its checkpoint folder there). A folder with
`tiktoken.model` or `tokenizer.json` is read with `engine.tokenizer.KimiTokenizer` (imports without torch).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("random", "prefix_repetition", "custom")


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    _add_endpoint_flags(parser)
    _add_run_flags(parser)
    s = parser.add_argument_group("sampling parameters (sent only when given)")
    for name, kind in (("temperature", float), ("top-p", float), ("top-k", int), ("min-p", float),
                       ("frequency-penalty", float), ("presence-penalty", float), ("repetition-penalty", float)):
        s.add_argument(f"--{name}", type=kind, default=None)
    _add_dataset_flags(parser.add_argument_group("datasets"))
    return parser


def _add_endpoint_flags(p: argparse.ArgumentParser) -> None:
    """What to talk to: backend, URL, headers, model and tokenizer."""
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat", "vllm"],
                   help="openai (or vllm): /v1/completions; openai-chat: /v1/chat/completions")
    p.add_argument("--label", default=None, help="prefix of the result file name (default: the backend)")
    p.add_argument("--base-url", default=None, help="server or API base URL, instead of --host/--port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions", help="API endpoint (/v1/completions, "
                   "/v1/chat/completions)")
    p.add_argument("--header", metavar="KEY=VALUE", nargs="*", help="extra headers sent with each request")
    p.add_argument("--model", default=None, help="model name (default: the first model from /v1/models)")
    p.add_argument("--served-model-name", default=None, help="the name sent in requests (default: --model)")
    p.add_argument("--tokenizer", default=None, help="checkpoint folder with the tokenizer (default: --model, or "
                   "the served model's folder when local)")


def _add_run_flags(p: argparse.ArgumentParser) -> None:
    """How the run goes (rate, concurrency, prompts) and what it reports (metrics, result file)."""
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson / gamma arrivals); inf: all at time 0")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more regular")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-warmups", type=int, default=0, help="requests (the first prompt) sent before the run")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (implied by --dataset-name random)")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--percentile-metrics", default=None,
                   help="comma-separated: ttft, tpot, itl, e2el, client_queue_time, e2el_including_client_queue "
                        "(default ttft,tpot,itl)")
    p.add_argument("--metric-percentiles", default="99", help='comma-separated percentiles, e.g. "25,50,99"')
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:VALUE",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:2000")
    p.add_argument("--save-result", action="store_true", help="save the result JSON")
    p.add_argument("--save-detailed", action="store_true", help="include per-request lists in the saved JSON")
    p.add_argument("--append-result", action="store_true", help="append the result JSON to the file")
    p.add_argument("--metadata", metavar="KEY=VALUE", nargs="*", help="recorded in the result JSON")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-", help="x-request-id prefix")
    p.add_argument("--ready-check-timeout-sec", type=int, default=0,
                   help="wait up to this long for the first prompt to succeed before the run (0: no check)")
    p.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    p.add_argument("--metrics-url", action="append", default=None, metavar="URL",
                   help="kdamesh: a Prometheus /metrics URL read before and after the run for the speculative "
                        "decoding counters (repeat it per worker; default: the base URL's /metrics)")


def _add_dataset_flags(d) -> None:
    d.add_argument("--dataset-name", default="random", choices=DATASETS)
    d.add_argument("--dataset-path", default=None, help="the JSONL file of --dataset-name custom")
    d.add_argument("--input-len", type=int, default=None, help="sets --random-input-len")
    d.add_argument("--output-len", type=int, default=None, help="sets every dataset's output length")
    d.add_argument("--disable-shuffle", action="store_true")
    d.add_argument("--no-oversample", action="store_true", help="custom: do not repeat prompts up to --num-prompts")
    d.add_argument("--skip-chat-template", action="store_true", help="custom: send prompts without the chat format")
    d.add_argument("--custom-output-len", type=int, default=256)
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths drawn from [len·(1−r), len·(1+r)], r in [0, 1)")
    d.add_argument("--random-prefix-len", type=int, default=0, help="fixed prefix tokens shared by every prompt")
    d.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    d.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    d.add_argument("--prefix-repetition-output-len", type=int, default=128)
    d.add_argument("--prompt-token-ids", action="store_true",
                   help="kdamesh: send random prompts as token ids (completions only): exact lengths and prefixes")


def build_parser() -> argparse.ArgumentParser:
    return add_cli_args(argparse.ArgumentParser(prog="kdamesh bench serve", description=__doc__.splitlines()[0]))


# -- resolving what to talk to ---------------------------------------------------------------------------------------


def _urls(args: argparse.Namespace) -> tuple[str, str]:
    base = args.base_url.rstrip("/") if args.base_url else f"http://{_host(args.host)}:{args.port}"
    return base, f"{base}{args.endpoint}"


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _pairs(items: list[str] | None, flag: str) -> dict[str, str] | None:
    if not items:
        return None
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"invalid {flag} {item!r}: use KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def _tokenizer_folder(candidate: str | None) -> Path | None:
    if not candidate:
        return None
    folder = Path(candidate).expanduser()
    if (folder / "tiktoken.model").is_file() or (folder / "tokenizer.json").is_file():
        return folder
    return None


def load_tokenizer(args: argparse.Namespace, model_root: str | None) -> tuple[Any, str | None]:
    """(tokenizer or None, the tokenizer id recorded in the result)."""
    from engine.tokenizer import KimiTokenizer

    if args.tokenizer:
        folder = _tokenizer_folder(args.tokenizer)
        if folder is None:
            raise ValueError(f"--tokenizer {args.tokenizer}: not a folder with tiktoken.model or tokenizer.json")
        return KimiTokenizer.from_pretrained(folder), args.tokenizer
    for candidate in (args.model, model_root):
        folder = _tokenizer_folder(candidate)
        if folder is not None:
            return KimiTokenizer.from_pretrained(folder), str(candidate)
    return None, args.tokenizer or args.model


async def served_root(base_url: str, client: Any, headers: dict | None, name: str) -> str | None:
    """The `root` that `/v1/models` reports for model `name` (kdamesh: its checkpoint folder)."""
    import httpx

    try:
        response = await client.get(f"{base_url}/v1/models", headers=headers)
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise RuntimeError(str(exc)) from exc
    return next((m.get("root") for m in models if name in (m.get("id"), m.get("root"))), None)


def _chat_renderer(folder: str | None, tokenizer: Any) -> Any:
    if folder is None or tokenizer is None or not (Path(folder) / "config.json").is_file():
        return None
    try:
        from gateway.chat import ChatRenderer

        return ChatRenderer.from_pretrained(folder, tokenizer)
    except (ValueError, OSError) as exc:
        print(f"WARNING: no chat format for {folder} ({exc}); custom prompts are sent as they are", file=sys.stderr)
        return None


# -- the run -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """The run's checked flags."""

    base_url: str
    api_url: str
    headers: dict[str, str] | None
    goodput: dict[str, float] | None
    selected: list[str]  # the metrics with percentiles
    percentiles: list[float]
    request_func: Any
    chat: bool  # a chat completions endpoint
    metrics_urls: list[str]  # read for the speculative decoding counters (servebench.spec_metrics)
    metrics_explicit: bool  # they came from --metrics-url (one that fails is an error)


def _plan(args: argparse.Namespace) -> _Plan:
    """Checks the flags (ValueError for a bad combination) and applies the shorthands (`--input-len`,
    `--output-len`; the random dataset implies `--ignore-eos`, as in vLLM) to `args`."""
    from servebench.client import request_func_for
    from servebench.metrics import PERCENTILE_METRICS, parse_goodput

    if args.max_concurrency is not None and args.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be greater than 0")
    base_url, api_url = _urls(args)
    selected = (args.percentile_metrics or "ttft,tpot,itl").split(",")
    unknown = [m for m in selected if m not in PERCENTILE_METRICS]
    if unknown:
        raise ValueError(f"unknown --percentile-metrics {unknown}; choose from {', '.join(PERCENTILE_METRICS)}")
    request_func = request_func_for(args.backend, args.endpoint)
    chat = request_func.__name__ == "request_chat_completions"
    suffix = "chat/completions" if chat else "completions"
    if not api_url.endswith(suffix):
        raise ValueError(f"--backend {args.backend} needs an endpoint ending in '{suffix}', got {args.endpoint}")
    if args.prompt_token_ids and chat:
        raise ValueError("--prompt-token-ids needs a completions endpoint")
    plan = _Plan(base_url, api_url, _pairs(args.header, "--header"), parse_goodput(args.goodput), selected,
                 [float(p) for p in args.metric_percentiles.split(",")], request_func, chat,
                 args.metrics_url or [f"{base_url}/metrics"], bool(args.metrics_url))
    if args.input_len is not None:
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.prefix_repetition_output_len = args.custom_output_len = args.output_len
    if args.dataset_name == "random":
        args.ignore_eos = True  # as vLLM: random prompts generate to the requested length
    return plan


async def _model(args: argparse.Namespace, plan: _Plan, client: Any) -> tuple[str | None, str, str | None]:
    """-> (the name sent in requests, the model id, the served model's folder when known)."""
    from servebench.client import fetch_first_model

    model_root = None
    if args.model is None:
        print("Model not specified, fetching first model from server...")
        model_name, model_id = await fetch_first_model(plan.base_url, client, plan.headers)
        print(f"First model name: {model_name}, first model id: {model_id}")
        model_root = model_id
    else:
        model_name, model_id = args.served_model_name, args.model
    if model_root is None and not args.tokenizer and _tokenizer_folder(args.model) is None:
        with contextlib.suppress(RuntimeError):  # the served model's folder, when the server is local
            model_root = await served_root(plan.base_url, client, plan.headers, model_name or model_id)
    return model_name, model_id, model_root


def _run_config(args: argparse.Namespace, plan: _Plan, model_id: str, model_name: str | None):
    from servebench.runner import RunConfig

    sampling = {k: getattr(args, k) for k in ("top_p", "top_k", "min_p", "temperature", "frequency_penalty",
                                              "presence_penalty", "repetition_penalty")
                if getattr(args, k) is not None}
    return RunConfig(api_url=plan.api_url, model_id=model_id, model_name=model_name, request_func=plan.request_func,
                     request_rate=args.request_rate, burstiness=args.burstiness,
                     max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos, logprobs=args.logprobs,
                     extra_body={**sampling, **(args.extra_body or {})} or None, extra_headers=plan.headers,
                     num_warmups=args.num_warmups, seed=args.seed, disable_tqdm=args.disable_tqdm)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from servebench.client import make_client
    from servebench.datasets import get_samples
    from servebench.runner import run_requests
    from servebench.spec_metrics import RunScrape

    random.seed(args.seed)
    plan = _plan(args)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a log line per request
    async with make_client(args.max_concurrency) as client:
        model_name, model_id, model_root = await _model(args, plan, client)
        tokenizer, tokenizer_id = load_tokenizer(args, model_root)
        renderer = None
        if args.dataset_name == "custom" and not args.skip_chat_template:
            folder = _tokenizer_folder(tokenizer_id)
            renderer = _chat_renderer(str(folder) if folder else None, tokenizer)
        requests = get_samples(args, tokenizer, chat_endpoint=plan.chat, chat_renderer=renderer)
        config = _run_config(args, plan, model_id, model_name)
        spec = RunScrape(client, plan.metrics_urls, plan.metrics_explicit, _scrape_headers(plan.headers))
        config.before_main = spec.before
        if args.ready_check_timeout_sec > 0:
            await _ready_check(config, requests[0], client, args.ready_check_timeout_sec)
        run = await run_requests(config, requests, client)
        spec_delta = await spec.delta()
    return _report(args, plan, run, model_id, tokenizer_id, spec_delta)


def _scrape_headers(headers: dict[str, str] | None) -> dict[str, str]:
    """The run's headers and, as for the requests, `OPENAI_API_KEY` as a bearer token (a gateway's /metrics may
    need a key)."""
    import os

    key = os.environ.get("OPENAI_API_KEY")
    return {**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})}


def _report(args: argparse.Namespace, plan: _Plan, run: Any, model_id: str, tokenizer_id: str | None,
            spec_delta: Any = None) -> dict:
    """Prints vLLM's summary (and the first failures), saves the result JSON when asked -> the result."""
    from servebench import results
    from servebench.metrics import calculate_metrics
    from servebench.spec_metrics import spec_decode_result

    metrics, output_lens = calculate_metrics(run.outputs, run.duration, plan.percentiles, plan.goodput)
    measured = results.benchmark_result(metrics, run.outputs, output_lens, run.duration, plan.goodput, plan.selected,
                                        plan.percentiles, args.max_concurrency, args.request_rate)
    if spec_delta is not None:
        measured.update(spec_decode_result(spec_delta))
    failed = [o for o in run.outputs if not o.success]
    if failed:
        print("Failed requests during benchmark run detected (capping to 10):")
        for i, o in enumerate(failed[:10]):
            print(f"Error {i}: {o.error.strip()[-2000:]}")
    print(results.summary(measured, plan.selected, args.max_concurrency, args.request_rate, bool(plan.goodput)),
          flush=True)
    header = results.run_header(backend=args.backend, label=args.label, model_id=model_id, tokenizer_id=tokenizer_id,
                                num_prompts=args.num_prompts, request_rate=args.request_rate,
                                burstiness=args.burstiness, max_concurrency=args.max_concurrency,
                                metadata=args.metadata)
    result = {**header, **measured}
    saved = result if args.save_detailed else results.strip_detailed(result)
    if args.save_result or args.append_result:
        path = results.result_filename(result_filename=args.result_filename, result_dir=args.result_dir,
                                       label=args.label or args.backend, request_rate=args.request_rate,
                                       max_concurrency=args.max_concurrency, model_id=model_id, date=header["date"])
        results.save(saved, path, append=args.append_result)
        print(f"Saved the result to {path}")
    return result


async def _ready_check(config, request, client, timeout_s: float) -> None:
    import time

    from servebench.runner import _input

    deadline = time.monotonic() + timeout_s
    print("Waiting for the endpoint: a test request with the first prompt...")
    while True:
        out = await config.request_func(_input(config, request), client)
        if out.success:
            print("Initial test run completed.")
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the endpoint did not answer the first prompt within {timeout_s} s: {out.error}")
        await asyncio.sleep(1.0)


def main(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(main_async(args))


def run_cli(argv: list[str] | None = None) -> int:
    """Parses `argv`, runs, and returns the exit status: 0 after a run (failed requests are counted in the result, as
    vLLM does), 1 when every request failed, 2 on a usage or connection error."""
    args = build_parser().parse_args(argv)
    return run(args)


def run(args: argparse.Namespace) -> int:
    try:
        result = main(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"kdamesh bench serve: {exc}", file=sys.stderr)
        return 2
    return 1 if result["completed"] == 0 and result["failed"] > 0 else 0
