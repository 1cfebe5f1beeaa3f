"""Cloudflare's joint_schema_model.py, the reference, imported from the clef-finetune package that vendors it."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ..format.contract import REFERENCE_SHA256

REFERENCE_MODULE = "clef_reference_joint_schema_model"


def reference_path() -> Path:
    """Path of Cloudflare's joint_schema_model.py as shipped in clef-finetune."""
    spec = importlib.util.find_spec("clef_finetune")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("clef-finetune is not installed: pip install --no-deps clef-finetune==0.1.0")
    return Path(next(iter(spec.submodule_search_locations))) / "_vendor" / "joint_schema_model.py"


def load_reference() -> ModuleType:
    """Import the reference by file path, so clef_finetune/__init__ (and its deps) never runs."""
    if REFERENCE_MODULE in sys.modules:
        return sys.modules[REFERENCE_MODULE]
    path = reference_path()
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != REFERENCE_SHA256:
        raise RuntimeError(f"{path} has sha256 {digest}, expected {REFERENCE_SHA256}: not the reference")
    module_spec = importlib.util.spec_from_file_location(REFERENCE_MODULE, path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    # dataclasses resolve annotations through sys.modules, so register before executing.
    sys.modules[REFERENCE_MODULE] = module
    module_spec.loader.exec_module(module)
    return module
