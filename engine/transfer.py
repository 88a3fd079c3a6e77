"""Export/import of cache contents: the wire format the cache service stores and the objects it carries.

Wire format (`pack` / `unpack`), little-endian:

    magic  b"KDAM"                      4 bytes
    version                             u16: VERSION_WHOLE_DIGEST (1) or VERSION_CHUNK_DIGESTS (2)
    header_len                          u32
    header                              header_len bytes, UTF-8 JSON:
                                          {"layout": str, "meta": {...},
                                           "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...]}
    payload_len                         u64
    digest                              32 bytes
    payload                             payload_len bytes: each tensor's raw C-order bytes at its offset

The digest, by version: 1, sha256(header ‖ payload); 2, sha256(header ‖ sha256(chunk_0) ‖ sha256(chunk_1) ‖ ...)
over the payload cut into `CHECKSUM_CHUNK_BYTES` (4 MiB) chunks, the last one shorter (none for an empty payload),
so the chunks hash on several threads at once (engine/background.py's `parallel_map`, `threads` of `pack` and
`unpack`; the digest does not depend on how many). Which version `pack` writes: 2 when the payload is longer than
one chunk (a KDA state, ~449 MB on the real K3 model, and a request state carrying one), else 1 (a kv_block/v1
block of the real K3 model is 27,648 B per token, 442 KB at the default 16-token blocks: small objects gain nothing
from chunks and stay readable by builds that know only version 1). `unpack` reads both.

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
  KDA state after them, the full-block hashes, the sampler's seed and the cache salt. Importing it
  into another engine with the same fingerprint continues the request exactly where it was.

Handoffs (prefill -> decode): `lean_handoff(state)` keeps only the KV after the last full block (the full blocks
travel as their own `kv_block/v1` objects, named by `block_hashes`); `stitch_handoff(state, blocks, layout)` puts
them back and checks the whole state against the receiving engine's `CacheLayout` (`check_request_state`, the
checks `EngineCore.import_request` makes). A state or object of another model or block size raises
`ModelMismatchError`, tensors of the wrong shape `ShapeMismatchError` (a `CorruptObjectError`), a full block the
caller could not fetch `MissingBlockError`. `check_block(data, hash, layout, i)` is one full block's checks (the
object, its hash and model, its shape) -> its `kv`; a streamed import runs it per block on a thread pool and hands
the engine the tensors (`CacheExchange.import_block_tensors`), then the lean state itself
(`check_request_state(..., lean=True)`: the engine takes the full blocks from its prefix cache).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from engine.background import parallel_map

MAGIC = b"KDAM"
VERSION_WHOLE_DIGEST = 1
VERSION_CHUNK_DIGESTS = 2
CHECKSUM_CHUNK_BYTES = 4 << 20  # part of version 2's definition: another size would be another version
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


class ModelMismatchError(TransferError):
    """The object belongs to another model (fingerprint) or block size than the engine's."""


class ShapeMismatchError(CorruptObjectError):
    """Tensors whose shapes do not fit the engine's pools."""


class MissingBlockError(TransferError):
    """A full KV block a lean handoff names was not available."""


@dataclass(frozen=True)
class CacheLayout:
    """The shapes of an engine's caches, fixed when it starts; imported objects must fit them."""

    fingerprint: bytes
    block_size: int
    kv_block_shape: tuple[int, int, int]  # one block across MLA layers: [num_mla_layers, block_size, cache_dim]
    state_shapes: Mapping[str, tuple[int, ...]]  # KDA state tensors by name ({} without KDA layers)
    kv_block_bytes: int = 0  # bytes of one block's data across MLA layers (0: not known)

    @property
    def has_kda(self) -> bool:
        return bool(self.state_shapes)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise TransferError(f"dtype {dtype} cannot be serialised")


def pack(tensors: dict[str, torch.Tensor], layout: str, meta: dict | None = None, threads: int | None = None) -> bytes:
    """`threads`: how many threads hash a version-2 payload's chunks (default engine/background.py's)."""
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
    version = VERSION_CHUNK_DIGESTS if len(payload) > CHECKSUM_CHUNK_BYTES else VERSION_WHOLE_DIGEST
    digest = payload_digest(version, header, payload, threads)
    return b"".join([_PREFIX.pack(MAGIC, version, len(header)), header,
                     _PAYLOAD.pack(len(payload), digest), payload])


def payload_digest(version: int, header: bytes, payload: bytes | memoryview, threads: int | None = None) -> bytes:
    """The 32-byte digest of a `version` object (see the module docstring); no copy of header + payload."""
    h = hashlib.sha256(header)
    if version == VERSION_WHOLE_DIGEST:
        h.update(payload)  # hashlib releases the GIL on the payload
    else:
        for chunk_digest in chunk_digests(payload, threads):
            h.update(chunk_digest)
    return h.digest()


def chunk_digests(payload: bytes | memoryview, threads: int | None = None) -> list[bytes]:
    """sha256 of each `CHECKSUM_CHUNK_BYTES` chunk of `payload`, in order, on up to `threads` threads."""
    view = memoryview(payload)
    starts = range(0, len(view), CHECKSUM_CHUNK_BYTES)
    return parallel_map(lambda a: hashlib.sha256(view[a:a + CHECKSUM_CHUNK_BYTES]).digest(), starts, threads)


def unpack(data: bytes, expected_layout: str | None = None,
           threads: int | None = None) -> tuple[dict[str, torch.Tensor], str, dict]:
    """-> (tensors, layout, meta), after verifying magic, version, lengths and checksum (`threads` as in `pack`)."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise CorruptObjectError("object shorter than its header")
    magic, version, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptObjectError(f"bad magic {bytes(magic)!r}")
    if version not in (VERSION_WHOLE_DIGEST, VERSION_CHUNK_DIGESTS):
        raise VersionMismatchError(f"format version {version}, this build reads {VERSION_WHOLE_DIGEST} and "
                                   f"{VERSION_CHUNK_DIGESTS}")
    start = _PREFIX.size + header_len
    if len(view) < start + _PAYLOAD.size:
        raise CorruptObjectError("object truncated in its header")
    header_bytes = bytes(view[_PREFIX.size:start])
    payload_len, digest = _PAYLOAD.unpack_from(view, start)
    payload_start = start + _PAYLOAD.size
    if len(view) != payload_start + payload_len:
        raise CorruptObjectError(f"payload is {len(view) - payload_start} bytes, header says {payload_len}")
    payload = view[payload_start:]
    if payload_digest(version, header_bytes, payload, threads) != digest:
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
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape)  # owns `raw` (one copy, no clone)


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
    sampling_seed: int | None = None  # the sampler's seed (engine/sampling.py: noise by seed and output position)
    cache_salt: str | None = None
    num_cached_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def to_bytes(self) -> bytes:
        tensors = {"kv": self.kv, **{f"state.{k}": v for k, v in self.state.items()}}
        meta = {"prompt_token_ids": self.prompt_token_ids, "output_token_ids": self.output_token_ids,
                "num_computed_tokens": self.num_computed_tokens, "block_size": self.block_size,
                "fingerprint": self.fingerprint.hex(), "block_hashes": [h.hex() for h in self.block_hashes],
                "cache_salt": self.cache_salt, "num_cached_tokens": self.num_cached_tokens,
                "sampling_seed": self.sampling_seed}
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
                       sampling_seed=_optional_int(meta.get("sampling_seed")), cache_salt=meta.get("cache_salt"),
                       num_cached_tokens=int(meta.get("num_cached_tokens", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptObjectError(f"malformed request state: {exc}") from exc


# -- checks against an engine's layout, and handoffs -----------------------------------------------------------


def check_model(fingerprint: bytes, layout: CacheLayout, what: str) -> None:
    if fingerprint != layout.fingerprint:
        raise ModelMismatchError(f"{what} comes from a different model (fingerprint mismatch)")


def check_state_tensors(state: Mapping[str, torch.Tensor], layout: CacheLayout) -> None:
    """A KDA state ({"conv", "recurrent"}) has exactly the engine's tensors and shapes."""
    expected = layout.state_shapes
    if set(state) != set(expected):
        raise ShapeMismatchError(f"state tensors {sorted(state)}, expected {sorted(expected)}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise ShapeMismatchError(f"state {name} shape {tuple(state[name].shape)}, expected {shape}")


def check_block_tensor(kv: torch.Tensor, layout: CacheLayout) -> None:
    if tuple(kv.shape) != layout.kv_block_shape:
        raise ShapeMismatchError(f"block shape {tuple(kv.shape)}, expected {layout.kv_block_shape}")


def check_request_state(state: RequestState, layout: CacheLayout, lean: bool = False) -> None:
    """The checks an engine makes before importing a request state (model, block size, a token left to compute,
    KV and KDA state shapes). `lean`: `kv` may instead hold only the blocks after the last full one (`lean_handoff`)
    with `block_hashes` naming every full block."""
    check_model(state.fingerprint, layout, "the request state")
    if state.block_size != layout.block_size:
        raise ModelMismatchError(f"block size {state.block_size}, this engine uses {layout.block_size}")
    n = state.num_computed_tokens
    if not 0 < n < len(state.prompt_token_ids) + len(state.output_token_ids):
        raise CorruptObjectError(f"num_computed_tokens {n} leaves no token to compute")
    layers, bs, dim = layout.kv_block_shape
    full = n // bs if lean and len(state.block_hashes) == n // bs else 0
    if tuple(state.kv.shape) not in {(layers, layout.blocks_for(n) - skip, bs, dim) for skip in {0, full}}:
        raise ShapeMismatchError(f"kv shape {tuple(state.kv.shape)} does not fit {n} tokens of this model")
    check_state_tensors(state.state, layout)


def lean_handoff(state: RequestState) -> RequestState:
    """`state` with only the KV after its last full block (`kv [layers, ceil(N/bs) - N//bs, bs, dim]`)."""
    full = state.num_computed_tokens // state.block_size
    return replace(state, kv=state.kv[:, full:].contiguous())


def stitch_handoff(state: RequestState, blocks: Sequence[bytes | None], layout: CacheLayout) -> RequestState:
    """A handoff made whole and checked (`check_request_state`): a lean one gets its full blocks from `blocks`, the
    serialised `kv_block/v1` objects named by `state.block_hashes`, in order (None: not available); a full one
    (every block carried) is only checked."""
    check_model(state.fingerprint, layout, "the handoff")
    n, bs = state.num_computed_tokens, layout.block_size
    total, full = layout.blocks_for(n), n // bs
    have = state.kv.shape[1] if state.kv.dim() == 4 else -1
    if have == total - full and full:
        if len(state.block_hashes) != full or len(blocks) != full:
            raise CorruptObjectError(f"the handoff names {len(state.block_hashes)} full blocks for {n} tokens")
        kv = torch.cat([_full_blocks(state.block_hashes, blocks, layout), state.kv], dim=1)
        state = replace(state, kv=kv)  # [layers, total, bs, dim]
    elif have != total:
        raise CorruptObjectError(f"the handoff holds {have} KV blocks for {n} tokens")
    check_request_state(state, layout)
    return state


def _full_blocks(hashes: Sequence[bytes], blocks: Sequence[bytes | None], layout: CacheLayout) -> torch.Tensor:
    """[num_mla_layers, len(hashes), block_size, dim] from the serialised blocks named by `hashes`."""
    return torch.stack([check_block(data, h, layout, i) for i, (h, data) in enumerate(zip(hashes, blocks))], dim=1)


def check_block(data: bytes | None, block_hash: bytes, layout: CacheLayout, index: int) -> torch.Tensor:
    """Full block `index` of a prompt, serialised (`kv_block/v1`; None: not available), checked to be the block
    named `block_hash` of this engine's model and shape -> kv [num_mla_layers, block_size, cache_dim]."""
    if data is None:
        raise MissingBlockError(f"KV block {index} of the prompt is not available")
    try:
        got_hash, fingerprint, kv = decode_block(data)
    except TransferError as exc:
        raise CorruptObjectError(f"KV block {index}: {exc}") from None
    if got_hash != block_hash or fingerprint != layout.fingerprint:
        raise ModelMismatchError(f"KV block {index} is another block")
    check_block_tensor(kv, layout)
    return kv


def _hex(meta: dict, key: str) -> bytes:
    try:
        return bytes.fromhex(meta[key])
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptObjectError(f"malformed meta field {key!r}") from exc


def _need(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise CorruptObjectError(f"object lacks tensor {name!r}")
    return tensors[name]


def _optional_int(value) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    return value
