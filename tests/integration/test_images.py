"""K3 images end to end, over an in-process tiny-k3 mesh (and the gateway on it).

- Mesh: the same image twice reports cached tokens covering its features and gives the same tokens; a different
  image with the same text (negative control) hits nothing past the text before the image and changes the tokens;
  disaggregated (prefill -> decode) equals colocated with an image.
- Gateway: an OpenAI `image_url` data-URL part through `/v1/chat/completions` with the official `openai` client
  returns a completion whose greedy text equals the model-level greedy (`SequenceDriver` fed the encoder's rows)
  on the same expanded prompt, and so does the gRPC API through the SDK (inline image bytes), from the cache;
- Workers: a bad `MediaItem` (bytes that are no image, a span that does not match the image, a hash that is not
  sha256) is INVALID_ARGUMENT on both routes, and the next request is served; every bad-image kind is its 4xx
  naming the part, and the workers keep serving; without the flags an http(s) or file: URL is 400 naming
  `--allowed-media-domains` / `--allowed-local-media-path` (allowed URLs: test_image_urls.py).
"""

from __future__ import annotations

import base64

import grpc
import httpx
import openai
import pytest
from PIL import Image

import sdk
from engine.model.loader import LoadConfig, load_model
from engine.model.presets import MEDIA_ID
from engine.tokenizer import KimiTokenizer
from engine.vision.encoder import media_inputs
from engine.vision.loader import load_vision
from engine.vision.processor import ProcessorConfig, decode_image, preprocess, to_tensors
from protos import common_pb2
from gateway.media import MediaConfig
from gateway.mesh_client import MeshError
from gateway.protocol import ChatCompletionRequest
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh, greedy
from tests.model_driver import SequenceDriver
from tests.unit.vision.images import encode, make_image

MODEL = "tiny-k3"
STEPS = 8
BLOCK = 16  # the workers' block size (EngineArgs default)
A, C = encode(make_image("RGB", 224, 168, 1)), encode(make_image("RGB", 224, 168, 7))  # 48 rows each
TRUNCATED = encode(make_image("RGB", 84, 56, 2))[:200]

tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(*urls: str, text: str = "Describe this picture in detail, with every colour, shape and texture you can see in "
                                         "it, and then say what it might show.") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url, "detail": "high"}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]  # text after: blocks past it


def planned(gw, messages: list[dict]):
    """The gateway's plan of a chat request: expanded prompt ids and media items."""
    plan = gw.core.planner.plan(ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": messages, "max_tokens": STEPS}))
    return plan.prompt_ids, plan.media


def test_cache_hits_and_disaggregated_equals_colocated(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3, parsers=False) as gw:
            ids, media = planned(gw, chat(data_url(A)))
            other_ids, other = planned(gw, chat(data_url(C)))
            assert other_ids == ids and other[0].content_hash != media[0].content_hash
            first = await mesh.run(ids, greedy(STEPS), media=media)
            again = await mesh.run(ids, greedy(STEPS), media=media)
            end = media[0].token_offset + media[0].num_tokens
            assert again.ids == first.ids and again.usage.cached_tokens >= end // BLOCK * BLOCK > media[0].token_offset
            changed = await mesh.run(other_ids, greedy(STEPS), media=other)
            assert changed.usage.cached_tokens <= media[0].token_offset // BLOCK * BLOCK
            assert changed.ids != first.ids  # negative control: the image matters
            local = await mesh.run(ids, greedy(STEPS), route="local", media=media)
            assert local.route == "local" and first.route == "remote" and local.ids == first.ids
    run(main(), timeout_s=150)


def test_workers_refuse_bad_media_and_keep_serving(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3, parsers=False) as gw:
            ids, media = planned(gw, chat(data_url(A)))
            good = media[0]
            bad = {"not an image": common_pb2.MediaItem(content_hash=good.content_hash, token_offset=good.token_offset,
                                                        num_tokens=good.num_tokens, data=b"garbage"),
                   "short span": common_pb2.MediaItem(content_hash=good.content_hash, token_offset=good.token_offset,
                                                      num_tokens=good.num_tokens - 1, data=good.data),
                   "bad hash": common_pb2.MediaItem(content_hash=b"x", token_offset=good.token_offset,
                                                    num_tokens=good.num_tokens, data=good.data)}
            for name, item in bad.items():
                for route in ("remote", "local"):
                    with pytest.raises(MeshError) as info:
                        await mesh.run(ids, greedy(2), route=route, media=(item,))
                    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, (name, route)
            assert len((await mesh.run(ids, greedy(2), media=media)).ids) == 2
            assert len((await mesh.run(ids, greedy(2), route="local", media=media)).ids) == 2
    run(main(), timeout_s=150)


def model_greedy(model_dir, ids: list[int], images: list[bytes]) -> list[int]:
    config = ProcessorConfig()
    model = load_model(model_dir, LoadConfig(dtype="float32"))
    encoder = load_vision(model_dir, LoadConfig(dtype="float32"))
    pixel_values, grid_thws = to_tensors([preprocess(decode_image(d, config), config) for d in images])
    mm = media_inputs(ids, encoder(pixel_values, grid_thws), MEDIA_ID)
    return SequenceDriver(model, max_seqs=1).greedy(0, ids, STEPS, mm=mm)


def test_openai_client_image_equals_model_greedy(tiny_k3):
    async def main():
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3, parsers=False) as gw:
            client = openai.AsyncOpenAI(base_url=gw.openai_base_url, api_key="unused", max_retries=0, timeout=60)
            messages = chat(data_url(A))
            reply = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=STEPS,
                                                         temperature=0, extra_body={"ignore_eos": True})
            await client.close()
            async with sdk.AsyncClient(gw.grpc_address) as grpc_client:  # the SDK sends the bytes inline
                whole = await grpc_client.chat(MODEL, messages, sampling=sdk.Sampling(max_tokens=STEPS, temperature=0,
                                                                                    ignore_eos=True))
            ids, _ = planned(gw, messages)
            return reply, whole, ids
    reply, whole, ids = run(main(), timeout_s=150)
    assert reply.usage.prompt_tokens == len(ids) and reply.usage.completion_tokens == STEPS
    want = KimiTokenizer.from_pretrained(tiny_k3).decode(model_greedy(tiny_k3, ids, [A]), skip_special_tokens=True)
    assert want and reply.choices[0].message.content == want
    assert whole.choices[0].message.content == want and whole.usage.cached_tokens >= len(ids) // BLOCK * BLOCK


BAD = {  # name -> (url, status, code)
    "not base64": ("data:image/png;base64,@@@@", 400, "not_an_image"),
    "not an image": (data_url(b"hello, not a picture"), 400, "not_an_image"),
    "truncated": (data_url(TRUNCATED), 400, "truncated"),
    "bad dimensions": (data_url(encode(make_image("RGB", 300, 1, 3))), 400, "bad_dimensions"),
    "too many bytes": (data_url(encode(make_image("RGB", 400, 400, 4))), 413, "too_many_bytes"),
    "too many pixels": (data_url(encode(Image.new("RGB", (300, 300)))), 413, "too_many_pixels"),  # a small file
    "http url": ("https://example.com/cat.png", 400, "media_url_not_allowed"),
    "file url": ("file:///etc/passwd", 400, "media_url_not_allowed"),
}

NAMED_FLAG = {"http url": "--allowed-media-domains", "file url": "--allowed-local-media-path"}


def test_bad_images_are_4xx_and_the_workers_keep_serving(tiny_k3):
    async def post(http: httpx.AsyncClient, messages: list[dict]) -> httpx.Response:
        return await http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                              "max_tokens": 2, "temperature": 0})

    async def main():
        # prepare_processes=0: the limits below are set on this process's planner; the preparation processes of
        # the large lane build their own from the model folder (tests/integration/test_gateway_prep_processes.py)
        async with Mesh(tiny_k3) as mesh, running_gateway(mesh, tiny_k3, parsers=False, prepare_processes=0) as gw:
            planner = gw.core.planner
            planner.media = MediaConfig(ProcessorConfig(max_image_bytes=150_000, max_pixels=50_000),
                                        planner.media.pad_id, max_images=2)
            for name, (url, status, code) in BAD.items():
                response = await post(gw.http, chat(data_url(A), url))
                error = response.json()["error"]
                assert (response.status_code, error["code"]) == (status, code), (name, response.text)
                assert error["param"] == "messages" and error["message"].startswith("messages[0].content[1]: "), name
                assert NAMED_FLAG.get(name, "") in error["message"], name  # no flags: the refusal names the flag
            too_many = await post(gw.http, chat(data_url(A), data_url(A), data_url(C)))
            assert too_many.status_code == 400 and too_many.json()["error"]["code"] == "too_many_images"
            ok = await post(gw.http, chat(data_url(A)))
            assert ok.status_code == 200, ok.text
            assert ok.json()["usage"]["prompt_tokens"] > 20
    run(main(), timeout_s=150)


@pytest.mark.parametrize("kind", ["tiny-linear"])
def test_a_text_only_model_refuses_images(kind, tmp_path):
    from engine.model.checkpoint import make_checkpoint

    model_dir = make_checkpoint(kind, tmp_path / kind, seed=1)

    async def main():
        async with Mesh(model_dir) as mesh, running_gateway(mesh, model_dir, parsers=False) as gw:
            response = await gw.http.post("/v1/chat/completions", json={
                "model": kind, "messages": chat(data_url(A)), "max_tokens": 2})
            assert response.status_code == 400 and "text-only" in response.json()["error"]["message"]
    run(main(), timeout_s=150)
