"""The embedded tiny FLUX model: the committed checkpoint loads, sampling is deterministic, captures
have the right names and shapes, the replace hook is exact for identity and bites otherwise, and the
real FLUX path fails offline with a message that says how to provide the weights."""
import json

import pytest
import torch

from shared.diffusion import (
    CHECKPOINT,
    WeightsUnavailable,
    capture_tiny_flux,
    generate,
    load_flux_pipeline,
    load_tiny_flux,
    record_block_output,
)
from shared.errors import InvalidTensorError, TensorCodecError

STEPS = 3  # Euler steps: enough to exercise every path, cheap on 2 cores


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(2)
    return load_tiny_flux()


def test_checkpoint_loads_as_a_flux_transformer_under_10_mb(model):
    from diffusers import FluxTransformer2DModel

    assert CHECKPOINT.stat().st_size < 10e6
    assert isinstance(model.transformer, FluxTransformer2DModel)
    assert len(model.transformer.transformer_blocks) >= 2 and len(model.transformer.single_transformer_blocks) >= 2
    assert model.transformer.inner_dim >= 128
    images = torch.rand(3, 1, model.image_side, model.image_side)
    assert torch.equal(model.unpack(model.pack(images)), images)


def test_generation_is_deterministic_for_a_seed(model):
    first = generate(model, [0, 7], seed=3, steps=STEPS)
    assert first.shape == (2, 1, 16, 16) and first.min() >= 0 and first.max() <= 1
    assert torch.equal(first, generate(model, [0, 7], seed=3, steps=STEPS))
    assert not torch.equal(first, generate(model, [0, 7], seed=4, steps=STEPS))


def test_capture_names_shapes_and_meta(model, tmp_path):
    store = capture_tiny_flux(model, seeds=[0, 1], classes=[2, 5], steps=STEPS, root=tmp_path / "caps")
    keys = store.keys()
    assert len(keys) == 2 * 2 * STEPS
    assert "seed1_class5_step02" in keys
    act = store.load("seed0_class2_step01")["act"]
    assert act.shape == (model.tokens, model.transformer.inner_dim) and act.dtype == torch.float32
    meta = json.loads((tmp_path / "caps" / "manifest.json").read_text())["meta"]
    assert meta["model"] == "tiny_flux" and meta["block"] == len(model.transformer.transformer_blocks) // 2 and meta["stream"] == "image"
    assert meta["seeds"] == [0, 1] and meta["classes"] == [2, 5] and meta["steps"] == STEPS
    # a capture is exactly what the block emits when that seed's batch is regenerated
    with record_block_output(model.transformer) as outputs:
        generate(model, [2, 5], seed=0, steps=STEPS)
    assert torch.equal(outputs[1][0], act)


def test_replace_hook_identity_is_exact_and_zeroing_changes_images(model):
    plain = generate(model, [1, 4], seed=0, steps=STEPS)
    seen = []
    identity = generate(model, [1, 4], seed=0, steps=STEPS, activation_hook=lambda x: seen.append(x.shape) or x)
    assert torch.equal(plain, identity)
    assert seen == [(model.tokens, model.transformer.inner_dim)] * (2 * STEPS)
    zeroed = generate(model, [1, 4], seed=0, steps=STEPS, activation_hook=torch.zeros_like)
    assert (zeroed - plain).abs().max() > 0.05


def test_whole_batch_hook_sees_the_stacked_batch_and_is_exact_for_identity(model):
    plain = generate(model, [1, 4], seed=0, steps=STEPS)
    seen = []
    identity = generate(model, [1, 4], seed=0, steps=STEPS, hook_whole_batch=True,
                        activation_hook=lambda x: seen.append(x.shape) or x)
    assert torch.equal(plain, identity)
    assert seen == [(2 * model.tokens, model.transformer.inner_dim)] * STEPS


def test_grad_generation_gives_the_images_sensitivity_and_the_default_records_none(model):
    delta = torch.zeros(2 * model.tokens, model.transformer.inner_dim, requires_grad=True)
    model.requires_grad_(False)
    images = generate(model, [1, 4], seed=0, steps=STEPS, hook_whole_batch=True, grad=True,
                      activation_hook=lambda x: x + delta)
    (g,) = torch.autograd.grad(images.sum(), delta)
    assert g.shape == delta.shape and g.abs().max() > 0
    assert torch.equal(images.detach(), generate(model, [1, 4], seed=0, steps=STEPS))  # adding zero changes nothing
    assert not generate(model, [1, 4], seed=0, steps=STEPS, hook_whole_batch=True,
                        activation_hook=lambda x: x + delta).requires_grad


def test_digit_classifier_labels_generated_digits_as_asked(model):
    from shared.diffusion import classify, digit_classifier, digits

    images, labels = digits()
    assert images.shape == (1797, 1, 16, 16) and images.min() >= -1 and images.max() <= 1
    classifier = digit_classifier()
    samples = generate(model, range(10), seed=0, steps=10)
    assert (classify(classifier, samples) == torch.arange(10)).float().mean() >= 0.7
    assert (classify(classifier, torch.zeros(10, 1, 16, 16)) == torch.arange(10)).float().mean() <= 0.2


def test_replace_hook_rejects_a_wrong_shape(model):
    with pytest.raises(InvalidTensorError, match="shape"):
        generate(model, [0], seed=0, steps=1, activation_hook=lambda x: x[:, :10])


def test_bad_labels_and_blocks_are_named(model):
    with pytest.raises(ValueError, match="0..9"):
        generate(model, [10], seed=0, steps=1)
    with pytest.raises(ValueError, match="double block 7"):
        generate(model, [0], seed=0, steps=1, activation_hook=lambda x: x, block=7)


def test_real_flux_path_offline_says_how_to_provide_weights(tmp_path):
    for model_id in ("black-forest-labs/FLUX.1-schnell", str(tmp_path / "no_such_folder")):
        with pytest.raises(WeightsUnavailable) as caught:
            load_flux_pipeline(model_id, cache_dir=tmp_path / "empty_cache")
        assert isinstance(caught.value, TensorCodecError) and isinstance(caught.value, FileNotFoundError)
        message = str(caught.value)
        assert "local folder" in message and "HF_HOME" in message and "tiny_flux" in message
        error = caught.value  # no chained hub traceback underneath
        assert error.__cause__ is None and (error.__context__ is None or error.__suppress_context__)
    (tmp_path / "not_diffusers").mkdir()
    with pytest.raises(WeightsUnavailable, match="model_index.json"):
        load_flux_pipeline(str(tmp_path / "not_diffusers"))


def tiny_random_flux_pipeline():
    """A FluxPipeline of the real diffusers classes, built here with random weights and word-level
    tokenizers: it exercises the real-path code (prompt encoders, scheduler, VAE) with no download."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast, T5Config, T5EncoderModel

    def word_tokenizer(max_length):
        vocab = {"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate("a photo of cat dog red".split())}}
        tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>",
                                       model_max_length=max_length)

    torch.manual_seed(0)
    clip = CLIPTextModel(CLIPTextConfig(vocab_size=16, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
                                        num_attention_heads=4, max_position_embeddings=77, bos_token_id=0,
                                        eos_token_id=1, pad_token_id=0))
    t5 = T5EncoderModel(T5Config(vocab_size=16, d_model=32, d_ff=37, d_kv=8, num_layers=1, num_heads=4))
    vae = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(4, 4), latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        norm_num_groups=1, layers_per_block=1, shift_factor=0.0, scaling_factor=1.0)
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=3, num_single_layers=1,
                                         attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                         pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    for module in (clip, t5, vae, transformer):
        module.eval()  # built, not loaded: switch dropout off as from_pretrained would
    return FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip,
                        tokenizer=word_tokenizer(77), text_encoder_2=t5, tokenizer_2=word_tokenizer(256),
                        transformer=transformer)


def test_real_pipeline_path_captures_and_replaces_the_same_stream(tmp_path):
    from shared.diffusion import capture_flux_pipeline, flux_pipeline_generate

    pipe = tiny_random_flux_pipeline()
    store = capture_flux_pipeline(pipe, ["a photo of a cat", "a red dog"], seeds=[0], steps=2, height=32,
                                  width=32, model_id="local/tiny-random-flux", root=tmp_path / "caps")
    assert store.keys() == ["seed0_prompt00_step00", "seed0_prompt00_step01",
                            "seed0_prompt01_step00", "seed0_prompt01_step01"]
    assert store.load("seed0_prompt01_step01")["act"].shape == (8 * 8, 32)  # 32x32 px -> 16x16 latent -> 8x8 packed tokens
    meta = json.loads((tmp_path / "caps" / "manifest.json").read_text())["meta"]
    assert meta["block"] == 1 and meta["stream"] == "image" and meta["steps"] == 2

    plain = flux_pipeline_generate(pipe, "a photo of a cat", seed=0, steps=2, height=32, width=32)
    assert plain.shape == (3, 32, 32)
    same = flux_pipeline_generate(pipe, "a photo of a cat", seed=0, steps=2, height=32, width=32,
                                  activation_hook=lambda x: x)
    assert torch.equal(plain, same)
    zeroed = flux_pipeline_generate(pipe, "a photo of a cat", seed=0, steps=2, height=32, width=32,
                                    activation_hook=torch.zeros_like)
    assert (zeroed - plain).abs().max() > 0.01

    # the same pipeline saved to a local folder loads through load_flux_pipeline and gives the same image
    pipe.save_pretrained(tmp_path / "folder")
    loaded = load_flux_pipeline(str(tmp_path / "folder"), dtype=torch.float32, device="cpu")
    assert torch.equal(flux_pipeline_generate(loaded, "a photo of a cat", seed=0, steps=2, height=32, width=32),
                       plain)
    import shutil

    shutil.rmtree(tmp_path / "folder" / "transformer")
    with pytest.raises(WeightsUnavailable, match="incomplete"):
        load_flux_pipeline(str(tmp_path / "folder"), dtype=torch.float32, device="cpu")
