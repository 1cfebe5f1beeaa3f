"""`clef-gguf convert` and `clef-gguf graft`: a release into a Clef GGUF, with a progress bar per stage."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..format.file_types import DEFAULT_ADAPTER_TYPE, DEFAULT_FILE_TYPE, FILE_TYPES
from .common import run_with_progress
from .errors import fail, say

if TYPE_CHECKING:
    from ..conversion.convert import Converted
    from ..conversion.writer import Progress

Out = Annotated[Path, typer.Option("--out", "-o", help="Output .gguf file.")]


SourceOption = Annotated[
    str, typer.Argument(help="Release folder, Hugging Face repo id (owner/name), or a clef-finetune checkpoint with --base.")
]
BaseOption = Annotated[
    str | None,
    typer.Option(
        "--base",
        help="For a clef-finetune checkpoint (adapter/ + joint_head.safetensors): the release it was trained from, "
        "whose weights its LoRA is merged into as they are converted.",
        show_default=False,
    ),
]
HeadTypeOption = Annotated[
    str,
    typer.Option(
        "--head-type",
        help="Head weight type: auto (as llama.cpp's converter: the file type for f32/f16/bf16/q8_0, else f32), "
        "f32, f16, bf16 or q8_0.",
    ),
]
ImatrixOption = Annotated[
    Path | None, typer.Option("--imatrix", help="Importance matrix (llama-imatrix GGUF) for llama.cpp's quantizer.")
]
MmprojOption = Annotated[
    Path | None,
    typer.Option(
        "--mmproj",
        help="Where to write the vision tower (llama.cpp's mmproj GGUF). Default: mmproj-<OUT's stem>.gguf beside OUT.",
        show_default=False,
    ),
]
MmprojTypeOption = Annotated[
    str,
    typer.Option(
        "--mmproj-type",
        help="Vision tower weight type: auto (the file type for f32/f16/bf16/q8_0, else f16), f32, f16, bf16 or q8_0.",
    ),
]


TypeOption = Annotated[
    str | None,
    typer.Option(
        "--type",
        "-t",
        help=f"Backbone type: {', '.join(FILE_TYPES)} (default {DEFAULT_FILE_TYPE}); "
        f"with --to-adapter, the LoRA's: f32, f16 or q8_0 (default {DEFAULT_ADAPTER_TYPE}).",
        show_default=False,
    ),
]
ToAdapterOption = Annotated[
    bool,
    typer.Option(
        "--to-adapter",
        help="With a checkpoint and --base: write an adapter file (the LoRA in llama.cpp's adapter layout, the head "
        "tensors that differ from the base's) to load over the base's GGUF, instead of a merged model.",
    ),
]
# --to-adapter's spelling until 0.2.0, where every other command's --adapter names an adapter FILE: kept for one
# release, hidden, with a line on stderr (CHANGELOG.md).
OldAdapterOption = Annotated[bool, typer.Option("--adapter", hidden=True)]
LlamaServerOption = Annotated[
    bool, typer.Option("--llama-server", help="With --to-adapter: the variant llama-server's --lora loads (no head tensors).")
]


def convert(
    source: SourceOption,
    out: Out,
    base: BaseOption = None,
    file_type: TypeOption = None,
    head_type: HeadTypeOption = "auto",
    imatrix: ImatrixOption = None,
    mmproj: MmprojOption = None,
    no_mmproj: Annotated[bool, typer.Option("--no-mmproj", help="Do not convert the vision tower.")] = False,
    mmproj_type: MmprojTypeOption = "auto",
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUT (and the mmproj) if they exist.")] = False,
    to_adapter: ToAdapterOption = False,
    llama_server: LlamaServerOption = False,
    old_adapter: OldAdapterOption = False,
) -> None:
    """Convert a Clef release into one GGUF file (backbone, head, tokenizer, decision metadata), and its vision
    tower into llama.cpp's mmproj file beside it. A clef-finetune checkpoint with --base: the base release with the
    checkpoint's LoRA merged in and its head, or with --to-adapter an adapter file over the base's GGUF."""
    if old_adapter:
        say(
            "warning: convert --adapter is now --to-adapter (--adapter names an adapter file in every other command); "
            "the old spelling goes in the next release"
        )
    adapter = to_adapter or old_adapter
    if no_mmproj and mmproj is not None:
        fail("--mmproj and --no-mmproj exclude each other")
    if adapter or llama_server:
        if mmproj is not None or imatrix is not None or mmproj_type != "auto":
            fail("--to-adapter writes a LoRA and a head, no mmproj and no llama.cpp quantization: drop --mmproj and --imatrix")
        _convert_adapter(source, out, base, file_type, head_type, adapter, llama_server, force)
        return
    options = {"base": base, "head_type": head_type, "imatrix": imatrix, "mmproj_type": mmproj_type, "force": force}
    vision = False if no_mmproj else (mmproj or True)

    def converting(progress: Progress) -> Converted:
        # The converter (gguf-py, numpy, the writer) loads when convert runs, not with every command; inside run(), so
        # that a signal while it loads is run's one line.
        from ..conversion.convert import convert_files

        return convert_files(source, out, file_type or DEFAULT_FILE_TYPE, mmproj=vision, progress=progress, **options)

    made = run_with_progress(converting)
    say(f"wrote {made.model}")
    if made.mmproj is not None:
        say(f"wrote {made.mmproj} (the vision tower)")
    if made.note:
        say(f"note: {made.note}")


def _convert_adapter(
    source: str,
    out: Path,
    base: str | None,
    file_type: str | None,
    head_type: str,
    adapter: bool,
    llama_server: bool,
    force: bool,
) -> None:
    if not adapter:
        fail("--llama-server is a variant of --to-adapter: give both")
    if base is None:
        fail("--to-adapter converts a clef-finetune checkpoint over its base: give the release it was trained from with --base")
    options = {"head_type": head_type, "llama_server": llama_server, "force": force}

    def converting(progress: Progress) -> Path:
        from ..conversion.adapter import convert_adapter  # (as convert's converter: loaded here, inside run())

        return convert_adapter(source, base, out, file_type or DEFAULT_ADAPTER_TYPE, progress=progress, **options)

    written = run_with_progress(converting)
    say(f"wrote {written} (an adapter over {base}'s GGUF" + (", for llama-server's --lora)" if llama_server else ")"))


def graft(
    backbone: Annotated[Path, typer.Argument(help="A backbone-only qwen35 GGUF (any quantization).")],
    source: Annotated[
        str, typer.Argument(help="The release: folder or Hugging Face repo id (only head, config and tokenizer files are read).")
    ],
    out: Out,
    head_type: Annotated[str, typer.Option("--head-type", help="Head weight type: auto (f32), f32, f16, bf16 or q8_0.")] = "auto",
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUT if it exists.")] = False,
) -> None:
    """Add a release's head to a backbone-only GGUF, without re-quantizing the backbone."""

    def grafting(progress: Progress) -> Path:
        from ..conversion.graft import graft as graft_head  # (as convert's converter: loaded here, inside run())

        return graft_head(backbone, source, out, head_type=head_type, force=force, progress=progress)

    say(f"wrote {run_with_progress(grafting)}")
