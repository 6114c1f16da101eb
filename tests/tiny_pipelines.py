"""Real diffusers pipelines of tiny components built from configs (no downloads), shared by
tests/test_pipeline.py and tests/test_docs.py: Flux, Wan and SD3 with tiny text encoders and
tokenizers written to a folder or built in memory."""
from __future__ import annotations

import json
from pathlib import Path

import torch

WORDS = ("a", "photo", "of", "cat")  # the word-level tokenizers' vocabulary (the prompt's words)
PROMPT = "a photo of a cat"
FLUX_CALL = dict(height=16, width=16, num_inference_steps=2, max_sequence_length=8, output_type="pt")


def clip_tokenizer(folder: Path, max_length: int = 16):
    """A CLIPTokenizer of a character-level vocabulary written to ``folder``."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in (chr(c) for c in range(ord("a"), ord("z") + 1)):
        vocab[c], vocab[c + "</w>"] = len(vocab), len(vocab) + 1
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=max_length)


def t5_tokenizer():
    """A T5TokenizerFast over a word-level vocabulary of :data:`WORDS` (no file)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import T5TokenizerFast

    words = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    word_level = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    return T5TokenizerFast(tokenizer_object=word_level, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                           extra_ids=0)


def tiny_clip(vocab_size: int, **kw):
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(CLIPTextConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16,
                                        projection_dim=16, **kw)).eval()


def tiny_t5(vocab_size: int, d_model: int = 32):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=4)).eval()


def tiny_vae(**kw):
    from diffusers import AutoencoderKL

    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8),
                         down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                         norm_num_groups=8, layers_per_block=1, sample_size=16, shift_factor=0.0,
                         scaling_factor=1.0, **kw).eval()


def tiny_flux_pipeline(folder: Path):
    """FluxPipeline of tiny components from configs; character-level CLIP vocabulary, word-level T5."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline

    from weightstream.models import tiny_flux

    clip_tok = clip_tokenizer(folder)
    t5_tok = t5_tokenizer()
    torch.manual_seed(0)
    clip = tiny_clip(len(clip_tok.get_vocab()))
    t5 = tiny_t5(len(t5_tok.get_vocab()))
    pipe = FluxPipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=tiny_vae(), text_encoder=clip,
                        tokenizer=clip_tok, text_encoder_2=t5, tokenizer_2=t5_tok, transformer=tiny_flux())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe):
    """The tiny Flux pipeline's image for :data:`PROMPT` (seeded)."""
    return pipe(PROMPT, generator=torch.Generator().manual_seed(0), **FLUX_CALL).images


def reload(pipe, folder: Path):
    """``type(pipe).from_pretrained`` of a saved folder. The word-level T5 tokenizer does not survive
    transformers' save / load (it reloads as a Unigram one), so that one object is passed."""
    back = type(pipe).from_pretrained(str(folder), tokenizer_2=pipe.tokenizer_2)
    back.set_progress_bar_config(disable=True)
    return back


def tiny_sd3_pipeline(folder: Path):
    """StableDiffusion3Pipeline of tiny components from configs: a tiny SD3Transformer2DModel, two
    CLIP text encoders with projection (character-level vocabulary, written to ``folder``), a T5
    encoder (word-level tokenizer), a VAE. Widths follow SD3's joins: the two CLIP hidden states
    side by side fill the T5 width (joint_attention_dim), their projections the pooled width."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from weightstream.models import tiny_sd3

    clip_tok = clip_tokenizer(folder)
    t5_tok = t5_tokenizer()
    torch.manual_seed(0)
    transformer = tiny_sd3()  # joint_attention_dim 16, pooled_projection_dim 8
    cfg = transformer.config
    clips = [CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=len(clip_tok.get_vocab()), hidden_size=cfg.joint_attention_dim // 2, intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16,
        projection_dim=cfg.pooled_projection_dim // 2)).eval() for _ in range(2)]
    t5 = tiny_t5(len(t5_tok.get_vocab()), d_model=cfg.joint_attention_dim)
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(),
                                    vae=tiny_vae(), text_encoder=clips[0], tokenizer=clip_tok,
                                    text_encoder_2=clips[1], tokenizer_2=clip_tok, text_encoder_3=t5,
                                    tokenizer_3=t5_tok)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate_sd3(pipe):
    """The tiny SD3 pipeline's image for :data:`PROMPT` (seeded; classifier-free guidance on)."""
    return pipe(PROMPT, generator=torch.Generator().manual_seed(0), height=16, width=16, num_inference_steps=2,
                max_sequence_length=8, output_type="pt").images


def reload_sd3(pipe, folder: Path):
    """StableDiffusion3Pipeline.from_pretrained of a saved folder (the word-level T5 tokenizer passed, see
    :func:`reload`)."""
    back = type(pipe).from_pretrained(str(folder), tokenizer_3=pipe.tokenizer_3)
    back.set_progress_bar_config(disable=True)
    return back
