"""The diffusion models whose activations the suite compresses: a small FLUX transformer trained in
this repository (the embedded default, no network) and the real FLUX path through diffusers.

    from shared.diffusion import load_tiny_flux, generate, capture_tiny_flux
    model = load_tiny_flux()                                   # models/tiny_flux.safetensors
    images = generate(model, labels=range(10), seed=0, steps=20)     # (10, 1, 16, 16) in [0, 1]
    store = capture_tiny_flux(model, seeds=range(8), classes=range(10), steps=20)
    x = store.load("seed0_class3_step05")["act"]               # [64 tokens, 128 channels] float32
    lossy = generate(model, range(10), seed=0, steps=20, activation_hook=lambda x: x.half().float())

The tiny model is a real `diffusers.FluxTransformer2DModel` (double-stream MMDiT blocks, then
single-stream blocks, rotary positions, AdaLN-zero modulation) trained with rectified flow on
scikit-learn's digits by `models/train_tiny_flux.py`. An image is 16x16 pixels, one channel, packed
the way FLUX packs latents: 2x2 patches become 64 tokens of 4 values. The class label plays the
prompt: a learned embedding gives the text tokens (`encoder_hidden_states`) and the pooled vector.

What is captured and replaced is the IMAGE-stream output of one double block (default the middle
one), [T tokens, D channels] per denoising step, the tensor the original write-up compressed on FLUX.
The replace hook calls `fn(x) -> x_hat` once per batch item with x of shape [T, D].

Real path: `load_flux_pipeline("black-forest-labs/FLUX.1-schnell")` or a local diffusers folder;
`capture_flux_pipeline(pipe, prompts, seeds, ...)` records the same stream of the same kind of block,
and `flux_pipeline_generate(pipe, prompt, seed, activation_hook=...)` replaces it.
Without the weights on disk it raises WeightsUnavailable, which says how to provide them.
"""
from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from .captures import CaptureStore
from .errors import InvalidTensorError, WeightsUnavailable

ROOT = Path(__file__).resolve().parent.parent
CHECKPOINT = ROOT / "models" / "tiny_flux.safetensors"
CHECKPOINT_CONFIG = ROOT / "models" / "tiny_flux.json"
TINY_FLUX_ID = "tiny_flux"
DEFAULT_FLUX_ID = "black-forest-labs/FLUX.1-schnell"

# ---------------------------------------------------------------- the tiny model

class TinyFlux(nn.Module):
    """FluxTransformer2DModel plus the class-label "prompt" and the packing of 16x16 digit images."""

    def __init__(self, transformer: dict, image_side: int, patch: int, channels: int, num_classes: int,
                 text_tokens: int):
        super().__init__()
        from diffusers import FluxTransformer2DModel

        self.image_side, self.patch, self.channels = image_side, patch, channels
        self.num_classes, self.text_tokens = num_classes, text_tokens
        self.transformer = FluxTransformer2DModel(**transformer)
        joint_dim = self.transformer.config.joint_attention_dim
        pooled_dim = self.transformer.config.pooled_projection_dim
        self.label_tokens = nn.Embedding(num_classes, text_tokens * joint_dim)
        self.label_pooled = nn.Embedding(num_classes, pooled_dim)
        side = image_side // patch
        rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        # FLUX's position ids: axis 0 is unused for images, axes 1 and 2 are row and column
        img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3).float()
        self.register_buffer("img_ids", img_ids, persistent=False)
        self.register_buffer("txt_ids", torch.zeros(text_tokens, 3), persistent=False)

    @property
    def tokens(self) -> int:
        return (self.image_side // self.patch) ** 2

    @property
    def token_values(self) -> int:
        return self.channels * self.patch ** 2

    def pack(self, images: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) -> (B, H/p * W/p, C*p*p), FLUX's latent packing."""
        b, c, h, w = images.shape
        p = self.patch
        x = images.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(b, (h // p) * (w // p), c * p * p)

    def unpack(self, tokens: torch.Tensor) -> torch.Tensor:
        b, p, c, side = tokens.shape[0], self.patch, self.channels, self.image_side // self.patch
        x = tokens.reshape(b, side, side, c, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(b, c, side * p, side * p)

    def forward(self, packed: torch.Tensor, sigma: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Velocity (noise - image) predicted at noise level sigma in [0, 1] for the packed tokens."""
        joint_dim = self.transformer.config.joint_attention_dim
        text = self.label_tokens(labels).reshape(len(labels), self.text_tokens, joint_dim)
        return self.transformer(hidden_states=packed, encoder_hidden_states=text,
                                pooled_projections=self.label_pooled(labels), timestep=sigma,
                                img_ids=self.img_ids, txt_ids=self.txt_ids, return_dict=False)[0]


def build_tiny_flux(model_config: dict) -> TinyFlux:
    return TinyFlux(**model_config)


def checkpoint_id(path: str | Path = CHECKPOINT) -> str:
    """First 16 hex digits of the checkpoint's SHA-256: names the weights in capture metadata."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def load_tiny_flux(path: str | Path = CHECKPOINT) -> TinyFlux:
    """The committed tiny FLUX model, float32, eval mode, on the CPU. No network."""
    from safetensors.torch import load_file

    path = Path(path)
    config_path = path.with_suffix(".json")
    if not path.exists() or not config_path.exists():
        raise WeightsUnavailable(
            f"tiny FLUX checkpoint missing: {path} and {config_path} must both exist. They are committed "
            f"with the repository; to rebuild them run `make models` (python models/train_tiny_flux.py).")
    config = json.loads(config_path.read_text())
    model = build_tiny_flux(config["model"])
    state = {k: v.float() for k, v in load_file(str(path)).items()}
    model.load_state_dict(state, strict=True)
    model.checkpoint_id = checkpoint_id(path)
    return model.eval()


def _labels_tensor(model: TinyFlux, labels: Iterable[int] | torch.Tensor) -> torch.Tensor:
    labels = torch.as_tensor(list(labels) if not isinstance(labels, torch.Tensor) else labels, dtype=torch.long)
    if labels.ndim != 1 or len(labels) == 0:
        raise ValueError(f"labels must be a non-empty 1-D list of class ids, got shape {tuple(labels.shape)}")
    if labels.min() < 0 or labels.max() >= model.num_classes:
        raise ValueError(f"labels must lie in 0..{model.num_classes - 1}, got {labels.tolist()}")
    return labels


def generate(model: TinyFlux, labels: Iterable[int] | torch.Tensor, seed: int, steps: int,
             activation_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
             block: int | None = None, hook_whole_batch: bool = False, grad: bool = False) -> torch.Tensor:
    """Images (B, 1, 16, 16) in [0, 1] by Euler steps of the rectified flow from sigma 1 to 0.

    The starting noise of all B items comes from one generator seeded with `seed`, so item j depends
    on the seed and on its position j in `labels`. `activation_hook` (x [T, D] -> x_hat [T, D])
    replaces the image-stream output of double block `block` (default the middle one) at every step.
    grad=True records the autograd graph (e.g. the images' sensitivity to what a hook adds).
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    labels = _labels_tensor(model, labels)
    generator = torch.Generator().manual_seed(int(seed))
    x = torch.randn(len(labels), model.tokens, model.token_values, generator=generator)
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    replacing = (replace_block_output(model.transformer, activation_hook, block, hook_whole_batch)
                 if activation_hook else nullcontext())
    with replacing, torch.set_grad_enabled(grad):
        for i in range(steps):
            velocity = model(x, sigmas[i].expand(len(labels)), labels)
            x = x + (sigmas[i + 1] - sigmas[i]) * velocity
    return ((model.unpack(x) + 1) / 2).clamp(0, 1)


def digits(side: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """The training data: scikit-learn's digits as (N, 1, side, side) float32 in [-1, 1] (8x8 upsampled
    bilinearly) and their labels."""
    import torch.nn.functional as F
    from sklearn.datasets import load_digits

    data = load_digits()
    images = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(side, side), mode="bilinear", align_corners=False)
    return images * 2 - 1, torch.tensor(data.target, dtype=torch.long)


def digit_classifier(side: int = 16):
    """A classifier of generated digits: logistic regression fit on the real digits (pixels in [0, 1]).
    `classify(clf, images)` labels images (B, 1, side, side) in [0, 1]."""
    from sklearn.linear_model import LogisticRegression

    images, labels = digits(side)
    return LogisticRegression(max_iter=2000).fit(((images + 1) / 2).flatten(1).numpy(), labels.numpy())


def classify(classifier, images: torch.Tensor) -> torch.Tensor:
    """The class digit_classifier() sees in each image (B, 1, H, W) in [0, 1]."""
    return torch.as_tensor(classifier.predict(images.detach().flatten(1).numpy()))


# ---------------------------------------------------------------- hooks on a double block (tiny and real)

def double_block_index(transformer, block: int | None = None) -> int:
    """`block`, checked, or the middle double block of a FluxTransformer2DModel."""
    count = len(transformer.transformer_blocks)
    index = count // 2 if block is None else int(block)
    if not 0 <= index < count:
        raise ValueError(f"double block {block} does not exist: this model has {count} (0..{count - 1})")
    return index


@contextmanager
def record_block_output(transformer, block: int | None = None):
    """Yields a list that receives the image-stream output [B, T, D] (a detached copy, CPU, model dtype)
    of double block `block` at each call, i.e. once per denoising step."""
    outputs: list[torch.Tensor] = []
    module = transformer.transformer_blocks[double_block_index(transformer, block)]
    # FluxTransformerBlock returns (encoder_hidden_states, hidden_states): [1] is the image stream
    handle = module.register_forward_hook(lambda _m, _a, out: outputs.append(out[1].detach().cpu().clone()))
    try:
        yield outputs
    finally:
        handle.remove()


@contextmanager
def replace_block_output(transformer, fn: Callable[[torch.Tensor], torch.Tensor], block: int | None = None,
                         whole_batch: bool = False):
    """While active, the image-stream output of double block `block` becomes fn(x): per batch item with
    x [T, D], or, with whole_batch, once per step with the batch's tokens stacked, x [B * T, D]."""
    module = transformer.transformer_blocks[double_block_index(transformer, block)]

    def replaced(x):
        x_hat = fn(x)
        if not isinstance(x_hat, torch.Tensor) or x_hat.shape != x.shape:
            got = tuple(x_hat.shape) if isinstance(x_hat, torch.Tensor) else type(x_hat).__name__
            raise InvalidTensorError(f"activation hook must return a tensor of shape {tuple(x.shape)} "
                                     f"[T tokens, D channels], got {got}")
        return x_hat.to(device=x.device, dtype=x.dtype)

    def hook(_module, _args, out):
        text_stream, image_stream = out
        if whole_batch:
            return text_stream, replaced(image_stream.reshape(-1, image_stream.shape[-1])).reshape(image_stream.shape)
        return text_stream, torch.stack([replaced(item) for item in image_stream])

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


# ---------------------------------------------------------------- captures

def capture_tiny_flux(model: TinyFlux | None = None, seeds: Iterable[int] = range(8),
                      classes: Iterable[int] = range(10), steps: int = 20, block: int | None = None,
                      root: str | Path | None = None) -> CaptureStore:
    """Record the image-stream output of double block `block` for every seed x class x step.

    One capture per (seed, class, step), key "seed{s}_class{c}_step{k:02d}", tensor "act" [T, D] float32.
    Each seed is one generate(model, classes, seed, steps) call, so a capture can be regenerated exactly.
    A finished store with the same metadata is reused, not recomputed.
    """
    from tqdm import tqdm

    model = model if model is not None else load_tiny_flux()
    checkpoint = getattr(model, "checkpoint_id", None)  # None: weights not from a file, never reuse
    seeds, classes = [int(s) for s in seeds], [int(c) for c in classes]
    index = double_block_index(model.transformer, block)
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    meta = {"model": TINY_FLUX_ID, "checkpoint": checkpoint or "in-memory", "block": index,
            "stream": "image", "steps": steps, "seeds": seeds, "classes": classes,
            "tokens": model.tokens, "channels": model.transformer.inner_dim}
    store = CaptureStore(root or f"tiny_flux_block{index}")
    if checkpoint and store.complete(meta):
        return store
    store.reset()
    for seed in tqdm(seeds, desc=f"capture tiny_flux block {index}", unit="seed"):
        with record_block_output(model.transformer, index) as outputs:
            generate(model, classes, seed, steps)
        for step, batch in enumerate(outputs):
            for position, label in enumerate(classes):
                store.write(f"seed{seed}_class{label}_step{step:02d}", {"act": batch[position]},
                            {"model": TINY_FLUX_ID, "block": index, "seed": seed, "class": label,
                             "step": step, "sigma": float(sigmas[step])})
    store.finish(meta)
    return store


# ---------------------------------------------------------------- the real FLUX path

def _hf_home() -> str:
    return os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))


def _missing_weights_message(model_id: str, cause: str) -> str:
    hub_id = model_id if _looks_like_hub_id(model_id) else DEFAULT_FLUX_ID
    return (f"FLUX weights for {model_id!r} are not available: {cause}. This machine reaches no model hub, "
            f"so provide them one of two ways: (1) pass a local folder in diffusers layout (model_index.json, "
            f"transformer/, vae/, text_encoder/, text_encoder_2/, tokenizer/, tokenizer_2/, scheduler/), "
            f"e.g. --model /data/FLUX.1-schnell; or (2) place the snapshot of a hub id such as {hub_id} in the "
            f"Hugging Face cache under HF_HOME={_hf_home()} (on a machine with network: `hf download {hub_id}`, "
            f"then copy the cache folder over). The embedded default --model {TINY_FLUX_ID} needs no download.")


def _looks_like_hub_id(model_id: str) -> bool:
    path = Path(model_id)
    return model_id.count("/") == 1 and not path.is_absolute() and not model_id.startswith((".", "~"))


def resolve_flux_folder(model_id: str, cache_dir: str | Path | None = None) -> Path:
    """The local diffusers folder for a model id or path, without touching the network.
    `cache_dir` overrides the Hugging Face hub cache (default: under HF_HOME)."""
    path = Path(model_id).expanduser()
    if path.is_dir():
        folder = path
    elif not _looks_like_hub_id(model_id):
        raise WeightsUnavailable(_missing_weights_message(model_id, f"no folder {path}"))
    else:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            folder = Path(snapshot_download(model_id, local_files_only=True, cache_dir=cache_dir))
        except LocalEntryNotFoundError:
            raise WeightsUnavailable(_missing_weights_message(
                model_id, f"not in the local Hugging Face cache ({cache_dir or _hf_home()})")) from None
    if not (folder / "model_index.json").exists():
        raise WeightsUnavailable(_missing_weights_message(model_id, f"{folder} has no model_index.json"))
    return folder


def load_flux_pipeline(model_id: str = DEFAULT_FLUX_ID, dtype: torch.dtype = torch.bfloat16,
                       device: str | None = None, cache_dir: str | Path | None = None):
    """A diffusers FluxPipeline from a local folder or the local cache; never downloads."""
    folder = resolve_flux_folder(model_id, cache_dir)
    from diffusers import FluxPipeline

    try:
        pipe = FluxPipeline.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as error:
        raise WeightsUnavailable(_missing_weights_message(
            model_id, f"{folder} is incomplete ({type(error).__name__}: {str(error)[:300]})")) from None
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return pipe.to(device)


def flux_pipeline_generate(pipe, prompt: str, seed: int, steps: int = 4, height: int = 512, width: int = 512,
                           activation_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
                           block: int | None = None, guidance_scale: float = 0.0) -> torch.Tensor:
    """One image (3, H, W) float in [0, 1] from the real pipeline; `activation_hook` as in generate().
    Guidance 0 suits FLUX.1-schnell; pass 3.5 for FLUX.1-dev."""
    replacing = (replace_block_output(pipe.transformer, activation_hook, block) if activation_hook
                 else nullcontext())
    generator = torch.Generator(device="cpu").manual_seed(int(seed))
    with replacing:
        images = pipe(prompt, num_inference_steps=steps, height=height, width=width, guidance_scale=guidance_scale,
                      generator=generator, max_sequence_length=256, output_type="pt").images
    return images[0].float().cpu()


def capture_flux_pipeline(pipe, prompts: list[str], seeds: Iterable[int] = range(2), steps: int = 4,
                          block: int | None = None, height: int = 512, width: int = 512,
                          model_id: str = DEFAULT_FLUX_ID, root: str | Path | None = None) -> CaptureStore:
    """The image-stream output of a FLUX double block per prompt x seed x step, as capture_tiny_flux.

    Keys "seed{s}_prompt{p:02d}_step{k:02d}", tensor "act" [T, D] in the pipeline's dtype (bf16).
    """
    from tqdm import tqdm

    seeds = [int(s) for s in seeds]
    index = double_block_index(pipe.transformer, block)
    meta = {"model": model_id, "block": index, "stream": "image", "steps": steps, "seeds": seeds,
            "prompts": list(prompts), "height": height, "width": width}
    store = CaptureStore(root or f"{Path(model_id).name.lower()}_block{index}")
    if store.complete(meta):
        return store
    store.reset()
    jobs = [(s, p) for s in seeds for p in range(len(prompts))]
    pipe.set_progress_bar_config(disable=True)  # one bar over all images instead of one per image
    for seed, p in tqdm(jobs, desc=f"capture {Path(model_id).name} block {index}", unit="image"):
        generator = torch.Generator(device="cpu").manual_seed(seed)
        with record_block_output(pipe.transformer, index) as outputs:
            pipe(prompts[p], num_inference_steps=steps, height=height, width=width, guidance_scale=0.0,
                 generator=generator, max_sequence_length=256, output_type="latent")
        for step, batch in enumerate(outputs):
            store.write(f"seed{seed}_prompt{p:02d}_step{step:02d}", {"act": batch[0]},
                        {"model": model_id, "block": index, "seed": seed, "prompt": prompts[p], "step": step})
    store.finish(meta)
    return store
