"""gateway/media_fetch.py against a loopback HTTP server and a temporary directory: an allowed host's PNG (also as
application/octet-stream, and through a redirect on the same host) is fetched byte for byte; a host not listed, a
redirect to one, a body over the limit (declared or streamed), a slow body (the deadline), a 404, a non-image, a
redirect loop and a closed port are each their 4xx — and the same fetcher serves the next good request after every
bad one. Local files: inside the directory is read; outside it, `..` out of it, a symlink out of it, a relative
path, a missing file and no flag are refused. No flag at all refuses both kinds, naming the flag."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time

import pytest

from gateway.media_fetch import MediaFetchConfig, MediaFetcher
from gateway.protocol import ApiError
from tests.media_server import MediaServer, Reply
from tests.unit.vision.images import encode, make_image

PNG = encode(make_image("RGB", 40, 30, 1))
LIMIT = len(PNG) + 100
TIMEOUT_S = 0.5
ROUTES = {
    "/a.png": Reply(body=PNG),
    "/octet": Reply(body=PNG, content_type="application/octet-stream"),
    "/streamed.png": Reply(body=PNG, chunked=True),
    "/big.png": Reply(body=b"\x89PNG" + bytes(LIMIT)),
    "/big-streamed.png": Reply(body=b"\x89PNG" + bytes(LIMIT), chunked=True),
    "/slow.png": Reply(body=PNG[:1024], chunked=True, chunk_delay_s=0.1),  # 16 chunks: 1.6 s > the deadline
    "/page": Reply(body=b"<html>hi</html>", content_type="text/html; charset=utf-8"),
    "/broken": Reply(500, b"oops", "text/plain"),
    "/in": Reply(302, headers=(("Location", "/a.png"),)),
    "/out": Reply(302, headers=(("Location", "http://localhost:{port}/a.png"),)),
    "/loop": Reply(302, headers=(("Location", "/loop"),)),
}


def _messages(*urls: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "look"},
                                         *[{"type": "image_url", "image_url": {"url": u}} for u in urls]]}]


async def _fetch(fetcher: MediaFetcher, *urls: str) -> dict[str, bytes]:
    return await fetcher.fetch(_messages(*urls), max_images=4, max_bytes=LIMIT)


async def _refused(fetcher: MediaFetcher, url: str, good: str) -> ApiError:
    """The error of fetching `url`; then the same fetcher still fetches `good`."""
    with pytest.raises(ApiError) as info:
        await _fetch(fetcher, url)
    assert (await _fetch(fetcher, good))[good] == PNG
    assert info.value.param == "messages" and info.value.message.startswith("messages[0].content[1]: ")
    return info.value


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_urls_of_allowed_hosts_only():
    async def main(server: MediaServer):
        fetcher = MediaFetcher(MediaFetchConfig(("127.0.0.1",), timeout_s=TIMEOUT_S))
        try:
            good = server.url("/a.png")
            urls = [good, server.url("/octet"), server.url("/streamed.png"), server.url("/in")]
            assert await _fetch(fetcher, *urls) == {u: PNG for u in urls}
            cases = {  # path or url -> (status, code, in the message)
                server.url("/a.png", "localhost"): (400, "media_url_not_allowed", "'localhost' is not in "
                                                                                    "--allowed-media-domains"),
                "/out": (400, "media_url_not_allowed", "'localhost' is not in --allowed-media-domains"),
                "/big.png": (413, "too_many_bytes", f"over the limit of {LIMIT} bytes"),
                "/big-streamed.png": (413, "too_many_bytes", f"more than {LIMIT} bytes"),
                "/slow.png": (400, "media_fetch_timeout", f"within {TIMEOUT_S:g} s"),
                "/missing.png": (400, "media_fetch_failed", "HTTP 404"),
                "/broken": (400, "media_fetch_failed", "HTTP 500"),
                "/page": (400, "not_an_image", "Content-Type text/html"),
                "/loop": (400, "media_fetch_failed", "redirected more than 5 times"),
                f"http://127.0.0.1:{_closed_port()}/a.png": (400, "media_fetch_failed", "could not fetch"),
            }
            for where, (status, code, says) in cases.items():
                hits_before = server.hits["/a.png"]
                started = time.monotonic()
                error = await _refused(fetcher, server.url(where) if where.startswith("/") else where, good)
                assert (error.status, error.code) == (status, code) and says in error.message, (where, error.message)
                assert time.monotonic() - started < TIMEOUT_S + 2
                if code == "media_url_not_allowed":
                    assert server.hits["/a.png"] == hits_before + 1  # only the good request: the refused one never
        finally:
            await fetcher.close()

    with MediaServer(ROUTES) as server:
        asyncio.run(main(server))


def test_local_files_inside_the_allowed_directory_only(tmp_path):
    root, outside = tmp_path / "media", tmp_path / "private"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    for folder in (root / "sub", outside):
        (folder / "a.png").write_bytes(PNG)
    (root / "big.png").write_bytes(bytes(LIMIT + 1))
    os.symlink(outside / "a.png", root / "link.png")
    os.symlink(root / "sub" / "a.png", root / "inner-link.png")
    good = (root / "sub" / "a.png").as_uri()

    async def main():
        fetcher = MediaFetcher(MediaFetchConfig(allowed_local_path=str(root)))
        assert await _fetch(fetcher, good, (root / "inner-link.png").as_uri()) == \
            {good: PNG, (root / "inner-link.png").as_uri(): PNG}
        cases = {
            (outside / "a.png").as_uri(): (400, "media_url_not_allowed", "outside --allowed-local-media-path"),
            f"file://{root}/sub/../../private/a.png": (400, "media_url_not_allowed", "outside"),
            (root / "link.png").as_uri(): (400, "media_url_not_allowed", "outside"),
            "file:sub/a.png": (400, "media_url_not_allowed", "absolute local path"),
            f"file://otherhost{root}/sub/a.png": (400, "media_url_not_allowed", "absolute local path"),
            (root / "nope.png").as_uri(): (400, "media_fetch_failed", "cannot read"),
            (root / "sub").as_uri(): (400, "media_fetch_failed", "not a regular file"),
            (root / "big.png").as_uri(): (413, "too_many_bytes", f"over the limit of {LIMIT} bytes"),
            "ftp://example.com/a.png": (400, None, "must be a base64 data: URL, an http(s) URL or a file: URL"),
        }
        for url, (status, code, says) in cases.items():
            error = await _refused(fetcher, url, good)
            assert (error.status, error.code) == (status, code) and says in error.message, (url, error.message)

    asyncio.run(main())


def test_no_flags_refuse_both_naming_the_flag(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)

    async def main():
        fetcher = MediaFetcher(MediaFetchConfig())
        assert await _fetch(fetcher) == {}  # a request without URLs fetches nothing
        for url, flag in (("https://example.com/a.png", "--allowed-media-domains"),
                          ((tmp_path / "a.png").as_uri(), "--allowed-local-media-path")):
            with pytest.raises(ApiError) as info:
                await _fetch(fetcher, url)
            assert (info.value.status, info.value.code) == (400, "media_url_not_allowed") and flag in info.value.message
        with pytest.raises(ApiError) as info:  # the image count is checked before anything is fetched
            await fetcher.fetch(_messages(*["https://example.com/a.png"] * 3), max_images=2, max_bytes=LIMIT)
        assert info.value.code == "too_many_images"

    asyncio.run(main())


@pytest.mark.parametrize("bad", [dict(allowed_domains=("https://example.com",)),
                                 dict(allowed_domains=("example.com:8080",)), dict(allowed_domains=("",)),
                                 dict(allowed_local_path="/no/such/dir"), dict(timeout_s=0)])
def test_a_bad_flag_value_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="--allowed-media-domains|--allowed-local-media-path|--media-fetch-timeout"):
        MediaFetchConfig(**bad)


def test_host_names_are_normalised():
    config = MediaFetchConfig(("Images.Example.COM.", "::1", "[::1]"))
    assert config.allowed_domains == ("images.example.com", "::1", "::1")


def test_a_fifo_or_a_nul_byte_is_a_prompt_400_and_holds_no_thread(tmp_path):
    """A FIFO under the directory is refused before it is opened (it used to hold a reader thread per request until
    the deadline, and after a dozen every local image timed out); a %00 in the path is a 400, not a 500."""
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(PNG)
    os.mkfifo(root / "pipe.png")
    good = (root / "ok.png").as_uri()

    async def main():
        fetcher = MediaFetcher(MediaFetchConfig(allowed_local_path=str(root), timeout_s=2.0))
        start = time.monotonic()
        for _ in range(16):  # more than the default thread pool's idle threads would survive
            error = await _refused(fetcher, (root / "pipe.png").as_uri(), good)
            assert (error.status, error.code) == (400, "media_fetch_failed"), error.message
            assert "not a regular file" in error.message
        assert time.monotonic() - start < 10.0  # each refused at once, never after the 2 s deadline
        for url in (good + "%00.jpg", f"file://{root}/pipe%00.png"):
            error = await _refused(fetcher, url, good)
            assert (error.status, error.code) == (400, "media_url_not_allowed") and "NUL" in error.message, url
        assert await _fetch(fetcher, good) == {good: PNG}

    asyncio.run(main())


def test_local_paths_are_resolved_off_the_event_loop(tmp_path, monkeypatch):
    """Resolving a file: URL's path touches the file system (symlinks, `..`; a slow or network mount): it happens
    on a thread, both the check before any URL is fetched and the read's."""
    (tmp_path / "a.png").write_bytes(PNG)
    threads = []
    original = MediaFetcher._local_path

    def recorded(self, where, url):
        threads.append(threading.get_ident())
        return original(self, where, url)

    monkeypatch.setattr(MediaFetcher, "_local_path", recorded)

    async def main():
        fetcher = MediaFetcher(MediaFetchConfig(allowed_local_path=str(tmp_path)))
        assert await _fetch(fetcher, (tmp_path / "a.png").as_uri()) == {(tmp_path / "a.png").as_uri(): PNG}
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert len(threads) == 2 and loop_thread not in threads, (threads, loop_thread)
