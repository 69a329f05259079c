"""On-disk cache of captured activations: one safetensors file per capture plus a manifest.

    store = CaptureStore("data/captures/smollm2_kv")
    if not store.complete(expected_meta):
        for key, tensors, meta in make_captures():
            store.write(key, tensors, meta)
        store.finish(expected_meta)
    x = store.load("prompt3")["layer15.k"]

A store is complete only after finish(): an interrupted capture run is redone, never half-used.
`expected_meta` (model, layers, prompts, ...) is compared on reuse, so changing a knob recaptures.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "data" / "captures"


class CaptureStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        if not self.root.is_absolute() and not self.root.exists():
            self.root = DEFAULT_ROOT / self.root if len(self.root.parts) == 1 else self.root
        self.manifest_path = self.root / "manifest.json"

    def complete(self, expected_meta: dict) -> bool:
        if not self.manifest_path.exists():
            return False
        manifest = json.loads(self.manifest_path.read_text())
        return manifest.get("meta") == json.loads(json.dumps(expected_meta))

    def reset(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True, exist_ok=True)

    def write(self, key: str, tensors: dict[str, torch.Tensor], meta: dict | None = None) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        save_file(tensors, str(self.root / f"{key}.safetensors"),
                  metadata={"meta": json.dumps(meta or {})})

    def finish(self, expected_meta: dict) -> None:
        keys = sorted(p.stem for p in self.root.glob("*.safetensors"))
        self.manifest_path.write_text(json.dumps({"meta": expected_meta, "keys": keys}, indent=1))

    def keys(self) -> list[str]:
        if not self.manifest_path.exists():
            raise FileNotFoundError(f"no finished captures in {self.root}; run the capture step first")
        return json.loads(self.manifest_path.read_text())["keys"]

    def meta(self) -> dict:
        """The metadata the store was finished with (model, layers, prompts, ...)."""
        self.keys()  # raises the clear error when unfinished
        return json.loads(self.manifest_path.read_text())["meta"]

    def load(self, key: str) -> dict[str, torch.Tensor]:
        return load_file(str(self.root / f"{key}.safetensors"))

    def stack(self, name: str) -> list[torch.Tensor]:
        """The tensor `name` from every capture, in key order."""
        return [self.load(k)[name] for k in self.keys()]
