"""The deciding part of a loaded model: the backbone, the heads, the vision tower and the loaded adapters.

Clef is a frozen base plus a LoRA and a head, and so is every clef-finetune fine-tune. The catalog (runtime/catalog.py)
says which models the base answers as; the decider loads the one a batch needs, on the model's compute thread: its
LoRA into llama.cpp (applied unmerged by the context, llama/lora.py) and its head into libclef_head (the adapter's head
tensors over the base's), both from one private copy of its file, read again and checked to be the version its prompts
name (Catalog.reread): a file replaced since is refused, never loaded under the old identity. Loaded adapters are kept
in an LRU bounded by a count and by bytes (AdapterSet.max_adapters, adapter_memory); the context applies one adapter
at a time, a batch's, and only between batches is another loaded or one unloaded.
"""

from __future__ import annotations

from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from ..check.description import ValidatedFile
from ..llama.backbone import Backbone
from ..llama.lora import Handle, apply_lora, free_lora, load_lora
from ..llama.mtmd import VisionEncoder
from ..llama.native_head import NativeHead
from ..settings import ModelSpec, default_ubatch
from .adapter_files import AdapterCopy
from .catalog import Catalog, CatalogEntry
from .images import ImageLimits


@dataclass(eq=False)
class LoadedAdapter:
    """One version of an adapter, loaded: its private copy (kept while loaded), its LoRA in llama.cpp, its head."""

    entry: CatalogEntry
    copy: AdapterCopy
    lora: Handle
    head: NativeHead

    def close(self) -> None:
        self.head.close()
        free_lora(self.lora)
        self.copy.close()


def load_backbone(spec: ModelSpec, validated: ValidatedFile) -> Backbone:
    """The backbone as the spec's LoadOptions say: its context, its ubatch and sequences, and its vocabulary (which
    the encoder tokenizes with)."""
    o = spec.options
    return Backbone(
        validated.file,
        n_gpu_layers=o.n_gpu_layers,
        max_prompt_tokens=o.max_prompt_tokens,
        n_threads=o.n_threads,
        nfc=validated.description.nfc,
        ubatch=default_ubatch(o.max_prompt_tokens) if o.ubatch is None else o.ubatch,
        parallel=o.parallel,
    )


class Decider:
    """Over the backbone (load_backbone): the base's head, the vision tower (with an mmproj) and an LRU of loaded
    adapters. Every method runs on the model's compute thread (ClefModel.compute)."""

    def __init__(
        self, spec: ModelSpec, validated: ValidatedFile, backbone: Backbone, catalog: Catalog, image_limits: ImageLimits | None
    ) -> None:
        o, d = spec.options, validated.description
        self.backbone, self._file, self._description, self._catalog = backbone, validated.file, d, catalog
        self._gpu, self._threads = o.n_gpu_layers != 0, o.n_threads  # (the heads run where the backbone runs)
        self.max_adapters, self.adapter_memory = spec.adapter_set.max_adapters, spec.adapter_set.adapter_memory
        self._loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()  # by identity, least recently used first
        self._applied: LoadedAdapter | None = None  # the adapter the context applies (None: the base alone)
        # Every stage registers its undo: a failure at any stage closes what the earlier ones opened.
        with ExitStack() as stack:
            self.head = NativeHead(validated.file, d.head, gpu=self._gpu, n_threads=o.n_threads)
            stack.callback(self.head.close)
            self.vision: VisionEncoder | None = None
            if o.mmproj is not None and image_limits is not None:
                self.vision = self._load_vision(Path(o.mmproj), image_limits)
                stack.callback(self.vision.close)
            self._resources = stack.pop_all()

    def _load_vision(self, mmproj: Path, limits: ImageLimits) -> VisionEncoder:
        """The vision tower (paired with this model by the encoder's check), in libmtmd over the lean backbone."""
        per_token = limits.factor**2
        # mtmd's own token limits around the runtime's: it then takes every image runtime/images.py sized unresized.
        tokens = (max(1, limits.min_pixels // per_token), -(-limits.max_pixels // per_token))
        return VisionEncoder(
            mmproj, self.backbone.model, n_threads=self._threads, use_gpu=self._gpu, min_tokens=tokens[0], max_tokens=tokens[1]
        )

    def activate(self, entry: CatalogEntry) -> NativeHead:
        """Make `entry` the context's model (loading it first if it is not), and return its head."""
        if entry is self._catalog.base:
            loaded = None
        else:
            loaded = self._loaded.get(entry.identity)
            if loaded is None:
                self._make_room(entry)
                loaded = self._load(entry)
            self._loaded.move_to_end(entry.identity)
        if loaded is not self._applied:
            apply_lora(self.backbone.ctx, loaded.lora if loaded is not None else None)
            self._applied = loaded
        return loaded.head if loaded is not None else self.head

    def _make_room(self, entry: CatalogEntry) -> None:
        """Unload the least recently used adapters until `entry` fits the count and the bytes (the one applied too:
        the context is switched to the base first)."""

        def over() -> bool:
            used = sum(a.entry.nbytes for a in self._loaded.values())
            bytes_over = self.adapter_memory is not None and used + entry.nbytes > self.adapter_memory
            return bool(self._loaded) and (len(self._loaded) >= self.max_adapters or bytes_over)

        while over():
            _, oldest = self._loaded.popitem(last=False)
            self._unload(oldest)

    def _load(self, entry: CatalogEntry) -> LoadedAdapter:
        """Its LoRA and its head, from one private copy of its version (kept until it is unloaded)."""
        copy = self._catalog.reread(entry)  # AdapterUnavailableError: the file is no longer this version
        with ExitStack() as stack:
            stack.callback(copy.close)
            lora = load_lora(self.backbone.model, copy.file, scratch=copy.file.path.parent)  # (the copy's own folder)
            stack.callback(free_lora, lora)
            head = NativeHead(self._file, self._description.head, gpu=self._gpu, n_threads=self._threads, adapter=copy.file)
            stack.pop_all()
        loaded = self._loaded[entry.identity] = LoadedAdapter(entry, copy, lora, head)
        self._catalog.hold(entry)
        return loaded

    def _unload(self, loaded: LoadedAdapter) -> None:
        """Free an adapter's LoRA and head; it is loaded again when a batch needs it."""
        if loaded is self._applied:
            apply_lora(self.backbone.ctx, None)
            self._applied = None
        loaded.close()
        self._catalog.release(loaded.entry)

    @property
    def loaded(self) -> list[str]:
        """The adapters loaded now, least recently used first."""
        return [a.entry.name for a in self._loaded.values()]

    def close(self) -> None:
        """Unload every adapter, then the vision tower and the head (the backbone is the model's to close)."""
        while self._loaded:
            self._unload(self._loaded.popitem()[1])
        self._resources.close()
