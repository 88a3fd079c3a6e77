"""Export/import of cache contents: the wire format the cache service stores and the objects it carries.

Wire format (`pack` / `unpack`), little-endian, version `FORMAT_VERSION`:

    magic  b"KDAM"                      4 bytes
    version                             u16
    header_len                          u32
    header                              header_len bytes, UTF-8 JSON:
                                          {"layout": str, "meta": {...},
                                           "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}
    payload_len                         u64
    sha256(header ‖ payload)            32 bytes
    payload                             payload_len bytes: each tensor's raw C-order bytes at its offset

`unpack` verifies everything before building a tensor and fails closed: a wrong magic, truncation, trailing
bytes, a checksum mismatch, a malformed header or an unknown dtype raise `CorruptObjectError`; another format
version raises `VersionMismatchError`; a layout other than the expected one raises `LayoutMismatchError`.
All are `TransferError` (a `ValueError`). The cache service stores these bytes without understanding them.

Objects (layout tags):
- `kv_block/v1`: one full MLA block across layers, tensor `kv [num_mla_layers, block_size, cache_dim]`;
  meta: block hash (hex), fingerprint, block size.
- `kda_state/v1`: one KDA state, tensors `conv [num_kda_layers, 3*H*D, W-1]` and `recurrent [num_kda_layers, H, D, D]`
  (fp32); meta: the hash of the prefix's last block for a snapshot, fingerprint.
- `request_state/v1` (`RequestState`): a request in flight — token ids, how many are computed, the KV of those
  tokens (`kv [num_mla_layers, num_blocks, block_size, cache_dim]`, the last block possibly partial), the running
  KDA state after them, the full-block hashes, the sampler's generator state and the cache salt. Importing it
  into another engine with the same fingerprint continues the request exactly where it was.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field

import torch

MAGIC = b"KDAM"
FORMAT_VERSION = 1
LAYOUT_KV_BLOCK = "kv_block/v1"
LAYOUT_KDA_STATE = "kda_state/v1"
LAYOUT_REQUEST_STATE = "request_state/v1"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "uint8": torch.uint8, "int64": torch.int64, "int32": torch.int32}
_PREFIX = struct.Struct("<4sHI")
_PAYLOAD = struct.Struct("<Q32s")


class TransferError(ValueError):
    """A serialised object that cannot be used; callers treat it as a cache miss and recompute."""


class CorruptObjectError(TransferError):
    pass


class VersionMismatchError(TransferError):
    pass


class LayoutMismatchError(TransferError):
    pass


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise TransferError(f"dtype {dtype} cannot be serialised")


def pack(tensors: dict[str, torch.Tensor], layout: str, meta: dict | None = None) -> bytes:
    entries, chunks, offset = [], [], 0
    for name, tensor in tensors.items():
        t = tensor.detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        entries.append({"name": name, "dtype": _dtype_name(t.dtype), "shape": list(t.shape), "offset": offset,
                        "nbytes": len(raw)})
        chunks.append(raw)
        offset += len(raw)
    header = json.dumps({"layout": layout, "meta": meta or {}, "tensors": entries},
                        sort_keys=True, separators=(",", ":")).encode()
    payload = b"".join(chunks)
    digest = hashlib.sha256(header + payload).digest()
    return b"".join([_PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)), header,
                     _PAYLOAD.pack(len(payload), digest), payload])


def unpack(data: bytes, expected_layout: str | None = None) -> tuple[dict[str, torch.Tensor], str, dict]:
    """-> (tensors, layout, meta), after verifying magic, version, lengths and checksum."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise CorruptObjectError("object shorter than its header")
    magic, version, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptObjectError(f"bad magic {bytes(magic)!r}")
    if version != FORMAT_VERSION:
        raise VersionMismatchError(f"format version {version}, this build reads {FORMAT_VERSION}")
    start = _PREFIX.size + header_len
    if len(view) < start + _PAYLOAD.size:
        raise CorruptObjectError("object truncated in its header")
    header_bytes = bytes(view[_PREFIX.size:start])
    payload_len, digest = _PAYLOAD.unpack_from(view, start)
    payload_start = start + _PAYLOAD.size
    if len(view) != payload_start + payload_len:
        raise CorruptObjectError(f"payload is {len(view) - payload_start} bytes, header says {payload_len}")
    payload = view[payload_start:]
    h = hashlib.sha256(header_bytes)
    h.update(payload)
    if h.digest() != digest:
        raise CorruptObjectError("checksum mismatch")
    try:
        header = json.loads(header_bytes)
        layout, meta, entries = header["layout"], header["meta"], header["tensors"]
        tensors = {e["name"]: _tensor(payload, e) for e in entries}
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptObjectError(f"malformed header: {exc}") from exc
    if expected_layout is not None and layout != expected_layout:
        raise LayoutMismatchError(f"layout {layout!r}, expected {expected_layout!r}")
    return tensors, layout, meta


def _tensor(payload: memoryview, entry: dict) -> torch.Tensor:
    dtype = _DTYPES.get(entry["dtype"])
    if dtype is None:
        raise ValueError(f"unknown dtype {entry['dtype']!r}")
    shape = [int(s) for s in entry["shape"]]
    numel = 1
    for s in shape:
        if s < 0:
            raise ValueError(f"negative dimension in {shape}")
        numel *= s
    nbytes, offset = int(entry["nbytes"]), int(entry["offset"])
    if nbytes != numel * torch.empty(0, dtype=dtype).element_size() or offset < 0 or offset + nbytes > len(payload):
        raise ValueError(f"tensor {entry['name']!r} does not fit its bytes")
    raw = bytearray(payload[offset:offset + nbytes])
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


# -- typed objects ---------------------------------------------------------------------------------------------


def encode_block(kv: torch.Tensor, block_hash: bytes, fingerprint: bytes) -> bytes:
    return pack({"kv": kv}, LAYOUT_KV_BLOCK, {"hash": block_hash.hex(), "fingerprint": fingerprint.hex()})


def decode_block(data: bytes) -> tuple[bytes, bytes, torch.Tensor]:
    """-> (block hash, fingerprint, kv [num_mla_layers, block_size, cache_dim])."""
    tensors, _, meta = unpack(data, LAYOUT_KV_BLOCK)
    return _hex(meta, "hash"), _hex(meta, "fingerprint"), _need(tensors, "kv")


def encode_state(state: dict[str, torch.Tensor], block_hash: bytes | None, fingerprint: bytes) -> bytes:
    meta = {"hash": block_hash.hex() if block_hash else "", "fingerprint": fingerprint.hex()}
    return pack(state, LAYOUT_KDA_STATE, meta)


def decode_state(data: bytes) -> tuple[bytes, bytes, dict[str, torch.Tensor]]:
    """-> (hash of the prefix's last block, fingerprint, {"conv", "recurrent"})."""
    tensors, _, meta = unpack(data, LAYOUT_KDA_STATE)
    return _hex(meta, "hash"), _hex(meta, "fingerprint"), tensors


@dataclass
class RequestState:
    """A request in flight, as moved between engines (see the module docstring)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int
    block_size: int
    fingerprint: bytes
    kv: torch.Tensor  # [num_mla_layers, num_blocks, block_size, cache_dim]
    state: dict[str, torch.Tensor]  # {"conv", "recurrent"}; empty without KDA layers
    block_hashes: list[bytes] = field(default_factory=list)
    generator_state: torch.Tensor | None = None  # uint8, torch.Generator.get_state()
    cache_salt: str | None = None
    num_cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def to_bytes(self) -> bytes:
        tensors = {"kv": self.kv, **{f"state.{k}": v for k, v in self.state.items()}}
        if self.generator_state is not None:
            tensors["generator_state"] = self.generator_state
        meta = {"prompt_token_ids": self.prompt_token_ids, "output_token_ids": self.output_token_ids,
                "num_computed_tokens": self.num_computed_tokens, "block_size": self.block_size,
                "fingerprint": self.fingerprint.hex(), "block_hashes": [h.hex() for h in self.block_hashes],
                "cache_salt": self.cache_salt, "num_cached_tokens": self.num_cached_tokens}
        return pack(tensors, LAYOUT_REQUEST_STATE, meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> "RequestState":
        tensors, _, meta = unpack(data, LAYOUT_REQUEST_STATE)
        try:
            return cls(prompt_token_ids=[int(t) for t in meta["prompt_token_ids"]],
                       output_token_ids=[int(t) for t in meta["output_token_ids"]],
                       num_computed_tokens=int(meta["num_computed_tokens"]), block_size=int(meta["block_size"]),
                       fingerprint=bytes.fromhex(meta["fingerprint"]), kv=_need(tensors, "kv"),
                       state={k.removeprefix("state."): v for k, v in tensors.items() if k.startswith("state.")},
                       block_hashes=[bytes.fromhex(h) for h in meta["block_hashes"]],
                       generator_state=tensors.get("generator_state"), cache_salt=meta.get("cache_salt"),
                       num_cached_tokens=int(meta.get("num_cached_tokens", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptObjectError(f"malformed request state: {exc}") from exc


def _hex(meta: dict, key: str) -> bytes:
    try:
        return bytes.fromhex(meta[key])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptObjectError(f"malformed meta field {key!r}") from exc


def _need(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise CorruptObjectError(f"object lacks tensor {name!r}")
    return tensors[name]
