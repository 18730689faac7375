"""The decode step launch by launch in numpy: what each planned launch computes from what it reads.

`decode.plan_decode` lists one decode step as named launches over named buffers (`LaunchSpec`:
the kernel, its arguments by the names of the kernel's parameters, the buffers it reads and
writes). This module gives each
kernel of that list its reference — the maths of `reference.py` applied to the launch's own
parameters — so that a launch's outputs can be checked against the reference computed from the
very buffers the launch read (the GPU's inputs for that launch: errors do not accumulate along
the step), and so that the CPU can run the same list, launch for launch, by the same names
(`drvqwen step`, src/drvqwen/step/).

    group            a planned step entry (`DecodePlan.steps`: a name and one launcher) with
                     its launches in order. A buffer one launch of the group writes and a later
                     one reads is the group's scratch, in the kernel's own layout (the split-KV
                     partials of the attention): it has no reference; the group's other outputs
                     are checked after its last launch, against the reference computed from
                     what its first launch read.
    reference_for    kernel name → (function, one line on what it computes); the function
                     takes the group and a `BufferReader` and returns an `Expected` per buffer.
    compare          an output buffer against its `Expected`: relative L2, max abs error, the
                     first differing index, ok / MISMATCH by the kernel tests' bounds.

The references compute in `reader.dtype` (float64 for comparisons, as the kernel tests do;
float32 on the CPU stepper, as the CPU backend does) on the dequantized weights (INT4, or each
tensor's own format), with the
roundings the kernels make on purpose (the normalised GEMV input is FP16, as the kernel feeds
it to its MMAs; docs/numerics.md). A kernel without an entry here is run and timed but not
compared ("no reference").
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from . import reference as ref
from .kv_cache import PAGE_TOKENS
from .sampler import argmax_total_order

# Relative-L2 bounds of the kernel tests (docs/numerics.md#kernel-tests-against-the-reference):
# FP32-accumulated GEMV / norm / RoPE outputs, and the fused attention.
TOL_GEMV = 1e-3
TOL_ATTENTION = 3e-3
# An argmax partial may pick another row of its 32 where the reference's two logits are closer
# than this fraction of the logits' RMS: a near tie, which FP32 sums in another order can flip.
TIE_FRACTION = 1e-2


class BufferReader(Protocol):
    """What a reference reads: buffers by name (or BufferSpec / DeviceArray), and INT4 weights
    dequantized.

    Attributes:
        dtype: the compute dtype of the references (np.float64 or np.float32).
    """

    dtype: type

    def array(self, buf) -> np.ndarray:
        """The buffer's contents in its own dtype and shape (a weight: the file's tensor)."""

    def int4(self, qweight, scales) -> np.ndarray:
        """The INT4 matrix of (qweight, scales) dequantized, float32 [N, K] (exact: a 4-bit code
        times an FP16 scale fits float32's significand)."""

    def dense(self, weight) -> np.ndarray:
        """An FP16 weight matrix as float32 (exact), e.g. the lm_head."""

    def quantized(self, qweight) -> np.ndarray:
        """The weight whose `.qweight` part this is, dequantized in its per-tensor format as the
        file's reader does (format/weight_formats.py), or a dense one's `.weight`: float32 [N, K]."""


@dataclass
class Expected:
    """What the reference says a launch leaves in one buffer.

    Attributes:
        name: the buffer.
        values: the reference values of the written part (float64/float32, or int).
        where: the written part as an index into the buffer (None: all of it), e.g. the K/V
            cache slot of the position (page, :, slot, :).
        tol: the relative-L2 bound (TOL_GEMV or TOL_ATTENTION); 0 for exact outputs.
        exact: integers and copies, compared for equality.
        scores: for index outputs (an argmax partial): the reference scores the indices point
            into; a different index is fine where its score ties the reference's best.
        note: a few words on the written part, shown with the comparison.
    """

    name: str
    values: np.ndarray
    where: tuple | None = None
    tol: float = TOL_GEMV
    exact: bool = False
    scores: np.ndarray | None = None
    note: str = ""


@dataclass
class Comparison:
    """One output buffer against its reference.

    Attributes:
        name, note: from the Expected.
        rel_l2: ‖got − want‖ / ‖want‖ over the finite reference values (0 for exact matches).
        max_abs: the largest |got − want| there.
        first_diff: the first index (into the compared part) where they differ beyond the
            bound, or None.
        n_bad: elements that differ (exact outputs) or are NaN where the reference is not.
        ok: within the bound, no NaN left, infinities where the reference has them.
    """

    name: str
    rel_l2: float
    max_abs: float
    first_diff: tuple | None
    n_bad: int
    ok: bool
    note: str = ""
    exact: bool = False


def _first(mask: np.ndarray) -> tuple | None:
    idx = np.flatnonzero(mask.reshape(-1))
    if idx.size == 0:
        return None
    return tuple(int(i) for i in np.unravel_index(int(idx[0]), mask.shape))


def compare(exp: Expected, got_buffer: np.ndarray) -> Comparison:
    """Compare the written part of `got_buffer` (the whole buffer as read back) with `exp`.

    Floats: relative L2 over the entries where the reference is finite must be ≤ exp.tol, the
    other entries (−inf logits of rows without text) must be equal, and no NaN may be left.
    Exact outputs: every element equal (NaN equal to NaN). Index outputs with scores: an index
    differing from the reference's counts only where its score is not within TIE_FRACTION of
    the scores' RMS of the reference's choice.
    """
    got = np.asarray(got_buffer)[exp.where] if exp.where is not None else np.asarray(got_buffer)
    want = np.asarray(exp.values).reshape(got.shape)
    if exp.scores is not None:
        s = np.asarray(exp.scores, np.float64)
        finite = s[np.isfinite(s)]
        slack = TIE_FRACTION * (float(np.sqrt(np.mean(finite * finite))) if finite.size else 0.0)
        gi = np.clip(got.astype(np.int64), 0, s.size - 1)
        bad = (got != want) & ~(s[gi] >= s[want.astype(np.int64)] - slack)
        return Comparison(exp.name, 0.0, 0.0, _first(bad), int(bad.sum()), not bad.any(), exp.note, True)
    if exp.exact or not np.issubdtype(want.dtype, np.floating):
        g, w = got.astype(np.float64), want.astype(np.float64)
        bad = ~((g == w) | (np.isnan(g) & np.isnan(w)))
        diff = np.abs(np.where(bad, g - w, 0.0))
        max_abs = float(np.nan_to_num(diff, nan=np.inf).max()) if diff.size else 0.0
        return Comparison(exp.name, 0.0 if not bad.any() else float("nan"), max_abs, _first(bad), int(bad.sum()),
                          not bad.any(), exp.note, True)
    g, w = got.astype(np.float64), want.astype(np.float64)
    fin = np.isfinite(w)
    nan_left = np.isnan(g) & ~np.isnan(w)
    inf_wrong = ~fin & ~np.isnan(w) & (g != w)
    with np.errstate(invalid="ignore"):
        d = np.where(fin, g - w, 0.0)
    norm_w = float(np.linalg.norm(w[fin])) if fin.any() else 0.0
    rel = float(np.linalg.norm(d[fin]) / max(norm_w, 1e-300)) if fin.any() else 0.0
    ad = np.abs(d)
    max_abs = float(np.nan_to_num(ad, nan=np.inf).max()) if ad.size else 0.0
    rms_w = norm_w / max(1, int(fin.sum())) ** 0.5
    # "Differs" for the first index: beyond 4 · tol · RMS(want), well past a rounding.
    differs = nan_left | inf_wrong | (np.nan_to_num(ad, nan=np.inf) > exp.tol * max(rms_w, 1e-30) * 4)
    n_bad = int(nan_left.sum() + inf_wrong.sum())
    ok = rel <= exp.tol and n_bad == 0 and np.isfinite(rel)
    return Comparison(exp.name, rel, max_abs, _first(differs), n_bad, bool(ok), exp.note)


# ---- launch groups ------------------------------------------------------------------------------

def _name(buf) -> str:
    return buf if isinstance(buf, str) else getattr(buf, "name", str(buf))


@dataclass
class LaunchGroup:
    """One entry of the step (a name and its launcher's launches), e.g. "L3.attention".

    Attributes:
        name: the step entry's name.
        specs: its LaunchSpecs in order.
        launcher: the launcher (for `bytes_for` where the bytes depend on the sequence length).
    """

    name: str
    specs: list
    launcher: object = None
    scratch: tuple[str, ...] = field(init=False)
    outputs: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        scratch = []
        for i, s in enumerate(self.specs):
            later_reads = {r for t in self.specs[i + 1:] for r in t.reads}
            scratch += [w for w in s.writes if w in later_reads and w not in scratch]
        self.scratch = tuple(scratch)
        outs = []
        for s in self.specs:
            outs += [w for w in s.writes if w not in scratch and w not in outs]
        self.outputs = tuple(outs)

    def launch_names(self) -> list[str]:
        """The names of its launches: the group's name, or name.0, name.1, … for several."""
        if len(self.specs) == 1:
            return [self.name]
        return [f"{self.name}.{i}" for i in range(len(self.specs))]


def base_kernel(kernel_name: str) -> str:
    """The kernel's name without its head-dimension instantiation (attention_decode_tma_hd64 →
    attention_decode_tma)."""
    return re.sub(r"_hd\d+$", "", kernel_name)


# ---- the references, one per kernel --------------------------------------------------------------
# Each reads its launch's arguments by the kernel's parameter names (LaunchSpec.args, checked
# against the kernel files by tests/test_kernel_signatures.py).

def _val(p):
    """A ctypes scalar argument's Python value."""
    return p.value if isinstance(p, ctypes._SimpleCData) else p


def _matvec(w32: np.ndarray, x: np.ndarray, dtype, rows: int = 8192) -> np.ndarray:
    """w [N, K] · x [K] in `dtype`, converting w a block of rows at a time (an FP16 lm_head of
    152064 rows would be 4.4 GB in float64 at once)."""
    x = np.asarray(x, dtype)
    out = np.empty(w32.shape[0], dtype)
    for r in range(0, w32.shape[0], rows):
        out[r:r + rows] = np.asarray(w32[r:r + rows]).astype(dtype, copy=False) @ x
    return out


def _normed(r: BufferReader, residual, weight, eps: float) -> np.ndarray:
    """rmsnorm(residual) · weight computed in float64 and rounded to FP16 once, as the kernels
    feed it to their MMAs (rmsnorm.cuh), then in the compute dtype."""
    x = r.array(residual).astype(np.float64)
    return ref.rmsnorm(x, r.array(weight), eps).astype(np.float16).astype(r.dtype)


def _rope(x: np.ndarray, pos: int, inv_freq: np.ndarray) -> np.ndarray:
    """Rotate-half RoPE of x [H, Dh] at `pos`, with the angle float32(pos) · inv_freq in float32
    as reference.rope_cos_sin computes it, from the launch's own inv_freq buffer."""
    freqs = np.float32(pos) * np.asarray(inv_freq, np.float32)
    emb = np.concatenate([freqs, freqs])[None, :]
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)
    return ref.apply_rope(x[None], cos, sin)[0]


def _matrix(r: BufferReader, a: dict, p: str = "") -> np.ndarray:
    """The weight matrix a launch reads, float32 [N, K]: INT4 (`<p>_qweight`, `<p>_scales`, or
    `qweight`, `scales` unprefixed), or a per-tensor format (gemv_fmt.cu: its four planes, the
    `<p>_aux` one among them)."""
    pre = f"{p}_" if p else ""
    if f"{pre or 'w_'}aux" in a:
        return r.quantized(a[f"{pre or 'w_'}qweight"])
    return r.int4(a[f"{pre}qweight"], a[f"{pre}scales"])


def _embedding(g: LaunchGroup, r: BufferReader) -> list[Expected]:
    a = g.specs[0].args
    out, state, vocab = a["residual"], a["state"], a["V"]
    tok = int(r.array(state)[1])
    if 0 <= tok < _val(vocab):
        table = r.quantized(a["w_qweight"]) if "w_aux" in a else r.array(a["embed"])
        row = np.asarray(table[tok]).astype(np.float32)
    else:
        row = np.full(out.shape, np.nan, np.float32)       # the kernel's answer to a bad id
    return [Expected(_name(out), row, exact=True, note=f"row {tok}")]


def _qkv_rope(g: LaunchGroup, r: BufferReader) -> list[Expected]:
    a = g.specs[0].args
    hq, hkv, dh = (_val(a[n]) for n in ("Hq", "Hkv", "Dh"))
    xn = _normed(r, a["residual"], a["norm_w"], _val(a["eps"]))
    q, k, v = (_matvec(_matrix(r, a, m), xn, r.dtype) + r.array(a[f"{m}_bias"]).astype(r.dtype) for m in "qkv")
    q_out, k_cache, v_cache, state, bt, inv_freq = (a[n] for n in ("q_out", "k_cache", "v_cache", "state",
                                                                     "block_table", "inv_freq"))
    st = r.array(state)
    pos = int(st[0])
    inv = r.array(inv_freq)
    page = int(r.array(bt)[pos // PAGE_TOKENS])
    slot = (page, slice(None), pos % PAGE_TOKENS, slice(None))
    where = f"position {pos}: page {page}, slot {pos % PAGE_TOKENS}"
    return [Expected(_name(q_out), _rope(q.reshape(hq, dh), pos, inv).reshape(-1)),
            Expected(_name(k_cache), _rope(k.reshape(hkv, dh), pos, inv), slot, note=where),
            Expected(_name(v_cache), v.reshape(hkv, dh), slot, note=where)]


def _attention(g: LaunchGroup, r: BufferReader) -> list[Expected]:
    first = g.specs[0]
    a = first.args
    q, bt, state = a["q"], a["block_table"], a["state"]
    # The plain and cluster kernels take one layer's cache views; the TMA kernel tensor maps of
    # the whole pools, and names the layer's views among what it reads.
    if "k_map" in a:
        k_name, v_name = first.reads[1], first.reads[2]
    else:
        k_name, v_name = _name(a["k_cache"]), _name(a["v_cache"])
    hq = int(_val(a["Hq"]))
    seq_len = int(r.array(state)[2])
    qv = r.array(q).astype(r.dtype).reshape(hq, -1)
    out = ref.attention_decode(qv, r.array(k_name), r.array(v_name), r.array(bt), seq_len)
    return [Expected(_name(g.specs[-1].args["out"]), out.reshape(-1), tol=TOL_ATTENTION,
                     note=f"over {seq_len} positions")]


def _residual(g: LaunchGroup, r: BufferReader) -> list[Expected]:
    a = g.specs[0].args
    res, x = a["residual"], a["x"]
    want = r.array(res).astype(r.dtype) + _matvec(_matrix(r, a), r.array(x), r.dtype)
    return [Expected(_name(res), want)]


def _gemv_f16(g: LaunchGroup, r: BufferReader) -> list[Expected]:
    a = g.specs[0].args
    return [Expected(_name(a["y"]), _matvec(_matrix(r, a), r.array(a["x"]), r.dtype))]


def _gate_up(g: LaunchGroup, r: BufferReader) -> list[Expected]:
    a = g.specs[0].args
    xn = _normed(r, a["residual"], a["norm_w"], _val(a["eps"]))
    want = ref.swiglu(_matvec(_matrix(r, a, "gate"), xn, r.dtype), _matvec(_matrix(r, a, "up"), xn, r.dtype))
    return [Expected(_name(a["h"]), want)]


def _rmsnorm(g: LaunchGroup, r: BufferReader) -> list[Expected]:
    a = g.specs[0].args
    out, x, w, dim, eps = a["out"], a["x"], a["weight"], a["D"], a["eps"]
    xv = r.array(x).astype(r.dtype).reshape(-1, _val(dim))
    return [Expected(_name(out), ref.rmsnorm(xv, r.array(w), _val(eps)).reshape(-1))]


def _lm_head(g: LaunchGroup, r: BufferReader) -> list[Expected]:
    a = g.specs[0].args
    logits, part_val, part_idx, x = (a[n] for n in ("logits", "part_val", "part_idx", "x"))
    vocab, n_valid = _val(a["V"]), a["n_valid"]
    per_tensor = "w_aux" in a                     # gemv_fmt_lm_head: blocks own ranges of 16-row tiles
    want = _matvec(_matrix(r, a) if per_tensor else r.dense(a["weight"]), r.array(x), r.dtype)
    want[_val(n_valid):] = -np.inf
    n_part = part_val.shape[0]
    if per_tensor:
        tiles = -(-vocab // 16)
        bounds = [min(16 * (b * tiles // n_part), vocab) for b in range(n_part + 1)]
        what = "best of each block's 16-row tiles"
    else:
        rows = -(-vocab // n_part)
        bounds = [min(b * rows, vocab) for b in range(n_part + 1)]
        what = f"best of each {rows} rows"
    # Lowest index on ties, as the kernels; an empty range (never in a planned grid) gives −inf.
    idx = np.array([lo + int(np.argmax(want[lo:hi])) if hi > lo else lo for lo, hi in zip(bounds, bounds[1:])],
                   np.int32)
    best = np.array([want[i] if i < vocab else -np.inf for i in idx], want.dtype)
    return [Expected(_name(logits), want, note=f"rows from {_val(n_valid)} on are −inf"),
            Expected(_name(part_val), best, note=what),
            Expected(_name(part_idx), idx, scores=want, note="its row (near ties may differ)")]


def _argmax_final(g: LaunchGroup, r: BufferReader) -> list[Expected]:
    a = g.specs[-1].args
    out, part_val, part_idx = a["next_token"], a["part_val"], a["part_idx"]
    vals, idx = r.array(part_val), r.array(part_idx)
    ok = ~np.isnan(vals)
    best = 0
    if ok.any():
        top = vals[ok].max()
        best = int(idx[ok & (vals == top)].min())
    return [Expected(_name(out), np.array([best], np.int32), exact=True)]


def _argmax_two_pass(g: LaunchGroup, r: BufferReader) -> list[Expected]:
    logits = g.specs[0].args["logits"]
    return [Expected(_name(g.specs[-1].args["next_token"]), np.array([argmax_total_order(r.array(logits))], np.int32),
                     exact=True)]


def _advance_state(g: LaunchGroup, r: BufferReader) -> list[Expected]:
    state, next_token = g.specs[0].args["state"], g.specs[0].args["next_token"]
    s = r.array(state).astype(np.int64)
    want = np.array([s[0] + 1, int(r.array(next_token)[0]), s[2] + 1], np.int32)
    return [Expected(_name(state), want, exact=True, note="(pos, token, seq_len)")]


Reference = Callable[[LaunchGroup, BufferReader], list[Expected]]

# base kernel name of a group's first launch → (reference, what the launch computes).
REFERENCES: dict[str, tuple[Reference, str]] = {
    "embedding": (_embedding, "residual fp32 [D] = embed[state.token]"),
    "gemv_int4_qkv_rope": (_qkv_rope, "xn = rmsnorm(residual)·w_in; q = rope(Wq xn + bq); "
                                      "K/V cache[pos] = rope(Wk xn + bk), Wv xn + bv"),
    "attention_decode_tma": (_attention, "attn = softmax(q Kᵀ/√Dh) V over pos < seq_len: split-KV partials "
                                         "(TMA producer warp + 4 consumer warps), then their combine"),
    "attention_decode": (_attention, "attn = softmax(q Kᵀ/√Dh) V over pos < seq_len: split-KV partials, "
                                     "then their combine"),
    "attention_decode_cluster": (_attention, "attn = softmax(q Kᵀ/√Dh) V over pos < seq_len: split-KV in one launch, "
                                             "the splits merged in a thread block cluster"),
    "gemv_int4_residual": (_residual, "residual += W x (INT4 GEMV, the add in its epilogue)"),
    "gemv_int4_f16": (_gemv_f16, "y = W x (INT4 GEMV)"),
    "gemv_int4_gate_up_swiglu": (_gate_up, "xn = rmsnorm(residual)·w_post; h = silu(Wg xn) · (Wu xn)"),
    "embedding_fmt": (_embedding, "residual fp32 [D] = embed[state.token], dequantized in its format"),
    "gemv_fmt_qkv_rope": (_qkv_rope, "xn = rmsnorm(residual)·w_in; q = rope(Wq xn + bq); K/V cache[pos] = "
                                     "rope(Wk xn + bk), Wv xn + bv (each W in its own format)"),
    "gemv_fmt_residual": (_residual, "residual += W x (GEMV in the weight's format, the add in its epilogue)"),
    "gemv_fmt_f16": (_gemv_f16, "y = W x (GEMV in the weight's format)"),
    "gemv_fmt_gate_up_swiglu": (_gate_up, "xn = rmsnorm(residual)·w_post; h = silu(Wg xn) · (Wu xn) (in their format)"),
    "gemv_fmt_lm_head": (_lm_head, "logits fp32 [V] = W_lm xn (in its format), and each block's best (value, row)"),
    "rmsnorm": (_rmsnorm, "xn fp16 = rmsnorm(residual) · w"),
    "gemv_f16_lm_head": (_lm_head, "logits fp32 [V] = W_lm xn, and the best (value, row) of every 32 rows"),
    "argmax_final": (_argmax_final, "next_token = the best of the (value, row) partials"),
    "argmax_partial": (_argmax_two_pass, "next_token = argmax(logits), in two passes"),
    "advance_state": (_advance_state, "state = (pos + 1, next_token, seq_len + 1)"),
    "l2_prefetch": (lambda _g, _r: [], "L2 ← the first weights of the layer's o_proj, gate_up and down (writes "
                                       "nothing: nothing to check)"),
}


def reference_for(group: LaunchGroup) -> tuple[Reference | None, str]:
    """(the group's reference or None, one line on what it computes) from its first kernel.

    A kernel not listed gets (None, its launcher's first docstring line).
    """
    kernel = base_kernel(group.specs[0].kernel.kernel)
    if kernel in REFERENCES:
        return REFERENCES[kernel]
    doc = (type(group.launcher).__doc__ or kernel).strip().splitlines()[0] if group.launcher is not None else kernel
    return None, doc


def groups_of(steps) -> list[LaunchGroup]:
    """LaunchGroups of a step list [(name, launcher)] (DecodePlan.steps, DecodeStep.launchers)."""
    return [LaunchGroup(name, list(launcher.specs), launcher) for name, launcher in steps]
