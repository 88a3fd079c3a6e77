"""Fused weights: parameters that one forward multiplies by the same input share one tensor.

Contract:
- `ParamGroup(members, dim)` names parameters, as `(module, attribute)` pairs (looked up at each use: moving a
  module may replace its `Parameter` objects), that are concatenated along `dim` (the same shape elsewhere). `bind()`
  copies their current values into one new tensor and rebinds each parameter's `.data` to its slice, so names,
  shapes, dtypes and values stay as they were (the loader, `save_weights` and tests see the official layout) and
  in-place writes to a parameter (loading, `copy_`) land in the fused tensor. `tensor()` returns the fused tensor
  while every member still is its view, else None: after `param.data = …`, `.to(...)` or a device move the owner
  falls back to the per-parameter form, so results stay correct.
- `ParamGroup(members, dim, pad_multiple)`: with `pad_multiple > 1`, the fused tensor gets zero rows after the
  members along `dim` up to a multiple of it (the members stay its leading slices; nothing reads the padding but a
  matmul's extra output columns, which callers drop).
- `FusedLinear(parts)`: `parts` are groups of bias-free `nn.Linear`s with the same input; `__call__(x)` returns one
  output per part (the members' outputs concatenated on the last dim). Bound, that is one matmul whose output is
  split (parts are column slices of it, not copies); unbound, one matmul per member. Its fused weight is padded to
  `FUSED_ROWS_MULTIPLE` output rows: on CPU (MKL, AVX2) a [2048, 768] x [768, N] product took 1.45x longer at
  N = 2,566 than at 2,576 (bench: KDA's fused projections of small-linear, 2,566 wide), and no longer at 32 rows.
- `lay_out_for_gemv(model)` stores a linear weight input-major where a one-row product streams it faster that way
  (`prefers_input_major`, judged on the product the weight takes part in: a fused group's whole width) or where
  kernels/cpu/small_gemm.py takes the product (`small_gemm_reads`: it reads input-major), and so the
  stacked `[E, out, in]` weights a module names in its `gemv_input_major` attribute (the routed experts: the decode
  MoE then reads a chosen expert's rows in place, kernels/moe/grouped.py `moe_experts_bagged`); a group of such
  members binds into an input-major fused tensor, so its members stay views of it.
- `attach_compact_weights(model)`: once the weights hold their values, each product the small-batch kernel reads
  (a bound `FusedLinear`, a `Linear` outside one, stacked routed experts) gets an exact bf16 copy of its fp32 weight
  where every value is a bf16 value (a bf16 checkpoint on CPU), which the kernel reads instead: bitwise the same
  products from half the bytes (kernels/cpu/small_gemm.py `compact_copy`); an fp32 checkpoint gets none.
- `bind_fused_weights(model)` binds every `ParamGroup` / `FusedLinear` reachable as a module attribute. The loader
  calls it once the parameters have their final device and dtype, before any weights are read.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.cpu import small_gemm
from kernels.linear import linear

FUSED_ROWS_MULTIPLE = 16  # FusedLinear's output width is padded to a multiple of this (see the module docstring)
ROW_MAJOR_WEIGHTS = ("kv_b_proj",)  # linears whose weight a module reshapes (MLA's absorbed form): kept row-major
INPUT_MAJOR_MAX_OUT = 64  # products this narrow stream faster input-major whatever their input width (a router)


class ParamGroup:
    def __init__(self, members: list[tuple[nn.Module, str]], dim: int = 0, pad_multiple: int = 1):
        self.members = tuple(members)
        self.dim = dim
        self.pad_multiple = pad_multiple
        self._fused: torch.Tensor | None = None
        self._ptrs: tuple[int, ...] = ()

    @property
    def params(self) -> list[nn.Parameter]:
        return [getattr(module, name) for module, name in self.members]

    def bind(self) -> None:
        parts = [p.data for p in self.params]
        total = sum(part.shape[self.dim] for part in parts)
        padding = -total % self.pad_multiple
        # keep the members' layout: input-major members (concatenated along their output dim) stay input-major
        input_major = self.dim == parts[0].dim() - 2 and all(column_major(part) for part in parts)
        if padding:
            shape = list(parts[0].shape)
            shape[self.dim] = padding
            zeros = parts[0].new_zeros(shape[:-2] + shape[:-3:-1]).transpose(-1, -2) if input_major else None
            parts.append(zeros if input_major else parts[0].new_zeros(shape))
        if input_major:
            fused = torch.cat([part.transpose(-1, -2) for part in parts], dim=-1).transpose(-1, -2)
        else:
            fused = torch.cat(parts, dim=self.dim)
        start = 0
        for p in self.params:
            size = p.shape[self.dim]
            p.data = fused.narrow(self.dim, start, size)
            start += size
        self._fused = fused
        self.note_addresses()

    def note_addresses(self) -> None:
        """Records the members' addresses: `tensor` checks them (call again after the fused tensor and its views
        moved together, engine/model/huge_pages.py)."""
        self._ptrs = tuple(p.data_ptr() for p in self.params)

    def tensor(self) -> torch.Tensor | None:
        """The fused tensor, or None when it is unbound or some member no longer is its view."""
        fused = self._fused
        if fused is None:
            return None
        if torch.compiler.is_compiling():  # traced once per compiled step: the binding is checked when it is built
            return fused
        for p, ptr in zip(self.params, self._ptrs):
            if p.data_ptr() != ptr or p.dtype != fused.dtype or p.device != fused.device:
                return None
        return fused


class FusedLinear:
    def __init__(self, parts: list[list[nn.Linear]]):
        self.parts = tuple(tuple(part) for part in parts)
        self.sizes = [sum(lin.out_features for lin in part) for part in self.parts]
        self.width = sum(self.sizes)  # output columns before the padding
        self.group = ParamGroup([(lin, "weight") for part in self.parts for lin in part], dim=0,
                                pad_multiple=FUSED_ROWS_MULTIPLE)
        self.compact: torch.Tensor | None = None  # the fused tensor's exact bf16 copy (`attach_compact_weights`)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        weight = self.group.tensor()  # [sum(sizes) + padding, in]
        if weight is not None:
            out = linear(x, weight, self.compact)  # [..., width + padding]
            return list(out[..., : self.width].split(self.sizes, dim=-1))
        return [part[0](x) if len(part) == 1 else torch.cat([lin(x) for lin in part], dim=-1)
                for part in self.parts]


def column_major(weight: torch.Tensor) -> bool:
    """A weight `[..., out, in]` (2-D, or stacked experts `[E, out, in]`) stored input-major: consecutive outputs
    of one input are adjacent (stride 1)."""
    return weight.dim() >= 2 and weight.stride(-2) == 1 and weight.shape[-2] > 1


def prefers_input_major(out_rows: int, in_features: int) -> bool:
    """Whether a one-row product `x @ W^T` (W `[out_rows, in_features]`) streams W faster input-major on CPU.

    Input-major, MKL runs the product as `in_features` axpys over contiguous rows of `out_rows` outputs; row-major,
    as `out_rows` dot products of `in_features`. The longer contiguous run wins where it matters (AMD EPYC, one
    thread, bench/bench_gemv_layout.py: [1, 768] x [768, 8192] 2.02 -> 1.07 ms and [768, 4880] 1.18 -> 0.66 ms
    input-major, [256 <- 768] 65 vs 93 us row-major; shapes near the crossover, [768 <- 1536] and [768 <- 2048],
    are even within run-to-run noise), except for products of at most `INPUT_MAJOR_MAX_OUT` outputs ([32 <- 768]:
    6.9 vs 9.8 us input-major)."""
    return out_rows >= in_features or out_rows <= INPUT_MAJOR_MAX_OUT


def product_rows(model: nn.Module) -> dict[int, int]:
    """id(weight parameter) -> the output width of the product it is multiplied in: its fused group's total for a
    member of a row-concatenated `ParamGroup` / `FusedLinear` (padding included), else absent."""
    rows: dict[int, int] = {}
    for group in param_groups(model):
        if group.dim == 0 and all(p.dim() == 2 for p in group.params):
            total = sum(p.shape[0] for p in group.params)
            total += -total % group.pad_multiple
            rows.update((id(p), total) for p in group.params)
    return rows


def fused_linears(model: nn.Module):
    """Every `FusedLinear` held as an attribute of a module of `model`."""
    for module in model.modules():
        yield from (value for value in vars(module).values() if isinstance(value, FusedLinear))


def param_groups(model: nn.Module):
    """Every `ParamGroup` held as an attribute of a module of `model` (a `FusedLinear`'s own group included)."""
    yield from (fused.group for fused in fused_linears(model))
    for module in model.modules():
        yield from (value for value in vars(module).values() if isinstance(value, ParamGroup))


def embedding_weights(model: nn.Module) -> set[int]:
    """ids of the embedding tables' weights (a linear sharing one is tied to it and keeps its layout)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding) or type(m).__name__ ==
            "VocabEmbedding"}


def small_gemm_reads(weight: torch.Tensor, out_rows: int) -> bool:
    """Whether decode's products with this weight (in a product `out_rows` wide: a fused group's width) take
    kernels/cpu/small_gemm.py, which streams it input-major."""
    return small_gemm.takes(out_rows, weight.shape[1], weight.dtype, weight.device.type) and small_gemm.available()


def lay_out_for_gemv(model: nn.Module, keep_row_major: tuple[str, ...] = ROW_MAJOR_WEIGHTS) -> None:
    """Stores each bias-free linear's weight `[out, in]` input-major (its transpose contiguous) where
    `prefers_input_major` says so for the product it takes part in (`product_rows`), or where the product takes
    kernels/cpu/small_gemm.py (`small_gemm_reads`), which reads the weight input-major, one row or eight, faster
    than MKL reads either layout; same values.

    Why: on CPU a decode step's products are one-row products, bound by streaming their weights; MKL streams a wide
    product's weight ~1.3-1.8x faster input-major (bench: the LM head [8192, 256] 922 -> 517 us on AVX2), a product
    with fewer outputs than inputs faster row-major. Weights a module reshapes (`keep_row_major`, names ending so)
    and weights shared with an embedding stay as they are. Call before `bind_fused_weights`."""
    tied = embedding_weights(model)
    rows = product_rows(model)
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (isinstance(module, nn.Linear) and weight is not None and weight.dim() == 2 and id(weight) not in tied
                and not name.endswith(keep_row_major) and weight.is_contiguous() and weight.shape[0] > 1):
            width = rows.get(id(weight), weight.shape[0])  # the product's output width (a fused group's)
            if small_gemm_reads(weight, width) or prefers_input_major(width, weight.shape[1]):
                weight.data = weight.data.t().contiguous().t()
        for attribute in getattr(module, "gemv_input_major", ()):  # stacked expert weights [E, out, in]
            stacked = getattr(module, attribute)
            if stacked.is_contiguous() and stacked.shape[-2] > 1:
                stacked.data = stacked.data.transpose(-1, -2).contiguous().transpose(-1, -2)


def attach_compact_weights(model: nn.Module) -> int:
    """Gives each product the small-batch kernel reads (a bound `FusedLinear`'s fused tensor, a `compact_weight`-
    holding linear outside a bound group, stacked routed experts' `attach_compact`) an exact bf16 copy of its fp32
    weight where every value is a bf16 value (`small_gemm.compact_copy`: a bf16 checkpoint upcast to fp32), which
    the kernel reads instead — bitwise the same products from half the bytes; returns the bytes added. Call once
    the weights hold their loaded values; a weight written afterwards (rebinding, loading again) must call it
    again."""
    added = 0
    fused_members: set[int] = set()
    for fused in fused_linears(model):
        if (weight := fused.group.tensor()) is not None:
            fused_members.update(id(p) for p in fused.group.params)
            fused.compact = small_gemm.compact_copy(weight)
            added += _nbytes(fused.compact)
    for module in model.modules():
        if hasattr(module, "compact_weight") and id(module.weight) not in fused_members:
            module.compact_weight = small_gemm.compact_copy(module.weight)
            added += _nbytes(module.compact_weight)
        if callable(getattr(module, "attach_compact", None)):  # stacked routed experts (engine/model/moe.py)
            added += module.attach_compact()
    return added


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def bind_fused_weights(model: nn.Module) -> None:
    """Binds every `ParamGroup` and `FusedLinear` held as an attribute of a module of `model`."""
    for group in param_groups(model):
        group.bind()
