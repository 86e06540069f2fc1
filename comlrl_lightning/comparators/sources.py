"""Comparator sources: the "other side" of each comparison in iterative preference training
(docs/iterative.md, Comparators).

In round ν the current agents sample K_c candidates per item; a comparator samples K_cmp more, and candidate k of
one side is compared with candidate k of the other. Every source has one interface::

    start_round(iteration)                      prepare (clone, load a checkpoint or a model) for round ν (0-based)
    sample(roles, prompts, K, items) -> texts   texts[j][m*K + k]: k-th sample for prompts[j][m], written by the
                                                comparator of role ``roles[j]`` (decentralized: all roles;
                                                centralized generation: one role answering joint prompts)
    end_round()                                 release what only this round needed

Sources (``comparator_policy`` and its aliases):

* ``current``       the live agents, sampled from an independent random stream (``IndependentRNG``), so the
                    comparison is "policy vs an independent sample set of itself";
* ``current_copy``  a frozen copy of the agents on ``comparator_devices`` for the round (live weights when those
                    devices are the agents' own);
* ``model``         frozen models loaded once from ``comparator_agents`` / ``comparator_model_name``;
* ``history``       the policy as it was at the start of round ν−k (``comparator_history_k``), read from the
                    policy checkpoints (``PolicyCheckpoints``): ``iteration_{ν−k−1:04d}`` (saved after round
                    ν−k−1), ``initial`` when ν ≤ k. CoMLRL's k = 1 picks the policy saved after round ν−1, which
                    equals the current weights; ours is one round further back, as "k rounds back" says (docs/differences.md);
* ``api``           a remote endpoint (``comlrl_lightning.comparators.api``).

Local comparators sample through the rollout engine (batched ``generate``, K per prompt, chat template as the
agents) and always inside the comparator's random stream; texts are returned, since pairs are rebuilt from text.
"""

from __future__ import annotations

import abc
import contextlib
import copy
import logging
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from comlrl_lightning.agents import load_agents, resolve_devices
from comlrl_lightning.choices import Choice
from comlrl_lightning.comparators.api import ApiComparator, ApiComparatorConfig
from comlrl_lightning.rollout.policy import TeamPolicy

log = logging.getLogger(__name__)

COMPARATOR_POLICY = Choice(
    "comparator_policy",
    {
        "current": ("self", "online"),
        "current_copy": ("copy", "online_copy", "current-offload", "current_offload"),
        "model": ("external", "comparator", "reference", "ref"),
        "history": ("checkpoint", "previous", "previous_iteration"),
        "api": ("http", "endpoint"),
    },
    message="{field} must be one of: {allowed}. (got {value!r})",
)
COMPARATOR_GENERATION_MODE = Choice(
    "comparator_generation_mode",
    {
        "decentralized": ("decentralised", "multi_agent", "multi-agent"),
        "centralized": ("centralised", "single_agent", "single-agent"),
    },
    message="{field} must be one of: {allowed}. (got {value!r})",
)
COMPARATOR_POLICIES = COMPARATOR_POLICY.values
normalize_comparator_policy, normalize_generation_mode = COMPARATOR_POLICY, COMPARATOR_GENERATION_MODE


class IndependentRNG:
    """A persistent random stream of its own, swapped in around the comparator's sampling.

    ``active(devices)`` saves the global CPU/CUDA generator states, installs this stream's, runs the block, stores
    the advanced stream and restores the global states — so the policy's own sampling sequence is the same whether
    or not the comparator sampled in between. Seeded from ``seed`` on first use; ``state_dict`` goes into
    checkpoints so a resumed run continues the same stream.
    """

    def __init__(self, seed: int):
        self.seed = int(seed)
        self.cpu: torch.Tensor | None = None
        self.cuda: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def active(self, devices: Sequence[torch.device]):
        devices = [torch.device(d) for d in devices]
        unsupported = sorted({str(d) for d in devices if d.type not in ("cpu", "cuda")})
        if unsupported:
            raise ValueError(f"Independent comparator RNG currently supports CPU and CUDA devices; got {unsupported}.")
        cuda_ids = sorted(
            {d.index if d.index is not None else torch.cuda.current_device() for d in devices if d.type == "cuda"}
        )
        with torch.random.fork_rng(devices=cuda_ids):
            if self.cpu is None:
                torch.manual_seed(self.seed)  # also seeds every CUDA device; fork_rng restores them afterwards
            else:
                torch.set_rng_state(self.cpu)
            for i in cuda_ids:
                if i in self.cuda:
                    torch.cuda.set_rng_state(self.cuda[i], i)
            yield
            self.cpu = torch.get_rng_state()
            self.cuda.update({i: torch.cuda.get_rng_state(i) for i in cuda_ids})

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "cpu": self.cpu, "cuda": dict(self.cuda)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seed, self.cpu, self.cuda = int(state["seed"]), state["cpu"], dict(state["cuda"])


def _frozen(model: torch.nn.Module, device: torch.device | str | None = None) -> torch.nn.Module:
    if device is not None:
        model = model.to(device)
    return model.eval().requires_grad_(False)


class LocalComparator(abc.ABC):
    """Samples with local models through the agents' rollout engine, inside the comparator's random stream.
    Subclasses say which model and tokenizer answer for a role (``model_for``)."""

    def __init__(self, policy: TeamPolicy, rng: IndependentRNG):
        self.policy, self.rng = policy, rng

    @abc.abstractmethod
    def model_for(self, role: int) -> tuple[torch.nn.Module, Any]:
        """The (model, tokenizer) that writes role ``role``'s comparator candidates this round."""

    def start_round(self, iteration: int) -> None:  # noqa: B027 - a hook: nothing to do by default
        pass

    def end_round(self) -> None:  # noqa: B027
        pass

    @torch.no_grad()
    def sample(
        self, roles: Sequence[int], prompts: Sequence[Sequence[str]], K: int, items: Sequence[Mapping[str, Any]]
    ) -> list[list[str]]:
        models, tokenizers = zip(*(self.model_for(r) for r in roles))
        devices = {next(m.parameters()).device for m in models}
        with self.rng.active(sorted(devices, key=str)):
            completions = self.policy.sample(prompts, K, models=models, tokenizers=tokenizers)
        return [c.texts for c in completions]


class CurrentComparator(LocalComparator):
    """The live agents (same weights), sampled from the comparator's own stream."""

    def model_for(self, role: int):
        return self.policy.model(role)


class CurrentCopyComparator(CurrentComparator):
    """A frozen copy of the agents on ``devices`` for one round; the live agents when the devices are theirs."""

    def __init__(self, policy: TeamPolicy, rng: IndependentRNG, devices: list[torch.device] | None):
        super().__init__(policy, rng)
        self.devices = devices
        self.copies: dict[int, torch.nn.Module] = {}

    def start_round(self, iteration: int) -> None:
        if self.devices is None:
            return
        by_model: dict[int, torch.nn.Module] = {}  # shared weights are copied once
        for role in range(self.policy.num_agents):
            device = self.devices[role]
            live = self.policy.models[role]
            if next(live.parameters()).device == torch.device(device):
                continue
            if id(live) not in by_model:
                by_model[id(live)] = _frozen(copy.deepcopy(live), device)
            self.copies[role] = by_model[id(live)]

    def end_round(self) -> None:
        self.copies.clear()

    def model_for(self, role: int):
        if role in self.copies:
            return self.copies[role], self.policy.tokenizers[role]
        return super().model_for(role)


class ModelComparator(LocalComparator):
    """Frozen comparator models from ``sources`` (one per role), loaded at the first round that needs them; kept
    across rounds unless ``keep_loaded`` is False (freed after each collection). Tokenizers: ``tokenizers`` (one
    per role) where given; else a model loaded by name brings its own and a model object uses its role's agent
    tokenizer (as CoMLRL does)."""

    def __init__(
        self,
        policy: TeamPolicy,
        rng: IndependentRNG,
        sources: Sequence[Any],
        devices: list[torch.device] | None,
        keep_loaded: bool = True,
        roles: Sequence[int] | None = None,
        tokenizers: Sequence[Any] | None = None,
        field: str = "comparator_agents",
    ):
        super().__init__(policy, rng)
        self.sources, self.devices, self.keep_loaded = list(sources), devices, keep_loaded
        self.roles = list(range(len(self.sources))) if roles is None else list(roles)
        self.tokenizers = list(tokenizers) if tokenizers is not None else None
        self.field = field
        self.loaded: dict[int, tuple[torch.nn.Module, Any]] = {}

    def tokenizer_for(self, role: int) -> Any:
        if self.tokenizers is not None:
            return self.tokenizers[role]
        return None if isinstance(self.sources[role], str) else self.policy.tokenizers[role]

    def start_round(self, iteration: int) -> None:
        if self.loaded:
            return
        models, tokenizers = load_agents(
            [self.sources[r] for r in self.roles],
            num_agents=len(self.roles),
            tokenizers=[self.tokenizer_for(r) for r in self.roles],
            field=self.field,
            tokenizer_field="comparator_tokenizers",
        )
        default_device = self.policy.device(0)
        for r, model, tokenizer in zip(self.roles, models, tokenizers):
            device = self.devices[r] if self.devices is not None else default_device
            self.loaded[r] = (_frozen(model, device), tokenizer)
        log.info("comparator models loaded for roles %s", self.roles)

    def end_round(self) -> None:
        if not self.keep_loaded:
            self.loaded.clear()

    def model_for(self, role: int):
        if role not in self.loaded:
            raise RuntimeError(f"comparator model for role {role} is not loaded (start_round was not called).")
        return self.loaded[role]


class HistoryComparator(ModelComparator):
    """The policy as it was at the start of round ν−k, read from ``directory`` (written by PolicyCheckpoints)."""

    def __init__(
        self,
        policy: TeamPolicy,
        rng: IndependentRNG,
        directory: Path,
        k: int,
        devices: list[torch.device] | None,
        roles: Sequence[int],
    ):
        super().__init__(policy, rng, sources=[], devices=devices, keep_loaded=False, roles=roles)
        self.directory, self.k = Path(directory), k
        self.checkpoint: Path | None = None

    def checkpoint_for(self, iteration: int) -> Path:
        """``iteration_{ν−k−1:04d}``, else the newest earlier ``iteration_*``, else ``initial``."""
        target = iteration - self.k - 1
        for label in range(target, -1, -1):
            path = self.directory / f"iteration_{label:04d}"
            if path.is_dir():
                return path
        return self.directory / "initial"

    def start_round(self, iteration: int) -> None:
        self.checkpoint = self.checkpoint_for(iteration)
        self.loaded.clear()
        missing = [
            str(self.checkpoint / f"agent_{r}") for r in self.roles if not (self.checkpoint / f"agent_{r}").is_dir()
        ]
        if missing:
            raise FileNotFoundError(
                f"Missing comparator history checkpoint agent directory/directories: {', '.join(missing)}."
            )
        self.sources = [
            str(self.checkpoint / f"agent_{r}") if r in self.roles else None for r in range(max(self.roles) + 1)
        ]
        super().start_round(iteration)
        log.info("round %d: history comparator = %s", iteration + 1, self.checkpoint)


class ApiComparatorSource:
    """A remote endpoint; one request set per (role, item), all of a round's chunk sent concurrently."""

    def __init__(self, config: ApiComparatorConfig, sampling):
        self.client = ApiComparator(config)
        self.sampling = sampling

    def start_round(self, iteration: int) -> None:
        pass

    def end_round(self) -> None:
        pass

    def sample(
        self, roles: Sequence[int], prompts: Sequence[Sequence[str]], K: int, items: Sequence[Mapping[str, Any]]
    ) -> list[list[str]]:
        flat = [p for role_prompts in prompts for p in role_prompts]
        agent_idx = [r for r, role_prompts in zip(roles, prompts) for _ in role_prompts]
        texts = self.client.complete_many(
            flat,
            K,
            agent_idx=agent_idx,
            batch_items=list(items) * len(roles),
            max_new_tokens=self.sampling.max_new_tokens,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            top_k=self.sampling.top_k,
        )
        M = len(items)
        return [[t for texts_m in texts[j * M : (j + 1) * M] for t in texts_m] for j in range(len(roles))]


def build_comparator(
    kind: str,
    policy: TeamPolicy,
    rng: IndependentRNG,
    *,
    roles: Sequence[int],
    model_sources: Sequence[Any] | None = None,
    model_tokenizers: Any = None,
    model_field: str = "comparator_agents",
    devices: Any = None,
    history_dir: Path | None = None,
    history_k: int = 1,
    keep_loaded: bool = True,
    api_config: ApiComparatorConfig | None = None,
):
    """The comparator source ``kind`` (a canonical ``comparator_policy``) for the team ``policy``. ``roles`` are the roles whose comparator models
    are needed (all of them, or the one centralized role); ``devices`` is ``comparator_devices`` (default: the
    agents' devices); ``model_tokenizers`` is ``comparator_tokenizers`` (one, or one per model source)."""
    N = policy.num_agents
    resolved = resolve_devices(devices, N, kind="comparator_devices") if devices is not None else None
    if kind == "current":
        return CurrentComparator(policy, rng)
    if kind == "current_copy":
        return CurrentCopyComparator(policy, rng, resolved)
    if kind == "model":
        sources = list(model_sources)
        if len(sources) == 1:
            sources = sources * N
        tokenizers = model_tokenizers
        if tokenizers is not None:
            tokenizers = list(tokenizers) if isinstance(tokenizers, (list, tuple)) else [tokenizers]
            tokenizers = tokenizers * N if len(tokenizers) == 1 else tokenizers
        return ModelComparator(
            policy,
            rng,
            sources,
            resolved,
            keep_loaded=keep_loaded,
            roles=roles,
            tokenizers=tokenizers,
            field=model_field,
        )
    if kind == "history":
        return HistoryComparator(policy, rng, history_dir, history_k, resolved, roles=roles)
    return ApiComparatorSource(api_config, policy.engine.sampling)
