"""Real diffusers pipelines built from configs (Flux, Wan, SD3: tiny transformers, CLIP and T5 text
encoders, VAEs, tokenizers written to a folder or built here; no downloads; tests/tiny_pipelines.py),
the way a user walks them: offload, generate, save, reload, generate; and what the pipeline entry
points refuse."""
import copy
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from tiny_pipelines import generate, reload, t5_tokenizer, tiny_flux_pipeline  # noqa: E402
from weightstream import OffloadConfig, OffloadedTransformer, offload_pipeline  # noqa: E402
from weightstream.offload.misuse import AlreadyOffloadedError  # noqa: E402


@pytest.fixture
def pipe(tmp_path):
    return tiny_flux_pipeline(tmp_path)


def test_the_wrapper_on_a_pipeline_saves_and_reloads_bit_for_bit(pipe, tmp_path):
    from diffusers import FluxTransformer2DModel

    expected = generate(pipe)
    pipe.transformer = OffloadedTransformer(pipe.transformer, OffloadConfig.layerwise(progress=False), device="cpu")
    assert pipe.config["transformer"] == ("diffusers", "FluxTransformer2DModel")  # model_index.json's entry
    assert isinstance(pipe.transformer, FluxTransformer2DModel) and type(pipe.transformer) is OffloadedTransformer
    assert repr(pipe.transformer).startswith("OffloadedTransformer(")
    assert pipe.components["transformer"] is pipe.transformer
    assert torch.equal(generate(pipe), expected)
    pipe.save_pretrained(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "model_index.json").read_text())
    assert saved["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    back = reload(pipe, tmp_path / "saved")
    assert type(back.transformer) is FluxTransformer2DModel
    want = pipe.transformer.state_dict()
    got = back.transformer.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(generate(back), expected)
    # the reloaded pipeline offloads again, and still gives the same image
    back.transformer = OffloadedTransformer(back.transformer, OffloadConfig.layerwise(progress=False), device="cpu")
    assert torch.equal(generate(back), expected)


def test_layer_mode_pipeline_saves_and_reloads_bit_for_bit(pipe, tmp_path):
    expected = generate(pipe)
    handle = offload_pipeline(pipe, {"mode": "layer", "components": ["dit", "text_encoder"], "progress": False},
                              device="cpu")
    assert torch.equal(generate(pipe), expected)
    pipe.save_pretrained(str(tmp_path / "saved"))
    back = reload(pipe, tmp_path / "saved")
    assert torch.equal(generate(back), expected)
    offload_pipeline(back, {"mode": "layer", "components": ["dit", "text_encoder"], "progress": False},
                     device="cpu")
    assert torch.equal(generate(back), expected)
    assert handle.disable() is pipe


def test_module_mode_pipeline_saves_and_reloads_bit_for_bit(pipe, tmp_path):
    expected = generate(pipe)
    handle = offload_pipeline(pipe, {"mode": "module", "components": ["dit", "text_encoder"]}, device="cpu")
    assert torch.equal(generate(pipe), expected)
    pipe.save_pretrained(str(tmp_path / "saved"))
    assert torch.equal(generate(reload(pipe, tmp_path / "saved")), expected)
    handle.disable()


@pytest.mark.parametrize("mode", ["module", "layer"])
def test_a_pipeline_under_enable_model_cpu_offload_is_refused(pipe, mode):
    pytest.importorskip("accelerate")
    pipe.enable_model_cpu_offload(device="cpu")
    with pytest.raises(AlreadyOffloadedError, match="enable_model_cpu_offload") as e:
        offload_pipeline(pipe, {"mode": mode, "components": ["dit", "text_encoder"]}, device="cpu")
    assert "remove_all_hooks()" in str(e.value)
    pipe.remove_all_hooks()  # what the error says to do; then it offloads
    handle = offload_pipeline(pipe, {"mode": mode, "components": ["dit", "text_encoder"]}, device="cpu")
    handle.disable()


def test_a_typo_keyword_to_offload_pipeline_names_the_allowed_ones(pipe):
    from weightstream.offload.config import ConfigTypeError

    with pytest.raises(ConfigTypeError, match=r"unknown keyword 'devcie', which is not allowed; choose from: "
                                              r"device, config") as e:
        offload_pipeline(pipe, {"mode": "layer"}, devcie="cpu")
    assert isinstance(e.value, TypeError)  # as Python's own
    with pytest.raises(ConfigTypeError, match="config fields such as num_slots go in the config"):
        offload_pipeline(pipe, num_slots=3)


@pytest.mark.parametrize("mode", ["module", "layer"])
def test_budget_errors_speak_the_configs_unit(pipe, mode):
    """device_memory_budget_gb means 1e9 bytes: the messages give decimal units, never GiB / MiB."""
    cfg = {"mode": mode, "components": ["dit", "text_encoder"], "device_memory_budget_gb": 1e-5}
    with pytest.raises(ValueError, match="device_memory_budget_gb=1e-05 is too small") as e:
        offload_pipeline(pipe, cfg, device="cpu")
    assert "iB" not in str(e.value) and " KB" in str(e.value), str(e.value)


def test_pipeline_calls_on_the_wrapper_work_or_name_the_error(pipe):
    from weightstream.offload.misuse import UnsupportedOperationError

    expected = generate(pipe)
    pipe.transformer = OffloadedTransformer(pipe.transformer, OffloadConfig.layerwise(progress=False), device="cpu")
    assert pipe.to("cpu") is pipe  # the device it runs on: a no-op
    assert torch.equal(generate(pipe), expected)
    with pytest.raises(UnsupportedOperationError, match=r"\.to\(torch.bfloat16\) on an OffloadedTransformer"):
        pipe.to(torch.bfloat16)


@pytest.mark.parametrize("mode", ["layer", "module"])
def test_pipeline_casts_and_moves_after_offload_pipeline_are_refused_by_name(pipe, mode):
    """pipe.to(...) after offload_pipeline: to the device it runs on, a no-op (the next image bit for
    bit); a cast or a move elsewhere, the wrapper's UnsupportedOperationError naming what to do
    (never a StreamedModuleAccessError, a raw torch error or a silent cast); disable() gives the
    plain modules back, which cast as usual."""
    from weightstream.offload.misuse import UnsupportedOperationError

    expected = generate(pipe)
    handle = offload_pipeline(pipe, {"mode": mode, "components": ["dit", "text_encoder"], "progress": False},
                              device="cpu")
    assert pipe.to("cpu") is pipe and pipe.to(torch.float32) is pipe
    assert torch.equal(generate(pipe), expected)
    for arg, what in ((torch.bfloat16, r"\.to\(torch.bfloat16\)"), ("cuda", r"\.to\(cuda\)")):
        with pytest.raises(UnsupportedOperationError, match=what + r" on \w+ streamed by offload_pipeline.*"
                                                                r"handle.disable\(\) gives the plain module back"):
            pipe.to(arg)
    with pytest.raises(UnsupportedOperationError, match=r"\.half\(\)"):
        pipe.transformer.half()
    assert torch.equal(generate(pipe), expected)  # the refusals cast nothing that streams
    handle.disable()
    assert all("to" not in m.__dict__ and "_apply" not in m.__dict__ for m in pipe.components.values()
               if isinstance(m, torch.nn.Module))
    assert pipe.transformer.to(torch.bfloat16).dtype == torch.bfloat16  # plain modules again


@pytest.mark.parametrize("codec", ["none", "exp-k"])
@pytest.mark.parametrize("components", [["dit"], ["dit", "text_encoder"]])
def test_module_mode_uses_a_state_dict_edit_at_the_next_generation(pipe, codec, components):
    """Issue 36's stale read, in module mode: a component that stays on the device between
    generations (the only swapped one) kept its device copy after an in-place edit of a
    state_dict() tensor, which state_dict() showed; now its next call makes the copy again."""
    resident = copy.deepcopy(pipe)
    handle = offload_pipeline(pipe, {"mode": "module", "components": components, "weight_codec": codec}, device="cpu")
    assert torch.equal(generate(pipe), generate(resident))
    key = "transformer_blocks.0.attn.to_q.weight"
    with torch.no_grad():
        pipe.transformer.state_dict()[key].add_(0.25)
        resident.transformer.state_dict()[key].add_(0.25)
    assert torch.equal(pipe.transformer.state_dict()[key], resident.transformer.state_dict()[key])
    expected = generate(resident)
    assert all(torch.equal(generate(pipe), expected) for _ in range(2))
    assert "host edit" in {e.cause for e in handle.events} or len(components) > 1  # the DiT alone: made again
    handle.disable()


def tiny_wan_pipeline():
    """WanPipeline of tiny components from configs: tiny Wan, a UMT5 encoder, a Wan VAE, a word-level tokenizer."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    from weightstream.models import tiny_wan

    tokenizer = t5_tokenizer()
    torch.manual_seed(0)
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer.get_vocab()), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                          num_heads=4)).eval()
    vae = AutoencoderKLWan(base_dim=3, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                           latents_std=[1.0] * 4).eval()
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=encoder, transformer=tiny_wan(), vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate_wan(pipe):
    return pipe("a photo of a cat", generator=torch.Generator().manual_seed(0), height=16, width=16, num_frames=5,
                num_inference_steps=2, max_sequence_length=8, guidance_scale=1.0, output_type="pt").frames


def reload_wan(folder: Path, tokenizer):
    from diffusers import WanPipeline

    back = WanPipeline.from_pretrained(str(folder), tokenizer=tokenizer)
    back.set_progress_bar_config(disable=True)
    return back


@pytest.mark.parametrize("entry", ["wrapper", "layer"])
def test_a_wan_pipeline_offloads_saves_and_reloads_bit_for_bit(tmp_path, entry):
    """A reloaded Wan pipeline does not repeat the in-memory one bit for bit even without weightstream
    (diffusers' configs reload with defaults filled in), so the yardstick is the plain pipeline's own
    save and reload: the offloaded pipeline's saved folder must reload to exactly that."""
    pipe = tiny_wan_pipeline()
    expected = generate_wan(pipe)
    pipe.save_pretrained(str(tmp_path / "plain"))
    expected_reloaded = generate_wan(reload_wan(tmp_path / "plain", pipe.tokenizer))
    if entry == "wrapper":
        pipe.transformer = OffloadedTransformer(pipe.transformer, OffloadConfig.layerwise(progress=False),
                                                device="cpu")
    else:
        offload_pipeline(pipe, {"mode": "layer", "components": ["dit", "text_encoder"], "progress": False},
                         device="cpu")
    assert torch.equal(generate_wan(pipe), expected)
    pipe.save_pretrained(str(tmp_path / "offloaded"))
    assert torch.equal(generate_wan(reload_wan(tmp_path / "offloaded", pipe.tokenizer)), expected_reloaded)


@pytest.mark.parametrize("entry", ["wrapper", "layer", "module"])
def test_an_sd3_pipeline_offloads_saves_and_reloads_bit_for_bit(tmp_path, entry):
    """StableDiffusion3Pipeline from configs (tiny SD3 transformer, two CLIP encoders with projection,
    a T5 encoder, tokenizers built here): offload -> generate -> save -> reload -> generate. As for Wan,
    a reloaded pipeline does not repeat the in-memory one bit for bit even without weightstream, so
    the saved folder must reload to exactly what the plain pipeline's own save and reload gives."""
    from diffusers import SD3Transformer2DModel

    from tiny_pipelines import generate_sd3, reload_sd3, tiny_sd3_pipeline

    pipe = tiny_sd3_pipeline(tmp_path)
    expected = generate_sd3(pipe)
    pipe.save_pretrained(str(tmp_path / "plain"))
    expected_reloaded = generate_sd3(reload_sd3(pipe, tmp_path / "plain"))
    components = ["dit", "text_encoder"]  # the transformer and all three text encoders
    if entry == "wrapper":
        pipe.transformer = OffloadedTransformer(pipe.transformer, OffloadConfig.layerwise(progress=False),
                                                device="cpu")
    else:
        handle = offload_pipeline(pipe, {"mode": entry, "components": components, "progress": False}, device="cpu")
        assert entry == "module" or set(handle.wrapped) == {"transformer", "text_encoder", "text_encoder_2",
                                                            "text_encoder_3"}, handle
    assert torch.equal(generate_sd3(pipe), expected)
    pipe.save_pretrained(str(tmp_path / "offloaded"))
    back = reload_sd3(pipe, tmp_path / "offloaded")
    assert type(back.transformer) is SD3Transformer2DModel
    want = pipe.transformer.state_dict()
    got = back.transformer.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(generate_sd3(back), expected_reloaded)
    assert torch.equal(generate_sd3(pipe), expected)  # the offloaded pipeline still generates the same
