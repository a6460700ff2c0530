"""Tensor work of the attention replay: deterministic K/V, paged and dense
attention, device choice, and (on a CUDA machine with vLLM) vLLM's own kernel.

Layout of one KV-cache group's cache, the same as vLLM's Triton backend::

    K, V: [num_blocks, B, heads, head_dim]      block 0 = NULL, poisoned with NaN

Values are a pure function of what they stand for, so a dense reference can
be rebuilt at any time without looking at the cache:

* ``kv_true(prompt_len, t)``: the K/V of the token at position ``t``, a function of
  the tokens up to ``t`` as a model's would be. Every request has the same
  prompt stream and every target samples the same generated token, so a
  prompt position's K/V depends on ``t`` only and a generated position's on
  ``(prompt_len, t)``: a prefix-cache hit (equal hashes, equal tokens) reads
  identical K/V, across requests too; a block of a request with another
  prompt length does not.
* patterns that must never be read (:func:`junk_kv`): ``foreign`` (what an
  unordered writer such as a connector's load into a freed block leaves, V
  shifted by +8), ``uninit`` (a slot never written, V shifted by -8),
  ``draft`` (a rejected draft token's K/V, unshifted: it looks like any
  token's), ``failed_load`` (what a failed connector load leaves, V +8).
  Only V is shifted, so a junk key is weighted like a true one and the error
  it causes is large (about 8 times its softmax weight).
"""

from __future__ import annotations

import hashlib
import importlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from model.kinds import Kind

# dtype name -> (torch dtype, tolerance of the paged result against the dense one)
DTYPES: dict[str, tuple[torch.dtype, float]] = {
    "fp32": (torch.float32, 1e-5),
    "bf16": (torch.bfloat16, 2e-2),
}
# vLLM's kernel against our torch paged path: Triton's fp32 dots run in TF32.
KERNEL_TOL = {"fp32": 5e-3, "bf16": 3e-2}

TAG_K, TAG_V, TAG_Q, TAG_DRAFT, TAG_FOREIGN, TAG_UNINIT, TAG_FAILED = range(1, 8)
PATTERN_SHIFT = {TAG_FOREIGN: 8.0, TAG_UNINIT: -8.0, TAG_FAILED: 8.0}

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """CUDA when available (or asked for), else CPU. Asking for CUDA on a
    machine without it is a clear error rather than a silent fallback."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} asked for, but torch {torch.__version__} "
                         "sees no CUDA GPU on this machine")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {str(device)!r} (use 'cpu' or 'cuda')")
    return dev


def pick_dtype(dtype: str) -> tuple[torch.dtype, float]:
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    return DTYPES[dtype]


# ------------------------------------------------------------ deterministic values


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser, elementwise on uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = (x + np.uint64(0x9E3779B97F4A7C15)) & _M64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _M64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _M64
        return z ^ (z >> np.uint64(31))


def rid_stream(rid: str) -> int:
    """A stable 63-bit id of a request (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little") | 1


@dataclass(frozen=True)
class Shape:
    heads: int = 2
    head_dim: int = 8

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


def pattern(stream: int, tag: int, group: int, positions: np.ndarray, shape: Shape,
            salt: int = 0) -> torch.Tensor:
    """Values in [-1, 1) for ``positions``: float32
    [len(positions), heads, head_dim] on the CPU."""
    pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
    base = _mix(np.array([stream & 0x7FFFFFFFFFFFFFFF], dtype=np.uint64))
    base = _mix(base ^ np.uint64(tag * 1_000_003 + group * 7919 + salt * 104_729))
    idx = pos[:, None] * np.uint64(shape.width) + np.arange(shape.width, dtype=np.uint64)[None]
    bits = _mix(idx ^ base)
    u = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    vals = (2.0 * u - 1.0).astype(np.float32)
    return torch.from_numpy(vals).view(len(pos), shape.heads, shape.head_dim)


def junk_kv(tag: int, stream: int, group: int, positions: np.ndarray, shape: Shape,
            salt: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V of a pattern that must never be read (see the module docstring)."""
    k = pattern(stream, tag, 2 * group, positions, shape, salt)
    v = pattern(stream, tag, 2 * group + 1, positions, shape, salt)
    return k, v + PATTERN_SHIFT.get(tag, 0.0)


def _generated_stream(prompt_len: int) -> int:
    """The stream of generated positions after a prompt of ``prompt_len`` tokens
    (the prompt stream is 0)."""
    return rid_stream(f"generated after {prompt_len}")


def kv_true(prompt_len: int, group: int, positions: np.ndarray,
            shape: Shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The true K and V at ``positions`` of a request with ``prompt_len`` prompt
    tokens (float32, CPU): the same for every such request."""
    positions = np.asarray(positions, dtype=np.int64)
    stream = _generated_stream(prompt_len)
    k = pattern(0, TAG_K, group, positions, shape)
    v = pattern(0, TAG_V, group, positions, shape)
    gen = positions >= prompt_len
    if gen.any():
        gen_t = torch.from_numpy(gen)
        k = torch.where(gen_t[:, None, None], pattern(stream, TAG_K, group, positions, shape), k)
        v = torch.where(gen_t[:, None, None], pattern(stream, TAG_V, group, positions, shape), v)
    return k, v


def q_true(prompt_len: int, group: int, positions: np.ndarray,
           shape: Shape) -> torch.Tensor:
    """The query at ``positions`` of a request with ``prompt_len`` prompt
    tokens (float32, CPU)."""
    positions = np.asarray(positions, dtype=np.int64)
    q = pattern(0, TAG_Q, group, positions, shape)
    gen = positions >= prompt_len
    if gen.any():
        qg = pattern(_generated_stream(prompt_len), TAG_Q, group, positions, shape)
        q = torch.where(torch.from_numpy(gen)[:, None, None], qg, q)
    return q


# ------------------------------------------------------------------- the caches


class PagedCache:
    """One group's K and V cache on a device, NULL block poisoned with NaN."""

    def __init__(self, num_blocks: int, block_size: int, shape: Shape, group: int,
                 device: torch.device, dtype: torch.dtype):
        self.B = block_size
        self.shape = shape
        self.group = group
        self.device = device
        self.dtype = dtype
        k, v = junk_kv(TAG_UNINIT, 0, group, np.arange(num_blocks * block_size), shape)
        dims = (num_blocks, block_size, shape.heads, shape.head_dim)
        self.k = k.view(dims).to(device=device, dtype=dtype).contiguous()
        self.v = v.view(dims).to(device=device, dtype=dtype).contiguous()
        self.poison_null()

    def poison_null(self) -> None:
        self.k[0] = float("nan")
        self.v[0] = float("nan")

    def zero_null(self) -> None:
        self.k[0] = 0.0
        self.v[0] = 0.0

    def write(self, blocks: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Write rows of K/V at (block, slot) pairs (long tensors on the device)."""
        if len(blocks) == 0:
            return
        self.k[blocks, slots] = k.to(device=self.device, dtype=self.dtype)
        self.v[blocks, slots] = v.to(device=self.device, dtype=self.dtype)



# ------------------------------------------------------- Mamba states (align mode)
#
# A small linear recurrence stands for a Mamba layer's state: per channel
#
#     h[t] = a * h[t-1] + (1 - a) * x[t],    h[-1] = 0,   0.5 <= a < 0.95
#
# with x[t] the token's input (its true V, flattened; a rejected draft's is
# the draft pattern's). The state after t is a function of the tokens up to
# t only, so a state read from the wrong slot (the state after another
# position, a draft's, junk) differs from the dense one.


def state_decay(group: int, shape: Shape) -> torch.Tensor:
    """The recurrence's per-channel decay ``a`` of a group, float32 [width]."""
    u = pattern(0, TAG_K, 1000 + group, np.zeros(1, dtype=np.int64), shape).flatten()
    return 0.725 + 0.225 * u


def state_inputs(k_v: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The recurrence's inputs from a K/V pair (its V), float32 [n, width]."""
    return k_v[1].flatten(1)


def recur(h0: torch.Tensor, xs: torch.Tensor, decay: torch.Tensor) -> torch.Tensor:
    """The states after each input: h0 [width], xs [n, width] -> [n, width]
    (float32, in order; the same operations as :func:`dense_states`)."""
    out = torch.empty_like(xs)
    h = h0
    one_minus = 1.0 - decay
    for i in range(len(xs)):
        h = decay * h + one_minus * xs[i]
        out[i] = h
    return out


class StateCache:
    """One Mamba group's state blocks on a device: ``[num_blocks, width]``, a
    block never written holds the ``uninit`` pattern, NULL is NaN."""

    def __init__(self, num_blocks: int, shape: Shape, group: int, device: torch.device,
                 dtype: torch.dtype):
        self.device = device
        self.dtype = dtype
        self.shape = shape
        self.group = group
        junk = junk_kv(TAG_UNINIT, 0, group, np.arange(num_blocks), shape)[1].flatten(1)
        self.h = junk.to(device=device, dtype=dtype).contiguous()
        self.h[0] = float("nan")

    def read(self, block: int) -> torch.Tensor:
        return self.h[block].float()

    def write(self, block: int, state: torch.Tensor) -> None:
        if block != 0:
            self.h[block] = state.to(device=self.device, dtype=self.dtype)

    def fill(self, block: int, tag: int, stream: int, salt: int) -> None:
        """Junk of pattern ``tag`` (an unordered writer's load, a failed load)."""
        junk = junk_kv(tag, stream, self.group, np.array([block]), self.shape, salt)[1]
        self.write(block, junk.flatten())


class DenseStates:
    """The dense recurrence over the true tokens of each prompt length, on
    the CPU in float32, grown as positions are asked for."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self._h: dict[tuple[int, int], torch.Tensor] = {}

    def after(self, prompt_len: int, group: int, positions: np.ndarray) -> torch.Tensor:
        """The states after ``positions`` (float32 [n, width], CPU)."""
        key = (prompt_len, group)
        have = self._h.get(key)
        need = int(np.max(positions)) + 1 if len(positions) else 0
        if have is None or len(have) < need:
            n0 = 0 if have is None else len(have)
            n = max(need, 2 * n0, 16)
            h0 = torch.zeros(self.shape.width) if have is None else have[-1]
            xs = state_inputs(kv_true(prompt_len, group, np.arange(n0, n), self.shape))
            more = recur(h0, xs, state_decay(group, self.shape))
            have = more if have is None else torch.cat([have, more])
            self._h[key] = have
        return have[torch.from_numpy(np.asarray(positions, dtype=np.int64))]


# -------------------------------------------------------------------- attention


@dataclass
class Gathered:
    """K/V of the window of each query row, padded to a common length ``L``."""

    k: torch.Tensor  # [n, L, H, D]
    v: torch.Tensor  # [n, L, H, D]
    mask: torch.Tensor  # [n, L] bool: inside the row's window
    nan_rows: torch.Tensor  # [n] bool: the window read a NaN


def window_grid(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions ``lo[i] + j`` for each row (``j < max(hi - lo + 1)``) and the
    mask of those ``<= hi[i]``."""
    length = int((hi - lo).max()) + 1
    pos = lo[:, None] + np.arange(length)[None, :]
    return pos, pos <= hi[:, None]


def gather_paged(cache: PagedCache, table: tuple[int, ...], pos: np.ndarray,
                 mask: np.ndarray) -> Gathered:
    """Gather the window positions ``pos`` through ``table`` (logical block ->
    physical id); a logical block past the table's end reads the NULL block."""
    B = cache.B
    ext = np.array(list(table) + [0], dtype=np.int64)
    logical = np.minimum(pos // B, len(table))
    phys = torch.from_numpy(np.where(mask, ext[logical], 0)).to(cache.device)
    slot = torch.from_numpy(np.where(mask, pos % B, 0)).to(cache.device)
    k = cache.k[phys, slot]
    v = cache.v[phys, slot]
    m = torch.from_numpy(mask).to(cache.device)
    bad = (torch.isnan(k) | torch.isnan(v)).flatten(2).any(-1) & m
    return Gathered(k, v, m, bad.any(-1))


def attend(q: torch.Tensor, g: Gathered, compute_dtype: torch.dtype) -> torch.Tensor:
    """Softmax attention of each row's query over its own window: q [n, H, D]
    -> out [n, H, D] float32. Masked (padding) entries are zeroed before use so
    that a NaN outside a window cannot leak in; a NaN inside one does."""
    m4 = g.mask[:, :, None, None]
    k = torch.where(m4, g.k, torch.zeros((), dtype=g.k.dtype, device=g.k.device))
    v = torch.where(m4, g.v, torch.zeros((), dtype=g.v.dtype, device=g.v.device))
    qd = q.to(device=k.device, dtype=compute_dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.einsum("nhd,nlhd->nhl", qd, k.to(compute_dtype)).float() * scale
    s = s.masked_fill(~g.mask[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    out = torch.einsum("nhl,nlhd->nhd", p.to(compute_dtype), v.to(compute_dtype))
    return out.float()


def dense_reference(prompt_len: int, group: int, q: torch.Tensor, pos: np.ndarray,
                    mask: np.ndarray, shape: Shape, device: torch.device,
                    dtype: torch.dtype) -> torch.Tensor:
    """Dense attention over the true K/V of the same window positions, in fp32
    from values rounded to the cache's dtype (so only arithmetic differs)."""
    flat = np.where(mask, pos, 0).reshape(-1)
    k, v = kv_true(prompt_len, group, flat, shape)
    n, L = pos.shape
    k = k.to(dtype).view(n, L, shape.heads, shape.head_dim).to(device)
    v = v.to(dtype).view(n, L, shape.heads, shape.head_dim).to(device)
    m = torch.from_numpy(mask).to(device)
    g = Gathered(k, v, m, torch.zeros(n, dtype=torch.bool, device=device))
    return attend(q.to(dtype), g, torch.float32)


# --------------------------------------------------------- vLLM's kernel (CUDA)

_VLLM_MODULES = (
    "vllm.v1.attention.ops.triton_unified_attention",  # vLLM >= 0.11
    "vllm.attention.ops.triton_unified_attention",  # older releases
)


class VllmKernel:
    """vLLM's Triton ``unified_attention`` (the paged kernel its Triton backend
    runs) on our cache and block tables. Each query row is its own sequence of
    one query token, so per-row windows need no extra support:

    * full / sliding(W) / mamba: the request's table, ``seqused_k = t + 1``,
      ``window_size = (-1, -1)`` / ``(W - 1, 0)`` / ``(1, 0)``;
    * chunked_local(C): vLLM's own trick (local attention as virtual batches):
      the table from the chunk's first block on, ``seqused_k = t - chunk + 1``.
    """

    def __init__(self, fn, module: str):
        self.fn = fn
        self.module = module

    @property
    def name(self) -> str:
        return f"vLLM triton unified_attention ({self.module})"

    def run(self, cache: PagedCache, kind: Kind, table: tuple[int, ...],
            ts: np.ndarray, q: torch.Tensor) -> torch.Tensor:
        B = cache.B
        dev = cache.device
        n = len(ts)
        rows, lens = [], []
        for t in ts.tolist():
            if kind.kernel_from_lo:
                first = kind.lo(t)
                rows.append(list(table[first // B:]))
                lens.append(t - first + 1)
            else:
                rows.append(list(table))
                lens.append(t + 1)
        width = max(1, max(len(r) for r in rows), max(-(-x // B) for x in lens))
        bt = torch.zeros((n, width), dtype=torch.int32)
        for i, r in enumerate(rows):
            if r:
                bt[i, :len(r)] = torch.tensor(r, dtype=torch.int32)
        window = kind.kernel_window()
        if window is None:
            raise ValueError(f"{kind.label()} has no unified_attention window")
        qd = q.to(device=dev, dtype=cache.dtype).contiguous()
        out = torch.empty_like(qd)
        ones = torch.ones((n, cache.shape.heads), dtype=torch.float32, device=dev)
        self.fn(
            q=qd, k=cache.k, v=cache.v, out=out,
            cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=dev),
            max_seqlen_q=1,
            seqused_k=torch.tensor(lens, dtype=torch.int32, device=dev),
            max_seqlen_k=max(lens),
            softmax_scale=1.0 / math.sqrt(q.shape[-1]),
            causal=True, window_size=window,
            block_table=bt.to(dev), softcap=0.0,
            q_descale=None, k_descale=ones, v_descale=ones,
        )
        return out.float()


def load_vllm_kernel(device: torch.device, shape: Shape) -> tuple[VllmKernel | None, str]:
    """vLLM's paged kernel where it can run, else ``(None, why not)``.
    The import happens here only, and only on a CUDA device."""
    if device.type != "cuda":
        return None, "no CUDA device: vLLM's kernel not run"
    if shape.head_dim < 16:
        return None, f"head_dim {shape.head_dim} < 16: vLLM's Triton kernel needs >= 16"
    errors = []
    for mod in _VLLM_MODULES:
        try:
            m = importlib.import_module(mod)
        except Exception as e:  # ImportError, or vLLM failing to initialise
            errors.append(f"{mod}: {type(e).__name__}: {e}"[:160])
            continue
        fn = getattr(m, "unified_attention", None)
        if fn is not None:
            return VllmKernel(fn, mod), ""
    return None, "vLLM's kernel unavailable (" + "; ".join(errors) + ")"
