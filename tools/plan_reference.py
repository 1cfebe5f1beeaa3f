"""The README's memory table for Clef-flash's real shapes, with no weights downloaded.

Clef-flash is Qwen3.5-9B (32 layers, 8 of them full attention) plus the joint schema
head. This tool writes a *sparse* qwen35 GGUF with the real tensor shapes (a header
and a hole: nothing to download, almost nothing on disk), asks llama.cpp's quantizer
for the exact Q4_K_M / Q5_K_M mixture (dry run: it decides every tensor's type
without quantizing), writes the same sparse file with those types, and runs
`clef_gguf.llama.plan.memory_plan` on it: llama.cpp's no-alloc pass plans every buffer
without reading the weights.

The second table is chunked prefill (the runtime's default): a context of n_ctx tokens
processed in ubatches of n_ubatch, so the compute buffer is planned for n_ubatch tokens
against a KV cache of n_ctx; it gives the device total at Clef's full context and the
largest context that fits the card, per ubatch.

    python tools/plan_reference.py [--vram 8GiB] [--ubatch 512,1024,2048] > table.md
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import tempfile
from pathlib import Path

import gguf
import llama_cpp as L

from clef_gguf.conversion.vocab import Vocab
from clef_gguf.conversion.writer import GT, storage_type, write_metadata
from clef_gguf.format import contract as C
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama import log as llama_log
from clef_gguf.llama.backbone import MAX_UBATCH
from clef_gguf.llama.plan import _largest_fitting, _lines, _NoAllocModel, memory_plan, parse_size

# Qwen3.5-9B's text config (the Clef-flash backbone).
QWEN35_9B = C.BackboneShape(
    n_vocab=248320,
    n_embd=4096,
    n_ff=12288,
    n_layer=32,
    n_head=16,
    n_head_kv=4,
    head_dim=256,
    recurrent=tuple((i + 1) % 4 != 0 for i in range(32)),
    conv_kernel=4,
    k_heads=16,
    v_heads=32,
    linear_head_dim=128,
    tied=False,
)
HPARAMS: dict[str, object] = {
    "context_length": 262144,
    "embedding_length": 4096,
    "block_count": 32,
    "feed_forward_length": 12288,
    "attention.head_count": 16,
    "attention.head_count_kv": 4,
    "attention.key_length": 256,
    "attention.value_length": 256,
    "attention.layer_norm_rms_epsilon": 1e-6,
    "attention.recurrent_layers": list(QWEN35_9B.recurrent),
    "rope.freq_base": 10_000_000.0,
    "rope.dimension_count": 64,
    "rope.dimension_sections": [11, 11, 10, 0],
    "ssm.conv_kernel": 4,
    "ssm.state_size": 128,
    "ssm.group_count": 16,
    "ssm.time_step_rank": 32,
    "ssm.inner_size": 4096,
    "full_attention_interval": 4,
}
_DRY_RUN_LINE = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s.*?(?:->\s+[\d.]+ MiB \((\w+)\)|size =\s+[\d.]+ MiB\n)", re.S)


def byte_level_vocab(n_vocab: int) -> Vocab:
    """GPT-2's byte alphabet, one merge, and unused padding up to the real vocabulary size."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    alphabet, extra = [], 0
    for b in range(256):
        alphabet.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    tokens = [*alphabet, "Ġt", "<|im_end|>"]
    types = [gguf.TokenType.NORMAL] * (len(tokens) - 1) + [gguf.TokenType.CONTROL]
    padding = n_vocab - len(tokens)
    return Vocab(
        tokens=tokens + [f"[PAD{i}]" for i in range(len(tokens), n_vocab)],
        token_types=[int(t) for t in types] + [int(gguf.TokenType.UNUSED)] * padding,
        merges=["Ġ t"],
        eos_id=len(tokens) - 1,
        pad_id=None,
        normalizer="NFC",
    )


def write_sparse(path: Path, types: dict[str, GT]) -> None:
    """A qwen35 GGUF whose data section is a hole: real header, real size, no weights."""
    shapes = C.backbone_tensor_shapes(QWEN35_9B)
    writer = gguf.GGUFWriter(path, C.BACKBONE_ARCH)
    vocab = byte_level_vocab(QWEN35_9B.n_vocab)
    write_metadata(writer, name="Qwen3.5-9B (shapes only)", hparams=HPARAMS, vocab=vocab, file_type=0, head=None)
    finish_sparse(writer, path, {name: (shape, types[name]) for name, shape in shapes.items()})


def finish_sparse(writer: gguf.GGUFWriter, path: Path, tensors: dict[str, tuple[tuple[int, ...], GT]]) -> int:
    """Write a GGUF's tensor infos after the keys already added, and a hole for its data; the data's bytes."""
    total = 0
    for name, (shape, qtype) in tensors.items():
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = int(gguf.np.prod(shape)) // block * size
        byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype) if qtype not in (GT.F32, GT.F16) else shape
        dtype = {GT.F32: gguf.np.float32, GT.F16: gguf.np.float16}.get(qtype, gguf.np.uint8)
        writer.add_tensor_info(name, byte_shape, gguf.np.dtype(dtype), n_bytes, raw_dtype=qtype)
        total += -(-n_bytes // 32) * 32
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    header_end = writer.fout[0].tell()
    writer.close()
    os.truncate(path, -(-header_end // 32) * 32 + total)
    return total


def mixture(bf16: Path, file_type: int) -> dict[str, GT]:
    """The type llama.cpp's quantizer gives every tensor (a dry run: nothing is quantized)."""
    params = L.llama_model_quantize_default_params()
    params.ftype = file_type
    params.dry_run = True
    lines: list[str] = []
    with llama_log.capture_info(lines.append):
        status = L.llama_model_quantize(str(bf16).encode(), str(bf16.with_suffix(".out")).encode(), ctypes.byref(params))
    assert status == 0, llama_log.last_error("dry run failed")
    types = {}
    for m in _DRY_RUN_LINE.finditer("".join(lines)):
        types[m[1]] = GT[m[2].upper()] if m[2] else GT.F32
    return types


def chunked_device_bytes(path: Path, model: _NoAllocModel, n_ctx: int, n_ubatch: int) -> tuple[int, int]:
    """(device bytes, compute buffer bytes) with every layer offloaded."""
    f = GGUFFile.open(path)
    try:
        offloaded = QWEN35_9B.n_layer + 1
        lines = _lines(f, model.measure(n_ctx, n_ubatch), n_ctx, n_ubatch, offloaded)[0]
    finally:
        f.close()
    compute = next(line.device_bytes for line in lines if line.component.startswith("compute buffer"))
    return sum(line.device_bytes for line in lines), compute


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vram", default="8GiB")
    parser.add_argument("--ubatch", default="256,512,1024,2048", help="ubatch sizes of the chunked-prefill table")
    parser.add_argument("--ctx", type=int, default=65536, help="context of the chunked-prefill table (Clef's: 65536)")
    args = parser.parse_args()
    vram = parse_size(args.vram)
    ubatches = [int(u) for u in args.ubatch.split(",")]
    shapes = C.backbone_tensor_shapes(QWEN35_9B)
    one_batch, chunked = [], []
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = Path(tmp) / "qwen35-9b-bf16.gguf"
        write_sparse(bf16, {n: storage_type(n, s, GT.BF16) for n, s in shapes.items()})
        for name, ftype in (("Q4_K_M", L.LLAMA_FTYPE_MOSTLY_Q4_K_M), ("Q5_K_M", L.LLAMA_FTYPE_MOSTLY_Q5_K_M)):
            path = Path(tmp) / f"qwen35-9b-{name}.gguf"
            write_sparse(path, mixture(bf16, ftype))
            # The whole prompt as one physical batch (ubatch = the prompt limit), as before ubatches.
            at_4k = memory_plan(path, 4096, -1, ubatch=4096)
            at_16k = memory_plan(path, 16384, -1, ubatch=16384)
            weights = sum(at_4k.weights_by_type.values())
            one_batch.append(
                f"| {name} | {weights / 2**30:.2f} | {at_4k.device_bytes / 2**30:.2f} | {at_16k.device_bytes / 2**30:.2f} |"
            )
            f = GGUFFile.open(path)
            model = _NoAllocModel(f, -1)
            try:
                one_batch_fits = _largest_fitting(
                    lambda n, path=path, model=model: chunked_device_bytes(path, model, n, n)[0], vram, MAX_UBATCH
                )
                one_batch[-1] += f" {one_batch_fits} |"
                for ubatch in ubatches:
                    device, compute = chunked_device_bytes(path, model, args.ctx, ubatch)

                    def device_at(n: int, u: int = ubatch, path: Path = path, model: _NoAllocModel = model) -> int:
                        return chunked_device_bytes(path, model, max(n, u), u)[0]

                    fits = _largest_fitting(device_at, vram, args.ctx)
                    chunked.append(
                        f"| {name} | {ubatch} | {compute / 2**30:.2f} | {device / 2**30:.2f} | {fits} | {one_batch_fits} |"
                    )
            finally:
                model.close()
                f.close()
    print(f"| type | weights GiB | device total at 4096 tokens (GiB) | at 16384 | largest prompt in {args.vram} |")
    print("|---|---:|---:|---:|---:|")
    print("\n".join(one_batch))
    print()
    print(
        f"| type | ubatch | compute buffer GiB | device total at {args.ctx} tokens (GiB) "
        f"| largest prompt in {args.vram}, chunked | one batch |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    print("\n".join(chunked))


if __name__ == "__main__":
    main()
