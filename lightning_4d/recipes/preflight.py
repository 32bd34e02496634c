"""Checks a recipe makes before anything is built: the data's vocabulary and tokenizer against the model's
(:func:`validate`, :func:`data_tokenizer`), a Hugging Face model directory, and whether the model is built on the
meta device.

Example:
    >>> _print.__name__, META_INIT_THRESHOLD
    ('_print', 100000000)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Union

from omegaconf import DictConfig

from lightning_4d.recipes.resources import count_params, model_spec
from lightning_4d.recipes.schema import (
    HFDataConfig, HFModelConfig, RecipeConfigError, SyntheticDataConfig, TextDataConfig, TrainConfig, to_train_config,
)
from lightning_4d.recipes.schema import LlamaModelConfig  # noqa: F401 - used by the examples

if TYPE_CHECKING:
    from lightning_4d.recipes.schema import DataConfig

__all__ = ["META_INIT_THRESHOLD", "data_tokenizer", "validate"]

META_INIT_THRESHOLD = 100_000_000
"""With ``meta_init: null`` models with more parameters than this are built on the meta device."""

Config = Union[DictConfig, TrainConfig]


def _cfg(cfg: Config) -> TrainConfig:
    return to_train_config(cfg)


def _is_main_local_process() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("RANK", "0") == "0"


def _print(msg: str) -> None:
    if _is_main_local_process():
        print(msg, flush=True)


# ---------------------------------------------------------------------------------------------- checks
def _data_vocab(data: DataConfig) -> int:
    if isinstance(data, SyntheticDataConfig):
        return data.vocab_size
    from lightning_4d.data.tokenizer import get_tokenizer

    try:
        return get_tokenizer(data.tokenizer).vocab_size
    except (ImportError, ValueError, FileNotFoundError) as err:
        raise RecipeConfigError(f"data.tokenizer={data.tokenizer!r}: {err}") from err


def _model_dir(m: HFModelConfig) -> Path:
    source = Path(m.source).absolute()
    return source if source.is_dir() else source.parent


def data_tokenizer(cfg: Config) -> str:
    """The tokenizer of ``data=hf_text`` / ``data=chat``: ``data.tokenizer`` (a directory, made absolute), or for
    ``auto`` the model's own: the directory of ``model.path`` (``model=hf``), which must hold tokenizer files.

    Example:
        >>> from lightning_4d.recipes.schema import HFDataConfig
        >>> data_tokenizer(TrainConfig(model=LlamaModelConfig(), data=HFDataConfig(files=["a.jsonl"])))
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.errors.RecipeConfigError: data.tokenizer=auto means the tokenizer of model.path ...
    """
    from lightning_4d.data.tokenizer import is_tokenizer_dir

    c = _cfg(cfg)
    d, m = c.data, c.model
    if d.tokenizer != "auto":
        if not is_tokenizer_dir(d.tokenizer):
            raise RecipeConfigError(
                f"data.tokenizer={d.tokenizer!r} is not a directory holding a Hugging Face tokenizer (tokenizer.json, "
                f"tokenizer_config.json, ...): data={d.name} tokenizes with the model's own tokenizer; use "
                f"data.tokenizer=auto (model.path) or the directory it was saved to.")
        return str(Path(d.tokenizer).absolute())
    if not isinstance(m, HFModelConfig):
        raise RecipeConfigError(
            f"data.tokenizer=auto means the tokenizer of model.path (model=hf); with model={m.name} name the "
            f"Hugging Face tokenizer directory: data.tokenizer=DIR.")
    directory = _model_dir(m)
    if not is_tokenizer_dir(directory):
        raise RecipeConfigError(
            f"data.tokenizer=auto: {m.source_key}={m.source!r} holds no tokenizer files (tokenizer.json, "
            f"tokenizer_config.json, ...). Save the model's tokenizer there (tokenizer.save_pretrained(DIR)) or set "
            f"data.tokenizer=DIR.")
    return str(directory)


def _check_tokenizer(c: TrainConfig) -> None:
    """``model=hf`` whose directory holds a tokenizer: the data must be tokenized by that tokenizer (same
    vocabulary and special ids), or its ids would mean other tokens. Refused before anything is built."""
    from lightning_4d.data.tokenizer import HFTokenizer, check_same_tokenizer, is_tokenizer_dir, tokenizer_record
    from lightning_4d.data.tokens import TokenFile

    m, d = c.model, c.data
    if not isinstance(m, HFModelConfig) or isinstance(d, SyntheticDataConfig) or not is_tokenizer_dir(_model_dir(m)):
        return
    expected = tokenizer_record(HFTokenizer(_model_dir(m)))
    if isinstance(d, HFDataConfig):
        what, fix = f"data.tokenizer={d.tokenizer!r}", "Use data.tokenizer=auto (the model's own tokenizer)."
        recorded = tokenizer_record(HFTokenizer(d.tokenizer)) if Path(d.tokenizer) != _model_dir(m) else expected
    else:
        assert isinstance(d, TextDataConfig)
        fix = (f"Tokenize the text with the model's tokenizer: data=hf_text or data=chat (data.tokenizer=auto), or "
               f"python -m lightning_4d.data prepare --tokenizer {m.source} ...")
        train = Path(d.data_dir).absolute() / "train.bin"
        if not d.prepare and train.exists():
            what, recorded = f"data.data_dir={d.data_dir!r} ({train.name})", TokenFile(train).tokenizer_record
        else:
            what = f"data.tokenizer={d.tokenizer!r}"
            recorded = (tokenizer_record(HFTokenizer(d.tokenizer)) if is_tokenizer_dir(d.tokenizer)
                        else {"name": d.tokenizer})
    try:
        check_same_tokenizer(recorded, expected, what, fix)
    except ValueError as err:
        raise RecipeConfigError(f"{err} (The model's tokenizer is in {m.source_key}={m.source!r}.)") from None


def validate(cfg: Config) -> TrainConfig:
    """Schema rules plus cross-group rules (vocabulary and sequence length fit the model); pure.

    Example:
        >>> from lightning_4d.recipes.schema import SyntheticDataConfig
        >>> validate(TrainConfig(model=LlamaModelConfig(vocab_size=64), data=SyntheticDataConfig(vocab_size=256)))
        ... # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lightning_4d.recipes.errors.RecipeConfigError: data vocabulary (256 ids) exceeds model.vocab_size=64: ...
    """
    c = _cfg(cfg)
    if isinstance(c.data, HFDataConfig):
        c.data.tokenizer = data_tokenizer(c)  # auto -> the model's directory
    _check_tokenizer(c)
    if isinstance(c.model, HFModelConfig):
        _validate_hf(c)
        return c
    vocab, spec = _data_vocab(c.data), model_spec(c.model)
    if vocab > spec.vocab_size:
        raise RecipeConfigError(
            f"data vocabulary ({vocab} ids) exceeds model.vocab_size={spec.vocab_size}: raise model.vocab_size "
            f"to at least {vocab} or use a smaller tokenizer / data.vocab_size.")
    if c.data.seq_len > spec.seq_len:
        raise RecipeConfigError(f"data.seq_len={c.data.seq_len} exceeds the model's longest sequence {spec.seq_len} "
                                f"(model.max_seq_len, or model.block_size of GPT-2).")
    return c


def _validate_hf(c: TrainConfig) -> None:
    """``model=hf``: the directory or config file is usable, the data fits the model; ``meta_init=true`` with
    pretrained weights needs safetensors files."""
    from lightning_4d.recipes.hf_model import hf_shape

    m = c.model
    shape = hf_shape(m)  # raises for a missing path, no config.json, no weights
    vocab = _data_vocab(c.data)
    if vocab > shape.vocab_size:
        raise RecipeConfigError(
            f"data vocabulary ({vocab} ids) exceeds the vocab_size={shape.vocab_size} of {m.source_key}={m.source!r}: "
            f"token ids >= {shape.vocab_size} have no embedding. Use data whose ids fit (e.g. "
            f"data.vocab_size={shape.vocab_size} for data=synthetic, or text tokenized with the model's tokenizer).")
    if shape.max_positions is not None and c.data.seq_len > shape.max_positions:
        raise RecipeConfigError(
            f"data.seq_len={c.data.seq_len} exceeds max_position_embeddings={shape.max_positions} of "
            f"{m.source_key}={m.source!r}; use data.seq_len<={shape.max_positions}.")
    if c.meta_init and m.path is not None and not _has_safetensors(m.path):
        raise RecipeConfigError(
            f"meta_init=true with model.path={m.path!r}: streaming pretrained weights into each rank's shards reads "
            f"*.safetensors files and the directory holds none (pytorch_model*.bin only). Convert it once "
            f"(AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir)) or set meta_init=null to load "
            f"the whole model on every rank.")


def _has_safetensors(path: str) -> bool:
    return any(Path(path).glob("*.safetensors"))


def _hf_meta_init(c: TrainConfig) -> bool:
    """``model=hf`` on the meta device? ``model.path``: yes when the directory holds safetensors (its weights
    are then streamed into each rank's shards), unless ``meta_init=false`` (loaded whole on every rank);
    ``model.config`` (random init): as every other model (``meta_init``, ``null``: over 100M parameters)."""
    m = c.model
    if c.meta_init is not None:
        return c.meta_init
    if m.path is not None:
        return _has_safetensors(m.path)
    return count_params(m).total > META_INIT_THRESHOLD
