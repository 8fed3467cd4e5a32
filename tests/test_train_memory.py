"""Where a CPU training step's memory went, and the two wastes cut (``qerl.train.host_memory``).

* Training's forward of an NVFP4 layer on CPU dequantized a fresh dense weight, which autograd kept until the
  backward: a second dense model beside the rollout engine's own copy. It now reads the engine's copy
  (``NVFP4Linear.cpu_dense``): the loss and every gradient are bit-identical, and the tensors saved for the backward
  no longer hold the weights.
* glibc kept the freed activations of a step in its heap (it raises its mmap threshold as large blocks are freed):
  ``hand_back_large_blocks`` fixes the threshold, so that freed large blocks go back to the system.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tiny_models import nvfp4_lora, tiny_llama

from qerl.load.linear import NVFP4Linear

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """(loss, gradients, bytes of new storage autograd saved for the backward) of one forward and backward."""
    before = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    kept = [layer.cpu_dense(torch.float32, make=False) for layer in _nvfp4(model)]
    before |= {d.untyped_storage().data_ptr() for d in kept if d is not None}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in before:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    model.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved.values())


def _nvfp4(model: torch.nn.Module) -> list[NVFP4Linear]:
    return [m for m in model.modules() if isinstance(m, NVFP4Linear)]


def test_training_forward_reads_the_engines_dense_copy() -> None:
    torch.manual_seed(0)
    model = nvfp4_lora(tiny_llama()).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 24))
    loss, grads, saved = _step(model, ids)
    dense_bytes = 0
    for layer in _nvfp4(model):  # what the native engine does at its first CPU rollout
        dense_bytes += layer.cpu_dense(torch.float32).nbytes
    cached_loss, cached_grads, cached_saved = _step(model, ids)
    assert torch.equal(loss, cached_loss)
    assert grads.keys() == cached_grads.keys() and len(grads) > 0
    assert all(torch.equal(grads[n], cached_grads[n]) for n in grads)
    assert saved - cached_saved >= dense_bytes, (saved, cached_saved, dense_bytes)


def test_a_dense_copy_goes_stale_with_its_packed_weight() -> None:
    layer = nvfp4_lora(tiny_llama()).base_model.model.model.layers[0].mlp.down_proj.base_layer
    dense = layer.cpu_dense(torch.float32)
    assert layer.cpu_dense(torch.float32, make=False) is dense
    assert layer.cpu_dense(torch.bfloat16, make=False) is None  # another dtype is another copy
    layer.weight_packed = layer.weight_packed.clone()  # .to() or stacking replaces the buffers
    assert layer.cpu_dense(torch.float32, make=False) is None


#: Frees 80 blocks of 8 MB but the last one (it pins the heap's top), after a freed 16 MB mapped block raised glibc's
#: threshold above 8 MB; prints the resident growth that stays, in MB.
_KEPT_AFTER_FREE = textwrap.dedent(
    """
    import sys
    from qerl.train.host_memory import hand_back_large_blocks
    if sys.argv[1] == "fixed":
        assert hand_back_large_blocks()
    def rss():
        return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024
    freed = b"x" * (16 << 20)  # mapped on its own; freeing it raises glibc's dynamic threshold to 16 MB
    del freed
    start = rss()
    blocks = [b"x" * (8 << 20) for _ in range(80)]
    last = blocks.pop()
    del blocks
    print(round(rss() - start))
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_large_blocks_go_back_to_the_system() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    kept = {}
    for mode in ("dynamic", "fixed"):
        done = subprocess.run([sys.executable, "-c", _KEPT_AFTER_FREE, mode], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr
        kept[mode] = int(done.stdout)
    assert kept["dynamic"] > 400, kept  # glibc's default: the heap keeps them
    assert kept["fixed"] < 50, kept
