"""Expert parallelism: router, token permutation, all-to-all dispatch, the MoE layer, Mixtral rewrite.

Usable without Lightning::

    from lightning_4d.expert_parallel import MoE, apply_expert_parallel
    moe = MoE(dim=256, hidden_dim=512, num_experts=8, top_k=2)
    apply_expert_parallel(model, four_d_mesh)   # E/ep experts per rank, all-to-all token dispatch
"""

from lightning_4d.expert_parallel.dispatch import CommCounter, CommRecord, all_reduce_, all_to_all, combine, dispatch
from lightning_4d.expert_parallel.experts import GroupedExperts, SwiGLU, grouped_linear, scale_grad, swiglu_experts
from lightning_4d.expert_parallel.moe import MoE, attach_aux_loss, expert_load, moe_aux_loss, update_expert_bias
from lightning_4d.expert_parallel.parallel import apply_expert_parallel, check_expert_parallel, expert_grad_scale
from lightning_4d.expert_parallel.permute import (
    PermutePlan, compute_capacity, make_permutation, permute, split_sizes, unpermute,
)
from lightning_4d.expert_parallel.rewrite import (
    convert_original_state_dict, export_original_state_dict, find_moe_modules, moe_from_mixtral,
    rewrite_moe_modules,
)
from lightning_4d.expert_parallel.router import RouterOutput, TopKRouter, check_routing

__all__ = [
    "CommCounter", "CommRecord", "GroupedExperts", "MoE", "PermutePlan", "RouterOutput", "SwiGLU", "TopKRouter",
    "all_reduce_", "all_to_all", "apply_expert_parallel", "attach_aux_loss", "check_expert_parallel",
    "check_routing", "combine", "compute_capacity", "convert_original_state_dict", "dispatch",
    "expert_grad_scale", "expert_load", "export_original_state_dict", "find_moe_modules", "grouped_linear",
    "make_permutation", "moe_aux_loss", "moe_from_mixtral", "permute", "rewrite_moe_modules", "scale_grad",
    "split_sizes", "swiglu_experts", "unpermute", "update_expert_bias",
]
