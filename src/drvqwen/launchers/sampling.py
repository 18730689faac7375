"""Launchers of kernels/sampling.cu: the GPU sampler and the hand-over of tokens to the host.

    SampleToken           next_token int32 [1] = sampler.sample(logits, params, uniform(seed, token_index))
    PenalizedSampleToken  penalize_logits (sampler.penalize over the device token history),
                          sample_token, record_token (the chosen token into the history)
    PublishToken          host_ring[token_index % R] = next_token[0]; token_index += 1

The sampling parameters and the token counter live in device memory (`params`, the 32 bytes
of sampling.cu's SamplerParams, packed by engine.pack_sampler_params), so one captured graph
serves every temperature, seed and step.
"""

from __future__ import annotations

import numpy as np

from ..cuda import Stream
from ..sampler import PENALTY_WINDOW
from .base import KernelRef, Launcher, check_buffer, i32, mirrored, require

THREADS = mirrored("sampling", "SAMPLE_THREADS", 1024)      # one block, a thread per histogram bin
PARAMS_BYTES = mirrored("sampling", "sizeof(SamplerParams)", 48)
WINDOW = mirrored("sampling", "PENALTY_WINDOW", PENALTY_WINDOW)
HISTORY_INTS = 1 + WINDOW                                    # count, then the ring of the last WINDOW ids
INFO_INTS = 4                                                # (token, Philox x, kept count, token_index)


class SampleToken(Launcher):
    """next_token int32 [1] = the token `sampler.sample` picks from logits fp32 [V], with the
    parameters and the step in device memory (`params`: uint8 [PARAMS_BYTES]).

    info int32 [INFO_INTS] gets (token, the 32-bit Philox draw, the kept-set size, token_index)
    for tests.

    Raises:
        LaunchError: a buffer of the wrong size or dtype.
    """

    def __init__(self, next_token, info, params, logits, *, vocab_size: int, stream: Stream | None = None):
        super().__init__(stream)
        check_buffer(next_token, "next_token", 1, np.int32)
        check_buffer(info, "info", INFO_INTS, np.int32)
        check_buffer(params, "params", PARAMS_BYTES, np.uint8)
        check_buffer(logits, "logits", vocab_size, np.float32)
        self.bytes_moved = 10 * 4 * vocab_size  # at most 10 passes over the logits (L2)
        self._add(KernelRef("sampling", "sample_token", pdl=True), (1,), (THREADS,),
                  dict(next_token=next_token, info=info, params=params, logits=logits, V=i32(vocab_size)),
                  reads=(params, logits), writes=(next_token, info), bytes_moved=self.bytes_moved)


class PenalizedSampleToken(Launcher):
    """SampleToken after the repeat penalty: three launches,

        penalize_logits  logits fp32 [V] of each distinct id in history's last WINDOW tokens
                         divided (> 0) or multiplied (≤ 0) by params.repeat_penalty, in place
        sample_token     as SampleToken (its greedy branch is the argmax of the penalized logits)
        record_token     history int32 [HISTORY_INTS] (count, ring): next_token appended

    history is filled by the host at each prefill (engine.py) with the sequence's last WINDOW ids.

    Raises:
        LaunchError: a buffer of the wrong size or dtype.
    """

    def __init__(self, next_token, info, params, logits, history, *, vocab_size: int,
                 stream: Stream | None = None):
        super().__init__(stream)
        check_buffer(history, "history", HISTORY_INTS, np.int32)
        check_buffer(next_token, "next_token", 1, np.int32)
        check_buffer(info, "info", INFO_INTS, np.int32)
        check_buffer(params, "params", PARAMS_BYTES, np.uint8)
        check_buffer(logits, "logits", vocab_size, np.float32)
        self._add(KernelRef("sampling", "penalize_logits", pdl=True), (1,), (WINDOW,),
                  dict(logits=logits, params=params, history=history, V=i32(vocab_size)),
                  reads=(params, history, logits), writes=(logits,), bytes_moved=4 * HISTORY_INTS + 8 * WINDOW)
        self._add(KernelRef("sampling", "sample_token", pdl=True), (1,), (THREADS,),
                  dict(next_token=next_token, info=info, params=params, logits=logits, V=i32(vocab_size)),
                  reads=(params, logits), writes=(next_token, info), bytes_moved=10 * 4 * vocab_size)
        self._add(KernelRef("sampling", "record_token", pdl=True), (1,), (1,),
                  dict(history=history, next_token=next_token),
                  reads=(next_token, history), writes=(history,), bytes_moved=12)
        self.bytes_moved = sum(sp.bytes_moved for sp in self.specs)


class PublishToken(Launcher):
    """host_ring[token_index % ring_size] = next_token[0]; params.token_index += 1.

    host_ring: page-locked host memory (cuda.PinnedHostBuffer) — the kernel writes it through
    its unified address, so the host reads each token without a device-to-host copy.

    Raises:
        LaunchError: ring_size < 1, or a buffer of the wrong size or dtype.
    """

    def __init__(self, host_ring, params, next_token, *, ring_size: int, stream: Stream | None = None):
        super().__init__(stream)
        check_buffer(params, "params", PARAMS_BYTES, np.uint8)
        check_buffer(next_token, "next_token", 1, np.int32)
        require(ring_size >= 1, f"publish_token: ring_size={ring_size} must be >= 1")
        self._add(KernelRef("sampling", "publish_token", pdl=True), (1,), (1,),
                  dict(host_ring=host_ring, params=params, next_token=next_token, ring_size=i32(ring_size)),
                  reads=(next_token,), writes=("host token ring", params), bytes_moved=8)
