"""Is a GGUF file a Clef adapter (format/adapter.py) that llama.cpp's adapter loader and clef-gguf can apply?

Recognized by `general.type = adapter`. Checked from the header alone: llama.cpp's keys (src/llama-adapter.cpp:
205-221), every tensor a `.lora_a` / `.lora_b` of a layer matrix llama.cpp applies LoRA to, paired, with one rank
per pair (:323-371), or a head tensor of the shape the adapter's head keys imply; clef-gguf's keys. Whether it fits
a given base is check/adapter_pair.py's. Verdicts and exit codes are validate's: 0 complete, 5 corrupt, 7 incomplete.

The LoRA tensors' values are read too (lora_values: they are small beside a model), as a model's head is: NaN or
Inf in one, or a scale alpha / rank that lets a pair's product overflow, would make every decision of the fine-tune
NaN. llama-server's variant (no head keys, no head tensors) is a sound adapter for llama-server, and validates; the
runtime refuses it unless asked to decide with the base's head (refuse_headless).
"""

from __future__ import annotations

import math
import re

import gguf
import numpy as np
from gguf import GGUFValueType as VT
from gguf import Keys

from ..errors import IncompleteModelError
from ..format import adapter as A
from ..format import contract as C
from ..format.header import GGUFFile, Header
from ..format.hparams import MAX_HEAD_COUNT, MAX_HEAD_LAYERS, MAX_WIDTH
from .finite import count_nonfinite
from .layout import check_layout
from .report import Counts, Findings, Problem, Verdict, corrupt

CHECK = "adapter"
MAX_RANK = 1 << 16
_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")
# The layer matrices a LoRA may adapt (format/adapter.adaptable), by their name below blk.N.
_TARGETS = frozenset(
    r.gguf
    for r in C.COMMON_LAYER_RULES + C.FULL_ATTENTION_RULES + C.LINEAR_ATTENTION_RULES
    if len(r.shape) == 2 and r.transform in A.ROW_TRANSFORMS | A.COLUMN_TRANSFORMS
)
_UINT_KEYS = (A.KEY_EMBEDDING_LENGTH, A.KEY_HEAD_WIDTH, A.KEY_HEAD_FEEDFORWARD, A.KEY_RANK)
_HEAD_COUNTS = {"routing_layers": C.KEY_ROUTING_BLOCKS, "layers": C.KEY_JOINT_BLOCKS, "heads": C.KEY_HEAD_COUNT}
# The most a LoRA pair may multiply an activation by (its scale times the row sums of |B| and |A|: a bound on
# max |scale B A x| / max |x|): float16's largest value. Trained pairs stay in the single digits; past this the
# product is Inf where a backend computes in float16, and a few layers of it overflow float32 too (alpha 1e6 did).
MAX_LORA_GAIN = float(np.finfo(np.float16).max)


def is_adapter(h: Header) -> bool:
    return A.is_adapter_header(h.get(A.KEY_GENERAL_TYPE))


def _key(h: Header, key: str, vtype: VT) -> tuple[object, list[Problem]]:
    f = h.fields.get(key)
    if f is None:
        return None, [Problem(CHECK, f"{key} is missing")]
    if f.type != vtype:
        return None, [Problem(CHECK, f"{key} is stored as {f.type.name}, not {vtype.name}")]
    return f.value, []


def _keys(h: Header) -> list[Problem]:
    problems = []
    arch = h.get(Keys.General.ARCHITECTURE)
    if arch != C.ARCH:
        problems.append(Problem(CHECK, f"an adapter for architecture {arch!r}, not for a Clef base ({C.ARCH!r})"))
    kind, found = _key(h, A.KEY_ADAPTER_TYPE, VT.STRING)
    problems += found or (
        [Problem(CHECK, f"{A.KEY_ADAPTER_TYPE} is {kind!r}; llama.cpp loads only 'lora'")] if kind != A.ADAPTER_TYPE else []
    )
    alpha, found = _key(h, A.KEY_ALPHA, VT.FLOAT32)
    problems += found or ([] if math.isfinite(alpha) and alpha > 0 else [Problem(CHECK, f"{A.KEY_ALPHA} = {alpha} is not > 0")])  # type: ignore[arg-type]
    fingerprint, found = _key(h, A.KEY_BASE_FINGERPRINT, VT.STRING)
    if not found and not re.fullmatch(r"[0-9a-f]{64}", str(fingerprint)):
        found = [Problem(CHECK, f"{A.KEY_BASE_FINGERPRINT} is not 64 hex digits")]
    problems += found
    for key in _UINT_KEYS:
        value, found = _key(h, key, VT.UINT32)
        problems += found or ([Problem(CHECK, f"{key} = {value} is 0")] if value == 0 else [])
    return problems


def adapter_head_config(h: Header) -> tuple[C.HeadConfig | None, list[Problem]]:
    """The head config the adapter's keys give (None without the head's keys: llama-server's variant), bounded as
    format/hparams.read_head_config bounds a model's."""
    if C.KEY_DECISION_TYPE not in h.fields:
        return None, []
    problems, values = [], {}
    keys = {"hidden_size": A.KEY_EMBEDDING_LENGTH, "width": A.KEY_HEAD_WIDTH, "feedforward": A.KEY_HEAD_FEEDFORWARD}
    for name, key in (_HEAD_COUNTS | keys).items():
        value, found = _key(h, key, VT.UINT32)
        low, high = (0, MAX_HEAD_LAYERS) if name in ("routing_layers", "layers") else (1, MAX_WIDTH)
        if not found and not low <= value <= (MAX_HEAD_COUNT if name == "heads" else high):  # type: ignore[operator]
            found = [Problem(CHECK, f"{key} = {value} is out of range")]
        problems += found
        values[name] = value
    eps, found = _key(h, C.KEY_HEAD_NORM_EPS, VT.FLOAT32)
    if not found and not 0 < eps < 1:  # type: ignore[operator]
        found = [Problem(CHECK, f"{C.KEY_HEAD_NORM_EPS} = {eps} is not in (0, 1)")]
    if problems or found:
        return None, problems + found
    if values["width"] % values["heads"]:
        return None, [Problem(CHECK, f"the head's width {values['width']} is not a multiple of {C.KEY_HEAD_COUNT}")]
    return C.HeadConfig(**values, norm_eps=float(eps)), []  # type: ignore[arg-type]


def lora_pairs(h: Header) -> tuple[dict[str, tuple[tuple[int, ...], tuple[int, ...]]], list[Problem]]:
    """{model tensor: (lora_a's numpy shape, lora_b's)} of the well-formed pairs, and what is wrong with the rest."""
    parts: dict[str, dict[str, tuple[int, ...]]] = {}
    problems = []
    for name, t in h.tensors.items():
        split = A.lora_target(name)
        if split is None:
            continue
        target, suffix = split
        m = _LAYER.match(target)
        if m is None or m[2] not in _TARGETS:
            problems.append(Problem(CHECK, f"{name}: {target} is no layer matrix llama.cpp applies a LoRA to"))
        elif t.type not in C.WEIGHT_TYPES or len(t.dims) != 2:
            problems.append(Problem(CHECK, f"{name} is a {len(t.dims)}-D {t.type.name} tensor, not a 2-D weight"))
        else:
            parts.setdefault(target, {})[suffix] = t.shape
    pairs = {}
    for target, ab in parts.items():
        if len(ab) != 2:
            problems.append(Problem(CHECK, f"{target} has {next(iter(ab))} but not its pair (llama.cpp refuses it)"))
            continue
        a, b = ab[A.LORA_A], ab[A.LORA_B]
        if a[0] != b[1] or not 0 < a[0] <= MAX_RANK:
            problems.append(Problem(CHECK, f"{target}: lora_a is {list(a)}, lora_b {list(b)}; both must have one rank r"))
            continue
        pairs[target] = (a, b)
    return pairs, problems


def _head(h: Header, config: C.HeadConfig | None) -> list[Problem]:
    present = [n for n in h.tensors if C.is_head_tensor(n)]
    if config is None:
        return (
            [Problem(CHECK, f"head tensor {present[0]} without the head's keys ({C.KEY_DECISION_TYPE}, ...)")] if present else []
        )
    expected = C.head_tensor_shapes(config)
    for name in present:
        if name not in expected:
            return [
                Problem(CHECK, f"head tensor {name} is not one of this head's ({config.routing_layers} + {config.layers} blocks)")
            ]
        if h.tensors[name].shape != tuple(expected[name]):
            return [
                Problem(
                    CHECK, f"head tensor {name} is {list(h.tensors[name].shape)}; the head's keys imply {list(expected[name])}"
                )
            ]
    return []


def _past_data(h: Header, file_size: int) -> list[Problem]:
    """Bytes after an adapter's tensor data (padded to the alignment), which convert never writes: junk appended, which
    the server would copy for nothing (a file of the folder is judged by its header before it is copied)."""
    ends = h.data_offset + -(-h.data_size() // h.alignment) * h.alignment
    return (
        [corrupt("layout", f"{file_size - ends} bytes follow its tensor data, which ends at byte {ends}")]
        if file_size > ends
        else []
    )


def judge_adapter(h: Header, file_size: int) -> Findings:
    found = Findings(decision=True, summarize=summary)
    found.problems += check_layout(h, file_size) + _past_data(h, file_size)
    found.problems += _keys(h)
    config, problems = adapter_head_config(h)
    found.problems += problems + _head(h, config)
    pairs, problems = lora_pairs(h)
    found.problems += problems
    n_head = sum(C.is_head_tensor(n) for n in h.tensors)
    other = [n for n in h.tensors if A.lora_target(n) is None and not C.is_head_tensor(n)]
    if other:
        found.problems.append(Problem(CHECK, f"tensor {other[0]} is neither a LoRA tensor nor a head tensor"))
    if not pairs and not problems:
        found.problems.append(Problem(CHECK, "it holds no LoRA pair"))
    found.counts = Counts(tensors=len(h.tensors), backbone=2 * len(pairs), head=n_head)
    found.notes.append(f"trained over {h.get(A.KEY_BASE_NAME)!r} (base fingerprint {h.get(A.KEY_BASE_FINGERPRINT)})")
    return found


def _matrix(f: GGUFFile, name: str) -> np.ndarray:
    """A LoRA tensor's values as float32, numpy shape (its types: C.WEIGHT_TYPES, which gguf-py decodes)."""
    t = f.header.tensors[name]
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(f.tensor_bytes(name), t.type).reshape(t.shape).astype(np.float32, copy=False)


def _gain(f: GGUFFile, target: str, scale: float) -> float:
    """A bound on how much the pair of `target` multiplies an activation: scale * ||B||_inf * ||A||_inf (row sums)."""
    with np.errstate(all="ignore"):
        a = np.abs(_matrix(f, target + A.LORA_A)).sum(axis=1, dtype=np.float64).max(initial=0.0)
        b = np.abs(_matrix(f, target + A.LORA_B)).sum(axis=1, dtype=np.float64).max(initial=0.0)
        # NaN or Inf values are their own problem (lora_values, --deep): no gain is told of them
        return float(scale * a * b) if math.isfinite(a) and math.isfinite(b) else math.nan


def lora_values(f: GGUFFile, nonfinite: bool = True) -> list[Problem]:
    """The LoRA pairs of an adapter file read: NaN or Inf values (corrupt: exit 5; `nonfinite` False when --deep
    reads every tensor already), and an alpha whose scale lets a pair overflow (the adapter check: exit 7). Each names
    the tensor, or the alpha and the pair."""
    h = f.header
    if not is_adapter(h):
        return []
    pairs, _ = lora_pairs(h)
    names = [target + suffix for target in pairs for suffix in (A.LORA_A, A.LORA_B)]
    bad = [(n, count_nonfinite(f.tensor_bytes(n), h.tensors[n].type)) for n in names] if nonfinite else []
    bad = [(n, k) for n, k in bad if k]
    if bad:
        name, n = bad[0]
        more = f" (and {len(bad) - 1} more LoRA tensors)" if len(bad) > 1 else ""
        message = f"LoRA tensor {name} holds {n} NaN or Inf values of {h.tensors[name].n_elements}{more}: every decision"
        return [corrupt("lora values", f"{message} of this fine-tune would be NaN (a diverged fine-tune?); convert it again")]
    alpha = h.get(A.KEY_ALPHA)
    if not isinstance(alpha, float) or not math.isfinite(alpha) or alpha <= 0:
        return []  # (_keys says so)
    gains = [(target, a[0], _gain(f, target, alpha / a[0])) for target, (a, _) in pairs.items()]
    over = [g for g in gains if g[2] > MAX_LORA_GAIN]  # (an Inf gain too: alpha times finite values overflowed)
    if not over:
        return []
    target, rank, gain = max(over, key=lambda g: g[2])
    more = f" (and {len(over) - 1} more pairs)" if len(over) > 1 else ""
    return [
        Problem(
            CHECK,
            f"{A.KEY_ALPHA} = {alpha:g} over rank {rank} (scale {alpha / rank:g}) lets the LoRA of {target} multiply an "
            f"activation by up to {gain:.3g}{more}, beyond {MAX_LORA_GAIN:g}: every decision would overflow to NaN; "
            "the alpha is wrong (PEFT's lora_alpha): convert the checkpoint again with its own",
        )
    ]


def is_headless(h: Header) -> bool:
    """llama-server's variant of an adapter (convert --to-adapter --llama-server): its LoRA, no head keys or tensors."""
    return is_adapter(h) and C.KEY_DECISION_TYPE not in h.fields and not any(C.is_head_tensor(n) for n in h.tensors)


def refuse_headless(h: Header, name: str) -> None:
    """IncompleteModelError (exit 7) for llama-server's variant: clef-gguf would answer with the base's head, not the
    fine-tune's, unnoticed. What decide and serve call, unless asked for the base's head (--base-head, base_head)."""
    if is_headless(h):
        raise IncompleteModelError(
            f"{name} is llama-server's variant of an adapter (convert --to-adapter --llama-server: a LoRA, no head), so the "
            "fine-tune's head is not in it: convert the checkpoint with --to-adapter alone, or pass --base-head "
            "(base_head=True) to decide with the base's head"
        )


def summary(verdict: Verdict, found: Findings, h: Header | None) -> str:
    problems = found.problems
    if verdict is Verdict.CORRUPT:
        return f"corrupt or unreadable: {next(p for p in problems if p.corrupt).message}"
    if verdict is not Verdict.COMPLETE:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        return f"incomplete or inconsistent Clef adapter: {problems[0].message}{more}"
    assert h is not None
    pairs, _ = lora_pairs(h)
    ranks = sorted({a[0] for a, _ in pairs.values()})
    rank = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]} to {ranks[-1]}"
    types = "/".join(sorted({h.tensors[n].type.name for n in h.tensors if A.lora_target(n)}))
    head = (
        f"head: {found.counts.head} tensors of its own (the others its base's)"
        if C.KEY_DECISION_TYPE in h.fields
        else "no head (llama-server's variant: the base's head decides)"
    )
    return f"an adapter for a Clef base: {len(pairs)} LoRA pairs ({types}), {rank}, alpha {h.get(A.KEY_ALPHA):g}; {head}"
