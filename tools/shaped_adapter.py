"""A Clef-flash-shaped adapter over tools/shaped_model.py's file, and what it costs there: memory and time.

    python tools/shaped_model.py OUT_DIR                       # OUT_DIR/clef-flash-shaped-Q4_K_M.gguf (a minute)
    python tools/shaped_adapter.py OUT_DIR [--rank 64] [--type f16] [--rounds 2]
    python tools/shaped_adapter.py OUT_DIR --hub     # its first use from a local Hub stand-in instead

Writes OUT_DIR/shaped-r64.adapter.gguf: clef-finetune's default LoRA (r 64 on every linear of `linear_attn`,
`self_attn` and `mlp`: format/adapter.adaptable on Qwen3.5-9B's shapes), random pairs of small values, alpha = r,
the base's fingerprint, no head of its own (the base's decides, as in llama-server's variant). Then prints the pairs,
the parameters and the file's size, llama.cpp's LoRA buffer as it loads the adapter, and one request (three
questions) decided by the base and by the adapter over it, one at a time, medians of --rounds, at the default threads.

With --hub, the adapter's first use as `serve --adapter-source hf://acme` makes it, from a local stand-in of the
Hugging Face Hub (testing/hub.py, the real client), in its stages: the base loaded with the source; the request's name
resolved (the download into the adapter cache, the check against the base, the private copy read and validated);
llama.cpp's LoRA loaded from that copy. No decision: one takes minutes here, and it is the loaded adapter's
(above), not the first use's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import gguf
import numpy as np

import clef_gguf
from clef_gguf.check.validate import open_validated
from clef_gguf.format import adapter as A
from clef_gguf.format.header import GGUFFile
from clef_gguf.llama import log as llama_log

BASE = "clef-flash-shaped-Q4_K_M.gguf"
REQUEST = {
    "state": {"ticket": "My order arrived broken and nobody answers the phone. I want my money back today."},
    "questions": {
        "complaint": {"type": "noul", "instructions": "Is the customer complaining?"},
        "intent": {"type": "choice", "criteria": {"refund": "Money back", "replacement": None, "information": None}},
        "urgency": {"type": "score", "criteria": ["low", "medium", "high"]},
    },
}


def write_adapter(base: Path, out: Path, rank: int, file_type: str) -> tuple[int, int]:
    """The adapter file: (pairs, parameters)."""
    validated = open_validated(base)
    try:
        shape, head, fingerprint = validated.description.shape, validated.description.head, A.model_fingerprint(validated.file)
    finally:
        validated.close()
    qtype = {"f16": gguf.GGMLQuantizationType.F16, "f32": gguf.GGMLQuantizationType.F32}[file_type]
    writer = gguf.GGUFWriter(out, "clef")
    writer.add_string(A.KEY_GENERAL_TYPE, A.GENERAL_TYPE)
    writer.add_string(A.KEY_ADAPTER_TYPE, A.ADAPTER_TYPE)
    writer.add_float32(A.KEY_ALPHA, float(rank))
    writer.add_string(A.KEY_BASE_FINGERPRINT, fingerprint)
    writer.add_string(A.KEY_BASE_NAME, base.stem)
    for key, value in ((A.KEY_RANK, rank), (A.KEY_EMBEDDING_LENGTH, shape.n_embd), (A.KEY_HEAD_WIDTH, head.width)):
        writer.add_uint32(key, value)
    writer.add_uint32(A.KEY_HEAD_FEEDFORWARD, head.feedforward)
    rng, params = np.random.default_rng(0), 0
    targets = A.adaptable(shape)
    for name, tensor in targets.items():
        rows, columns = tensor.shape
        for suffix, pair_shape in ((A.LORA_A, (rank, columns)), (A.LORA_B, (rows, rank))):
            values = rng.normal(0, 0.02, pair_shape).astype(np.float32)
            writer.add_tensor(name + suffix, values.astype(np.float16) if qtype == gguf.GGMLQuantizationType.F16 else values)
            params += values.size
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return len(targets), params


def timed(model: clef_gguf.ClefModel, name: str | None, rounds: int) -> float:
    times = []
    for i in range(rounds + 1):  # (the first of each: warm-up)
        request = {**REQUEST, "state": {"ticket": f"{REQUEST['state']['ticket']} ({i})"}}
        started = time.perf_counter()
        model.decide(request | ({"model": name} if name else {}))
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def first_use_from_hub(base: Path, adapter: Path) -> dict[str, float]:
    """Seconds of each stage of the adapter's first use from a local Hub (the module's docstring)."""
    import os
    import shutil
    import tempfile

    from clef_gguf.testing.hub import Hub

    work = Path(tempfile.mkdtemp(prefix="shaped-hub-", dir=adapter.parent))
    hub = Hub(work / "hub")
    try:
        shutil.copyfile(adapter, hub.repo("acme", "shaped") / adapter.name)
        os.environ["HF_ENDPOINT"] = hub.url
        started = time.perf_counter()
        load = {"max_prompt_tokens": 4096, "state_cache": 0, "adapter_sources": ["hf://acme"], "adapter_cache": work / "cache"}
        load |= {"base_head": True}  # (the adapter has no head of its own: write_adapter)
        with clef_gguf.load(base, **load) as model:
            loaded = time.perf_counter()
            ref = model.catalog.resolve("acme/shaped")
            resolved = time.perf_counter()
            model.compute(model.decider.adapters.apply, ref.entry, model.catalog.reread)
            applied = time.perf_counter()
        return {
            "base_load_s": loaded - started,
            "download_check_copy_s": resolved - loaded,
            "lora_load_s": applied - resolved,
            "first_use_s": applied - loaded,
            "downloads": sum(hub.downloads.values()),
        }
    finally:
        hub.close()
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dir", type=Path, help="the folder where tools/shaped_model.py wrote its file")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--type", choices=("f16", "f32"), default="f16")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hub", action="store_true", help="its first use from a local Hub stand-in, in stages")
    args = parser.parse_args()
    base, out = args.dir / BASE, args.dir / f"shaped-r{args.rank}.adapter.gguf"
    pairs, params = write_adapter(base, out, args.rank, args.type)
    report: dict[str, object] = {"pairs": pairs, "parameters": params, "file_gib": out.stat().st_size / 2**30}
    GGUFFile.open(out).close()
    if args.hub:
        print(json.dumps(report | first_use_from_hub(base, out), indent=2))
        return
    lines: list[str] = []
    load = {"max_prompt_tokens": 4096, "state_cache": 0, "adapters": {"tune": out}}
    with llama_log.capture_info(lines.append), clef_gguf.load(base, **load) as model:
        report["base_s"] = timed(model, None, args.rounds)
        report["adapter_s"] = timed(model, "tune", args.rounds)
    report["llama_lora_buffer"] = [line.strip() for line in lines if "LoRA buffer size" in line]
    report["adapter_over_base"] = report["adapter_s"] / report["base_s"]  # type: ignore[operator]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
