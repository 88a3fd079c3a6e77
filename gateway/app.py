"""The gateway's REST front (FastAPI): the OpenAI-compatible API over the mesh.

This is the gateway of the mesh issue — `GET /health`, `GET /v1/models`, `POST /v1/completions` — built so the
gateway issue can extend it (chat completions, auth and tenants, tokenize, metrics) on the same `create_app`.

Contract:
- `create_app(config, mesh=None, tokenizer=None)` builds the app; without `mesh` it connects a `MeshClient` to
  `config.decode_addresses` / `config.prefill_addresses` at start-up and closes it at shutdown.
- `GET /health`: 200 `{"status": "ok", "workers": {...}}` when every mesh worker reports SERVING, else 503.
- `GET /v1/models`: the served model (`config.model_name`).
- `POST /v1/completions` (OpenAI legacy completions, with vLLM's extra sampling fields): `prompt` as text, a list of
  texts, token ids, or a list of token-id lists; `n` choices per prompt (choice index = prompt index * n + i);
  `stream` as Server-Sent Events ending in `data: [DONE]`, `stream_options.include_usage` adding a trailer chunk with
  `choices: []`; `usage.prompt_tokens_details.cached_tokens`; `logprobs` (int), `echo`, `stop`, `seed`, ...
  Text is detokenised here, incrementally, and stop strings are matched on it (held back while they may still match,
  never emitted); a stop token's text is not part of the output.
- Errors use the OpenAI envelope `{"error": {"message", "type", "param", "code"}}`: malformed JSON or fields 400,
  a prompt beyond the context 400 with code `context_length_exceeded`, unknown model 404, mesh unavailable 503,
  deadline 504. Never a 500 for bad input. An error after a stream started is sent as a final `data: {"error": …}`.
- A client that disconnects from a stream cancels its mesh calls (decode aborts the request).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.tokenizer import IncrementalDetokenizer, KimiTokenizer
from gateway.mesh_client import MeshClient, MeshError, MeshRequest, PDDecider, TokenEvent
from protos import common_pb2

log = logging.getLogger(__name__)

MODES = ("disaggregated", "colocated")
MAX_LOGPROBS = 20
HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400,
               grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.UNIMPLEMENTED: 501,
               grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
               grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.CANCELLED: 499}


@dataclass(frozen=True)
class GatewayConfig:
    # The model folder (its tokenizer is used here) and the name clients use for it (None: the folder's name).
    model: str
    decode_addresses: tuple[str, ...]
    prefill_addresses: tuple[str, ...] = ()
    served_model_name: str | None = None
    # "disaggregated": prefill workers + P/D decider; "colocated": every request prefills on its decode worker.
    mode: str = "disaggregated"
    # Remote prefill only when at least this many prompt tokens are not in the decode worker's prefix cache.
    pd_min_uncached_tokens: int = 256
    # Colocate when this many prefills are already in flight from this gateway (0: no limit).
    pd_max_prefill_inflight: int = 0
    host: str = "127.0.0.1"
    http_port: int = 8000
    # Deadline of one request through the mesh (seconds).
    request_timeout_s: float = 600.0
    # TTL of handoff objects (milliseconds); 0: the cache service's default (30 s).
    handoff_ttl_ms: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not self.decode_addresses:
            raise ValueError("the gateway needs at least one decode worker address")
        if self.mode == "disaggregated" and not self.prefill_addresses:
            raise ValueError("disaggregated mode needs at least one prefill worker address")
        if self.pd_min_uncached_tokens < 0 or self.pd_max_prefill_inflight < 0:
            raise ValueError("pd_min_uncached_tokens and pd_max_prefill_inflight must be >= 0")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def make_mesh(self) -> MeshClient:
        prefill = self.prefill_addresses if self.mode == "disaggregated" else ()
        return MeshClient(self.decode_addresses, prefill,
                          PDDecider(self.pd_min_uncached_tokens, self.pd_max_prefill_inflight), self.handoff_ttl_ms)


# -- errors ------------------------------------------------------------------------------------------------------


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def mesh_api_error(exc: MeshError) -> ApiError:
    status = HTTP_STATUS.get(exc.code, 500)
    code = "context_length_exceeded" if "maximum context length" in exc.message else exc.code.name.lower()
    param = "prompt" if code == "context_length_exceeded" else None
    return ApiError(status, exc.message, param=param, code=code)


# -- request parsing ---------------------------------------------------------------------------------------------


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Fields:
    """Typed reads of a JSON object; a wrong type is a 400 naming the field."""

    def __init__(self, body: dict):
        self.body = body

    def get(self, name: str, check, what: str, default=None):
        value = self.body.get(name)
        if value is None:
            return default
        if not check(value):
            raise ApiError(400, f"'{name}' must be {what}, got {json.dumps(value)[:100]}", param=name)
        return value

    def int(self, name, default=None, lo=None, hi=None):
        v = self.get(name, _is_int, "an integer", default)
        if v is not None and ((lo is not None and v < lo) or (hi is not None and v > hi)):
            raise ApiError(400, f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}", param=name)
        return v

    def num(self, name, default=None):
        return self.get(name, _is_num, "a number", default)

    def bool(self, name, default=False):
        return self.get(name, lambda v: isinstance(v, bool), "a boolean", default)


@dataclass
class CompletionJob:
    """A parsed /v1/completions request."""

    model: str
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    sampling: common_pb2.SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    logprobs: int | None
    stop: list[str]
    min_tokens: int
    include_stop_str: bool
    skip_special_tokens: bool
    ignore_eos: bool
    stop_token_ids: list[int] = field(default_factory=list)


def parse_completion(body, tokenizer: KimiTokenizer, served: set[str]) -> CompletionJob:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    f = _Fields(body)
    model = f.get("model", lambda v: isinstance(v, str), "a string")
    if model is None:
        raise ApiError(400, "'model' is required", param="model")
    if model not in served:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found",
                       type_="NotFoundError")
    prompts, texts = _parse_prompt(body.get("prompt"), tokenizer)
    if body.get("suffix") is not None:
        raise ApiError(400, "'suffix' is not supported", param="suffix")
    n = f.int("n", 1, lo=1, hi=128)
    best_of = f.int("best_of", None, lo=1)
    if best_of is not None and best_of != n:
        raise ApiError(400, "'best_of' other than n is not supported", param="best_of")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    stop = stop or []
    stop_ids = f.get("stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v),
                     "a list of token ids", [])
    logprobs = f.int("logprobs", None, lo=0, hi=MAX_LOGPROBS)
    options = f.get("stream_options", lambda v: isinstance(v, dict), "an object", {})
    stream = f.bool("stream")
    if options and not stream:
        raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options")
    sampling = common_pb2.SamplingParams(
        min_tokens=f.int("min_tokens", 0, lo=0), presence_penalty=f.num("presence_penalty", 0.0),
        frequency_penalty=f.num("frequency_penalty", 0.0), stop=stop, stop_token_ids=stop_ids,
        ignore_eos=f.bool("ignore_eos"), include_stop_str_in_output=f.bool("include_stop_str_in_output"),
        logprobs=logprobs is not None, top_logprobs=logprobs or 0, n=n,
        skip_special_tokens=f.bool("skip_special_tokens", True))
    max_tokens = f.int("max_tokens", 16, lo=1)
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
        value = f.num(name)
        if value is not None:
            setattr(sampling, name, float(value))
    top_k = f.int("top_k", None, lo=-1)
    if top_k is not None:
        sampling.top_k = top_k
    seed = f.int("seed", None)
    if seed is not None:
        sampling.seed = seed % (1 << 64)
    f.get("user", lambda v: isinstance(v, str), "a string")
    return CompletionJob(model=model, prompts=prompts, prompt_texts=texts, sampling=sampling, n=n, stream=stream,
                         include_usage=bool(_Fields(options).bool("include_usage")), echo=f.bool("echo"),
                         logprobs=logprobs, stop=stop, min_tokens=sampling.min_tokens,
                         include_stop_str=sampling.include_stop_str_in_output,
                         skip_special_tokens=sampling.skip_special_tokens, ignore_eos=sampling.ignore_eos,
                         stop_token_ids=list(stop_ids))


def _parse_prompt(prompt, tokenizer: KimiTokenizer) -> tuple[list[list[int]], list[str | None]]:
    vocab = tokenizer.vocab_size

    def ids(p: list) -> list[int]:
        if not p:
            raise ApiError(400, "a prompt must not be empty", param="prompt")
        if not all(_is_int(t) and 0 <= t < vocab for t in p):
            raise ApiError(400, f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        return list(p)

    def text(s: str) -> list[int]:
        if not s:
            raise ApiError(400, "a prompt must not be empty", param="prompt")
        return tokenizer.encode(s)

    if isinstance(prompt, str):
        return [text(prompt)], [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return [text(p) for p in prompt], list(prompt)
        if all(_is_int(t) for t in prompt):
            return [ids(prompt)], [None]
        if all(isinstance(p, list) for p in prompt):
            return [ids(p) for p in prompt], [None] * len(prompt)
    raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists",
                   param="prompt")


# -- text of one choice ------------------------------------------------------------------------------------------


class ChoiceText:
    """Detokenises one choice incrementally, matches stop strings and releases text that can no longer be part of
    one (the same rules as the engine's `OutputState`)."""

    def __init__(self, tokenizer: KimiTokenizer, job: CompletionJob):
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, job.skip_special_tokens)
        self.stop = job.stop
        self.include_stop = job.include_stop_str
        self.min_tokens = job.min_tokens
        self.stop_ids = set(job.stop_token_ids) | (set() if job.ignore_eos else set(tokenizer.stop_token_ids))
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0
        self.token_ids: list[int] = []
        self.logprobs: list[common_pb2.TokenLogprob] = []
        self.finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, event: TokenEvent) -> str:
        """Takes an event's tokens; returns the text newly safe to emit."""
        for i, token in enumerate(event.token_ids):
            if self.finished:
                break
            self.token_ids.append(token)
            if i < len(event.logprobs):
                self.logprobs.append(event.logprobs[i])
            last = i == len(event.token_ids) - 1
            min_reached = len(self.token_ids) > self.min_tokens
            if last and event.finish_reason == "stop" and token in self.stop_ids and min_reached:
                self.finish_reason = "stop"  # a stop token: its text is not output
                break
            before = len(self.text)
            self.text += self.detok.push(token)
            if self.stop and min_reached and self._match_stop(before):
                self.finish_reason = "stop"
        if event.finish_reason is not None and not self.finished:
            if event.finish_reason != "stop":
                self.text += self.detok.finish()
            self.finish_reason = event.finish_reason
        visible = len(self.text) if self.finished else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted:visible]
        self.emitted = max(self.emitted, visible)
        return delta

    def _match_stop(self, old_len: int) -> bool:
        start = max(0, old_len - self.holdback)
        found = [(self.text.find(s, start), s) for s in self.stop]
        found = [(i, s) for i, s in found if i >= 0]
        if not found:
            return False
        i, s = min(found)
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return True

    def openai_logprobs(self, start: int, offset: int) -> dict:
        """OpenAI completions `logprobs` for tokens [start:] (text offsets counted from `offset`)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for lp in self.logprobs[start:]:
            piece = self.tokenizer.decode([lp.token_id])
            tokens.append(piece)
            token_lps.append(lp.logprob)
            tops.append({self.tokenizer.decode([t.token_id]): t.logprob for t in lp.top_logprobs})
            offsets.append(offset)
            offset += len(piece)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


# -- the app -----------------------------------------------------------------------------------------------------


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def create_app(config: GatewayConfig, mesh: MeshClient | None = None,
               tokenizer: KimiTokenizer | None = None) -> FastAPI:
    state: dict = {"mesh": mesh, "tokenizer": tokenizer}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        own = state["mesh"] is None
        if state["tokenizer"] is None:
            state["tokenizer"] = KimiTokenizer.from_pretrained(config.model)
        if own:
            state["mesh"] = config.make_mesh()
        log.info("gateway serving %s (%s mode) over decode %s, prefill %s", config.model_name, config.mode,
                 list(config.decode_addresses), list(config.prefill_addresses))
        try:
            yield
        finally:
            if own:
                await state["mesh"].close()

    app = FastAPI(title="kdamesh gateway", lifespan=lifespan)
    app.state.gateway = state
    created = int(time.time())
    served = {config.model_name, config.model}

    @app.get("/health")
    async def health():
        workers = await state["mesh"].health()
        ok = all(workers.values())
        return JSONResponse({"status": "ok" if ok else "unavailable", "workers": workers},
                            status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": created,
                                            "owned_by": "kdamesh", "root": config.model, "parent": None}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
            job = parse_completion(body, state["tokenizer"], served)
        except ApiError as exc:
            return exc.response()
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        run = _CompletionRun(config, state["mesh"], state["tokenizer"], job, completion_id)
        if job.stream:
            return StreamingResponse(run.sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            return JSONResponse(await run.collect())
        except MeshError as exc:
            return mesh_api_error(exc).response()

    return app


class _CompletionRun:
    """One /v1/completions request: its prompts through the mesh, merged into choices."""

    def __init__(self, config: GatewayConfig, mesh: MeshClient, tokenizer: KimiTokenizer, job: CompletionJob,
                 completion_id: str):
        self.config, self.mesh, self.tokenizer, self.job = config, mesh, tokenizer, job
        self.id = completion_id
        self.created = int(time.time())
        self.choices = {p * job.n + i: ChoiceText(tokenizer, job) for p in range(len(job.prompts))
                        for i in range(job.n)}
        self.usage = [None] * len(job.prompts)

    def _prompt_echo(self, p: int) -> str:
        text = self.job.prompt_texts[p]
        return text if text is not None else self.tokenizer.decode(self.job.prompts[p])

    async def _events(self) -> AsyncIterator[tuple[int, TokenEvent]]:
        """(prompt index, event) from every prompt's mesh request, merged as they come."""
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(p: int) -> None:
            request = MeshRequest(request_id=f"{self.id}-{p}", prompt_token_ids=tuple(self.job.prompts[p]),
                                  sampling=self.job.sampling, model=self.config.model_name,
                                  timeout_s=self.config.request_timeout_s)
            try:
                async with aclosing(self.mesh.generate(request)) as events:
                    async for event in events:
                        await queue.put((p, event))
                        if all(self.choices[p * self.job.n + i].finished for i in range(self.job.n)):
                            break  # e.g. a stop string matched here: cancel the rest
            except MeshError as exc:
                await queue.put(exc)
            finally:
                await queue.put(done)

        tasks = [asyncio.create_task(pump(p)) for p in range(len(self.job.prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, MeshError):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _apply(self, p: int, event: TokenEvent) -> tuple[int, str, ChoiceText]:
        index = p * self.job.n + event.index
        choice = self.choices[index]
        was_finished = choice.finished
        delta = "" if was_finished else choice.add(event)
        if event.usage is not None:
            self.usage[p] = event.usage
        return index, delta, choice

    def _usage(self) -> dict:
        prompt = sum(len(p) for p in self.job.prompts)
        completion = sum(len(c.token_ids) for c in self.choices.values())
        cached = sum(u.cached_tokens for u in self.usage if u is not None)
        return _usage(prompt, completion, cached)

    async def collect(self) -> dict:
        async with aclosing(self._events()) as events:
            async for p, event in events:
                self._apply(p, event)
        choices = []
        for index, c in sorted(self.choices.items()):
            p = index // self.job.n
            echo = self._prompt_echo(p) if self.job.echo else ""
            logprobs = c.openai_logprobs(0, len(echo)) if self.job.logprobs is not None else None
            choices.append({"index": index, "text": echo + c.text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason or "abort", "stop_reason": None})
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.config.model_name,
                "choices": choices, "usage": self._usage()}

    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        body = {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.config.model_name, "choices": choices}
        if usage is not None or self.job.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    async def sse(self) -> AsyncIterator[str]:
        echoed: set[int] = set()
        finish_sent: set[int] = set()
        sent_logprobs = {i: 0 for i in self.choices}
        sent_offset = {i: 0 for i in self.choices}
        try:
            async with aclosing(self._events()) as events:
                async for p, event in events:
                    index, delta, choice = self._apply(p, event)
                    if index in finish_sent:
                        continue
                    if self.job.echo and index not in echoed:
                        echoed.add(index)
                        delta = self._prompt_echo(p) + delta
                    if not delta and not choice.finished:
                        continue
                    logprobs = None
                    if self.job.logprobs is not None:
                        logprobs = choice.openai_logprobs(sent_logprobs[index], sent_offset[index])
                        sent_logprobs[index] = len(choice.logprobs)
                    sent_offset[index] += len(delta)
                    if choice.finished:
                        finish_sent.add(index)
                    yield self._chunk([{"index": index, "text": delta, "logprobs": logprobs,
                                        "finish_reason": choice.finish_reason, "stop_reason": None}])
            if self.job.include_usage:
                yield self._chunk([], self._usage())
        except MeshError as exc:
            yield f"data: {json.dumps(mesh_api_error(exc).body())}\n\n"
        yield "data: [DONE]\n\n"


# -- running it --------------------------------------------------------------------------------------------------


async def serve(config: GatewayConfig, log_level: str = "info") -> None:
    """Runs the gateway with uvicorn until SIGINT/SIGTERM."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(config), host=config.host, port=config.http_port,
                                           log_level=log_level.lower(), timeout_graceful_shutdown=5))
    await server.serve()
