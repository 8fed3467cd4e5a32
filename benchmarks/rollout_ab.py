"""The A/B modes of benchmarks/rollout.py: one engine setting against another in one process.

``--kernel-ab gluon|direct|rope|sampler|direct_ring|shrink_rank|pdl`` times only the NVFP4 + LoRA engine (the first of
``--shapes``) at ``--batches`` with the ``qerl.kernels.schedule`` switch ``AB_SWITCHES`` names off / on / off, fresh
graphs each: the Gluon decode GEMMs above 16 rows (``gluon_decode``) or up to 8 (``direct_decode``) against the
Triton kernel, the RoPE and cache write in the attention kernel (``rope_in_attention``), the one-kernel sampler
(``fused_sampler``), the 32B down's slices on the mma.sync kernel's x ring (``direct_ring``), the RMSNorm shrink
split over u's ranks (``shrink_by_rank``), programmatic dependent launch (``decode_pdl``).

``--ab-constant MODULE.NAME=BASE:VARIANT ...`` does the same for module constants set together (e.g.
``qerl.rollout.step_plan.FUSED_LORA_MAX_ROWS=32:64 qerl.kernels.step_norm.RANK_SPLIT_MAX_ROWS=32:64``), so a
threshold's A/B needs no script of its own.

Each engine's greedy tokens (16 of them) are compared with the first base engine's on the same prompts: a wrong
kernel shows as rows that differ from token 1 on, rounding-order differences as a later flip of a near tie.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import gc
import importlib
from collections.abc import Iterator
from dataclasses import replace
from types import ModuleType

import torch

from benchmarks import common
from benchmarks.common import PROMPT, VOCAB, utc_now
from benchmarks.rollout_models import build_model, environment, ms_per_step

#: ``--kernel-ab`` variants: the ``schedule`` switch each has, and what runs with it off.
AB_SWITCHES = {
    "gluon": ("gluon_decode", "triton"),
    "direct": ("direct_decode", "triton"),
    "rope": ("rope_in_attention", "rope_kernel"),
    "sampler": ("fused_sampler", "torch_sampler"),
    "direct_ring": ("direct_ring", "tma_for_ring"),
    "shrink_rank": ("shrink_by_rank", "column_split"),
    "pdl": ("decode_pdl", "no_pdl"),
}


#: What an A/B sets: (module, attribute, value) triples, applied together around one engine's build and timing.
Setting = list[tuple[ModuleType, str, object]]


def parse_ab_constants(specs: list[str]) -> tuple[Setting, Setting]:
    """``--ab-constant MODULE.NAME=BASE:VARIANT ...`` -> (the base settings, the variant's). Each value is a Python
    literal of the attribute's own type (int, float or bool), so a typo in a name or a value is an error up front,
    not a run that silently timed the default twice; ValueError names the spec and what was expected."""
    base: Setting = []
    variant: Setting = []
    for spec in specs:
        target, _, values = spec.partition("=")
        path, _, name = target.rpartition(".")
        a, sep, b = values.partition(":")
        expected = "MODULE.NAME=BASE:VARIANT, e.g. qerl.rollout.step_plan.FUSED_LORA_MAX_ROWS=32:64"
        if not (path and name and sep):
            raise ValueError(f"--ab-constant {spec!r}: expected {expected}")
        try:
            module = importlib.import_module(path)
        except ImportError as err:
            raise ValueError(f"--ab-constant {spec!r}: cannot import {path} ({err})") from None
        if not hasattr(module, name):
            raise ValueError(f"--ab-constant {spec!r}: {path} has no attribute {name}")
        kind = type(getattr(module, name))
        try:
            parsed = [ast.literal_eval(v.strip()) for v in (a, b)]
        except (ValueError, SyntaxError):
            parsed = []
        if kind not in (bool, int, float) or len(parsed) != 2 or any(type(v) is not kind for v in parsed):
            raise ValueError(f"--ab-constant {spec!r}: expected two {kind.__name__} literals after '=' ({expected})")
        base.append((module, name, parsed[0]))
        variant.append((module, name, parsed[1]))
    return base, variant


@contextlib.contextmanager
def applied(settings: Setting) -> Iterator[None]:
    """``settings`` in force inside the block; every attribute back to what it was after it."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in settings]
    try:
        for module, name, value in settings:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def kernel_ab(args: argparse.Namespace) -> dict:
    """``--kernel-ab K``: K's ``schedule`` switch off / on / off (``AB_SWITCHES``)."""
    from qerl.kernels import schedule

    switch, base = AB_SWITCHES[args.kernel_ab]
    off, on = (replace(schedule.SWITCHES, **{switch: value}) for value in (False, True))
    return engine_ab(args, base, [(schedule, "SWITCHES", off)], args.kernel_ab, [(schedule, "SWITCHES", on)])


def constant_ab(args: argparse.Namespace, base: Setting, variant: Setting) -> dict:
    """``--ab-constant`` (parsed by ``parse_ab_constants``): the named module attributes at their BASE / VARIANT /
    BASE values."""

    def label(settings: Setting) -> str:
        return ",".join(f"{name}={value}" for _, name, value in settings)

    return engine_ab(args, label(base), base, label(variant), variant)


def engine_ab(
    args: argparse.Namespace, base: str, base_settings: Setting, variant: str, variant_settings: Setting
) -> dict:
    """ms/step of the NVFP4 + LoRA engine under ``base`` / ``variant`` / ``base`` settings at each of ``--batches``, a
    fresh engine (graphs, compiled launches) for each, in one process, on the first of ``--shapes``; each engine's
    greedy tokens compared with the first base engine's on the same prompts."""
    from qerl.rollout import SamplingParams
    from qerl.rollout.native import NativeEngine

    shape = args.shapes[0]
    model = build_model(shape, nvfp4=True)
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16, seed=0)
    for b in args.batches:
        prompts = [torch.randint(0, VOCAB, (PROMPT,), generator=gen).tolist() for _ in range(b)]
        reference_tokens = None
        for name, settings in ((base, base_settings), (variant, variant_settings), (base, base_settings)):
            with applied(settings):
                engine = NativeEngine(model, 0)
                tokens = engine.generate(prompts, greedy).completion_ids
                ms, t_one = ms_per_step(engine, prompts, args.tokens)
            reference_tokens = reference_tokens or tokens
            same = sum(t == r for t, r in zip(tokens, reference_tokens, strict=True)) / len(tokens)
            # Tokens before a row's first difference: a wrong kernel diverges at the first decode step
            # (token 1; token 0 comes from the prefill, which never takes the decode GEMMs), while
            # rounding-order differences flip a near-tied argmax somewhere later, if at all.
            prefix = sum(
                next((i for i, (a, c) in enumerate(zip(t, r, strict=False)) if a != c), len(t))
                for t, r in zip(tokens, reference_tokens, strict=True)
            ) / len(tokens)
            del engine
            gc.collect()
            torch.cuda.empty_cache()
            rows.append(
                dict(
                    shape=shape,
                    batch=b,
                    variant=name,
                    tokens=args.tokens,
                    ms_per_step=round(ms, 4),
                    prefill_plus_1_s=round(t_one, 4),
                    greedy_rows_equal_to_base=same,
                    greedy_common_prefix_tokens=prefix,
                    greedy_tokens=greedy.max_new_tokens,
                )
            )
            print(
                f"{shape} nvfp4+lora {name:6s} b={b:3d}: {ms:8.3f} ms/step, greedy rows equal to {base}'s "
                f"{same:.2f}, common prefix {prefix:.1f} of {greedy.max_new_tokens} tokens",
                flush=True,
            )
    return {
        "benchmark": f"rollout decode, {base} vs {variant} (ms/step)",
        "date": utc_now(),
        **environment(),
        "command": common.command("benchmarks.rollout"),
        "results": rows,
    }
