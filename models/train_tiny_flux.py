"""Train the embedded diffusion model: a small diffusers FluxTransformer2DModel, rectified flow, digits.

Question: can the suite have a real FLUX-architecture diffusion transformer (double and single
MMDiT blocks) with no model hub, trained reproducibly on a 2-core CPU in minutes, whose
activations are then captured and compressed like those of the original write-up (README)?

Command:
    python models/train_tiny_flux.py            # full run: 680 s measured on a busy 2-core CPU machine
    python models/train_tiny_flux.py --quick    # about 30 s; writes into a temporary folder

Writes:
    models/tiny_flux.safetensors   weights (float16 on disk; the model runs in float32)
    models/tiny_flux.json          model config, training knobs, seed, final loss, time, versions
    figures/tiny_flux_samples.png  generated samples per class beside real digits

Data: scikit-learn's `load_digits` (1797 images, 8x8, shipped inside the package), upsampled
bilinearly to 16x16 and scaled to [-1, 1]. An image is packed as FLUX packs latents: 2x2 patches
-> 64 tokens of 4 values. The class label is the prompt (see shared/diffusion.py).

Reproducible: the same seed and thread count give bit-identical weights (other thread counts round
differently). Sample output (full run):
    train tiny_flux: 100%|##########| 1500/1500 [11:20<00:00,  2.20step/s, loss=0.127]
    params 2,415,364; checkpoint 4.8 MB; final loss 0.126 (last 100 steps), eval loss 0.126; trained in 680 s
    a classifier fit on real digits labels 96% of generated samples as the class asked for
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

# set before torch loads OpenMP: on a busy 2-core machine, spinning worker threads made steps 4x slower
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from shared.diffusion import build_tiny_flux, classify, digit_classifier, digits, generate, load_tiny_flux  # noqa: E402

SEED = 0                 # seeds weights, batches, noise and timesteps
THREADS = 2              # CPU threads (the CI and developer machines have 2 cores); part of the recipe:
                         # another count gives other float rounding, hence other (equally good) weights
IMAGE_SIDE = 16          # pixels; the 8x8 digits are upsampled to this
PATCH = 2                # pixels per token side; FLUX packs 2x2 patches
HIDDEN = 128             # channels D of the residual stream (= heads x head dim)
HEADS = 4                # attention heads (head dim 32)
ROPE_AXES = (8, 12, 12)  # rotary dims per position axis (unused, row, column); sums to the head dim
DOUBLE_BLOCKS = 3        # double-stream MMDiT blocks; the middle one (index 1) is captured
SINGLE_BLOCKS = 2        # single-stream blocks
TEXT_TOKENS = 4          # tokens of the label "prompt"
BATCH = 32               # images per optimizer step
STEPS = 1500             # optimizer steps
LR = 1e-3                # peak AdamW learning rate
WARMUP = 100             # steps of linear warm-up, then cosine decay to LR/10
WEIGHT_DECAY = 0.0       # AdamW weight decay
EMA = 0.998              # decay of the moving average of the weights that gets saved
SAMPLE_STEPS = 20        # Euler steps when drawing samples for the figure
SAMPLE_SEEDS = 8         # samples per class in the figure
REAL_PER_CLASS = 4       # real digits per class in the figure

OUT_WEIGHTS = ROOT / "models" / "tiny_flux.safetensors"
OUT_FIGURE = ROOT / "figures" / "tiny_flux_samples.png"


def model_config() -> dict:
    transformer = dict(patch_size=1, in_channels=PATCH * PATCH, num_layers=DOUBLE_BLOCKS,
                       num_single_layers=SINGLE_BLOCKS, attention_head_dim=HIDDEN // HEADS,
                       num_attention_heads=HEADS, joint_attention_dim=HIDDEN, pooled_projection_dim=HIDDEN,
                       guidance_embeds=False, axes_dims_rope=list(ROPE_AXES))
    return dict(transformer=transformer, image_side=IMAGE_SIDE, patch=PATCH, channels=1, num_classes=10,
                text_tokens=TEXT_TOKENS)


def load_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Digits as (N, 1, 16, 16) float32 in [-1, 1] and their labels."""
    return digits(IMAGE_SIDE)


def flow_loss(model, images, labels, generator) -> torch.Tensor:
    """Rectified flow: x_sigma = (1 - sigma) x0 + sigma noise, target velocity noise - x0."""
    x0 = model.pack(images)
    noise = torch.randn(x0.shape, generator=generator)
    sigma = torch.sigmoid(torch.randn(len(x0), generator=generator))  # logit-normal, as SD3 and FLUX train
    x_sigma = (1 - sigma[:, None, None]) * x0 + sigma[:, None, None] * noise
    return F.mse_loss(model(x_sigma, sigma, labels), noise - x0)


def learning_rate(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(steps: int, batch: int) -> tuple[torch.nn.Module, list[float], float]:
    from tqdm import tqdm

    torch.manual_seed(SEED)
    images, labels = load_dataset()
    model = build_tiny_flux(model_config())
    ema = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    generator = torch.Generator().manual_seed(SEED)
    losses = []
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="train tiny_flux", unit="step")
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps)
        pick = torch.randint(len(images), (batch,), generator=generator)
        loss = flow_loss(model, images[pick], labels[pick], generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        decay = min(EMA, (1 + step) / (10 + step))  # a short average early, so the random start fades out
        with torch.no_grad():
            for name, value in model.state_dict().items():
                ema[name].mul_(decay).add_(value, alpha=1 - decay)
        losses.append(loss.item())
        if step % 20 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{np.mean(losses[-50:]):.3f}")
    seconds = time.perf_counter() - start
    model.load_state_dict(ema)
    return model.eval(), losses, seconds


@torch.no_grad()
def eval_loss(model) -> float:
    """Flow loss of the saved weights over the whole data set with fixed noise and timesteps."""
    images, labels = load_dataset()
    generator = torch.Generator().manual_seed(SEED + 1)
    return float(np.mean([flow_loss(model, images[i:i + 256], labels[i:i + 256], generator).item()
                          for i in range(0, len(images), 256)]))


def sample_accuracy(samples: torch.Tensor, asked: torch.Tensor) -> float:
    """Share of generated images that a classifier fit on the real digits assigns to the class asked for."""
    return float((classify(digit_classifier(IMAGE_SIDE), samples) == asked).float().mean())


def draw_figure(samples: torch.Tensor, path: Path, title: str, sample_steps: int) -> None:
    """Rows are classes 0-9: real digits on the left, generated ones (one per seed) on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    images, labels = load_dataset()
    real = torch.stack([((images[labels == c][:REAL_PER_CLASS] + 1) / 2) for c in range(10)])  # (10, R, 1, S, S)

    def grid(block: torch.Tensor) -> np.ndarray:  # (rows, cols, 1, S, S) -> one image with 1-pixel gaps
        rows, cols, side = block.shape[0], block.shape[1], block.shape[-1]
        out = np.ones((rows * (side + 1) - 1, cols * (side + 1) - 1), dtype=np.float32)
        for r in range(rows):
            for c in range(cols):
                out[r * (side + 1):r * (side + 1) + side, c * (side + 1):c * (side + 1) + side] = block[r, c, 0]
        return out

    side = IMAGE_SIDE + 1
    seeds = samples.shape[1]
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 7.2), gridspec_kw={"width_ratios": [REAL_PER_CLASS, seeds]})
    for ax, block, name in ((axes[0], real, "real digits\n(scikit-learn, upsampled)"),
                            (axes[1], samples, f"generated\n({sample_steps} Euler steps, seeds 0-{seeds - 1})")):
        ax.imshow(1 - grid(block), cmap="gray", vmin=0, vmax=1, interpolation="nearest")
        ax.set_title(name, fontsize=11)
        ax.set_yticks([r * side + IMAGE_SIDE / 2 - 0.5 for r in range(10)], [f"class {c}" for c in range(10)],
                      fontsize=10)
        ax.set_xticks([])
        ax.grid(False)
        for spine in ax.spines.values():
            spine.set_visible(False)
    axes[1].tick_params(labelleft=True)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)


def versions() -> dict:
    names = ["torch", "diffusers", "numpy", "scikit-learn", "safetensors"]
    return {"python": platform.python_version(), **{n: importlib.metadata.version(n) for n in names}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke run into a temporary folder")
    parser.add_argument("--steps", type=int, default=STEPS, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=BATCH, help="images per step")
    parser.add_argument("--out", type=Path, default=OUT_WEIGHTS, help="weights path; the .json goes beside it")
    parser.add_argument("--figure", type=Path, default=OUT_FIGURE, help="sample figure path")
    parser.add_argument("--threads", type=int, default=THREADS, help="CPU threads")
    parser.add_argument("--sample-steps", type=int, default=SAMPLE_STEPS, help="Euler steps per figure sample")
    parser.add_argument("--sample-seeds", type=int, default=SAMPLE_SEEDS, help="figure samples per class")
    args = parser.parse_args()
    if args.quick:
        folder = Path(tempfile.mkdtemp(prefix="tiny_flux_quick_"))
        args.steps, args.batch, args.sample_steps, args.sample_seeds = 30, 16, 4, 2
        args.out, args.figure = folder / "tiny_flux.safetensors", folder / "tiny_flux_samples.png"
    torch.set_num_threads(args.threads)

    model, losses, seconds = train(args.steps, args.batch)

    from safetensors.torch import save_file

    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.float16).contiguous() for k, v in model.state_dict().items()}, str(args.out))
    params = sum(p.numel() for p in model.parameters())
    record = {
        "model": model_config(),
        "weights_dtype": "float16",
        "training": {"seed": SEED, "steps": args.steps, "batch": args.batch, "lr": LR, "warmup": WARMUP,
                     "weight_decay": WEIGHT_DECAY, "ema": EMA, "threads": args.threads,
                     "objective": "rectified flow, velocity = noise - image, logit-normal sigma",
                     "data": f"sklearn load_digits, 1797 images 8x8 -> {IMAGE_SIDE}x{IMAGE_SIDE} bilinear, [-1, 1]"},
        "results": {"params": params, "final_loss": float(np.mean(losses[-100:])), "train_seconds": round(seconds, 1)},
        "versions": versions(),
    }
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))

    # everything below uses the weights as saved (float16 on disk), loaded back the way users load them
    saved = load_tiny_flux(args.out)
    record["results"]["eval_loss"] = eval_loss(saved)
    samples = torch.stack([generate(saved, range(10), seed, args.sample_steps)
                           for seed in range(args.sample_seeds)], dim=1)
    asked = torch.arange(10).repeat_interleave(args.sample_seeds)
    record["results"]["sample_accuracy"] = sample_accuracy(samples.reshape(-1, 1, IMAGE_SIDE, IMAGE_SIDE), asked)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    res = record["results"]
    title = (f"tiny FluxTransformer2DModel ({DOUBLE_BLOCKS} double + {SINGLE_BLOCKS} single blocks, D={HIDDEN}, "
             f"{params / 1e6:.2f}M params), {args.steps} steps x {args.batch} images\n"
             f"final loss {res['final_loss']:.3f}; a classifier fit on real digits labels "
             f"{res['sample_accuracy']:.0%} of the samples as the class asked for")
    draw_figure(samples, args.figure, title, args.sample_steps)

    size_mb = args.out.stat().st_size / 1e6
    print(f"params {params:,}; checkpoint {size_mb:.1f} MB; final loss {res['final_loss']:.3f} (last 100 steps), "
          f"eval loss {res['eval_loss']:.3f}; trained in {seconds:.0f} s")
    print(f"a classifier fit on real digits labels {res['sample_accuracy']:.0%} of generated samples "
          f"as the class asked for")
    print(f"wrote {args.out}, {args.out.with_suffix('.json')}, {args.figure}")


if __name__ == "__main__":
    main()
