"""A tiny, offline fine-tuning example: chat data in JSONL, a byte-level BPE tokenizer with a ChatML chat
template trained on it, and a tiny random Hugging Face model, all written with ``save_pretrained`` into one
directory. Nothing is downloaded: a stand-in for "your model directory and your data".

Command line (``python -m lightning_4d.data example-chat --out DIR``) or :func:`write_chat_example`.

Example:
    >>> conversations(2)[0]["messages"][1]
    {'role': 'assistant', 'content': 'The kettle is green.'}
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Union

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedTokenizerFast

__all__ = ["CHATML_TEMPLATE", "MODELS", "conversations", "tiny_chat_tokenizer", "write_chat_example"]

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The ChatML template (Qwen's, without tools): each turn ``<|im_start|>role\\ncontent<|im_end|>\\n``."""
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MODELS = ("qwen3_moe", "llama")
"""Model families :func:`write_chat_example` writes."""

_THINGS = ("kettle", "lamp", "door", "boat", "kite", "chair", "shirt", "cup", "book", "bike", "tent", "ball")
_COLOURS = ("green", "red", "blue", "yellow", "white", "black")
_SYSTEM = "You answer in one short sentence."


def conversations(n: int, seed: int = 0) -> list[dict[str, list[dict[str, str]]]]:
    """``n`` deterministic conversations ``{"messages": [system?, user, assistant]}`` with a learnable answer
    (each thing has a fixed colour); every third has a system turn.

    Example:
        >>> [m["role"] for m in conversations(3)[0]["messages"]]
        ['user', 'assistant']
    """
    out = []
    for i in range(n):
        j = (i * 7 + seed) % len(_THINGS)
        thing, colour = _THINGS[j], _COLOURS[j % len(_COLOURS)]
        messages = [{"role": "user", "content": f"What colour is the {thing}?"},
                    {"role": "assistant", "content": f"The {thing} is {colour}."}]
        if i % 3 == 2:
            messages.insert(0, {"role": "system", "content": _SYSTEM})
        out.append({"messages": messages})
    return out


def tiny_chat_tokenizer(texts: list[str], vocab_size: int = 384) -> PreTrainedTokenizerFast:
    """A byte-level BPE ``transformers`` tokenizer trained on ``texts`` (any text still encodes: all 256 bytes
    are in the vocabulary), with ChatML special tokens, ``<|im_end|>`` as EOS, ``<|endoftext|>`` as padding and
    :data:`CHATML_TEMPLATE`.

    Example:
        >>> tok = tiny_chat_tokenizer(["hello world"] * 4)
        >>> tok.eos_token, tok.decode(tok("héllo")["input_ids"])
        ('<|im_end|>', 'héllo')
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML_TEMPLATE
    return tok


def _model_config(family: str, vocab_size: int, eos: int, pad: int) -> PreTrainedConfig:
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, eos_token_id=eos,
                  pad_token_id=pad, bos_token_id=None, tie_word_embeddings=False)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                           moe_intermediate_size=64)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    raise ValueError(f"model={family!r} is not one of {', '.join(MODELS)}")


def write_chat_example(out: Union[str, "os.PathLike[str]"], model: str = "qwen3_moe", n: int = 256,
                       seed: int = 0) -> dict[str, Path]:
    """Write ``out/chat.jsonl`` (``n`` conversations), and into ``out/``: a tokenizer trained on them and a tiny
    random ``model`` (``qwen3_moe``: 4 experts, top-2; ``llama``), both with ``save_pretrained``.

    Returns:
        ``{"model": out, "data": out/chat.jsonl}``.

    Example:
        >>> # not run: needs files (writes a model directory)
        >>> paths = write_chat_example("tiny-qwen3-moe")  # doctest: +SKIP
        >>> sorted(p.name for p in paths["model"].iterdir())  # doctest: +SKIP
        ['chat.jsonl', 'chat_template.jinja', 'config.json', 'generation_config.json', 'model.safetensors', ...]
    """
    import torch
    import transformers

    if model not in MODELS:
        raise ValueError(f"model={model!r} is not one of {', '.join(MODELS)}")
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    rows = conversations(n, seed)
    data = directory / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    texts = [m["content"] for r in rows for m in r["messages"]]
    tok = tiny_chat_tokenizer(texts)
    tok.save_pretrained(directory)
    config = _model_config(model, len(tok), tok.eos_token_id, tok.pad_token_id)
    torch.manual_seed(seed)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return {"model": directory, "data": data}
