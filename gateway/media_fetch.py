"""Reading a chat request's image URLs that are not `data:` URLs — `http(s)` from allowed hosts, `file:` inside an
allowed directory — before the request is planned (gateway/plan.py then decodes and checks the bytes exactly as it
does a data URL's). The flags are vLLM's, but both are off by default here (vLLM fetches from any host by default).

Contract:
- `MediaFetchConfig` (frozen; `ValueError` naming the flag for a bad value): `allowed_domains`
  (`--allowed-media-domains`: host names compared exactly, case-insensitively, any port — vLLM's rule; empty: no
  http(s) URL is fetched), `allowed_local_path` (`--allowed-local-media-path`: an existing directory, resolved;
  None: no file is read), `timeout_s` (`--media-fetch-timeout-s`: the deadline of one URL, redirects and body
  included; default 5 s as vLLM's VLLM_IMAGE_FETCH_TIMEOUT), `max_redirects`.
- `MediaFetcher(config).fetch(messages, max_images, max_bytes)` -> {url: bytes} for every image part whose URL is
  http(s) or file: (the parts and the image count come from `gateway.media.image_urls`), concurrently; `data:` URLs
  are left to gateway/media.py. This is the one place a URL is allowed or refused: REST, the gRPC API and the SDK's
  `image_url` reach it through `GatewayCore.plan_chat` / `tokenize`. Errors are `ApiError`s, param `messages`,
  whose message starts with the part (`messages[i].content[j]: `):
  - 400 `media_url_not_allowed`: an http(s) host not listed, a redirect to one (each hop is checked), a file whose
    path — symlinks and `..` resolved — is outside the directory, a flag not set (the message names it), a
    `file:` URL naming another host or a relative path; 400 (no code) for any other scheme.
  - 413 `too_many_bytes`: a body (declared by Content-Length or read) or a file over `max_bytes`, the data-URL limit;
    the read stops there.
  - 400 `media_fetch_timeout`: not fetched within `timeout_s`. Not 408 (the client sent its request in time; the
    URL it named did not answer) and not vLLM's 500 (it lets the timeout through as a transient error).
  - 400 `media_fetch_failed`: the host answered a non-2xx status (named in the message), could not be reached, or
    redirected more than `max_redirects` times; the file does not exist or is not a regular file (a FIFO, a device,
    a directory: checked before it is opened, and opened non-blocking, so no thread ever waits on one).
  - 400 `media_url_not_allowed` too for a file: URL holding a NUL byte (`%00`).
  - 400 `not_an_image`: a Content-Type other than image/*, application/octet-stream or none.
- `close()` closes its HTTP client. Nothing blocks the event loop: HTTP is httpx's async client (no proxies from the
  environment, redirects followed here so each hop is checked); a file: URL's path is resolved and checked (symlinks
  and `..`: the file system) and the file read on a thread.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit
from urllib.request import url2pathname

import httpx

from gateway.media import image_urls
from gateway.protocol import ApiError

DOMAINS_FLAG = "--allowed-media-domains"
LOCAL_FLAG = "--allowed-local-media-path"
DEFAULT_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT
DEFAULT_MAX_REDIRECTS = 5
OPAQUE_TYPES = ("", "application/octet-stream")  # Content-Types read as a possible image


@dataclass(frozen=True)
class MediaFetchConfig:
    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    max_redirects: int = DEFAULT_MAX_REDIRECTS
    local_root: Path | None = field(default=None, init=False, compare=False)  # allowed_local_path, resolved

    def __post_init__(self):
        domains = tuple(_host_name(d) for d in self.allowed_domains)
        object.__setattr__(self, "allowed_domains", domains)
        if self.allowed_local_path is not None:
            root = Path(self.allowed_local_path).resolve()
            if not root.is_dir():
                raise ValueError(f"{LOCAL_FLAG} {self.allowed_local_path}: not an existing directory")
            object.__setattr__(self, "local_root", root)
        if not self.timeout_s > 0:
            raise ValueError(f"--media-fetch-timeout-s must be positive, got {self.timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")


def _host_name(domain: str) -> str:
    """One `--allowed-media-domains` entry, normalised; a value with a scheme, port or path is refused (it would
    never match a host name, so the flag would silently do nothing)."""
    name = domain.strip().lower().rstrip(".")
    try:
        return str(ipaddress.IPv6Address(name.strip("[]")))
    except ValueError:
        pass
    if not name or any(c in name for c in "/:@?#[] "):
        raise ValueError(f"{DOMAINS_FLAG} {domain!r}: give host names only (no scheme, port or path), "
                         "e.g. images.example.com")
    return name


def _fail(where: str, status: int, message: str, code: str | None) -> ApiError:
    return ApiError(status, f"{where}: {message}", param="messages", code=code)


def _too_large(where: str, size: int | None, max_bytes: int) -> ApiError:
    """413 for an image over the byte limit (`size` None: the read stopped past the limit)."""
    told = f"{size} bytes" if size is not None else f"more than {max_bytes} bytes"
    return _fail(where, 413, f"image is {told}, over the limit of {max_bytes} bytes", "too_many_bytes")


class MediaFetcher:
    def __init__(self, config: MediaFetchConfig):
        self.config = config
        self._client: httpx.AsyncClient | None = None

    async def fetch(self, messages: Sequence, max_images: int, max_bytes: int) -> dict[str, bytes]:
        wanted: dict[str, str] = {}  # url -> the first part naming it (which its errors name)
        for where, url in image_urls(messages, max_images):
            if url[:5].lower() != "data:":
                wanted.setdefault(url, where)
        if not wanted:
            return {}
        local = [(where, url) for url, where in wanted.items() if self._check(where, url)]
        if local:  # every URL allowed before any is fetched; resolving a path touches the file system: a thread
            await asyncio.to_thread(lambda: [self._local_path(where, url) for where, url in local])
        tasks: dict[str, asyncio.Task] = {}
        try:
            async with asyncio.TaskGroup() as group:
                for url, where in wanted.items():
                    tasks[url] = group.create_task(self._fetch_one(where, url, max_bytes))
        except BaseExceptionGroup as errors:
            raise _first_api_error(errors) from None
        return {url: task.result() for url, task in tasks.items()}

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def _check(self, where: str, url: str) -> bool:
        """Checks an http(s) URL; -> whether it is a file: URL (its path is checked on a thread, `_local_path`)."""
        scheme = url.split(":", 1)[0].lower()
        if scheme in ("http", "https"):
            self._check_host(where, url)
            return False
        if scheme == "file":
            return True
        raise _fail(where, 400, "image_url.url must be a base64 data: URL, an http(s) URL or a file: URL", None)

    def _check_host(self, where: str, url: str) -> None:
        try:
            parts = urlsplit(url)
            host = parts.hostname
        except ValueError:
            raise _fail(where, 400, f"{url[:100]!r} is not a valid URL", "media_fetch_failed") from None
        if parts.scheme.lower() not in ("http", "https") or not host:
            raise _fail(where, 400, f"{url[:100]!r} is not an http(s) URL with a host", "media_url_not_allowed")
        if not self.config.allowed_domains:
            raise _fail(where, 400, f"fetching {parts.scheme} image URLs is off: start the gateway with "
                                    f"{DOMAINS_FLAG} naming the hosts it may fetch from, or send the image as a "
                                    "base64 data: URL", "media_url_not_allowed")
        if _normal_host(host) not in self.config.allowed_domains:
            raise _fail(where, 400, f"the host {host!r} is not in {DOMAINS_FLAG} "
                                    f"({', '.join(self.config.allowed_domains)})", "media_url_not_allowed")

    def _local_path(self, where: str, url: str) -> Path:
        root = self.config.local_root
        if root is None:
            raise _fail(where, 400, f"local image files are off: start the gateway with {LOCAL_FLAG} naming the "
                                    "directory it may read, or send the image as a base64 data: URL",
                        "media_url_not_allowed")
        parts = urlsplit(url)
        path = Path(url2pathname(parts.path))
        if "\x00" in str(path):
            raise _fail(where, 400, "a file: URL may not contain a NUL byte (%00)", "media_url_not_allowed")
        if parts.netloc not in ("", "localhost") or not path.is_absolute():
            raise _fail(where, 400, "a file: URL must name an absolute local path (file:///dir/image.png)",
                        "media_url_not_allowed")
        resolved = path.resolve()
        if root not in resolved.parents:
            raise _fail(where, 400, f"the file {str(path)!r} is outside {LOCAL_FLAG} {root}", "media_url_not_allowed")
        return resolved

    async def _fetch_one(self, where: str, url: str, max_bytes: int) -> bytes:
        try:
            async with asyncio.timeout(self.config.timeout_s):
                if url[:5].lower() == "file:":
                    return await asyncio.to_thread(self._read_local, where, url, max_bytes)
                return await self._get(where, url, max_bytes)
        except TimeoutError:
            raise _fail(where, 400, f"the image URL did not answer within {self.config.timeout_s:g} s",
                        "media_fetch_timeout") from None
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise _fail(where, 400, f"could not fetch the image URL: {type(exc).__name__}: {exc}",
                        "media_fetch_failed") from None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(follow_redirects=False, trust_env=False,
                                             timeout=httpx.Timeout(self.config.timeout_s),
                                             headers={"Accept": "image/*", "User-Agent": "kdamesh-gateway"})
        return self._client

    async def _get(self, where: str, url: str, max_bytes: int) -> bytes:
        for _ in range(self.config.max_redirects + 1):
            self._check_host(where, url)
            async with self._http().stream("GET", url) as response:
                if response.has_redirect_location:
                    url = str(response.url.join(response.headers["location"]))
                    continue
                _check_response(where, response, max_bytes)
                return await _read_body(where, response, max_bytes)
        raise _fail(where, 400, f"the image URL redirected more than {self.config.max_redirects} times",
                    "media_fetch_failed")

    def _read_local(self, where: str, url: str, max_bytes: int) -> bytes:
        """The file a file: URL names (in a thread: resolving and reading touch the file system)."""
        return _read_file(where, self._local_path(where, url), max_bytes)


def _read_file(where: str, path: Path, max_bytes: int) -> bytes:
    """A regular file's bytes: checked before it is opened, opened non-blocking (a FIFO or a device never holds
    the thread) without following a link, and checked again once open (it may have been replaced meanwhile)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise _fail(where, 400, f"{str(path)!r} is not a regular file", "media_fetch_failed")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise _fail(where, 400, f"cannot read the file {str(path)!r}: {exc.strerror}", "media_fetch_failed") \
            from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _fail(where, 400, f"{str(path)!r} is not a regular file", "media_fetch_failed")
    if info.st_size > max_bytes:
        os.close(fd)
        raise _too_large(where, info.st_size, max_bytes)
    with os.fdopen(fd, "rb") as file:
        data = file.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _too_large(where, None, max_bytes)
    return data


def _normal_host(host: str) -> str:
    try:
        return str(ipaddress.IPv6Address(host))
    except ValueError:
        return host.lower().rstrip(".")


def _check_response(where: str, response: httpx.Response, max_bytes: int) -> None:
    if not 200 <= response.status_code < 300:
        raise _fail(where, 400, f"fetching the image URL failed: the host answered HTTP {response.status_code}",
                    "media_fetch_failed")
    content_type = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if not (content_type.startswith("image/") or content_type in OPAQUE_TYPES):
        raise _fail(where, 400, f"the image URL answered Content-Type {content_type}, not an image", "not_an_image")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(where, int(declared), max_bytes)


async def _read_body(where: str, response: httpx.Response, max_bytes: int) -> bytes:
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise _too_large(where, None, max_bytes)
    return bytes(body)


def _first_api_error(errors: BaseExceptionGroup) -> BaseException:
    """The error a failed fetch reports: its first ApiError (a sibling's cancellation is not one), else the first."""
    for error in errors.exceptions:
        if isinstance(error, BaseExceptionGroup):
            error = _first_api_error(error)
        if isinstance(error, ApiError):
            return error
    return errors.exceptions[0]
