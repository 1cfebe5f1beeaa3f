"""Many fine-tunes over one base: the models a loaded Clef answers as.

Clef is a frozen base plus a LoRA and a head, and so is every clef-finetune fine-tune. A loaded base answers as
itself and as each of its adapters (clef-gguf's adapter files, docs/finetune.md: a LoRA in llama.cpp's layout, the
fine-tune's head, its temperatures). A request names its model (System One's `model`, Workers AI's `lora`); the
prompt it is encoded into carries that model's identity, and the batch, the state cache and the answer follow it.

An adapter is validated against the base when it is first named, and loaded on the compute thread when a batch
needs it: its LoRA into llama.cpp (applied unmerged by the context, llama/lora.py) and its head into libclef_head
(the adapter's head tensors over the base's), both from one private copy of its file, read again and checked to be
the version its prompts name (Catalog.reread): a file replaced since is refused, never loaded under the old identity.
Loaded adapters are kept in an LRU bounded by a count and by bytes; the context applies one adapter at a time, a
batch's, and only between batches is another loaded or one unloaded.
The names, identities and files are runtime/catalog.py's (a Catalog, which the Ray ingress's PromptEncoder holds too).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path

from ..check.description import ClefDescription
from ..errors import SettingsError
from ..format.header import GGUFFile
from ..llama.backbone import Backbone
from ..llama.lora import apply_lora, free_lora, load_lora
from ..llama.native_head import NativeHead
from .catalog import Catalog, Variant


class Variants(Catalog):
    """The base and its adapters (runtime/catalog.py), and their loading. resolve() is thread-safe; activate() and
    unload run on the model's compute thread only (ClefModel.compute)."""

    def __init__(
        self,
        backbone: Backbone,
        base: GGUFFile,
        description: ClefDescription,
        base_identity: str,
        head: NativeHead,
        *,
        adapters: Mapping[str, str | Path] | None = None,
        adapter: str | Path | None = None,
        adapter_dir: str | Path | None = None,
        max_adapters: int = 8,
        adapter_memory: int | None = None,
        gpu: bool = False,
        n_threads: int | None = None,
        base_head: bool = False,
    ) -> None:
        if max_adapters < 1 or (adapter_memory is not None and adapter_memory < 1):
            raise SettingsError(f"max_adapters must be >= 1 and adapter_memory > 0 bytes, not {max_adapters}, {adapter_memory}")
        self._backbone, self._description = backbone, description
        self._gpu, self._threads = gpu, n_threads
        self.max_adapters, self.adapter_memory = max_adapters, adapter_memory
        self._loaded: OrderedDict[str, Variant] = OrderedDict()  # by identity, least recently used first
        many = {"adapters": adapters, "adapter": adapter, "adapter_dir": adapter_dir, "base_head": base_head}
        super().__init__(base, description, base_identity, **many)
        self.base.head = head
        self._applied: Variant = self.base

    # --- on the compute thread -------------------------------------------------------------------------------
    def activate(self, variant: Variant) -> NativeHead:
        """Make `variant` the context's model (loading it first if it is not), and return its head."""
        if variant is not self.base and variant.head is None:
            self._make_room(variant)
            self._load(variant)
        if variant is not self.base:
            self._loaded.move_to_end(variant.identity)
        if variant is not self._applied:
            apply_lora(self._backbone.ctx, variant.lora)
            self._applied = variant
        assert variant.head is not None
        return variant.head

    def _make_room(self, variant: Variant) -> None:
        """Unload the least recently used adapters until `variant` fits the count and the bytes (never the one
        applied: the context is switched to the base first)."""

        def over() -> bool:
            used = sum(v.nbytes for v in self._loaded.values())
            bytes_over = self.adapter_memory is not None and used + variant.nbytes > self.adapter_memory
            return bool(self._loaded) and (len(self._loaded) >= self.max_adapters or bytes_over)

        while over():
            _, oldest = self._loaded.popitem(last=False)
            self.unload(oldest)

    def _load(self, variant: Variant) -> None:
        """Its LoRA and its head, from one private copy of its version (kept until it is unloaded)."""
        copy = self.reread(variant)  # AdapterUnavailableError: the file is no longer this version
        try:
            variant.lora = load_lora(self._backbone.model, copy.file)
            variant.head = NativeHead(
                self._base_file, self._description.head, gpu=self._gpu, n_threads=self._threads, adapter=copy.file
            )
        except BaseException:
            if variant.lora is not None:
                free_lora(variant.lora)
                variant.lora = None
            copy.close()
            raise
        variant.copy = copy
        self._loaded[variant.identity] = variant

    def unload(self, variant: Variant) -> None:
        """Free an adapter's LoRA and head; it is loaded again when a batch needs it."""
        if variant is self._applied:
            apply_lora(self._backbone.ctx, None)
            self._applied = self.base
        if variant.head is not None:
            variant.head.close()
            variant.head = None
        if variant.lora is not None:
            free_lora(variant.lora)
            variant.lora = None
        if variant.copy is not None:
            variant.copy.close()
            variant.copy = None
        self._loaded.pop(variant.identity, None)
        self.forget(variant)

    @property
    def loaded(self) -> list[str]:
        """The adapters loaded now, least recently used first."""
        return [v.name for v in self._loaded.values()]

    def close(self) -> None:
        """Unload every adapter and drop their private copies (the base's head is the model's to close)."""
        for variant in list(self._loaded.values()):
            self.unload(variant)
        super().close()
