"""The looking commands of `drvqwen step`: show, kv, tmap, graph, src, and the register counts.

They read, never run: buffers through the machine (downloads on the GPU), the KV cache's page
allocator and block table, the tensor maps and the graph execs the engine built (on the GPU),
or what the plan says they would be (on the CPU), and the kernel files.
"""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np
from rich.text import Text

from ..errors import DrvqwenError
from ..format import weight_formats as wf
from ..format.tensor_set import proj_prefix
from ..kv_cache import PAGE_TOKENS, tensor_map_shape
from ..launchers.base import TensorMapSpec
from ..launchers.signatures import declaration
from . import render as R

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
NORMS = ("input_layernorm", "post_attention_layernorm")
# Values `show` prints when no slice is given.
DEFAULT_VALUES = 8


@lru_cache(maxsize=None)
def _resources(file: str, defines: tuple) -> dict:
    from ..cuda.nvrtc import compile_kernel

    return compile_kernel(file, defines=dict(defines)).resources


def registers(kernel) -> str:
    """Registers per thread of a KernelRef, from the ptxas report of its cubin (compiled by NVRTC
    once, then read from the cubin cache); "—" where NVRTC is not available."""
    try:
        r = _resources(kernel.file, tuple(kernel.defines)).get(kernel.kernel)
    except Exception:  # no NVRTC or CUDA headers on this machine: the column stays empty
        return "—"
    return "—" if r is None or r.registers is None else str(r.registers)


# ---- show -----------------------------------------------------------------------------------------

def parse_slice(text: str) -> tuple:
    """A numpy index written as in Python: `3`, `0:8`, `2,0:16`, `:, 5`, `-4:`.

    Raises:
        DrvqwenError: anything else (one line naming the text).
    """
    parts = []
    for piece in text.split(","):
        piece = piece.strip()
        try:
            if ":" in piece:
                bits = piece.split(":")
                if len(bits) > 3:
                    raise ValueError
                sl = slice(*(int(b) if b.strip() else None for b in bits))
                if sl.step == 0:  # numpy would raise ValueError later, at the indexing
                    raise DrvqwenError(f"bad slice {text!r}: a step of 0 (0:8:2 takes every other one)")
                parts.append(sl)
            else:
                parts.append(int(piece))
        except ValueError:
            raise DrvqwenError(f"bad slice {text!r}: write it as numpy does, e.g. 0:8, 3 or 2,0:16") from None
    return tuple(parts)


def _weight(s, name: str) -> tuple[np.ndarray, str] | None:
    """A weight by file name or by `L3.q_proj` / `L3.input_layernorm` / `L3.q_bias`, quantized
    ones dequantized in their format (float32 [N, K])."""
    m = re.fullmatch(r"L(\d+)\.(\w+)", name)
    w = s.m.weights
    if m:
        layer, role = int(m.group(1)), m.group(2)
        if layer >= s.m.config.num_layers:
            raise DrvqwenError(f"{name}: the model has layers 0..{s.m.config.num_layers - 1}")
        if role in PROJS:
            name = proj_prefix(layer, role) + ".qweight"
        elif role in NORMS:
            name = f"model.layers.{layer}.{role}.weight"
        elif role in ("q_bias", "k_bias", "v_bias"):
            name = proj_prefix(layer, role[0] + "_proj") + ".bias"
        else:
            return None
    base = name
    for suffix in wf.PART_SUFFIXES:      # any part of a quantized weight names the weight
        if name.endswith(suffix):
            base = name[:-len(suffix)]
    if w.has(base + ".qweight"):
        fmt = wf.FORMATS[w.file.formats[base]].name
        return w.quantized(base + ".qweight"), f"{base} dequantized ({fmt} → float32)"
    if not w.has(name) and w.has(base + ".weight"):   # a dense projection
        name = base + ".weight"
    if w.has(name):
        return np.asarray(w.weight(name)), f"{name} (from the model file)"
    return None


def show(s, arg: str) -> None:
    """`show NAME [SLICE]`: a buffer's shape, dtype, statistics and values, the reference beside."""
    if not arg:
        raise DrvqwenError("show: give a buffer name (activations such as residual, q, attn, logits; "
                           "k_cache[L] for K by position; L0.q_proj for a weight)")
    name, _, sl = arg.partition(" ")
    m = s.m
    ref_vals, what = None, ""
    kv = re.fullmatch(r"([kv])_cache\[(\d+)\]", name)
    if kv:
        if s.prompt_ids is None:
            raise DrvqwenError("the KV cache is empty: start one with `prompt TEXT` or `chat TEXT`")
        layer = int(kv.group(2))
        if layer >= m.config.num_layers:
            raise DrvqwenError(f"{name}: the model has layers 0..{m.config.num_layers - 1}")
        a = m.kv_positions(kv.group(1) + "_cache", layer)
        what = f"layer {layer}'s {kv.group(1).upper()} of positions 0..{a.shape[0] - 1} [pos, Hkv, Dh], through the block table"
    elif name in m.plan.buffers:
        s._need_prompt()   # before any step an activation holds nothing computed (NaN on the CPU)
        a = m.array(name)
        b = m.plan.buffers[name]
        what = f"activation {b.dtype}{list(b.shape)}"
        got = m.last_expected.get(name)
        if got is not None and got[0].where is None:
            ref_vals = np.asarray(got[0].values).reshape(a.shape)
            what += f"; reference from {got[1]}'s inputs"
    else:
        found = _weight(s, name)
        if found is None:
            raise DrvqwenError(f"no buffer {name!r}: activations are {', '.join(m.plan.buffers)}; "
                               f"also k_cache[L], v_cache[L], L0.q_proj, L0.input_layernorm, model.norm.weight …")
        a, what = found
    a = np.asarray(a)
    index = parse_slice(sl) if sl.strip() else None
    try:
        part = a[index] if index is not None else a.reshape(-1)[:DEFAULT_VALUES]
        rpart = None if ref_vals is None else (ref_vals[index] if index is not None else ref_vals.reshape(-1)[:DEFAULT_VALUES])
    except IndexError as e:
        raise DrvqwenError(f"slice {sl.strip()!r} of {name} {list(a.shape)}: {e}") from None
    s.say(Text(f"{name}: {a.dtype}{list(a.shape)}  {what}", style="bold"), f"  {R.stats(a)}")
    flat = np.atleast_1d(part).reshape(-1)
    cols = ("i", "value") if rpart is None else ("i", "value", "reference", "|diff|")
    t = R.table(*cols, title=f"values [{sl.strip() or f':{DEFAULT_VALUES} of the flattened buffer'}]", right=cols)
    rflat = None if rpart is None else np.atleast_1d(rpart).reshape(-1)
    for i, v in enumerate(flat[:256]):
        row = [str(i), f"{v:.6g}" if np.issubdtype(flat.dtype, np.floating) else str(v)]
        if rflat is not None:
            row += [f"{rflat[i]:.6g}", f"{abs(float(v) - float(rflat[i])):.3g}"]
        t.add_row(*row)
    s.say(t)
    if flat.size > 256:
        s.say(f"  ({flat.size - 256} more values not shown: narrow the slice)")
    if m.device == "cpu" and name in m.plan.buffers:
        s.say("  on the CPU this buffer is the reference's own output")


# ---- kv, tmap, graph --------------------------------------------------------------------------------

def kv(s) -> None:
    """`kv`: block table, pages in use and free, the next page boundary and so the next graph."""
    m = s.m
    bt = m.block_table_host()
    n_pages = m.plan.n_pages
    if s.prompt_ids is None:
        s.say(f"no sequence: the block table is empty and all {n_pages} pages are free; the first step of a "
              f"sequence opens page 0 (prefill reserves the prompt's pages at once)")
        return
    t = R.table("logical page", "positions", "physical page", title="block table (logical → physical)",
                right=("logical page", "physical page"))
    device_bt = m.array("block_table")
    for i, p in enumerate(bt):
        t.add_row(str(i), f"{i * PAGE_TOKENS}–{i * PAGE_TOKENS + PAGE_TOKENS - 1}",
                  str(p) + ("" if int(device_bt[i]) == p else f" (device table holds {int(device_bt[i])})"))
    pool = m.plan.kv["k_cache"]
    s.say(t, f"pages in use {len(bt)}, free {n_pages - len(bt)} of {n_pages} "
             f"(k_cache and v_cache fp16 {list(pool.shape)} each, {R.fmt_bytes(pool.nbytes)})")
    boundary = len(bt) * PAGE_TOKENS
    if m.cursor:
        where = (f"this step (position {m.pos}) opened page {m.opened_page}: it is replayed from 'opens_page'"
                 if m.opened_page is not None else
                 f"this step (position {m.pos}) writes into page {bt[m.pos // PAGE_TOKENS]}: the 'decode' graph")
        s.say(where)
        nxt = m.pos + 1
    else:
        nxt = m.pos
    opens = nxt // PAGE_TOKENS >= len(bt)
    s.say(Text(f"next step: position {nxt}; position {boundary} opens the next page, so the next step replays "
               f"'{'opens_page' if opens else 'decode'}'" + (" (a new page from the free list, set in the block "
                                                            "table by set_block_table_entry)" if opens else ""),
               style="bold"))


def _map_specs(m) -> dict[str, TensorMapSpec]:
    out = {}
    for e in m.entries:
        for p in e.spec.params:
            if isinstance(p, TensorMapSpec):
                out[p.of.name] = p
    return out


def tmap(s, arg: str) -> None:
    """`tmap NAME`: a TMA tensor map's fields (the encoded one on the GPU, the plan's on the CPU)."""
    m = s.m
    specs = _map_specs(m)
    name = {"k": "k_cache", "v": "v_cache"}.get(arg.strip(), arg.strip())
    if not specs:
        raise DrvqwenError("this step reads no tensor maps (the plain attention kernel)")
    if name not in specs:
        raise DrvqwenError(f"tmap: give one of {', '.join(specs)}")
    spec = specs[name]
    t = R.table("field", "value", title=f"tensor map of {name}")
    if m.device == "cuda":
        tm = m.dec.kv.tensor_map(name)
        rows = [("dtype", f"{tm.dtype} (CU_TENSOR_MAP_DATA_TYPE_FLOAT16)"), ("rank", str(len(tm.shape))),
                ("dims (row-major)", str(list(tm.shape))), ("strides (bytes, outer dims)", str(list(tm.strides_bytes))),
                ("box", f"{list(tm.box)} = {tm.box_bytes} B per copy"), ("global address", f"0x{tm.ptr:x}")]
    else:
        shape = tensor_map_shape(spec.of.shape)
        rows = [("dtype", f"{spec.dtype} (CU_TENSOR_MAP_DATA_TYPE_FLOAT16)"), ("rank", "2"),
                ("dims (row-major)", str(list(shape))), ("strides (bytes, outer dims)", str([shape[1] * 2])),
                ("box", f"{list(spec.box)} = {int(np.prod(spec.box)) * 2} B per copy"),
                ("global address", "assigned when the pool is allocated (plan only on the CPU)")]
    rows += [("element strides", "[1, 1]"), ("interleave", "none"), ("swizzle", "none"),
             ("L2 promotion", "none"), ("OOB fill", "none (zeros)")]
    for k, v in rows:
        t.add_row(k, v)
    s.say(t, f"one box = one page of one KV head: row ((layer·P + page)·Hkv + head)·{PAGE_TOKENS} "
             f"(kv_cache.tensor_map; encoded once per pool with encode_tiled's defaults)")


def graph(s) -> None:
    """`graph`: the two graph execs, their node counts, which one replays next and why."""
    m = s.m
    n = len(m.entries)
    if m.device == "cuda":
        g = m.graph_decoder()
        nodes = dict(g.num_nodes)
        head = f"captured from the {n} launches of the step (mode: {g.mode})"
        ran = (f"steps replayed so far: decode ×{g.steps_by_graph['decode']}, "
               f"opens_page ×{g.steps_by_graph['opens_page']}")
    else:
        nodes = {"decode": n, "opens_page": n + 1}
        head = "on the CPU, what the GPU would capture from this launch list"
        ran = ""
    t = R.table("graph", "nodes", "what it replays", title=f"decode graphs: {head}", right=("nodes",))
    t.add_row("decode", str(nodes.get("decode", "—")), "the decode step (15 of 16 steps)")
    t.add_row("opens_page", str(nodes.get("opens_page", "—")), "set_block_table_entry, then the step (pos % 16 == 0)")
    s.say(t)
    if ran:
        s.say(ran)
    pos = m.pos + (1 if m.cursor else 0)
    nxt = "opens_page" if pos // PAGE_TOKENS >= len(m.block_table_host()) else "decode"
    s.say(Text(f"next: '{nxt}', for position {pos}: " + (
        "it needs a page the block table does not hold yet" if nxt == "opens_page"
        else f"page {pos // PAGE_TOKENS} is already in the block table"), style="bold"))


# ---- src -------------------------------------------------------------------------------------------

def _kernel_of(s, name: str):
    for e in s.m.entries:
        if e.name == name or e.name.startswith(name + ".") or e.spec.kernel.kernel == name:
            return e.spec.kernel
    return None


def signature(text: str, kernel: str) -> str | None:
    """The `__global__` declaration of `kernel` in a kernel file, up to its body (through the
    macro that defines it, for kernels instantiated by a macro)."""
    return declaration(text, kernel)


def src(s, arg: str) -> None:
    """`src NAME`: the kernel file's header comment (work split, bytes, limit) and the signature."""
    from ..cuda.sources import kernel_source

    if not arg:
        raise DrvqwenError("src: give a launch name (L0.qkv_rope, lm_head …) or a kernel name")
    k = _kernel_of(s, arg.strip())
    if k is None:
        raise DrvqwenError(f"no launch or kernel named {arg.strip()!r} (`list` shows them)")
    source = kernel_source(k.file)
    text = source.text.decode("utf-8", errors="replace")
    header = []
    for line in text.splitlines():
        if not line.startswith("//"):
            break
        header.append(line)
    s.say(Text(f"kernels/{k.file}.cu — {k.kernel}", style="bold"), "\n".join(header) or "(no header comment)",
          "", signature(text, k.kernel) or f"(no __global__ {k.kernel} found)")
