"""The gateway's request pipeline (`GatewayCore`), shared by the REST API (gateway/app.py) and the gRPC API
(gateway/grpc_api.py).

One chat request: authenticate (API key -> tenant) -> validate (gateway.protocol) -> plan: render the chat template,
sampling, structured output, parsers (gateway.plan) -> derive the tenant's cache salt -> admit (per-tenant rate and
concurrency limits) -> a run through the mesh (gateway.run: P/D decision, prefill -> decode; incremental
detokenisation and stop strings, gateway.text; reasoning / tool-call parsers) -> transport-neutral events
(gateway.events) -> usage and metrics.

Contract:
- `GatewayCore(config, ...)` owns the tokenizer, chat renderer, mesh client, tenant directory, cache salter, rate
  limiter and metrics. `start()` loads what was not given, logs whether the gateway is open, and starts the periodic
  worker health checks and the KV event subscriptions (routing); `close()` stops them (and closes a mesh it created).
- `authenticate(authorization)` -> `Principal`, or `ApiError` 401 (open mode: every request is anonymous).
- `await prepare(fn, *args)`: CPU work of a request in the bounded preparation pool (gateway/prepare.py; 503
  `server_busy` / `prepare_timeout` with `Retry-After`; its large lane on preparation processes unless the core was
  given its tokenizer, which those processes could not load), never on the event loop: the fronts decode bodies and
  build completion jobs there, and `plan_chat` / `tokenize` render, tokenise and decode images there.
- `await plan_chat(request, size)` -> `ChatPlan` (gateway.plan; `size`: the body's bytes, to which the fetched
  images add, choose the preparation lane); `ApiError` 400 for what cannot be served. Its image URLs
  that are not data: URLs are fetched first (`MediaFetcher`, gateway/media_fetch.py: the one place they are
  allowed or refused), so the event loop never waits on them; `await tokenize(request)` does the same for a chat.
- `chat(principal, plan, ...)` / `complete(principal, job, ...)` admit the request (`ApiError` 429 with a
  `Retry-After` header when over a limit; 400 for a completion prompt beyond the context; the per-request caps of
  gateway/caps.py: 400 for too many prompts or sequences, 413 for a prompt over `--max-prompt-tokens`) and return a run
  (`ChatRun` / `CompletionRun`; its lifecycle is `gateway.run.Run`'s). With a `RequestTrace` (`trace(...)`) the
  run opens its root span here and finishes it on `close()`.
- The cache salt passed to the mesh is derived from the authenticated principal (`CacheSalter`); a client's
  `cache_salt` is only mixed in. Tenants therefore never share prefix-cache entries.
- Pools given as `dns:///NAME:PORT` (gateway/discovery.py, `discovery`): `start()` first waits for each pool's
  first addresses and builds the mesh over them, then keeps re-resolving (also right after a worker fails its
  health check) into `MeshClient.set_worker_addresses`; `close()` stops that.
- `tokenize` (async) / `detokenize` / `model_cards` answer vLLM's /tokenize, /detokenize and /v1/models.
- `max_model_len` is what the workers report, never recomputed here: the smallest context length over every worker
  of both pools that answered `WorkerInfoService.Info` (`WorkerPool.max_model_len`, asked at `start()` and after
  each health round), capped by `config.max_model_len` when that optional upper bound is set. None while no worker
  has answered: /v1/models and /tokenize then report `max_model_len: null` (gRPC: 0) and admission answers 503
  with `Retry-After` (`gateway.plan.check_prompt_length`), so a prompt over the workers' limit is always the
  gateway's 400, never a worker's error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from engine.formats.markers import OUTPUT_MARKERS
from engine.tokenizer import KimiTokenizer
from gateway.chat import ChatRenderer, read_family
from gateway.chat_run import ChatRun
from gateway.completion_run import CompletionRun
from gateway.config import GatewayConfig
from gateway.discovery import Discovery
from gateway.media_fetch import MediaFetcher
from gateway.mesh_client import MeshClient
from gateway.metrics import GatewayMetrics
from gateway.plan import ChatPlan, ChatPlanner, check_prompt_length, planner_for
from gateway.protocol.completions import encode_prompt_text
from gateway.prepare import PrepPool
from gateway.protocol import (ApiError, ChatCompletionRequest, CompletionJob, TokenizeChatRequest,
                              TokenizeCompletionRequest)
from gateway.ratelimit import Lease, RateLimiter, RateLimitExceeded
from gateway.request_trace import RequestTrace
from gateway.run import RunContext
from gateway.tenancy import AuthError, CacheSalter, Principal, TenantDirectory
from telemetry import tracing

log = logging.getLogger(__name__)
T = TypeVar("T")


class GatewayCore:
    def __init__(self, config: GatewayConfig, *, mesh: MeshClient | None = None,
                 tokenizer: KimiTokenizer | None = None, tenants: TenantDirectory | None = None,
                 salter: CacheSalter | None = None, metrics: GatewayMetrics | None = None,
                 env: Mapping[str, str] | None = None, discovery: Discovery | None = None):
        self.config = config
        self.discovery = discovery or Discovery(config)
        self.mesh = mesh
        self.tokenizer = tokenizer
        self._own_tokenizer = tokenizer is None  # loaded from config.model by `start()`
        self.renderer: ChatRenderer | None = None
        self.planner: ChatPlanner | None = None
        self.marker_ids: frozenset[int] = frozenset()  # special ids the output parsers read (others are dropped)
        self.metrics = metrics or GatewayMetrics(model_name=config.model_name)
        self.tracer = tracing.get_tracer("kdamesh.gateway")
        env = os.environ if env is None else env
        self.tenants = tenants if tenants is not None else TenantDirectory.from_config(
            config.api_keys, config.api_keys_file, config.tenant_limits())
        self.salter = salter if salter is not None else CacheSalter.from_env(env)
        self.limiter = RateLimiter(self.tenants.limits())
        self.family = read_family(config.model)
        self.caps = config.request_caps()
        self.fetcher = MediaFetcher(config.media_fetch())
        self.prep = PrepPool(config.prepare_settings())
        self.created = int(time.time())
        self._own_mesh = mesh is None
        self._health_task: asyncio.Task | None = None
        self._started = False

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self.prep.start()
        if self.tokenizer is None:
            self.tokenizer = KimiTokenizer.from_pretrained(self.config.model)
        self.planner = planner_for(self.config, self.tokenizer, lambda: self.max_model_len)
        self.renderer = self.planner.renderer
        specials = self.tokenizer.special_tokens
        if self._own_tokenizer:  # the processes load the same one from config.model (a given one stays on threads)
            self.prep.use_processes(self.config, {"tokenizer": self.tokenizer, "renderer": self.renderer,
                                                  "planner": self.planner}, lambda: self.max_model_len)
        self.marker_ids = frozenset(specials[m] for m in OUTPUT_MARKERS if m in specials)
        if self.mesh is None:
            self.mesh = (await self.discovery.resolve_config()).make_mesh()
        self.mesh.on_health_change = self._health_changed
        for address in list(self.mesh.decoders) + list(self.mesh.prefillers):
            self._health_changed(address, True)
        await self.mesh.refresh_info()  # the workers' limits before the first request, when they are up
        self._health_task = asyncio.create_task(self.mesh.run_health_checks(self.config.health_check_interval_s))
        self.mesh.start_kv_events()
        self._log_start()
        self.discovery.start(self.mesh)

    def _log_start(self) -> None:
        log.info(self.tenants.describe())
        if self.salter.ephemeral:
            log.info("cache salts use a per-process secret (set KDAMESH_CACHE_SALT_SECRET to share prefix-cache "
                     "hits across gateway replicas and restarts)")
        parsers = self.config.tool_call_parser or self.config.reasoning_parser
        expected = self.renderer.output_format
        if parsers and parsers != expected:
            log.warning("the configured output parser %r does not match this model's output format %r", parsers,
                        expected)
        log.info("gateway serving %s (%s, %s mode) over decode %s, prefill %s", self.config.model_name, self.family,
                 self.config.mode, list(self.config.decode_addresses), list(self.config.prefill_addresses))

    async def close(self) -> None:
        if self.mesh is not None:
            await self.mesh.stop_kv_events()
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
            self._health_task = None
        await self.fetcher.close()
        self.prep.close()
        await self.discovery.stop()
        if self._own_mesh and self.mesh is not None:
            await self.mesh.close()
            self.mesh = None
        self._started = False

    def _health_changed(self, address: str, healthy: bool) -> None:
        pool = "decode" if address in self.mesh.decoders else "prefill"
        self.metrics.worker_healthy.labels(pool, address).set(1 if healthy else 0)
        if not healthy:
            self.discovery.notify_failure(address)  # pods may have moved: re-resolve now

    @property
    def max_model_len(self) -> int | None:
        """The context length the workers serve (see the module docstring); None while none has reported."""
        reported = self.mesh.max_model_len() if self.mesh is not None else None
        cap = self.config.max_model_len
        return reported if reported is None or cap is None else min(reported, cap)

    @property
    def served(self) -> set[str]:
        return self.config.served_names

    def trace(self, endpoint: str, request_id: str, headers: Mapping[str, str] | None = None) -> RequestTrace:
        """The telemetry of one API request to `endpoint` (see gateway.request_trace)."""
        return RequestTrace(self.tracer, self.config.model_name, endpoint, request_id, headers)

    # -- tenancy -----------------------------------------------------------------------------------------------

    def authenticate(self, authorization: str | None) -> Principal:
        try:
            return self.tenants.authenticate(authorization)
        except AuthError as exc:
            raise ApiError(401, exc.message, code="invalid_api_key" if exc.kind == "invalid_key" else
                           "missing_api_key", type_="authentication_error",
                           headers={"WWW-Authenticate": "Bearer"}) from None

    def tenant_salt(self, principal: Principal, client_salt: str | None) -> bytes:
        return bytes.fromhex(self.salter.cache_salt(principal, client_salt))

    def _admit(self, principal: Principal, prompt_tokens: int, max_tokens: int | None, n: int, api: str) -> Lease:
        budget = max_tokens if max_tokens is not None else max(0, (self.max_model_len or 0) - prompt_tokens)
        try:
            lease = self.limiter.acquire(principal.tenant, prompt_tokens, budget * n)
        except RateLimitExceeded as exc:
            self.metrics.rate_limited.labels(principal.tenant, exc.limit_kind).inc()
            raise ApiError(429, str(exc), code="rate_limit_exceeded", type_="rate_limit_error",
                           headers={"Retry-After": exc.retry_after_header()}) from None
        self.metrics.running.labels(api).inc()
        return lease

    # -- runs --------------------------------------------------------------------------------------------------

    def run_context(self) -> RunContext:
        """What a run sees of the gateway (gateway.run); the mesh is read at each call (discovery may rebuild it)."""
        return RunContext(generate=lambda request: self.mesh.generate(request), tokenizer=self.tokenizer,
                          marker_ids=self.marker_ids, metrics=self.metrics, model=self.config.model_name,
                          request_timeout_s=self.config.request_timeout_s)

    async def prepare(self, fn: Callable[..., T], *args: Any, size: int = 0) -> T:
        """`fn(*args)` in the preparation pool, never on the event loop (gateway/prepare.py); `size`: the request's
        bytes (its lane)."""
        return await self.prep.run(fn, *args, size=size)

    async def plan_chat(self, request: ChatCompletionRequest, size: int = 0) -> ChatPlan:
        fetched = await self._fetch_media(request.messages)
        size += sum(len(data) for data in fetched.values())
        return await self.prepare(self.planner.plan, request, fetched, size=size)

    async def _fetch_media(self, messages: list) -> Mapping[str, bytes]:
        """The bytes of the image URLs that are not data: URLs (none for a text-only model: the planner refuses)."""
        media = self.planner.media
        if media is None:
            return {}
        return await self.fetcher.fetch(messages, media.max_images, media.processor.max_image_bytes)

    def chat(self, principal: Principal, plan: ChatPlan, *, api: str = "rest",
             trace: RequestTrace | None = None) -> ChatRun:
        request = plan.request
        if trace is not None:
            trace.start_span("chat", principal.tenant, plan.sampling, request.n, request.stream)
        self.caps.check([len(plan.prompt_ids)], request.n, "messages")
        lease = self._admit(principal, len(plan.prompt_ids), request.completion_limit, request.n, api)
        salt = self.tenant_salt(principal, request.cache_salt)
        return ChatRun(self.run_context(), principal, lease, plan,
                       f"chatcmpl-{request.request_id or uuid.uuid4().hex}", salt, api, trace)

    def complete(self, principal: Principal, job: CompletionJob, *, api: str = "rest",
                 trace: RequestTrace | None = None) -> CompletionRun:
        request = job.request
        if trace is not None:
            trace.start_span("text_completion", principal.tenant, job.sampling, request.n, request.stream)
        self.caps.check([len(p) for p in job.prompts], request.n, "prompt")
        for prompt in job.prompts:
            check_prompt_length(len(prompt), job.max_tokens, self.max_model_len, "prompt")
        lease = self._admit(principal, sum(len(p) for p in job.prompts), job.max_tokens, request.n * len(job.prompts),
                            api)
        salt = self.tenant_salt(principal, request.cache_salt)
        return CompletionRun(self.run_context(), principal, lease, job,
                             f"cmpl-{request.request_id or uuid.uuid4().hex}", salt, api, trace)

    # -- tokenizer and models ----------------------------------------------------------------------------------

    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest, size: int = 0) -> list[int]:
        if isinstance(request, TokenizeCompletionRequest):  # what /v1/completions feeds the model
            return await self.prepare(encode_prompt_text, self.tokenizer, request.prompt,
                                      request.split_special_tokens, size=size)
        fetched = await self._fetch_media(request.messages)
        size += sum(len(data) for data in fetched.values())
        return (await self.prepare(self.planner.render, request, fetched, size=size)).token_ids

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def model_cards(self) -> list[dict]:
        return [{"id": self.config.model_name, "object": "model", "created": self.created, "owned_by": "kdamesh",
                 "root": self.config.model, "parent": None, "max_model_len": self.max_model_len,
                 "family": self.family}]
