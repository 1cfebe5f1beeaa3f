"""A GGUF file copied with some key-values replaced: the header rewritten, the tensor data byte for byte.

What `clef-gguf calibrate` writes (the softmax temperature keys). The other key-values and every tensor info are
copied as the bytes they are; the tensor offsets are relative to the data section, so they stay valid wherever the
new header ends. The data section is streamed in chunks, to a temporary file renamed at the end.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path

from gguf import GGUFValueType

from ..format.header import GGUF_MAGIC, GGUFFile
from ..outputs import refuse_inputs
from .writer import Progress, atomic_output, check_free_space, writing

CHUNK = 16 << 20


def _float_kv(key: str, value: float) -> bytes:
    raw = key.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw + struct.pack("<If", GGUFValueType.FLOAT32, value)


def rekey(
    source: str | Path,
    out: str | Path,
    floats: Mapping[str, float],
    *,
    drop_prefix: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> Path:
    """Copy `source` to `out` with the keys of `floats` set (FLOAT32) and the keys starting with `drop_prefix`
    removed first; never in place."""
    source, out = Path(source), Path(out)
    refuse_inputs(out, [source])
    f = GGUFFile.open(source)
    try:
        h = f.header
        kept = [
            fld for k, fld in h.fields.items() if k not in floats and not (drop_prefix is not None and k.startswith(drop_prefix))
        ]
        infos = min((t.start for t in h.tensors.values()), default=h.header_end)
        head = bytearray(GGUF_MAGIC + struct.pack("<IQQ", h.version, len(h.tensors), len(kept) + len(floats)))
        for fld in kept:
            head += f.map[fld.start : fld.end]
        for key, value in floats.items():
            head += _float_kv(key, value)
        head += f.map[infos : h.header_end]
        head += bytes(-len(head) % h.alignment)
        data = memoryview(f.map)[h.data_offset :]
        check_free_space(out.parent, len(head) + len(data))
        with atomic_output(out, force) as tmp, writing(out), open(tmp, "wb") as file:
            file.write(head)
            for start in range(0, len(data), CHUNK):
                file.write(data[start : start + CHUNK])
                if progress:
                    progress("writing", min(start + CHUNK, len(data)), len(data), out.name)
            if not len(data) and progress:
                progress("writing", 0, 0, out.name)
        data.release()
    finally:
        f.close()
    return out
