"""The same decisions on the device and on the CPU: every request of the suite, on the tiny fixture at f32 and q8_0.

Each file is loaded twice, with n_gpu_layers=-1 (every layer, the head and the tower where the build has a device
backend) and with 0 (the CPU alone); the largest |p_device - p_cpu| of any option of any request, and the tokens
(which must be equal), per type. On a build without a device backend both loads are the CPU's: the tool says so,
and the difference is then 0 (a check of the tool itself). tools/gpu_check.sh runs it on an NVIDIA machine.

    python tools/compare_devices.py [--types f32 q8_0] [--head-type auto|f32] [--reference]

--head-type: the head's weights type (convert's --head-type; auto is the file type at f32/f16/bf16/q8_0), to tell
the head's products from the backbone's. --reference: each side against Cloudflare's reference too (torch).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=["f32", "q8_0"])
    parser.add_argument("--head-type", default="auto")
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()

    import clef_gguf
    from clef_gguf.testing.release_builder import build_release
    from clef_gguf.testing.request_suite import all_requests, largest_difference, response_probabilities

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        release = build_release(Path(tmp) / "release")
        references = {}
        if args.reference:
            from clef_gguf.testing.oracle import Oracle

            oracle = Oracle(release)
            references = {name: oracle.probabilities(r) for name, r in all_requests().items()}
        for file_type in args.types:
            out = Path(tmp) / f"model-{file_type}.gguf"
            path = clef_gguf.convert(release, out, file_type, head_type=args.head_type, mmproj=False, force=True)
            with (
                clef_gguf.load(path, n_gpu_layers=-1, max_prompt_tokens=8192) as device,
                clef_gguf.load(path, max_prompt_tokens=8192) as cpu,
            ):
                row = {"type": file_type, "head_type": args.head_type, "head": device.head.device, "same_tokens": True}
                row |= {"max_dp": 0.0, "device_vs_reference": 0.0, "cpu_vs_reference": 0.0}
                for name, request in all_requests().items():
                    ours, theirs = response_probabilities(device.decide(request)), response_probabilities(cpu.decide(request))
                    row["max_dp"] = max(row["max_dp"], largest_difference(ours, theirs))
                    if references:
                        row["device_vs_reference"] = max(row["device_vs_reference"], largest_difference(ours, references[name]))
                        row["cpu_vs_reference"] = max(row["cpu_vs_reference"], largest_difference(theirs, references[name]))
                    row["same_tokens"] &= device.encode(request).tokens == cpu.encode(request).tokens
                rows.append(row)
    for row in rows:
        where = "" if row["head"] != "CPU" else " (no device backend in this build: the CPU against itself)"
        against = f"; against the reference: device {row['device_vs_reference']:.6f}, CPU {row['cpu_vs_reference']:.6f}"
        print(
            f"{row['type']} (head {row['head_type']}): max |p_device - p_cpu| = {row['max_dp']:.6f}"
            f"{against if references else ''}, the same tokens: {row['same_tokens']}, the head on {row['head']}{where}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
