"""Reference Llama-style mixture-of-experts transformer (DeepSeek / Mixtral layout).

The model is :class:`~lightning_4d.models.llama.Llama` with the ``feed_forward`` of some blocks
replaced by :class:`~lightning_4d.expert_parallel.MoE`: blocks ``0 .. first_dense_layers-1`` are dense,
then every ``moe_every``-th block (counting from ``first_dense_layers``) is MoE. The forward is the
same sequential composition ``tok_embeddings -> layers -> norm -> output`` (pipeline-splittable), and
the initialisation contract is Llama's (meta build, ``to_empty``, ``init_weights(seed)``).

Example:
    >>> cfg = MoEConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, num_experts=4, top_k=2,
    ...                 expert_hidden=32, first_dense_layers=1, ffn_hidden=64)
    >>> model = MoETransformer(cfg)
    >>> model(torch.randint(0, 64, (2, 8))).shape
    torch.Size([2, 8, 64])
    >>> [type(b.feed_forward).__name__ for b in model.layers]
    ['FeedForward', 'MoE', 'MoE']
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Optional

import torch
from torch import nn

from lightning_4d.expert_parallel.moe import MoE
from lightning_4d.expert_parallel.router import check_routing
from lightning_4d.models.flops import training_flops_per_token
from lightning_4d.models.llama import Llama, LlamaConfig, TransformerBlock

__all__ = ["MoEConfig", "MoETransformer", "is_moe_layer"]


def is_moe_layer(layer_id: int, first_dense_layers: int, moe_every: int) -> bool:
    """Whether block ``layer_id`` has an MoE feed-forward (pure).

    Example:
        >>> [is_moe_layer(i, first_dense_layers=1, moe_every=2) for i in range(5)]
        [False, True, False, True, False]
    """
    return layer_id >= first_dense_layers and (layer_id - first_dense_layers) % moe_every == 0


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    """Hyper-parameters of :class:`MoETransformer`: Llama's (inherited) plus the MoE ones.

    ``expert_hidden`` is each expert's hidden size; ``shared_experts`` the number of always-active
    shared experts (a dense SwiGLU of hidden ``shared_experts · expert_hidden``); ``ffn_hidden`` the
    hidden size of the dense blocks (None: Llama's default). Router options are those of
    :class:`~lightning_4d.expert_parallel.TopKRouter`.

    >>> MoEConfig(vocab_size=8, dim=8, n_layers=2, n_heads=2, num_experts=4, top_k=5)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: top_k=5 exceeds num_experts=4: ... Use top_k <= 4 or add experts.
    """

    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 1024
    moe_every: int = 1
    first_dense_layers: int = 0
    shared_experts: int = 0
    score_func: str = "softmax"  # "softmax" | "sigmoid" (checked by check_routing)
    renormalize: bool = True
    route_scale: float = 1.0
    aux_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: Optional[float] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_routing(self.num_experts, self.top_k, self.score_func)
        for name in ("expert_hidden", "moe_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be >= 1. Fix: pass a positive {name}.")
        if self.first_dense_layers < 0 or self.shared_experts < 0:
            raise ValueError(
                f"first_dense_layers={self.first_dense_layers} / shared_experts={self.shared_experts} must be >= 0.")

    def llama_config(self) -> LlamaConfig:
        """The dense part as a :class:`LlamaConfig` (validates it)."""
        names = {f.name for f in fields(LlamaConfig)}
        return LlamaConfig(**{k: v for k, v in asdict(self).items() if k in names})


class MoETransformer(Llama):
    """Llama decoder whose selected blocks have an MoE ``feed_forward`` (see module docstring).

    Attributes: ``config`` (the dense :class:`LlamaConfig`), ``moe_config`` (:class:`MoEConfig`).

    >>> cfg = MoEConfig(vocab_size=16, dim=16, n_layers=2, n_heads=2, num_experts=4, top_k=1, expert_hidden=16)
    >>> with torch.device("meta"):
    ...     m = MoETransformer(cfg)
    >>> m = m.to_empty(device="cpu"); m.init_weights(seed=0)
    >>> ref = MoETransformer(cfg); ref.init_weights(seed=0)
    >>> torch.equal(m.layers[1].feed_forward.experts.w2, ref.layers[1].feed_forward.experts.w2)
    True
    """

    def __init__(self, config: MoEConfig) -> None:
        self.moe_config = config
        super().__init__(config.llama_config())
        c = config
        out_std = c.init_std / math.sqrt(2 * c.n_layers)  # depth-scaled residual projections, as in Llama
        for block in self.layers:
            if is_moe_layer(block.layer_id, c.first_dense_layers, c.moe_every):
                block.feed_forward = MoE(
                    c.dim, c.expert_hidden, c.num_experts, c.top_k, score_func=c.score_func,
                    renormalize=c.renormalize, route_scale=c.route_scale, aux_loss_coef=c.aux_loss_coef,
                    bias_update_rate=c.bias_update_rate, capacity_factor=c.capacity_factor,
                    shared_hidden_dim=c.shared_experts * c.expert_hidden or None,
                    init_std=c.init_std, out_init_std=out_std)
        self.init_weights()

    def moe_layers(self) -> list[MoE]:
        """The MoE feed-forwards, in block order."""
        return [b.feed_forward for b in _blocks(self.layers) if isinstance(b.feed_forward, MoE)]

    def num_active_params(self, exclude_embeddings: bool = False) -> int:
        """Parameters used per token: all dense ones plus ``top_k`` of the ``E`` routed experts.

        >>> cfg = MoEConfig(vocab_size=8, dim=4, n_layers=1, n_heads=1, num_experts=4, top_k=1, expert_hidden=4)
        >>> m = MoETransformer(cfg); m.num_params() - m.num_active_params()
        144
        """
        n = self.num_params(exclude_embeddings)
        for moe in self.moe_layers():
            per_expert = sum(p.shape[1] * p.shape[2] for p in (moe.experts.w1, moe.experts.w2, moe.experts.w3))
            n -= (moe.num_experts - moe.top_k) * per_expert
        return n

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token with *active* parameters: ``6·N_active + 12·L·H·hd·seq_len``.

        >>> cfg = MoEConfig(vocab_size=8, dim=4, n_layers=1, n_heads=1, num_experts=4, top_k=1, expert_hidden=4)
        >>> MoETransformer(cfg).flops_per_token(2) > 0
        True
        """
        c = self.config
        return training_flops_per_token(self.num_active_params(True), c.n_layers, c.n_heads * c.head_dim, seq_len)


def _blocks(layers: nn.Module) -> list[TransformerBlock]:
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
