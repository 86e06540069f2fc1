"""Agents sharded across the ranks of a data-parallel run with FSDP2 (``fully_shard``; Lightning's
``ModelParallelStrategy`` with ``tensor_parallel_size: 1``).

Each rank keeps 1/D of every agent between steps; a training step runs on the gathered agents. Every sharded forward
and backward is a collective, and the ranks run different numbers of them (EOS ends generation at different steps,
shares differ in size, a rank's share can be empty), so a step never leaves that to FSDP's hooks:

1. :func:`gathered` all-gathers every agent once, at the start of the step, and keeps it whole (no resharding
   after forward or backward): generation, scoring and training forwards then run without collectives.
2. The per-agent backwards accumulate gradients locally (``set_requires_gradient_sync(False)``).
3. :func:`reduce_gradients` — once per update, on every rank — runs one zero-weighted forward and backward per agent
   with the sync on: FSDP reduce-scatters the accumulated gradients (their mean over ranks) into the shards.
4. After the optimizer step (on the shards) :func:`refresh` re-gathers the updated agents; the step ends with them
   resharded.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def shard(model: nn.Module, mesh) -> None:
    """``fully_shard`` each decoder layer of ``model`` (the usual unit), then the model itself; then one forward
    through the model so that FSDP takes it as the root of its units (later calls may enter an inner module
    directly: a critic's decoder body, the backbone under a value head)."""
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if isinstance(module, nn.ModuleList) and module is not model:
            for layer in module:
                fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    with torch.no_grad():
        _probe(model)


def _probe(model: nn.Module) -> Tensor:
    """A one-token forward through ``model``; the sum of every output (logits, values, scores) times zero."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
    parts = [out] if isinstance(out, Tensor) else [getattr(out, name, None) for name in ("logits", "values")]
    return sum(part.float().sum() for part in parts if isinstance(part, Tensor)) * 0.0


def _units(models: Iterable[nn.Module]) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for model in models for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(models: list[nn.Module]) -> Iterator[None]:
    """Every sharded agent whole for the block (one all-gather each), gradients kept local; resharded after."""
    models = [m for m in models if is_sharded(m)]
    if not models:
        yield
        return
    _keep_whole(models, True)
    for unit in _units(models):
        unit.unshard()
    try:
        yield
    finally:
        _keep_whole(models, False)
        for unit in _units(models):
            unit.reshard()


def _keep_whole(models: list[nn.Module], whole: bool) -> None:
    """Whole: no resharding after forward or backward, gradients accumulated locally; else FSDP's defaults."""
    for model in models:
        model.set_reshard_after_forward(not whole)
        model.set_reshard_after_backward(not whole)
        model.set_requires_gradient_sync(not whole)


def reduce_gradients(models: list[nn.Module]) -> None:
    """Reduce-scatter each sharded model's accumulated gradients into its shards (mean over ranks): one
    zero-weighted forward and backward per model with the sync on, the same count on every rank. Every model
    passed gets a gradient (zeros where nothing was accumulated): pass only the models this update trains."""
    for model in (m for m in models if is_sharded(m)):
        model.set_requires_gradient_sync(True)
        _probe(model).backward()
        model.set_requires_gradient_sync(False)


def refresh(models: list[nn.Module]) -> None:
    """After an optimizer step on the shards: gather the updated agents again."""
    units = _units(m for m in models if is_sharded(m))
    for unit in units:
        unit.reshard()
    for unit in units:
        unit.unshard()


def full_state_dicts(models: list[nn.Module]) -> list[dict | None]:
    """Each sharded model's whole state dict on rank 0, on the CPU (a collective: call it on every rank); None
    for a model that is not sharded (its own ``state_dict`` is whole)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    done: dict[int, dict] = {}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for model in models:
        if is_sharded(model) and id(model) not in done:
            state = get_model_state_dict(model, options=options)
            for name in _aliases(model):  # tied weights (e.g. the output head tied to the embeddings): written once
                state.pop(name, None)
            done[id(model)] = state
    return [done.get(id(model)) for model in models]


def _aliases(model: nn.Module) -> list[str]:
    """Names of parameters that are another name's parameter (tied weights), after the first name of each."""
    seen: set[int] = set()
    aliases = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.append(name)
        seen.add(id(param))
    return aliases
