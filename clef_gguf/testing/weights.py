"""The fixtures' random weights, drawn per parameter name from a seeded stream.

Drawn here, not left to transformers' init: its init puts norms at exactly 0/1 and
gates at fixed values, which would let a converter that forgets a norm offset or
permutes V heads pass unnoticed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# Head scalars, tuned on random heads over the request suite: the median question
# answers a top probability ~1.5-2.7x uniform, almost none is saturated (an option
# below 0.01 would hide logit errors), and the lexical prior and the joint path
# (routing, decoder layers, residual scorer) move the logits about equally, so a
# converter error in either path shows.
PRIOR_LOGIT_SCALE = math.log(10.0)
JOINT_LOGIT_SCALE = math.log(20.0)
RESIDUAL_GATE = 1.0  # sigmoid(1) ~ 0.73
# The head's stream is offset from the backbone's, so head and backbone draws never coincide.
HEAD_SEED_OFFSET = 1_000_003

# Projections that write into the residual stream, and how much smaller they are drawn.
RESIDUAL_WRITERS = ("o_proj.weight", "linear_attn.out_proj.weight", "down_proj.weight")
RESIDUAL_WRITE_SCALE = 0.2

# Draws the random value of one named parameter of a given shape.
_ValueFn = Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]


def randomize_backbone(model: torch.nn.Module, seed: int) -> None:
    """Every parameter of a Qwen3.5 model (backbone and vision tower) drawn from the stream of `seed`."""
    _randomize(model, torch.Generator().manual_seed(seed), _backbone_value)


def randomize_head(head: torch.nn.Module, seed: int) -> None:
    """Every parameter of a JointSchemaHead drawn from its own stream of `seed`, then the three scalars set."""
    _randomize(head, torch.Generator().manual_seed(seed + HEAD_SEED_OFFSET), _head_value)
    with torch.no_grad():
        head.prior_logit_scale.fill_(PRIOR_LOGIT_SCALE)
        head.joint_logit_scale.fill_(JOINT_LOGIT_SCALE)
        head.residual_gate.fill_(RESIDUAL_GATE)


def _randomize(module: torch.nn.Module, generator: torch.Generator, value: _ValueFn) -> None:
    # Sorted names make the draw order independent of module registration order;
    # copy_ in place keeps tied parameters tied.
    with torch.no_grad():
        for name, parameter in sorted(module.named_parameters()):
            parameter.copy_(value(name, tuple(parameter.shape), generator))


def _normal(shape: tuple[int, ...], generator: torch.Generator, std: float = 1.0, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * std + mean


def _uniform(shape: tuple[int, ...], generator: torch.Generator, low: float, high: float) -> torch.Tensor:
    return torch.rand(shape, generator=generator) * (high - low) + low


def _fan_in_normal(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    # Variance-preserving scale: every layer moves the residual stream visibly
    # without blowing it up.
    fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
    return _normal(shape, generator, std=1.0 / math.sqrt(fan_in))


def _backbone_value(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if name.endswith("A_log"):
        # Decay rates exp(A_log) spread over [0.05, 4]: distinct per V head, so a
        # wrong V-head order changes the output; some heads keep long memory.
        return _uniform(shape, generator, 0.05, 4.0).log()
    if name.endswith("dt_bias"):
        return _normal(shape, generator)
    if name.endswith("conv1d.weight"):
        # Asymmetric taps: a time-reversed or transposed kernel gives other outputs.
        return _normal(shape, generator, std=0.5)
    if name.endswith("linear_attn.norm.weight") or (".visual." in name and "norm" in name and name.endswith("weight")):
        # Gated RMSNorm and vision LayerNorms multiply by the weight itself.
        return _normal(shape, generator, std=0.3, mean=1.0)
    if "norm" in name and name.endswith("weight"):
        # Qwen3.5 RMSNorms multiply by (1 + weight): a converter that forgets the
        # +1 would scale by ~0.3 instead of ~1.
        return _normal(shape, generator, std=0.3)
    if name.endswith("bias"):
        return _normal(shape, generator, std=0.05)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return _normal(shape, generator)
    if name.endswith(RESIDUAL_WRITERS):
        # Trained models add small updates to a dominant residual stream; a fixture whose
        # layers rewrite it amplifies rounding (q8_0) far beyond what real Clef files see.
        return _fan_in_normal(shape, generator) * RESIDUAL_WRITE_SCALE
    return _fan_in_normal(shape, generator)


def _head_value(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    if not shape:  # the three scalars, set explicitly afterwards
        return torch.zeros(())
    if "norm" in name and name.endswith("weight"):
        return _normal(shape, generator, std=0.2, mean=1.0)  # nn.LayerNorm: weight itself
    if name.endswith("bias"):
        return _normal(shape, generator, std=0.1)
    if name.startswith("type_embedding"):
        return _normal(shape, generator)
    return _fan_in_normal(shape, generator)
