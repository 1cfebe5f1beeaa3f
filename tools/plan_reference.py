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
import tempfile
from pathlib import Path

import llama_cpp as L

from clef_gguf.conversion.writer import GT, storage_type
from clef_gguf.format import contract as C
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama.backbone import MAX_UBATCH
from clef_gguf.llama.plan import _largest_fitting, _lines, _NoAllocModel, memory_plan
from clef_gguf.table_checks import parse_size
from clef_gguf.testing.shaped import QWEN35_9B, mixture, write_sparse


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
