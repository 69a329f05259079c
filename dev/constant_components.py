"""Would skipping the components the KV codec codes as one symbol make its decode cheaper?

A component whose quantized coefficients take one value over a chunk codes to no bytes (its rANS lanes
keep their initial state), but a GPU decoder still walks and writes its rows. Skipping them pays only if
there are many. This script counts them: SmolLM2's K and V of one held-out window (text past the codec's
fit and calibration regions), through the shipped KV codec (keys after RoPE, calibrated for +0.3%), per
layer and kind: the share of components whose symbols are all equal, and the share of nonzero symbols.

Command:  python dev/constant_components.py      (a CPU; about a minute, the model's load included)
"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from shared import llm  # noqa: E402
from shared.kvcodec import load_shipped  # noqa: E402

WINDOW = (41, 2)        # held-out 1024-token chunks: first chunk, chunk count (PoC 17 evaluates from chunk 40)
TARGET_PCT = 0.3        # the shipped codec's perplexity target

torch.set_num_threads(1)
codec = load_shipped("smollm2", TARGET_PCT, keys_after_rope=True)
model, tokenizer = llm.load_smollm2("cpu")
first, count = WINDOW
ids = llm.text_chunks(tokenizer, first + count, 1024)[first:first + count].reshape(1, -1)
with torch.no_grad():
    kv = llm.cache_kv(llm._output_cache(model(ids, use_cache=True)))
shares = {"k": [], "v": []}
nonzero = {"k": [], "v": []}
for layer, (k, v) in enumerate(kv):
    for kind, entry in (("k", k), ("v", v)):
        symbols = codec.symbols(llm.kv_to_rows(entry).float(), layer, kind).numpy()
        shares[kind].append(float((symbols == symbols[:1]).all(axis=0).mean()))
        nonzero[kind].append(float((symbols != 0).mean()))
for kind in "kv":
    per_layer = " ".join(f"{s:.2f}" for s in shares[kind])
    print(f"{kind}: components coded as one symbol {np.mean(shares[kind]):.3%} of all ({per_layer} by layer); "
          f"nonzero symbols {np.mean(nonzero[kind]):.1%}")
