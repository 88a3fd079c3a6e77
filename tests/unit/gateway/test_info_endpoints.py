"""`GET /version` and `GET /tokenizer_info` answer as vLLM's do and are in /openapi.json."""

from __future__ import annotations

import asyncio
import json
import shutil
from importlib import metadata

import httpx
import pytest

from gateway.app import create_app
from gateway.config import GatewayConfig


@pytest.fixture(scope="module")
def replies(k3_dir, k3_tok, tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("model")
    shutil.copytree(k3_dir, folder, dirs_exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "kimi_k3"}))
    config = GatewayConfig(model=str(folder), decode_addresses=("127.0.0.1:1",), mode="colocated",
                           max_model_len=4096)
    app = create_app(config, tokenizer=k3_tok)

    async def fetch() -> dict:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            return {path: await http.get(path) for path in ("/version", "/tokenizer_info", "/openapi.json")}
    return asyncio.run(fetch())


def test_version(replies):
    reply = replies["/version"]
    assert reply.status_code == 200
    assert reply.json() == {"version": metadata.version("kdamesh")}


def test_tokenizer_info(replies, k3_tok):
    reply = replies["/tokenizer_info"]
    assert reply.status_code == 200
    info = reply.json()
    # no worker has reported its context length (none runs here): null, not the configured upper bound (4096)
    assert info["tokenizer_class"] == "TikTokenTokenizer" and info["model_max_length"] is None
    assert info["vocab_size"] == k3_tok.vocab_size
    assert info["eos_token"] == k3_tok.convert_ids_to_tokens(k3_tok.eos_token_id)
    assert info["eos_token_ids"] == list(k3_tok.stop_token_ids)
    decoder = info["added_tokens_decoder"]
    assert {int(i): entry["content"] for i, entry in decoder.items()} == {
        i: content for content, i in k3_tok.special_tokens.items()}
    assert all(entry["special"] for entry in decoder.values())
    assert decoder[str(k3_tok.special_tokens["<|open|>"])]["content"] == "<|open|>"


def test_in_openapi(replies):
    paths = replies["/openapi.json"].json()["paths"]
    assert "get" in paths["/version"] and "get" in paths["/tokenizer_info"]
