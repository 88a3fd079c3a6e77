"""Image URLs through the gateway on an in-process tiny-k3 mesh (the harness of test_images.py), with
`--allowed-media-domains 127.0.0.1` and `--allowed-local-media-path DIR`: an http URL of a loopback server and a
file: URL of the same image give the same greedy tokens and prompt as its data URL — over REST (and /tokenize) and
over the gRPC API through the SDK — and a different image's URL gives other tokens (negative control). Every bad URL (host not
listed, redirect to one, too large, slow, 404, not an image, a file outside the directory or `..` out of it) is its
4xx over REST (INVALID_ARGUMENT / the SDK's error over gRPC) and the next request is served. The default gateway
(no flags) refuses both kinds naming the flag: tests/integration/test_images.py."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

import sdk
from tests.integration.gateway_harness import checkpoint_fixture, run, running_gateway
from tests.integration.mesh_harness import Mesh
from tests.integration.test_images import A, C, MODEL, STEPS, chat, data_url
from tests.media_server import MediaServer, Reply

TIMEOUT_S = 1.0
tiny_k3 = checkpoint_fixture("tiny-k3", MODEL, seed=3)
ROUTES = {"/a.png": Reply(body=A), "/c.png": Reply(body=C),
          "/big.png": Reply(body=b"\x89PNG" + bytes(len(A) + len(C))),
          "/slow.png": Reply(body=A[:2048], chunked=True, chunk_delay_s=0.1),  # 3.2 s > the deadline
          "/page": Reply(body=b"<html></html>", content_type="text/html"),
          "/out": Reply(302, headers=(("Location", "http://localhost:{port}/a.png"),))}


async def _chat(gw, messages: list[dict]):
    return await gw.http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": messages, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True,
        "logprobs": True})


def _tokens(reply) -> tuple[int, str, list[str]]:
    assert reply.status_code == 200, reply.text
    body = reply.json()
    choice = body["choices"][0]
    return body["usage"]["prompt_tokens"], choice["message"]["content"], [t["token"] for t in
                                                                          choice["logprobs"]["content"]]


def test_allowed_urls_equal_the_data_url_and_bad_ones_are_4xx(tiny_k3, tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(A)
    (tmp_path / "secret.png").write_bytes(A)
    max_bytes = len(A) + len(C) // 2  # over A and C, under big.png

    async def main(server: MediaServer):
        async with Mesh(tiny_k3) as mesh, running_gateway(
                mesh, tiny_k3, parsers=False, allowed_media_domains=("127.0.0.1",),
                allowed_local_media_path=str(root), media_fetch_timeout_s=TIMEOUT_S) as gw:
            media = gw.core.planner.media
            gw.core.planner.media = replace(media, processor=replace(media.processor, max_image_bytes=max_bytes))
            want = _tokens(await _chat(gw, chat(data_url(A))))
            assert _tokens(await _chat(gw, chat(server.url("/a.png")))) == want
            assert _tokens(await _chat(gw, chat((root / "a.png").as_uri()))) == want
            tokenized = [(await gw.http.post("/tokenize", json={"model": MODEL, "messages": chat(url)})).json()
                         for url in (data_url(A), server.url("/a.png"))]
            assert tokenized[0]["tokens"] == tokenized[1]["tokens"]  # /tokenize fetches too
            other = _tokens(await _chat(gw, chat(server.url("/c.png"))))
            assert other[0] == want[0] and other[2] != want[2]  # negative control: the fetched bytes matter
            await _bad_urls(gw, server, root, want)
            async with sdk.AsyncClient(gw.grpc_address) as client:  # the SDK sends a non-data URL as image_url
                sampling = sdk.Sampling(max_tokens=STEPS, temperature=0, ignore_eos=True)
                whole = await client.chat(MODEL, chat(server.url("/a.png")), sampling=sampling)
                assert whole.choices[0].message.content == want[1]
                with pytest.raises(sdk.KdameshError) as info:
                    await client.chat(MODEL, chat(server.url("/a.png", "localhost")), sampling=sampling)
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert "--allowed-media-domains" in info.value.message
            assert server.hits["/a.png"] == 3  # chat and tokenize over REST, chat over gRPC; never a refused host
    with MediaServer(ROUTES) as server:
        run(main(server), timeout_s=200)


async def _bad_urls(gw, server: MediaServer, root, want) -> None:
    bad = {  # url -> (status, code, in the message)
        server.url("/a.png", "localhost"): (400, "media_url_not_allowed", "--allowed-media-domains"),
        server.url("/out"): (400, "media_url_not_allowed", "'localhost' is not in --allowed-media-domains"),
        server.url("/big.png"): (413, "too_many_bytes", "over the limit"),
        server.url("/slow.png"): (400, "media_fetch_timeout", f"within {TIMEOUT_S:g} s"),
        server.url("/missing.png"): (400, "media_fetch_failed", "HTTP 404"),
        server.url("/page"): (400, "not_an_image", "text/html"),
        (root.parent / "secret.png").as_uri(): (400, "media_url_not_allowed", "--allowed-local-media-path"),
        f"file://{root}/../secret.png": (400, "media_url_not_allowed", "outside"),
    }
    for url, (status, code, says) in bad.items():
        reply = await _chat(gw, chat(data_url(A), url))
        error = reply.json()["error"]
        assert (reply.status_code, error["code"]) == (status, code), (url, reply.text)
        assert error["message"].startswith("messages[0].content[1]: ") and says in error["message"], url
        assert _tokens(await _chat(gw, chat(data_url(A)))) == want  # the next request is served
