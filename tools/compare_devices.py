"""The same decisions on the device and on the CPU: every request of the suite, on the tiny fixture at f32 and q8_0.

Each file is loaded twice, with n_gpu_layers=-1 (every layer, the head and the tower where the build has a device
backend) and with 0 (the CPU alone); the largest |p_device - p_cpu| of any option of any request, and the tokens
(which must be equal), per type. On a build without a device backend both loads are the CPU's: the tool says so,
and the difference is then 0 (a check of the tool itself). tools/gpu_check.sh runs it on an NVIDIA machine.

    python tools/compare_devices.py [--types f32 q8_0]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["f32", "q8_0"])
    args = parser.parse_args()

    import clef_gguf
    from clef_gguf.testing.release_builder import build_release
    from clef_gguf.testing.request_suite import all_requests, largest_difference, response_probabilities

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        release = build_release(Path(tmp) / "release")
        for file_type in args.types:
            path = clef_gguf.convert(release, Path(tmp) / f"model-{file_type}.gguf", file_type, mmproj=False)
            with (
                clef_gguf.load(path, n_gpu_layers=-1, max_prompt_tokens=8192) as device,
                clef_gguf.load(path, max_prompt_tokens=8192) as cpu,
            ):
                worst, same_tokens = 0.0, True
                for request in all_requests().values():
                    ours, theirs = device.decide(request), cpu.decide(request)
                    same_tokens &= ours["usage"]["input_tokens"] == theirs["usage"]["input_tokens"]
                    worst = max(worst, largest_difference(response_probabilities(ours), response_probabilities(theirs)))
                rows.append({"type": file_type, "head": device.head.device, "max_dp": worst, "same_tokens": same_tokens})
    for row in rows:
        where = "" if row["head"] != "CPU" else " (no device backend in this build: the CPU against itself)"
        print(
            f"{row['type']}: max |p_device - p_cpu| = {row['max_dp']:.6f}, the same tokens: {row['same_tokens']}, "
            f"the head on {row['head']}{where}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
