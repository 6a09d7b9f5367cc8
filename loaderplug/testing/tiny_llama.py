"""A tiny random Llama, written offline as a real Hugging Face model folder.

``write_tiny_llama`` builds it from scratch (no network): fp32 weights split over a few
safetensors shards with ``model.safetensors.index.json``, ``config.json``,
``generation_config.json`` and a word-level tokenizer. Small enough for vLLM on a CPU
(head_dim 64, the least its CPU attention takes) and identical byte for byte for a seed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Special tokens first, so their ids match the config's bos/eos/pad ids.
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)

# Plain words after the specials: 137 tokens in all, the model's whole vocabulary.
WORDS = [
    "hello",
    "world",
    "the",
    "a",
    "an",
    "and",
    "or",
    "but",
    "not",
    "is",
    "are",
    "was",
    "were",
    "be",
    "been",
    "to",
    "of",
    "in",
    "on",
    "at",
    "by",
    "for",
    "with",
    "from",
    "up",
    "down",
    "over",
    "under",
    "into",
    "out",
    "about",
    "after",
    "before",
    "again",
    "once",
    "here",
    "there",
    "when",
    "where",
    "why",
    "how",
    "all",
    "any",
    "both",
    "each",
    "few",
    "more",
    "most",
    "other",
    "some",
    "such",
    "no",
    "nor",
    "only",
    "own",
    "same",
    "so",
    "than",
    "too",
    "very",
    "can",
    "will",
    "just",
    "now",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "red",
    "green",
    "blue",
    "black",
    "white",
    "cat",
    "dog",
    "bird",
    "fish",
    "tree",
    "house",
    "car",
    "road",
    "city",
    "river",
    "sea",
    "sky",
    "sun",
    "moon",
    "star",
    "rain",
    "snow",
    "wind",
    "fire",
    "stone",
    "water",
    "light",
    "dark",
    "day",
    "night",
    "time",
    "year",
    "good",
    "bad",
    "new",
    "old",
    "big",
    "small",
    "long",
    "short",
    "high",
    "low",
    "fast",
    "slow",
    "hot",
    "cold",
    "warm",
    "open",
    "close",
    "read",
    "write",
    "load",
    "save",
    "run",
    "stop",
    "go",
    "come",
    "see",
    "make",
]

HIDDEN = 128
HEADS = 2
KV_HEADS = 2
HEAD_DIM = 64
LAYERS = 2
INTERMEDIATE = 256
MAX_POSITIONS = 256
INIT_STD = 0.02


def vocabulary() -> dict[str, int]:
    """Token -> id for the tokenizer; ids are dense from 0."""
    tokens = SPECIALS + WORDS
    if len(set(tokens)) != len(tokens):
        raise AssertionError("duplicate words in the tiny vocabulary")
    return {token: i for i, token in enumerate(tokens)}


def _config(
    vocab_size: int,
    hidden_size: int = HIDDEN,
    num_layers: int = LAYERS,
    intermediate_size: int = INTERMEDIATE,
) -> Any:
    from transformers import LlamaConfig

    # Heads of HEAD_DIM each, as many key/value heads as query heads (2 and 2 by default).
    heads = hidden_size // HEAD_DIM
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITIONS,
        initializer_range=INIT_STD,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        architectures=["LlamaForCausalLM"],
        dtype="float32",
    )


def _weights(config: Any, seed: int) -> dict[str, Any]:
    """Every tensor the model expects, drawn from one seeded generator in name order."""
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        shapes = {name: p.shape for name, p in LlamaForCausalLM(config).state_dict().items()}  # type: ignore[no-untyped-call]
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name in sorted(shapes):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shapes[name], dtype=torch.float32)
        else:
            weights[name] = torch.empty(shapes[name], dtype=torch.float32).normal_(
                0.0, INIT_STD, generator=generator
            )
    return weights


def _tokenizer(vocab: dict[str, int]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    # Words carry no spaces; the WordPiece decoder joins them with one.
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def write_tiny_llama(
    folder: Path,
    *,
    shards: int = 3,
    seed: int = 0,
    hidden_size: int = HIDDEN,
    num_layers: int = LAYERS,
    intermediate_size: int = INTERMEDIATE,
) -> list[Path]:
    """Write a tiny random ``LlamaForCausalLM`` into ``folder``; return its shard paths.

    The weights (about 1.4 MB of float32 with the default sizes) are split over ``shards``
    safetensors files of roughly equal size, named as ``save_pretrained`` names them, with
    the index beside. ``hidden_size`` (a multiple of 64: heads of 64), ``num_layers`` and
    ``intermediate_size`` make a bigger model of the same kind (benchmarks/vllm_bench.py:
    1024, 16 and 4096 give about 1 GiB); the defaults write the tiny model, byte for byte.
    """
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    if shards < 1:
        raise ValueError("shards must be at least 1")
    if hidden_size < HEAD_DIM or hidden_size % HEAD_DIM:
        raise ValueError(f"hidden_size must be a positive multiple of {HEAD_DIM}")
    folder.mkdir(parents=True, exist_ok=True)
    vocab = vocabulary()
    config = _config(len(vocab), hidden_size, num_layers, intermediate_size)
    weights = _weights(config, seed)
    names = sorted(weights)
    if shards > len(names):
        raise ValueError(f"at most {len(names)} shards")
    sizes = {name: weights[name].numel() * weights[name].element_size() for name in names}
    groups = _split_by_bytes(names, sizes, shards)

    paths: list[Path] = []
    weight_map: dict[str, str] = {}
    for index, group in enumerate(groups):
        filename = (
            "model.safetensors"
            if shards == 1
            else f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        )
        path = folder / filename
        save_file({name: weights[name] for name in group}, str(path), metadata={"format": "pt"})
        paths.append(path)
        weight_map.update(dict.fromkeys(group, filename))

    if shards > 1:
        index_doc = {
            "metadata": {"total_size": sum(sizes.values())},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2))

    config.save_pretrained(str(folder))
    GenerationConfig(  # type: ignore[no-untyped-call]
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    ).save_pretrained(str(folder))
    _tokenizer(vocab).save_pretrained(str(folder))
    return paths


def _split_by_bytes(names: list[str], sizes: dict[str, int], shards: int) -> list[list[str]]:
    """Greedy split by bytes in name order: each shard takes its share of what is left."""
    groups: list[list[str]] = []
    rest = list(names)
    for index in range(shards):
        left = shards - index
        if left == 1:
            groups.append(rest)
            break
        target = sum(sizes[n] for n in rest) / left
        group: list[str] = []
        while (
            rest and len(rest) > left - 1 and (not group or sum(sizes[n] for n in group) < target)
        ):
            group.append(rest.pop(0))
        groups.append(group)
    return groups
