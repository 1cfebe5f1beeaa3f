"""What Clef-flash's vision tower takes in memory, measured in libmtmd with no weights downloaded.

Writes a *sparse* mmproj with Qwen3.5's vision shapes (27 blocks, 1152 wide, 16 heads, patch 16,
a 48 x 48 position grid; embeddings 4096 wide, Clef-flash's hidden size) in the types `convert`
gives it (f16 and q8_0: the converter's rules, conversion/mmproj.storage_type): a real header and
a hole. libmtmd loads it as the runtime does (llama/mtmd.VisionEncoder) on this machine's CPU,
and the tool reports the weights' bytes and how much the process's peak memory grows while it
encodes one image of a given size (clip.cpp plans its compute buffer for the largest image it has
seen). On a GPU the weights and the compute buffer are device memory instead, of the same graph.
The weights are zeros: the time it takes says nothing (a CPU encode of 1,024 tokens is a minute).

    python tools/plan_vision.py [--tokens 256 1024] [--types f16 q8_0]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import gguf

from clef_gguf.check.validate import open_validated
from clef_gguf.conversion.mmproj import ImageProcessor, VisionTower, storage_type, write_mmproj_metadata
from clef_gguf.conversion.writer import GT
from clef_gguf.data import DEMO_MODEL
from clef_gguf.format import vision as V
from clef_gguf.llama.backbone import Vocabulary
from clef_gguf.llama.mtmd import VisionEncoder
from clef_gguf.testing.shaped import finish_sparse

# Qwen3.5's vision_config (Qwen3.5-9B, the Clef-flash backbone): depth, hidden, intermediate, heads, patch,
# num_position_embeddings; out_hidden_size is the text model's hidden size.
QWEN35_VISION = V.VisionShape(n_embd=1152, n_ff=4304, n_layer=27, n_head=16, patch_size=16, n_positions=2304, out_width=4096)
PROCESSOR = ImageProcessor(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), min_pixels=65_536, max_pixels=16_777_216)
FILE_TYPES = {"f16": (GT.F16, 1), "q8_0": (GT.Q8_0, 7)}


def write_sparse(path: Path, qtype: GT, file_type: int) -> int:
    """A sparse mmproj in `qtype`; returns the bytes of its tensors."""
    writer = gguf.GGUFWriter(path, V.ARCH)
    tower = VisionTower(QWEN35_VISION, PROCESSOR, 1e-6, {})
    write_mmproj_metadata(writer, name="Qwen3.5 vision tower (shapes only)", tower=tower, file_type=file_type)
    shapes = V.vision_tensor_shapes(QWEN35_VISION)
    return finish_sparse(writer, path, {name: (shape, storage_type(name, shape, qtype)) for name, shape in shapes.items()})


def _status_kib(key: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1])


def image_memory(mmproj: Path, text_model: object, sizes: list[int]) -> list[float]:
    """MiB the process's peak memory grows by while it encodes one square image of about n tokens, for each
    n of `sizes` in turn, the tower loaded without its warm-up (clip.cpp plans its compute buffer for the
    largest image it has seen: each size's growth is what that image takes on top of the weights)."""
    side = V.pixels_per_token(QWEN35_VISION.patch_size) ** 0.5
    encoder = VisionEncoder(mmproj, text_model, n_threads=os.cpu_count(), min_tokens=8, max_tokens=max(sizes), warmup=False)
    try:
        before = _status_kib("VmRSS")
        grown = []
        for n in sorted(sizes):
            Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) from what is resident now
            encoder.encode(gguf.np.zeros((int(n**0.5 * side), int(n**0.5 * side), 3), dtype=gguf.np.uint8))
            grown.append((_status_kib("VmHWM") - before) / 1024)
        return grown
    finally:
        encoder.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="+", type=int, default=[256, 1024])
    parser.add_argument("--types", nargs="+", default=list(FILE_TYPES), choices=list(FILE_TYPES))
    args = parser.parse_args()
    validated = open_validated(DEMO_MODEL)
    # A vocabulary-only text model: mtmd reads no hidden size from it (n_embd_inp 0), so it takes the
    # 4096-wide tower as it is; what the tower takes does not depend on the text model.
    vocabulary = Vocabulary(validated.file)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.types:
            qtype, file_type = FILE_TYPES[name]
            path = Path(tmp) / f"mmproj-qwen35-{name}.gguf"
            weights = write_sparse(path, qtype, file_type)
            for n_tokens, grown in zip(sorted(args.tokens), image_memory(path, vocabulary.model, args.tokens), strict=True):
                rows.append((name, weights / 2**20, n_tokens, grown))
                print(rows[-1], flush=True)
    vocabulary.close()
    validated.close()
    print("| mmproj | weights | one image of | memory the image adds |")
    print("|---|---:|---:|---:|")
    for name, weights, n_tokens, peak in rows:
        print(f"| {name} | {weights:.0f} MiB | {n_tokens} tokens | {peak:.0f} MiB |")


if __name__ == "__main__":
    main()
