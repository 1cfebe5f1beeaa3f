"""Writing GGUF files: streamed tensor by tensor, under a temporary name.

Both conversion (tensors produced from safetensors) and grafting (tensors copied
from another GGUF) describe their tensors up front as `OutTensor`s, so the header is
written first and then each tensor's bytes are produced, written and dropped.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ..check.finite import count_nonfinite
from ..errors import ConversionError, NonFiniteWeightsError, OutputError
from ..format import contract as C
from ..format.template import SYSTEMONE_TEMPLATE
from ..outputs import atomic_file, check_file, temporary
from .vocab import Vocab

GT = gguf.GGMLQuantizationType
Progress = Callable[[str, int, int, str], None]  # (stage, done, total, item)


@dataclass(frozen=True)
class OutTensor:
    name: str
    shape: tuple[int, ...]  # numpy order
    qtype: GT
    data: Callable[[], np.ndarray]  # exactly the tensor's bytes (any dtype), produced on demand

    @property
    def n_bytes(self) -> int:
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape, dtype=np.int64)) // block * type_size


def storage_type(name: str, shape: tuple[int, ...], wanted: GT) -> GT:
    """The type a tensor is stored in when `wanted` is asked for (llama.cpp's converter rules)."""
    if len(shape) <= 1 or name.endswith(C.F32_ONLY_SUFFIXES) or name == C.TOKEN_TYPES:
        return GT.F32
    if shape[-1] % gguf.GGML_QUANT_SIZES[wanted][0]:
        return GT.F16  # rows not whole blocks: llama.cpp's converter falls back to F16 too
    return wanted


NONFINITE_CAUSE = "a diverged fine-tune, or a bad lora_alpha?"


def encode(x: np.ndarray, qtype: GT) -> np.ndarray:
    """float32 values -> the bytes of `qtype` (numpy quantizers of gguf-py).

    NaN or Inf, in `x` or from a value `qtype` cannot hold (above 65504 in F16), raise NonFiniteWeightsError
    (write_gguf adds the tensor's name): no file holding one is written.
    """
    with np.errstate(all="ignore"):  # a NaN or an overflow is reported below, as the error it is, not as a warning
        x = np.ascontiguousarray(x, dtype=np.float32)
        bad = count_nonfinite(x, GT.F32)
        if bad:
            raise NonFiniteWeightsError(f"{bad} of its {x.size} values are NaN or Inf ({NONFINITE_CAUSE})")
        if qtype == GT.F32:
            return x
        out = x.astype(np.float16) if qtype == GT.F16 else gguf.quants.quantize(x, qtype)
    overflow = count_nonfinite(out, qtype)
    if overflow:
        raise NonFiniteWeightsError(
            f"{overflow} of its {x.size} values become Inf stored as {qtype.name} (the largest magnitude is "
            f"{float(np.abs(x).max()):.4g}, beyond what {qtype.name} holds): store it as f32 or bf16 "
            f"(--type, --head-type), or find why it is so large ({NONFINITE_CAUSE})"
        )
    return out


def _checked(t: OutTensor) -> np.ndarray:
    """The tensor's bytes, refused when one of its values is NaN or Inf (copied ones too: graft)."""
    try:
        with np.errstate(all="ignore"):  # a transform's overflow or NaN is found below, not printed as a warning
            data = t.data()  # reads the source: its errors are the source's, not the output's
    except NonFiniteWeightsError as e:
        raise NonFiniteWeightsError(f"tensor {t.name}: {e}; nothing was written") from None
    if data.nbytes != t.n_bytes:
        raise ConversionError(f"tensor {t.name}: {data.nbytes} bytes produced, {t.n_bytes} expected")
    bad = count_nonfinite(data, t.qtype)
    if bad:
        n = int(np.prod(t.shape, dtype=np.int64))
        raise NonFiniteWeightsError(
            f"tensor {t.name}: {bad} of its {n} values are NaN or Inf ({t.qtype.name}; {NONFINITE_CAUSE}); nothing was written"
        )
    return data


def human_size(n: int) -> str:
    """Bytes in the binary unit that fits: 512 bytes, 3.3 KiB, 12.0 MiB, 1.50 GiB."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}" if unit in ("TiB", "GiB") else f"{n / (1 << shift):.1f} {unit}"
    return f"{n} bytes"


def check_free_space(directory: Path, needed: int) -> None:
    usage = shutil.disk_usage(directory)
    if usage.total == 0:  # proc, sysfs, cgroup: "/proc has 0 bytes free" was true, and said nothing
        raise OutputError(f"{directory} is on a file system that stores no files (/proc, /sys): write to a folder on a disk")
    free = usage.free
    if free < needed:
        raise ConversionError(
            f"{directory} has {human_size(free)} free; this conversion needs about {human_size(needed)} ({needed} bytes)"
        )


def header_bytes(vocab: Vocab, tensors: Iterable[OutTensor], alignment: int = gguf.GGUF_DEFAULT_ALIGNMENT) -> int:
    """An upper bound of a GGUF header's size: the vocabulary's strings dominate it (~16 MB for Qwen3.5)."""
    strings = sum(len(t.encode()) + 8 for t in vocab.tokens) + sum(len(m.encode()) + 8 for m in vocab.merges)
    infos = sum(len(t.name.encode()) + 8 + 4 + 8 * 4 + 4 + 8 for t in tensors)
    other_keys = 64 << 10  # hyperparameters, the prompt template, the head config: a few kB
    return strings + 4 * len(vocab.token_types) + infos + other_keys + alignment


def data_bytes(tensors: Iterable[OutTensor], alignment: int = gguf.GGUF_DEFAULT_ALIGNMENT) -> int:
    """The data section: each tensor padded to the alignment."""
    return sum(-(-t.n_bytes // alignment) * alignment for t in tensors)


# --- Output files that clean up after themselves ---------------------------------------------------
# Temporary names carry the writer's PID, so that a later run can tell the leftovers of a
# dead process (SIGKILL, a power cut) from the files of a conversion still running.
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def remove_stale(out: Path) -> list[Path]:
    """Remove the `.OUT.PID.partial` files and `.OUT.PID.stage` folders beside `out` whose process is dead."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(\d+)\.(partial|stage)$")
    removed = []
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return []  # no folder to clean: check_output says why
    for path in entries:
        m = pattern.match(path.name)
        if not m or int(m[1]) == os.getpid() or _alive(int(m[1])):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def check_output(out: Path, force: bool, inputs: Iterable[str | os.PathLike[str] | None] = ()) -> None:
    """Refuse an OUT that cannot be written, before anything is read (outputs.check_file: OutputError, exit 9);
    then remove dead runs' leftovers."""
    check_file(out, force=force, inputs=inputs)
    remove_stale(out)


def _write_error(out: Path, e: OSError) -> ConversionError:
    # numpy's tofile reports a write the disk cut short with no errno ("4096 requested and 304 written").
    if e.errno == errno.ENOSPC or (e.errno is None and "requested and" in str(e)):
        free = human_size(shutil.disk_usage(out.parent).free)
        return ConversionError(f"the disk holding {out.parent} is full ({free} free, ENOSPC); free some space and run again")
    return ConversionError(f"cannot write {out}: {e.strerror or e}")


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """OSErrors of writing `path` (disk full, permissions) as one-line ConversionErrors; reading errors pass."""
    try:
        yield
    except OSError as e:
        raise _write_error(path, e) from e


@contextmanager
def atomic_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary path beside `out`; published as `out` only on success (outputs.publish)."""
    check_output(out, force)
    with atomic_file(out, force) as tmp:  # created atomically: of two runs without --force, one wins
        yield tmp


@contextmanager
def staging_dir(out: Path) -> Iterator[Path]:
    """A scratch folder beside `out` (same disk), removed whatever happens."""
    path = temporary(out, "stage")
    with writing(path):
        path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_metadata(
    w: gguf.GGUFWriter,
    *,
    name: str,
    hparams: dict[str, object],
    vocab: Vocab,
    file_type: int,
    head: C.HeadConfig | None,
    reference_sha256: str = "",
    lineage: Mapping[str, tuple[str, object]] | None = None,
) -> None:
    """Key-values of a Clef file (head given) or of a plain qwen35 backbone (head None); `lineage`: the keys of
    conversion/lineage.source_keys (key -> (gguf-py value type, value))."""
    arch = C.ARCH if head is not None else C.BACKBONE_ARCH
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for suffix in C.BACKBONE_KEY_SUFFIXES:
        key, value = f"{arch}.{suffix}", hparams[suffix]
        if isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, int(value))
    if head is not None:  # llama.cpp's Clef keys, then clef-gguf's optional ones (nothing requires them)
        w.add_string(C.KEY_DECISION_TYPE, C.DECISION_TYPE)
        w.add_uint32(C.KEY_ROUTING_BLOCKS, head.routing_layers)
        w.add_uint32(C.KEY_JOINT_BLOCKS, head.layers)
        w.add_uint32(C.KEY_HEAD_COUNT, head.heads)
        w.add_float32(C.KEY_HEAD_NORM_EPS, head.norm_eps)
        w.add_string(C.KEY_REFERENCE_SHA256, reference_sha256)
        w.add_string(C.KEY_NORMALIZER, vocab.normalizer)
        for key, (kind, value) in (lineage or {}).items():
            getattr(w, f"add_{kind}")(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    w.add_eos_token_id(vocab.eos_id)
    if vocab.pad_id is not None:
        w.add_pad_token_id(vocab.pad_id)
    w.add_add_bos_token(False)
    if head is not None:
        w.add_chat_template([{"name": C.TEMPLATE_NAME, "template": SYSTEMONE_TEMPLATE}])


def write_gguf(
    path: Path,
    arch: str,
    metadata: Callable[[gguf.GGUFWriter], None],
    tensors: list[OutTensor],
    progress: Progress | None = None,
    stage: str = "writing",
) -> None:
    """Write a GGUF: header from the descriptions, then each tensor's bytes in order."""
    writer = gguf.GGUFWriter(path, arch)
    try:
        metadata(writer)
        for t in tensors:
            if t.qtype in (GT.F32, GT.F16):
                byte_shape, dtype = t.shape, np.dtype(np.float32 if t.qtype == GT.F32 else np.float16)
            else:
                byte_shape, dtype = gguf.quant_shape_to_byte_shape(t.shape, t.qtype), np.dtype(np.uint8)
            writer.add_tensor_info(t.name, byte_shape, dtype, t.n_bytes, raw_dtype=t.qtype)
        with writing(path):
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for f in writer.fout or []:
                f.flush()
        # The header is on disk now: what is left to write must fit in what is left.
        check_free_space(path.parent, data_bytes(tensors))
        for i, t in enumerate(tensors):
            data = _checked(t)
            with writing(path):
                writer.write_tensor_data(data)
            if progress:
                progress(stage, i + 1, len(tensors), t.name)
        with writing(path):
            for f in writer.fout or []:
                f.flush()
                os.fsync(f.fileno())
    finally:
        with writing(path):
            writer.close()


def write_file(
    out: Path,
    metadata: Callable[[gguf.GGUFWriter], None],
    tensors: list[OutTensor],
    header: int,
    *,
    force: bool,
    progress: Progress | None,
    stage: str,
) -> Path:
    """Write a GGUF of the Clef architecture (a model or an adapter file) as `out`, published only once complete,
    after checking that the disk has room for the tensors and `header` bytes more."""
    check_free_space(out.parent, header + data_bytes(tensors))
    with atomic_output(out, force) as tmp:
        write_gguf(tmp, C.ARCH, metadata, tensors, progress, stage)
    return out
