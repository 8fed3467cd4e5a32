"""Host memory of a training run: freed tensors handed back to the system, and the peak it reached.

Where the quickstart's 6.9 GiB peak went (SmolLM2-135M, 8 completions of up to 96 tokens, one CPU step, measured with
the resident-set peak before and after each phase): 1.4 GiB the model, its LoRA and the rollout engine's dense copy of
the weights; 2.8 GiB the tensors autograd keeps from the loss forward for the backward (activations, of which 0.4 GiB
was a second dense copy of the weights, now shared with the engine: ``NVFP4Linear.cpu_dense``); about 1.7 GiB
transient in the backward, most of it trl's chunked log-probabilities (fp32 ``[tokens, 32768]`` tiles on a CPU);
and about 1.5 GiB that nothing used: freed
activations that glibc's allocator kept. glibc serves a block below its mmap threshold from its heap and raises the
threshold (up to 32 MB) each time it frees a larger mapped block, so after the first step every activation came
from the heap, which fragments and is not handed back: the process also kept its 5.3 GiB peak through every
rollout. :func:`hand_back_large_blocks` fixes the threshold instead.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource

logger = logging.getLogger(__name__)

#: glibc's ``mallopt`` parameter for the mmap threshold (malloc.h); setting it also stops the dynamic raise.
M_MMAP_THRESHOLD = -3
#: Blocks from 1 MB up are mapped on their own and unmapped when freed: a step's activations (1-10 MB tensors) go
#: back to the system at its backward, while small objects stay in the heap, where they are cheap.
MMAP_THRESHOLD_BYTES = 1 << 20


def hand_back_large_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Make glibc map blocks of ``threshold`` bytes and more on their own, so that freeing one returns its memory to
    the system; whether it was set (False without glibc: another C library manages memory its own way)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        done = bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False
    logger.debug("malloc: blocks of %d bytes and more are mapped on their own", threshold)
    return done


def peak_rss_gib() -> float:
    """The most resident memory this process has held so far, in GiB (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
