"""Reading a Hugging Face Clef release: config, tokenizer and tensors, one at a time.

Tensors are read straight from the safetensors files (no torch): a tiny header
parser plus one `np.fromfile` per tensor, so that conversion holds one tensor at a
time. bf16 is widened to f32 by bit shifting (numpy has no bf16).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ReleaseError
from ..format.contract import BACKBONE_KEY_SUFFIXES, BackboneShape, HeadConfig
from ..format.vision import PREPROCESSOR_CONFIG, PROCESSOR_CONFIG
from ..inputs import open_regular

BACKBONE_CLASS = "Qwen3_5ForConditionalGeneration"
HEAD_WEIGHTS = "joint_head.safetensors"
HEAD_CONFIG = "joint_head_config.json"
REFERENCE_CODE = "joint_schema_model.py"
HUB_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.txt", "*.jinja"]
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor inside a safetensors file, not yet read."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file

    def load(self) -> np.ndarray:
        """Read the tensor as float32."""
        if self.dtype not in _DTYPES:
            raise ReleaseError(f"{self.path.name}: tensor dtype {self.dtype} is not supported")
        count = int(np.prod(self.shape, dtype=np.int64))
        data = np.fromfile(self.path, dtype=_DTYPES[self.dtype], count=count, offset=self.offset)
        if data.size != count:
            raise ReleaseError(f"{self.path.name} is truncated")
        if self.dtype == "BF16":
            data = (data.astype(np.uint32) << 16).view(np.float32)
        return data.astype(np.float32, copy=False).reshape(self.shape)

    def load_span(self, start: int, count: int) -> np.ndarray:
        """Values [start, start + count) of the tensor in row-major order, as float32 (a weights digest's sample)."""
        if self.dtype not in _DTYPES:
            raise ReleaseError(f"{self.path.name}: tensor dtype {self.dtype} is not supported")
        dtype = np.dtype(_DTYPES[self.dtype])
        data = np.fromfile(self.path, dtype=dtype, count=count, offset=self.offset + start * dtype.itemsize)
        if data.size != count:
            raise ReleaseError(f"{self.path.name} is truncated")
        if self.dtype == "BF16":
            data = (data.astype(np.uint32) << 16).view(np.float32)
        return data.astype(np.float32, copy=False)


# Bytes per value of safetensors' dtypes; another dtype is refused when its tensor is read (StoredTensor.load).
_DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8,
}  # fmt: skip


def read_safetensors_index(path: Path) -> dict[str, StoredTensor]:
    """The tensors a safetensors file holds, each entry of its header checked against the file's bytes."""
    try:
        with open_regular(path) as f:  # (a FIFO is refused, not waited on)
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > 100_000_000:
                raise ValueError("header too large")
            header = json.loads(f.read(header_len))
            size = os.fstat(f.fileno()).st_size
    except (OSError, ValueError, RecursionError, struct.error) as e:
        raise ReleaseError(f"{path.name} is not a readable safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise ReleaseError(
            f"{path.name} is not a readable safetensors file: its header is a JSON {type(header).__name__}, not an object"
        )
    base = 8 + header_len
    spans, tensors = [], {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = _entry(path, name, info, size - base)
        tensors[name] = StoredTensor(path, info["dtype"], tuple(info["shape"]), base + begin)
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
        if begin < end:
            raise ReleaseError(f"{path.name}: the data of tensors {first!r} and {second!r} overlap: the file is damaged")
    return tensors


def _entry(path: Path, name: str, info: Any, data_size: int) -> tuple[int, int]:
    """The (begin, end) of a header entry's data, after checking its keys: a damaged header is a ReleaseError."""

    def bad(what: str) -> ReleaseError:
        return ReleaseError(f"{path.name}: tensor {name!r}: {what}: the file is damaged or not safetensors")

    if not isinstance(info, dict):
        raise bad(f"its header entry is a JSON {type(info).__name__}, not an object")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in info:
            raise bad(f"its header entry has no {key!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str):
        raise bad(f"dtype is {json_excerpt(dtype)}, not a name")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise bad(f"shape is {json_excerpt(shape)}, not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets):
        raise bad(f"data_offsets is {json_excerpt(offsets)}, not [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        where = f"data_offsets {offsets} lie outside the file's {data_size} bytes of data"
        if 0 <= begin <= end:  # a range past the end: the file is shorter than its header says
            raise ReleaseError(f"{path.name}: tensor {name!r}: {where}: the file is truncated (an interrupted download?)")
        raise bad(where)
    if dtype in _DTYPE_SIZES and end - begin != math.prod(shape) * _DTYPE_SIZES[dtype]:
        raise bad(
            f"shape {shape} of {dtype} needs {math.prod(shape) * _DTYPE_SIZES[dtype]} bytes, data_offsets give {end - begin}"
        )
    return begin, end


def json_excerpt(value: Any, limit: int = 80) -> str:
    """A JSON value read from a file, quoted in a message: one short line whatever it holds."""
    try:
        text = json.dumps(value)
    except (ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class Release:
    root: Path
    text_config: dict[str, Any]
    head_config: HeadConfig
    backbone: dict[str, StoredTensor]
    head: dict[str, StoredTensor]
    tokenizer: dict[str, Any]  # tokenizer.json
    tokenizer_config: dict[str, Any]
    vision_config: dict[str, Any] | None = None  # config.json's vision_config: the vision tower, if any
    preprocessor_config: dict[str, Any] | None = None  # preprocessor_config.json: the image processor

    @property
    def name(self) -> str:
        return self.root.name

    @property
    def tied(self) -> bool:
        # The weights decide: a tied release saves no lm_head.weight.
        if self.backbone:
            return "lm_head.weight" not in self.backbone
        return bool(self.text_config.get("tie_word_embeddings", False))

    def backbone_shape(self) -> BackboneShape:
        c = self.text_config
        k_dim, v_dim = c["linear_key_head_dim"], c["linear_value_head_dim"]
        if k_dim != v_dim:
            # llama.cpp's qwen35 graph takes both from ssm.state_size.
            raise ReleaseError(f"linear_key_head_dim {k_dim} != linear_value_head_dim {v_dim}: llama.cpp's qwen35 cannot run it")
        return BackboneShape(
            n_vocab=c["vocab_size"],
            n_embd=c["hidden_size"],
            n_ff=c["intermediate_size"],
            n_layer=c["num_hidden_layers"],
            n_head=c["num_attention_heads"],
            n_head_kv=c["num_key_value_heads"],
            head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
            recurrent=tuple(t == "linear_attention" for t in layer_types(c)),
            conv_kernel=c["linear_conv_kernel_dim"],
            k_heads=c["linear_num_key_heads"],
            v_heads=c["linear_num_value_heads"],
            linear_head_dim=k_dim,
            tied=self.tied,
        )


def layer_types(text_config: dict[str, Any]) -> list[str]:
    n = text_config["num_hidden_layers"]
    types = text_config.get("layer_types")
    if types is None:
        interval = text_config.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if len(types) != n:
        raise ReleaseError(f"config.json: layer_types has {len(types)} entries for {n} layers")
    return list(types)


def _looks_local(source: str) -> bool:
    """A path, not a Hub id: it starts with ./, ../, / or ~, holds the system's own separator (Windows') or a colon
    (a drive, C:/models/base: a Hub id has none)."""
    return source.startswith(("./", "../", "/", "~")) or (os.sep != "/" and os.sep in source) or ":" in source


def resolve(source: str) -> Path:
    """A local release folder, or a Hugging Face repo id downloaded (or found in the cache)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.is_symlink() and not path.exists():
        raise ReleaseError(f"{source}: a symbolic link that leads nowhere (a loop, or its target is gone)")
    if path.exists() or source.count("/") != 1:
        raise ReleaseError(f"{source}: not a release folder, and not a Hugging Face repo id (owner/name)")
    if _looks_local(source):  # ("./base" and "~/base" have one slash too: a typo, not a repository)
        raise ReleaseError(f"{source}: no such folder (a local path; a Hugging Face repo id is owner/name)")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError
    except ImportError as e:  # pragma: no cover - huggingface-hub is a dependency
        raise ReleaseError(f"huggingface-hub is needed to download {source}") from e
    try:
        return Path(snapshot_download(source, allow_patterns=HUB_PATTERNS))
    except RepositoryNotFoundError as e:
        raise ReleaseError(f"{source}: no such repository on the Hugging Face Hub (or it is private)") from e
    except LocalEntryNotFoundError as e:
        raise ReleaseError(f"{source}: cannot reach the Hugging Face Hub and the repo is not in the local cache") from e
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ReleaseError(f"{source}: download failed: {str(e).splitlines()[0]}") from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open_regular(path) as f:  # (a FIFO is refused, not waited on)
            data = f.read()
    except FileNotFoundError:
        raise ReleaseError(f"{path.parent.name}: not a Clef release: {path.name} is missing") from None
    except OSError as e:
        raise ReleaseError(f"{path.name}: cannot read ({e.strerror or e})") from None
    try:
        value = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise ReleaseError(f"{path.name} is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise ReleaseError(f"{path.name}: a JSON {type(value).__name__}, where a JSON object is expected")
    return value


def _model_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) for n in weight_map.values()):
            raise ReleaseError(f"{index.name}: weight_map is {json_excerpt(weight_map)}, not an object of file names")
        names = sorted(set(weight_map.values()))
        files = [root / n for n in names]
    else:
        files = sorted(root.glob("model*.safetensors"))
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise ReleaseError(
            f"{root.name}: not a Clef release: model weights missing ({', '.join(missing) or 'model*.safetensors'})"
        )
    return files


def open_release(source: str | Path, *, weights: bool = True) -> Release:
    """Open a release folder (or Hub repo id) and check it is a Clef release.

    weights=False skips the backbone weights (what `graft` needs).
    """
    root = resolve(str(source))
    config = _read_json(root / "config.json")
    if BACKBONE_CLASS not in config.get("architectures", []):
        found = ", ".join(config.get("architectures", [])) or "none"
        raise ReleaseError(f"{root.name}: not a Clef release: config.json architectures is {found}, expected {BACKBONE_CLASS}")
    head_config = _read_json(root / HEAD_CONFIG)
    if not (root / HEAD_WEIGHTS).is_file():
        raise ReleaseError(f"{root.name}: not a Clef release: {HEAD_WEIGHTS} is missing (a plain Qwen3.5 model?)")
    try:
        # The reference's LayerNorms take torch's default epsilon (HeadConfig's): head_config.json has none.
        head = HeadConfig(**{k: int(head_config[k]) for k in HeadConfig.__dataclass_fields__ if k != "norm_eps"})
    except (KeyError, TypeError, ValueError) as e:
        raise ReleaseError(f"{HEAD_CONFIG}: missing or invalid field {e}") from e
    backbone: dict[str, StoredTensor] = {}
    if weights:
        for f in _model_files(root):
            backbone |= read_safetensors_index(f)
    text_config = dict(config.get("text_config", config))
    text_config.setdefault("tie_word_embeddings", config.get("tie_word_embeddings", False))
    return Release(
        root=root,
        text_config=text_config,
        head_config=head,
        backbone=backbone,
        head=read_safetensors_index(root / HEAD_WEIGHTS),
        tokenizer=_read_json(root / "tokenizer.json"),
        tokenizer_config=_read_json(root / "tokenizer_config.json") if (root / "tokenizer_config.json").is_file() else {},
        vision_config=config.get("vision_config"),
        preprocessor_config=_image_processor_config(root),
    )


def _image_processor_config(root: Path) -> dict[str, Any] | None:
    """The image processor's settings as llama.cpp's converter reads them (conversion/base.py:2635-2664):
    preprocessor_config.json (its media_proc_cfg lifted to the top), then processor_config.json's
    image_processor over it. None when the release has neither."""
    found = None
    if (root / PREPROCESSOR_CONFIG).is_file():
        found = _read_json(root / PREPROCESSOR_CONFIG)
        found = {**found, **found.get("media_proc_cfg", {})}
    if (root / PROCESSOR_CONFIG).is_file():
        processor = _read_json(root / PROCESSOR_CONFIG)
        found = {**(found or {}), **processor, **processor.get("image_processor", {})}
    return found


def backbone_hparams(release: Release) -> dict[str, object]:
    """Values of the keys llama.cpp's qwen35 loader reads, from config.json."""
    c = release.text_config
    s = release.backbone_shape()
    rope = c.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 0.25))
    sections = list(rope.get("mrope_section", [11, 11, 10]))
    values: dict[str, object] = {
        "context_length": c.get("max_position_embeddings", 262144),
        "embedding_length": s.n_embd,
        "block_count": s.n_layer,
        "feed_forward_length": s.n_ff,
        "attention.head_count": s.n_head,
        "attention.head_count_kv": s.n_head_kv,
        "attention.key_length": s.head_dim,
        "attention.value_length": s.head_dim,
        "attention.layer_norm_rms_epsilon": float(c.get("rms_norm_eps", 1e-6)),
        "attention.recurrent_layers": list(s.recurrent),
        "rope.freq_base": float(rope.get("rope_theta", c.get("rope_theta", 10_000_000.0))),
        "rope.dimension_count": int(s.head_dim * partial),
        "rope.dimension_sections": (sections + [0, 0, 0, 0])[:4],
        "ssm.conv_kernel": s.conv_kernel,
        "ssm.state_size": s.linear_head_dim,
        "ssm.group_count": s.k_heads,
        "ssm.time_step_rank": s.v_heads,
        "ssm.inner_size": s.v_heads * s.linear_head_dim,
        "full_attention_interval": c.get("full_attention_interval", 4),
    }
    assert set(values) == set(BACKBONE_KEY_SUFFIXES)
    return values


def reference_sha256(release: Release) -> str:
    """sha256 of the release's joint_schema_model.py (empty when it ships none)."""
    path = release.root / REFERENCE_CODE
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
