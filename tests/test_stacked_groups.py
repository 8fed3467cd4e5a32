"""Row-stacked q/k/v and gate/up weights (``qerl.load.linear.stack_fused_groups``) and the rollout's one-launch
group path (``decoder.stacked_forward`` -> ``kernels.nvfp4_group_decode``), on CPU through the reference ops.

The Triton kernel itself is checked against the same references by ``rollout_kernel_checks.check_stacked_decode``
(interpreted on CPU where triton is installed, compiled in ``test_rollout_kernels.py``'s GPU test).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import nvfp4_lora, tiny_qwen2

from qerl import arch
from qerl.kernels import reference
from qerl.load.linear import NVFP4Linear, stack_fused_groups
from qerl.rollout import decoder
from qerl.rollout.layers import ModelView


def _bases(model: torch.nn.Module, names: tuple[str, ...]) -> list[list[NVFP4Linear]]:
    lm = model.get_base_model()
    groups = []
    for layer in lm.model.layers:
        owner = layer.self_attn if names == arch.QKV else layer.mlp
        groups.append([getattr(owner, n).get_base_layer() for n in names])
    return groups


def test_stacking_keeps_every_tensor_and_the_forward() -> None:
    """Qwen2 (q/k/v biases): each group becomes row views of one storage; values and logits unchanged."""
    torch.manual_seed(0)
    model = nvfp4_lora(tiny_qwen2(), group_scales=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(0, 200, (2, 7))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert stack_fused_groups(model) == 2 * len(model.get_base_model().model.layers)
    for names in arch.FUSED_GROUPS:
        for members in _bases(model, names):
            tensors = ["weight_packed", "weight_scale"] + (["bias"] if members[0].bias is not None else [])
            for t in tensors:
                storages = {getattr(m, t).untyped_storage().data_ptr() for m in members}
                assert len(storages) == 1, f"{t} of {names} not in one storage"
                offsets = [getattr(m, t).storage_offset() for m in members]
                rows = [
                    getattr(m, t).shape[0] * (getattr(m, t).stride(0) if getattr(m, t).dim() > 1 else 1)
                    for m in members
                ]
                assert offsets == [offsets[0] + sum(rows[:i]) for i in range(len(members))]
            assert len({m.weight_global_scale.data_ptr() for m in members}) == 1
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k, v in before.items():
        assert torch.equal(
            v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
            after[k].view(torch.uint8) if v.dtype == torch.float8_e4m3fn else after[k],
        ), k
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)


def test_groups_with_different_global_scales_stay_apart() -> None:
    """Per-Linear global scales (not a fused-group checkpoint): nothing is stacked, the view runs them per projection."""
    model = nvfp4_lora(tiny_qwen2())
    assert stack_fused_groups(model) == 0
    view = ModelView.from_model(model)
    assert all(g.stacked is None for g in view.groups())


@pytest.mark.parametrize("segmented", [False, True])
def test_stacked_forward_matches_each_projection(segmented: bool) -> None:
    """One group call (block-diagonal LoRA expand, u row-major or as a fused shrink writes it) ==
    every projection on its own, for q/k/v (with biases) and gate/up; the LoRA blocks are B * scaling."""
    torch.manual_seed(1)
    model = nvfp4_lora(tiny_qwen2(), group_scales=True)
    stack_fused_groups(model)
    view = ModelView.from_model(model)
    view.refresh_lora()
    layer = view.layers[1]
    for group in (layer.qkv, layer.gate_up):
        assert group.stacked is not None and group.lora_b is not None
        row = 0
        for proj in group.projs:
            a, b, s = proj.lora_sources[0]
            n = proj.base.out_features
            assert torch.equal(group.lora_b[row : row + n, proj.lora_slice], (b * s).to(group.lora_b.dtype))
            others = torch.ones(group.lora_b.shape[1], dtype=torch.bool)
            others[proj.lora_slice] = False
            assert not group.lora_b[row : row + n, others].any(), "off-diagonal blocks must be zero"
            row += n
        x = torch.randn(3, 2, group.stacked.weight.weight_packed.shape[1] * 2)
        lora = decoder.lora_inputs(x, group)
        want = decoder.group_op(group, x.device, stacked=False, gluon_k=False)(x, lora)  # one projection at a time
        if segmented:
            flat = reference.segment(lora.u.reshape(6, -1), group.lora_bounds)
            lora = decoder.LoraU(flat, group.lora_bounds, x.shape[:-1])
            for got_u, want_u in zip(
                lora.per_projection(group), decoder.lora_inputs(x, group).per_projection(group), strict=True
            ):
                assert torch.equal(got_u, want_u)
        got = decoder.group_op(group, x.device, stacked=True, gluon_k=False)(x, lora)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want, strict=True):
            assert g.is_contiguous()
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_segment_round_trip_with_empty_segments() -> None:
    m = torch.arange(24.0).view(4, 6)
    for bounds in ((2, 4), (6, 6), (0, 3), (3, 3)):
        flat = reference.segment(m, bounds)
        assert flat.shape == (24,)
        assert torch.equal(reference.unsegment(flat, 4, bounds, 6), m)
    assert torch.equal(reference.segment(m, (2, 4))[:8], m[:, :2].reshape(-1)), "segment 0 is [rows, 2] row-major"


def test_loader_stacks_a_checkpoint(tmp_path: Path) -> None:
    """A checkpoint of qerl's quantizer (one global scale per fused group) loads stacked."""
    from tiny_models import make_tiny_llama

    from qerl.load.loader import load_model
    from qerl.quantize.pipeline import quantize_checkpoint

    src = make_tiny_llama(tmp_path / "src")
    model = load_model(quantize_checkpoint(src, tmp_path / "q"), device="cpu")
    attn = model.model.layers[0].self_attn
    q, k = attn.q_proj.weight_packed, attn.k_proj.weight_packed
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    assert k.storage_offset() == q.storage_offset() + q.numel()
