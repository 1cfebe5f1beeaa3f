"""The tensors llama.cpp's qwen35 and Clef loaders ask for, with their shapes and types."""

from __future__ import annotations

import re

from gguf import GGMLQuantizationType as GT

from ..format import contract as C
from ..format.header import Header, TensorInfo
from .report import Problem

_OPTIONAL_BIAS = re.compile(r"^blk\.(\d+)\.attn_([qkv])\.bias$")


def _same_dims(t: TensorInfo, shape: tuple[int, ...]) -> bool:
    """llama.cpp's rule: the expected ggml dims, any further dims 1."""
    want = tuple(reversed(shape))
    return len(t.dims) >= len(want) and t.dims[: len(want)] == want and all(d == 1 for d in t.dims[len(want) :])


def _optional(name: str, t: TensorInfo, shape: C.BackboneShape, tensors: dict[str, TensorInfo]) -> bool:
    """q/k/v biases of full-attention layers: llama.cpp's qwen35 loader takes them when present."""
    m = _OPTIONAL_BIAS.match(name)
    if not m or int(m[1]) >= shape.n_layer or shape.recurrent[int(m[1])]:
        return False
    weight = tensors.get(f"blk.{m[1]}.attn_{m[2]}.weight")
    return weight is not None and len(t.dims) == 1 and t.dims[0] == weight.dims[-1]


def _first(names: list[str], n: int = 1) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def check_backbone(h: Header, shape: C.BackboneShape) -> tuple[list[Problem], int]:
    """Every tensor llama.cpp's qwen35 loader asks for, with the shapes the hyperparameters imply."""
    expected = C.backbone_tensor_shapes(shape)
    tensors = h.tensors
    missing = [n for n in expected if n not in tensors]
    wrong = [n for n, want in expected.items() if n in tensors and not _same_dims(tensors[n], want)]
    extra = [
        n for n, t in tensors.items() if not C.is_head_tensor(n) and n not in expected and not _optional(n, t, shape, tensors)
    ]
    problems = []
    if missing:
        problems.append(
            Problem(
                "backbone",
                f"{len(missing)} of the {len(expected)} backbone tensors llama.cpp asks for are missing: {_first(missing)}",
            )
        )
    if wrong:
        n = wrong[0]
        problems.append(
            Problem(
                "backbone",
                f"backbone tensor {n} has shape {list(tensors[n].shape)}, the hyperparameters imply {list(expected[n])}"
                + (f" ({len(wrong) - 1} more tensors differ)" if len(wrong) > 1 else ""),
            )
        )
    if extra:
        problems.append(Problem("backbone", f"llama.cpp's qwen35 loader refuses tensors it does not create: {_first(extra)}"))
    return problems, len(expected)


def _same_head_dims(name: str, t: TensorInfo, shape: tuple[int, ...]) -> bool:
    # llama-quantize writes decision.scorer_out.weight, (W, 1), back as 1-D (W); llama.cpp reads both.
    return _same_dims(t, shape) or (name == "decision.scorer_out.weight" and t.dims == (shape[1],))


def check_head(h: Header, config: C.HeadConfig) -> tuple[list[Problem], int]:
    """Every head tensor llama.cpp's Clef loader asks for, with the shape the config implies."""
    expected = C.head_tensor_shapes(config)
    present = {n: t for n, t in h.tensors.items() if C.is_head_tensor(n)}
    problems = []
    missing = [n for n in expected if n not in present]
    if missing:
        formula = f"20 + 18*{config.routing_layers} + 26*{config.layers}"
        reference = C.reference_tensor_count(config.routing_layers, config.layers)
        problems.append(
            Problem(
                "head",
                f"{len(expected) - len(missing)} of the {len(expected)} head tensors ({formula}, holding the {reference} "
                f"of joint_head.safetensors) are present; missing: {_first(missing)}",
            )
        )
    wrong = [n for n, want in expected.items() if n in present and not _same_head_dims(n, present[n], want)]
    if wrong:
        n = wrong[0]
        problems.append(
            Problem(
                "head",
                f"head tensor {n} has shape {list(present[n].shape)}, the head implies {list(expected[n])}: "
                "a head of another width, or of another backbone"
                + (f" ({len(wrong) - 1} more tensors differ)" if len(wrong) > 1 else ""),
            )
        )
    extra = [n for n in present if n not in expected]
    if extra:
        problems.append(Problem("head", f"head tensors llama.cpp's Clef loader does not create: {_first(extra)}"))
    return problems, len(expected)


def check_types(h: Header) -> list[Problem]:
    """Tensor types stock llama.cpp runs: the format's one table, which the native head is handed too."""
    problems = []
    for name, t in h.tensors.items():
        if C.needs_f32(name, len(t.dims)):
            if t.type != GT.F32:  # ggml_add and ggml_mul take vector operands in F32 only: ggml aborts
                problems.append(Problem("types", f"tensor {name} is {t.type.name}; llama.cpp needs it in F32"))
        elif t.type not in C.WEIGHT_TYPES:
            what = "the head does not run" if C.is_head_tensor(name) else "llama.cpp does not run as a weight"
            problems.append(Problem("types", f"tensor {name} is {t.type.name}, which {what}"))
    if len(problems) > 1:  # one type problem usually repeats over many tensors: name the first, count the rest
        problems[1:] = [Problem("types", f"{len(problems) - 1} more tensors have types that cannot run")]
    return problems
