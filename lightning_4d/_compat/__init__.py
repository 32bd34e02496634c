"""The one place that touches private torch / Lightning APIs, version-gated where it matters.

Everything here is an implementation detail. Each helper names the private symbol it uses, so an
upgrade of torch or Lightning only needs changes in this package. Where a symbol is missing in
another version, a helper falls back to public code (a loop instead of a fused kernel, nothing to
time, ``None``) or raises an error naming the symbol.

Areas (one module each, all re-exported here):

- :mod:`.trainer`: Lightning's process-group helpers, launcher, LightningModule / loop internals.
- :mod:`.fabric`: Lightning Fabric's launcher and gradient-sync control slots.
- :mod:`.distributed`: ``c10d`` groups and ``Work`` objects, ``DeviceMesh`` options, FSDP-based
  ``replicate``, DTensor shard offsets.
- :mod:`.dispatch`: ``TorchDispatchMode``, operator objects, the autograd engine, pytrees.
- :mod:`.fake`: the planner's dry runs: the ``fake`` process group, fake tensors, DTensor caches,
  FSDP2 state.
- :mod:`.pipelining`: internals of ``torch.distributed.pipelining`` schedules.
- :mod:`.kernels`: private operators (``_foreach_norm``, ``_foreach_mul_``, ``_grouped_mm``, the SDPA kernels).
- :mod:`.modules`: ``nn.Module`` / ``DataLoader`` internals, meta-device materialisation.
- :mod:`.compile`: Dynamo's settings, graph-break error and counters.
- :mod:`.moved`: the old names of modules that moved into folders (not re-exported; installed by the package).

Example:
    >>> from lightning_4d import _compat
    >>> callable(_compat.replicate)
    True
"""

from __future__ import annotations

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

from lightning_4d._compat.dispatch import (  # noqa: E402
    disabled_torch_function,
    dispatch_mode_base,
    in_backward,
    is_higher_order_op,
    meta_scalar_mode,
    op_is_view,
    op_name,
    op_schema,
    pytree,
    trunc_normal_hook,
    wrapper_subclass,
)
from lightning_4d._compat.distributed import (  # noqa: E402
    flatten_mesh,
    mesh_backend_override,
    mesh_groups,
    patch_work_wait,
    process_group_of,
    replicate,
    shard_global_offset,
    unbox_work,
    unflatten_mesh,
)
from lightning_4d._compat.fabric import install_fabric_launcher, set_backward_sync_control  # noqa: E402
from lightning_4d._compat.fake import (  # noqa: E402
    clear_dtensor_caches,
    fake_store,
    fake_tensor_mode,
    fsdp_param_group,
    is_fake,
    is_item_op,
    unset_fake,
)
from lightning_4d._compat.kernels import (  # noqa: E402
    attention_ops,
    attention_with_lse,
    attention_with_lse_backward,
    foreach_mul_,
    reducing_collective_ops,
    foreach_norm,
    fused_optimizer_devices,
    grouped_mm,
    grouped_mm_supported,
)
from lightning_4d._compat.modules import (  # noqa: E402
    MODULE_DICTS,
    TENSOR_SLOTS,
    InitCall,
    callable_without_arguments,
    child_modules,
    convert_shared_once,
    init_calls,
    is_loss_module,
    own_tensors,
    registered_submodule,
    release_freed_host_memory,
    returnable_host_empty,
    replace_batch_sampler,
    swapped_parameters,
    tensor_slots,
    to_empty_keeping_ties,
)
from lightning_4d._compat.pipelining import (  # noqa: E402
    forward_only_actions,
    patch_p2p_wait,
    schedule_action_table,
    time_schedule_step,
    time_stage_compute,
)
from lightning_4d._compat.trainer import (  # noqa: E402
    attached_trainer,
    current_hook,
    fit_loop_batches_processed,
    model_summary_options,
    model_summary_parts,
    set_fit_loop_position,
    default_pg_backend,
    init_dist_connection,
    install_subprocess_launcher,
    set_device_mesh,
    should_accumulate,
)

from lightning_4d._compat import (  # noqa: E402
    dispatch, distributed, fabric, fake, kernels, modules, pipelining, trainer,
)

__all__ = ["TORCH_VERSION", *trainer.__all__, *fabric.__all__, *distributed.__all__, *dispatch.__all__, *fake.__all__,
           *pipelining.__all__, *kernels.__all__, *modules.__all__]
