"""A Clef-flash-shaped GGUF in about a minute: Qwen3.5-9B's backbone and the released head's layout, random weights.

    python tools/shaped_model.py OUT_DIR [--f16] [--plan] [--time [--bin ~/.cache/clef-gguf/llama-build/bin]]

Writes OUT_DIR/clef-flash-shaped-Q4_K_M.gguf: every backbone tensor in the type llama.cpp's quantizer gives it in a
Q4_K_M (its dry run on a sparse bf16 file, clef_gguf/testing/shaped.py), the head in F32 (what `clef-gguf convert`
writes under llama.cpp's quantizations). The quantized blocks are written directly, no release and no torch: random
quants under fixed scales, chosen so that every weight is zero-mean with a standard deviation of 0.02 (checked by
gguf-py's dequantizer as it writes); norms are 1, biases 0, the Gated DeltaNet's A is -1. Activations then stay
finite through the 32 layers. --f16 writes the same shapes in f16 too (18 GB: planned, not run here).

The head: the released layout (6 routing + 3 joint layers, 206 tensors) at width 1024 and FFN 2048, 16 heads: its
weights take 0.44 GiB in F32, the "about 0.45 GiB" docs/memory.md gives. The vocabulary is byte-level (the 256
byte tokens, the template's special tokens, unused padding to 248,320): a prompt's text is one token per byte.

--plan: `plan` at 4,096 tokens against the buffers llama.cpp really allocates when clef-gguf loads the file at
4,096 tokens (its own log lines), side by side. --time: the seeds' request (three questions, 328 tokens with Qwen's
tokenizer) decided by clef-gguf and by llama-server (`--bin`) on this file, one at a time, medians of --rounds. In
this byte-level vocabulary the template alone is about 880 tokens, so the request has 916: the timing is of that.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import gguf
import llama_cpp as L
import numpy as np

from clef_gguf.conversion.vocab import Vocab
from clef_gguf.conversion.writer import GT, OutTensor, storage_type, write_gguf, write_metadata
from clef_gguf.format import contract as C
from clef_gguf.format.template import TEMPLATE_SPECIAL_TOKENS
from clef_gguf.testing.shaped import HPARAMS, QWEN35_9B, byte_level_vocab, mixture, write_sparse

FLASH_HEAD = C.HeadConfig(hidden_size=4096, width=1024, routing_layers=6, layers=3, heads=16, feedforward=2048)
STD = 0.02
# Each type's block: bytes (numpy dtype fields in ggml's order), and how the fixed scale fields are set.
_Q4_K_SCALES = bytes([160] * 8 + [0] * 4)  # every 6-bit scale and min 32 (ggml's get_scale_min_k4 packing)


def _f16(x: float) -> bytes:
    return np.float16(x).tobytes()


def random_blocks(qtype: GT, n_elements: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of `qtype` whose weights are zero-mean with standard deviation STD."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = n_elements // block
    if qtype in (GT.F32, GT.F16, GT.BF16):
        x = rng.standard_normal(n_elements, dtype=np.float32) * STD
        if qtype == GT.BF16:
            return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return x.astype(np.float32 if qtype == GT.F32 else np.float16).view(np.uint8)
    data = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if qtype == GT.Q4_K:  # d, dmin, scales[12], qs[128]: w = 32 d q - 32 dmin, q in 0..15
        d = STD / (32 * np.sqrt((16**2 - 1) / 12))
        data[:, 0:16] = np.frombuffer(_f16(d) + _f16(7.5 * d) + _Q4_K_SCALES, dtype=np.uint8)
    elif qtype == GT.Q5_K:  # d, dmin, scales[12], qh[32], qs[128]: q in 0..31
        d = STD / (32 * np.sqrt((32**2 - 1) / 12))
        data[:, 0:16] = np.frombuffer(_f16(d) + _f16(15.5 * d) + _Q4_K_SCALES, dtype=np.uint8)
    elif qtype == GT.Q6_K:  # ql[128], qh[64], scales[16] (int8), d: w = d s (q - 32), q in 0..63
        d = STD / (16 * np.sqrt((64**2 - 1) / 12))
        data[:, 192:208] = 16
        data[:, 208:210] = np.frombuffer(_f16(d), dtype=np.uint8)
    elif qtype == GT.Q8_0:  # d, qs[32] (int8 in -127..127)
        data[:, 2:] = rng.integers(-127, 128, size=(n, 32), dtype=np.int8).view(np.uint8)
        data[:, 0:2] = np.frombuffer(_f16(STD / np.sqrt((255**2 - 1) / 12)), dtype=np.uint8)
    else:
        raise SystemExit(f"no random blocks for {qtype.name}")
    return data.reshape(-1)


def fixed(name: str, shape: tuple[int, ...]) -> np.ndarray | None:
    """The tensors that must hold set values for the graph to stay sound (F32)."""
    n = int(np.prod(shape))
    if name.endswith("norm.weight") or name.endswith("_norm.weight"):
        return np.ones(n, dtype=np.float32)
    if name.endswith(".bias") or name.endswith("ssm_dt.bias"):
        return np.zeros(n, dtype=np.float32)
    if name.endswith("ssm_a"):
        return np.full(n, -1.0, dtype=np.float32)
    if name == C.SCALES:
        return np.array(C.inference_scales(0.0, 0.0, 0.0), dtype=np.float32)
    return None


def planned(name: str, shape: tuple[int, ...], qtype: GT, seed: int) -> OutTensor:
    def produce() -> np.ndarray:
        value = fixed(name, shape)
        if value is not None:
            return value if qtype == GT.F32 else value.astype(np.float16)
        data = random_blocks(qtype, int(np.prod(shape)), np.random.default_rng(seed))
        if qtype not in (GT.F32, GT.F16, GT.BF16) and seed < 3:  # the first few: check the scale's promise
            w = gguf.quants.dequantize(data[: gguf.GGML_QUANT_SIZES[qtype][1] * 4096], qtype)
            assert abs(float(w.std()) - STD) < 0.1 * STD and abs(float(w.mean())) < 0.1 * STD, (name, w.mean(), w.std())
        return data

    return OutTensor(name, shape, qtype, produce)


def vocabulary() -> Vocab:
    """Byte-level tokens, the prompt template's special tokens (CONTROL), unused padding to Qwen3.5's size."""
    base = byte_level_vocab(QWEN35_9B.n_vocab)
    used = [t for t in base.tokens[:258] if t != "<|im_end|>"]
    special = list(TEMPLATE_SPECIAL_TOKENS)
    tokens = used + special
    types = [int(gguf.TokenType.NORMAL)] * len(used) + [int(gguf.TokenType.CONTROL)] * len(special)
    padding = QWEN35_9B.n_vocab - len(tokens)
    return Vocab(
        tokens=tokens + [f"[PAD{i}]" for i in range(len(tokens), QWEN35_9B.n_vocab)],
        token_types=types + [int(gguf.TokenType.UNUSED)] * padding,
        merges=base.merges,
        eos_id=tokens.index("<|im_end|>"),
        pad_id=None,
        normalizer="NFC",
    )


def write_shaped(out: Path, backbone_types: dict[str, GT], head_type: GT, file_type: int) -> Path:
    shapes = C.backbone_tensor_shapes(QWEN35_9B)
    tensors = [planned(n, s, backbone_types[n], i) for i, (n, s) in enumerate(shapes.items())]
    head = C.head_tensor_shapes(FLASH_HEAD)
    tensors += [planned(n, s, storage_type(n, s, head_type), 1000 + i) for i, (n, s) in enumerate(head.items())]
    vocab = vocabulary()

    def metadata(w: gguf.GGUFWriter) -> None:
        write_metadata(w, name="Clef-flash (shapes only)", hparams=HPARAMS, vocab=vocab, file_type=file_type, head=FLASH_HEAD)

    write_gguf(out, C.ARCH, metadata, tensors)
    return out


def seeds_request(tokens: int = 328) -> dict:
    """Three questions about a ticket, the state padded so that the prompt has `tokens` tokens (a byte a token)."""
    questions = {
        "complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
        "intent": {"type": "choice", "criteria": {"refund": "Money back", "replacement": None}},
        "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
    }
    return {"state": {"ticket": "x"}, "questions": questions, "_pad": tokens}


def fit_tokens(model: Any, request: dict) -> dict:
    """The request with its ticket lengthened to the wanted token count (a byte a token in this vocabulary)."""
    want = request.pop("_pad")
    base = len(model.encode(request).tokens)
    request["state"]["ticket"] = ("My order arrived broken, I want my money back. " * 20)[: max(1, want - base + 1)]
    return request


def device_memory() -> str:
    """What nvidia-smi says the card holds, where there is one."""
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"], capture_output=True, text=True
        )
    except OSError:
        return "no nvidia-smi"
    return done.stdout.strip()


def time_requests(path: Path, binary: Path | None, rounds: int, n_gpu_layers: int = 0) -> list[str]:
    import clef_gguf

    lines = []
    with clef_gguf.load(path, max_prompt_tokens=4096, state_cache=0, n_gpu_layers=n_gpu_layers) as model:
        if n_gpu_layers:
            print(f"loaded with n_gpu_layers={n_gpu_layers}: the card holds {device_memory()}")
        request = fit_tokens(model, seeds_request())
        n = len(model.encode(request).tokens)
        model.decide(request)  # warm
        ours = []
        for _ in range(rounds):
            started = time.perf_counter()
            model.decide(request)
            ours.append(time.perf_counter() - started)
    lines.append(f"| clef-gguf | {n} | {statistics.median(ours) * 1e3:.0f} ms | {min(ours) * 1e3:.0f} to {max(ours) * 1e3:.0f} |")
    if binary is not None:
        theirs = time_llama_server(binary, path, request, rounds, n_gpu_layers)
        if theirs:
            lines.append(
                f"| llama-server | {n} | {statistics.median(theirs) * 1e3:.0f} ms | "
                f"{min(theirs) * 1e3:.0f} to {max(theirs) * 1e3:.0f} |"
            )
    return lines


def time_llama_server(binary: Path, path: Path, request: dict, rounds: int, n_gpu_layers: int = 0) -> list[float]:
    from clef_gguf.testing.llama_server import as_llama_server_accepts, placement_flags
    from clef_gguf.testing.processes import free_port, wait_healthy

    port = free_port()
    command = [str(binary / "llama-server"), "-m", str(path), "--port", str(port), "-c", "4096", "-b", "4096", "-ub", "4096"]
    command += ["-ngl", str(n_gpu_layers)]
    with tempfile.NamedTemporaryFile("w", suffix=".log") as log:
        server = subprocess.Popen([*command, *placement_flags()], stdout=log, stderr=subprocess.STDOUT)
        try:
            body = json.dumps(as_llama_server_accepts(request)).encode()
            wait_healthy(f"http://127.0.0.1:{port}", server, 600)
            times = []
            for i in range(rounds + 1):
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/systemone", body, {"content-type": "application/json"})
                started = time.perf_counter()
                with urllib.request.urlopen(req, timeout=600) as r:
                    r.read()
                if i:
                    times.append(time.perf_counter() - started)
            return times
        finally:
            server.terminate()
            server.wait(60)


def plan_lines(path: Path) -> list[str]:
    import clef_gguf
    from clef_gguf.llama import log as llama_log
    from clef_gguf.llama.plan import memory_plan

    lines = ["| component | plan at 4,096 tokens (MiB, host) | llama.cpp's buffers at 4,096 (MiB) |", "|---|---:|---:|"]
    plan = memory_plan(path, 4096, n_gpu_layers=0)
    logged: list[str] = []
    with llama_log.capture_info(logged.append):
        clef_gguf.load(path, max_prompt_tokens=4096, state_cache=0).close()
    allocated: dict[str, float] = {}
    for m in re.finditer(r"(\S+) (KV|RS|compute|model) buffer size =\s+([\d.]+) MiB", "".join(logged)):
        allocated[m[2]] = allocated.get(m[2], 0.0) + float(m[3])
    for kind, component in (("KV", "KV cache"), ("RS", "recurrent state"), ("compute", "compute buffer")):
        line = next(x for x in plan.lines if x.component.startswith(component))
        lines.append(f"| {component} | {line.host_bytes / 2**20:.2f} | {allocated.get(kind, 0.0):.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--f16", action="store_true")
    parser.add_argument("--plan", action="store_true")
    parser.add_argument("--time", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--n-gpu-layers", type=int, default=0, help="--time on the device (and nvidia-smi's reading)")
    parser.add_argument("--vram", help="--plan: also `clef-gguf plan --vram` at Clef's 65,536 tokens")
    parser.add_argument("--bin", type=Path, default=Path.home() / ".cache/clef-gguf/llama-build/bin")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    shapes = C.backbone_tensor_shapes(QWEN35_9B)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        bf16 = Path(tmp) / "qwen35-9b-bf16.gguf"
        write_sparse(bf16, {n: storage_type(n, s, GT.BF16) for n, s in shapes.items()})
        types = mixture(bf16, L.LLAMA_FTYPE_MOSTLY_Q4_K_M)
    q4 = write_shaped(args.out_dir / "clef-flash-shaped-Q4_K_M.gguf", types, GT.F32, int(gguf.LlamaFileType.MOSTLY_Q4_K_M))
    print(f"wrote {q4} ({q4.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.0f} s")
    if args.f16:
        started = time.perf_counter()
        f16 = {n: storage_type(n, s, GT.F16) for n, s in shapes.items()}
        path = write_shaped(args.out_dir / "clef-flash-shaped-f16.gguf", f16, GT.F16, int(gguf.LlamaFileType.MOSTLY_F16))
        print(f"wrote {path} ({path.stat().st_size / 2**30:.2f} GiB) in {time.perf_counter() - started:.0f} s")
    if args.plan:
        print("\n".join(plan_lines(q4)))
        if args.vram:
            command = [sys.executable, "-m", "clef_gguf.cli", "plan", str(q4), "--vram", args.vram, "--ctx", "65536"]
            print(subprocess.run(command, capture_output=True, text=True).stdout)
    if args.time:
        binary = args.bin if (args.bin / "llama-server").is_file() else None
        print("| server | prompt tokens | median | range |\n|---|---:|---:|---:|")
        print("\n".join(time_requests(q4, binary, args.rounds, args.n_gpu_layers)))


if __name__ == "__main__":
    main()
