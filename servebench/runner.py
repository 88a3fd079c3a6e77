"""Load shaping and the benchmark loop (`vllm bench serve`'s `get_request` and `benchmark`).

- Arrival times (`arrival_times`): with `--request-rate inf` every request is sent at t=0. Otherwise the gaps between
  arrivals are drawn from a gamma distribution with shape `--burstiness` and scale 1/(rate·burstiness), so the mean
  gap is 1/rate whatever the burstiness: burstiness 1 is a Poisson process (exponential gaps), < 1 burstier, > 1 more
  regular, `inf` evenly spaced. The first request also waits its drawn gap. As vLLM does, the cumulative times are
  then rescaled so the last arrival is exactly at num_prompts / rate (the achieved offered rate does not depend on the
  seed). Seeded: `numpy.random.default_rng(seed)`.
- `--max-concurrency N`: at most N requests in flight; a request that arrives while N are in flight waits for a slot
  (its `client_queue_time`), so the offered rate can be lower than `--request-rate` when the server is slow.
- The duration is from the first arrival's scheduling to the last response; warm-up requests (`--num-warmups`, the
  first prompt) run before and are not counted. `RunConfig.before_main` (e.g. the first `/metrics` scrape) runs
  between the two.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import numpy as np

from servebench.client import RequestFunc, RequestInput
from servebench.datasets import SampleRequest
from servebench.metrics import RequestOutput


def arrival_times(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send time of each request, in seconds from the start of the run."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    if num_requests <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num_requests
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng(seed)
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    times = np.cumsum(gaps)
    if times[-1] > 0:
        times *= (num_requests / request_rate) / times[-1]
    return times.tolist()


@dataclass
class RunConfig:
    """What one benchmark run sends, and how."""

    api_url: str
    model_id: str
    model_name: str | None
    request_func: RequestFunc
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    extra_body: dict | None = None
    extra_headers: dict | None = None
    num_warmups: int = 0
    seed: int = 0
    disable_tqdm: bool = True
    log: Callable[[str], None] = field(default=lambda s: print(s, flush=True))
    before_main: Callable[[], Awaitable[None]] | None = None  # awaited after the warm-ups, before the timed run


@dataclass
class RunResult:
    outputs: list[RequestOutput]
    duration: float


def _input(config: RunConfig, request: SampleRequest) -> RequestInput:
    return RequestInput(prompt=request.prompt, api_url=config.api_url, prompt_len=request.prompt_len,
                        output_len=request.expected_output_len, model=config.model_id, model_name=config.model_name,
                        logprobs=config.logprobs, ignore_eos=config.ignore_eos, extra_body=config.extra_body,
                        extra_headers=config.extra_headers, request_id=request.request_id or None)


def _progress(total: int, disable: bool):
    if disable:
        return None
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr)


async def run_requests(config: RunConfig, requests: list[SampleRequest], client: httpx.AsyncClient) -> RunResult:
    """Sends `requests` on their arrival schedule and returns every outcome (in request order) and the duration."""
    if config.max_concurrency is not None and config.max_concurrency <= 0:
        raise ValueError("--max-concurrency must be greater than 0")
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else contextlib.nullcontext()

    if config.num_warmups > 0 and requests:
        config.log(f"Warming up with {config.num_warmups} requests...")
        warm = _input(config, requests[0])
        warm.request_id = None

        async def warm_one() -> RequestOutput:
            async with semaphore:
                return await config.request_func(warm, client)

        warm_outputs = await asyncio.gather(*(warm_one() for _ in range(config.num_warmups)))
        failed = [o for o in warm_outputs if not o.success]
        if failed:
            config.log(f"Warm-up: {len(failed)} of {len(warm_outputs)} failed: {failed[0].error.strip()[-500:]}")
        config.log("Warmup run completed.")

    if config.before_main is not None:
        await config.before_main()
    distribution = "Poisson process" if config.burstiness == 1.0 else "Gamma distribution"
    config.log("Starting main benchmark run...")
    config.log(f"Traffic request rate: {config.request_rate}")
    config.log(f"Burstiness factor: {config.burstiness} ({distribution})")
    config.log(f"Maximum request concurrency: {config.max_concurrency}")
    pbar = _progress(len(requests), config.disable_tqdm)
    schedule = arrival_times(len(requests), config.request_rate, config.burstiness, config.seed)

    async def one(request: SampleRequest, arrived: float) -> RequestOutput:
        async with semaphore:
            output = await config.request_func(_input(config, request), client)
        output.client_queue_time = output.start_time - arrived
        if pbar is not None:
            pbar.update(1)
        return output

    start = time.perf_counter()
    tasks = []
    for request, at in zip(requests, schedule):
        delay = start + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request, time.perf_counter())))
    outputs = list(await asyncio.gather(*tasks))
    duration = time.perf_counter() - start
    if pbar is not None:
        pbar.close()
    return RunResult(outputs, duration)
