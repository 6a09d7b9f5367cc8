"""Tiny models of the Hub clients other than transformers' causal LMs, written with the
libraries themselves, for tests and recipes that load them by repo id: a DDPM pipeline
(diffusers: components in subfolders) and a sentence-transformers model (a small BERT
and its pooling module in ``1_Pooling/``). Weights are random, seeded."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any


def write_tiny_ddpm(folder: Path) -> dict[str, bytes]:
    """A DDPM pipeline (``model_index.json``, ``unet/``, ``scheduler/``) of 8x8 images;
    its files by repo path."""
    import torch

    diffusers = _untyped("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DModel(
        sample_size=8,
        in_channels=3,
        out_channels=3,
        layers_per_block=1,
        block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        norm_num_groups=4,
    )
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=10)
    diffusers.DDPMPipeline(unet=unet, scheduler=scheduler).save_pretrained(folder)
    return _files(folder)


def write_tiny_sentence_transformer(folder: Path) -> dict[str, bytes]:
    """A sentence-transformers model: a one-layer BERT (64 wide, a 33-word vocabulary)
    and mean pooling; its files by repo path."""
    import torch

    st, transformers = _untyped("sentence_transformers"), _untyped("transformers")
    torch.manual_seed(0)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]
    words += [chr(c) for c in range(ord("a"), ord("z") + 1)]
    parts = folder.parent / f"{folder.name}-parts"
    parts.mkdir(parents=True, exist_ok=True)
    (parts / "vocab.txt").write_text("\n".join(words))
    tokenizer = transformers.BertTokenizerFast(vocab_file=str(parts / "vocab.txt"))
    config = transformers.BertConfig(vocab_size=len(words), hidden_size=64, num_hidden_layers=1,
                        num_attention_heads=1, intermediate_size=64,
                        max_position_embeddings=64)  # fmt: skip
    transformers.BertModel(config).save_pretrained(parts)
    tokenizer.save_pretrained(parts)
    models = _untyped("sentence_transformers.sentence_transformer.modules")
    word = models.Transformer(str(parts))
    st.SentenceTransformer(modules=[word, models.Pooling(64)]).save(str(folder))
    return _files(folder)


def _untyped(name: str) -> Any:
    """A library whose stubs mypy cannot follow here (its classes are made dynamically)."""
    return importlib.import_module(name)


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }
