"""Time one MAGRPO (and, with ``--actor-critic``, IAC / MAAC) team update, phase by phase (benchmarks/README.md).

Workload: N agents x M prompts x K samples x exactly T new tokens (EOS is suppressed with
``min_new_tokens=T`` so every implementation generates and scores the same number of tokens).

Phases of one update, each timed separately (median over ``--repeats`` after one warm-up):

    generate  sampling the K completions of every agent (``RolloutEngine.rollout`` timings)
    reward    the team reward of every joint action (same)
    score     log-probs of all completions without grad, batched (what the reference model or old
              log-probs cost when reference KL is on; MAGRPO's default needs no such pass)
    update    forward + backward + optimizer step for all agents (one team update)

Implementations:

    ours        comlrl_lightning.MAGRPO: ``module.engine.rollout`` for generate/reward, then the pieces of
                ``MAGRPO.update`` (module.agent_batch -> token_logprobs -> policy_gradient_loss -> backward -> step)
    per-sample  (``--baseline``) a per-sample implementation in CoMLRL's style (docs/differences.md):
                one generate per agent per prompt, one reward call per joint action, and for the loss one
                forward per completion with a Python loop over token positions (log_softmax per position)
                and one backward per sample, one AdamW per agent
    trl         (``--trl``) the same workload at N=1 through trl's GRPOTrainer, one training step
    iac         (``--actor-critic``) comlrl_lightning.IAC with a separate critic LM per agent (the same factory)
    iac-shared  (same) IAC with a value head on each actor's backbone (``use_separate_critic=False``)
    maac        (same) comlrl_lightning.MAAC, one centralized critic LM (the same factory) over the joint text
    madpo       (``--preference``) comlrl_lightning.MADPO: ``collect_pairs`` (K_c = ``--candidates`` joint candidates
                per prompt, ``letter_reward`` as the oracle, ``--pairs-per-sample`` pairs kept per prompt), then the
                module's real ``training_step`` on ``--pair-batch`` of those pairs (one update)
    marlhf-rm   (same) comlrl_lightning.MARLHF(rl_algorithm="magrpo", reward_model_name=<same factory>): one real
                ``reward_model_step`` (Bradley-Terry update of the joint reward model) on the same pair batch

For the actor-critic rows, generate / reward / score are the module's own ``collect_rollout`` timings (score = the
critics' rollout-time old values, which actor-critic always needs), and update is the module's real
``update(steps)``, run outside ``fit`` on a bare Trainer (``attach_trainer``) after ``_set_advantages``. The
preference rows run ``training_step`` / ``reward_model_step`` on such a Trainer as well, with its fit loop's result
collection active so their ``self.log`` calls are recorded as in ``fit``.

    python benchmarks/bench_reinforce.py                          # tiny and tiny-5m, 2 agents x K=4 x 32 tokens
    python benchmarks/bench_reinforce.py --baseline --trl --json benchmarks/results/cpu.json
    python benchmarks/bench_reinforce.py --actor-critic --json benchmarks/results/cpu_actor_critic.json
    python benchmarks/bench_reinforce.py --preference --json benchmarks/results/cpu_preference.json

``--precision bf16-mixed`` and ``--generation-dtype bfloat16`` apply to ``ours`` only (the per-sample loop and trl run
as they are): the two bf16 options a user of the package sets.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))  # roofline.py

from comlrl_lightning import IAC, MAAC, MADPO, MAGRPO, MARLHF, PreferenceDataModule  # noqa: E402
from comlrl_lightning.agents.memory import keep_freed_memory  # noqa: E402
from comlrl_lightning.algorithms.optimization import clip_and_measure, trained_parameters  # noqa: E402
from comlrl_lightning.core.advantages import compute_advantages  # noqa: E402
from comlrl_lightning.core.losses import policy_gradient_loss  # noqa: E402
from comlrl_lightning.envs.toy import brevity_reward, letter_reward  # noqa: E402
from comlrl_lightning.rollout.sampling import collate_rows, token_logprobs  # noqa: E402
from comlrl_lightning.rollout.weights import weights_changed  # noqa: E402

PROMPTS = [
    "Write a short story about a cat.",
    "Write a function that returns the sum of two numbers.",
    "Plan a trip from Boston to Denver for three days.",
    "What is the capital of France?",
]
SAMPLING = dict(temperature=0.6, top_p=0.6, top_k=50)  # MAGRPO's (CoMLRL's) defaults, used everywhere
PHASES = ("generate", "reward", "score", "update")
TARGET_RATIO = 1 / 3  # issue target: our update <= 1/3 of the per-sample update at tiny-5m, 2 x 4 x 32


# ---------------------------------------------------------------------------------------------- measuring
def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rss_kib() -> tuple[int, int] | None:
    """(VmRSS, VmHWM) in KiB from /proc/self/status (Linux), else None."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])
    except (OSError, KeyError, ValueError):
        return None


def _reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (Linux >= 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _malloc_trim() -> None:
    """Give freed heap pages back to the OS so a phase's growth shows in RSS (glibc only)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Phase:
    """Times a block and measures its peak memory growth in MiB.

    CUDA: ``max_memory_allocated`` minus what was allocated at the start. CPU: growth of the process's peak
    RSS over its RSS at the start, after ``malloc_trim`` and a reset of the kernel's high-water mark (falls back
    to the ``getrusage`` max-RSS delta, a lower bound, where the reset is not allowed).

    A CPU process that keeps what it frees (``--keep-freed-memory``, as fit does) is timed without that trim, which
    would hand the kept memory back before every phase: ``measure_memory`` is then off and the peak is None, except
    in one more, untimed round that ``measure`` runs for the memory figures.
    """

    measure_memory = True

    def __init__(self, device: str):
        self.device = device
        self.seconds = 0.0
        self.peak_mib = 0.0

    def __enter__(self):
        gc.collect()
        sync(self.device)
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            self._start = torch.cuda.memory_allocated()
        elif self.measure_memory:
            _malloc_trim()
            self._hwm = _reset_peak_rss() and _rss_kib() is not None
            self._start = _rss_kib()[0] if self._hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self._tic = time.perf_counter()
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.seconds = time.perf_counter() - self._tic
        if self.device == "cuda":
            self.peak_mib = (torch.cuda.max_memory_allocated() - self._start) / 2**20
        elif not self.measure_memory:
            self.peak_mib = None
        else:
            peak = _rss_kib()[1] if self._hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            self.peak_mib = max(peak - self._start, 0) / 1024
        return False


def summarize(
    samples: list[dict[str, tuple[float, float]]],
    tokens: dict[str, int],
    memory: dict[str, tuple[float, float]] | None = None,
) -> dict[str, dict]:
    """Median seconds and max peak memory of each phase over the repeats (or the peaks of ``memory``, the round
    that measured them), with tokens/s."""
    out = {}
    for name in samples[0]:
        seconds = [s[name][0] for s in samples]
        median = statistics.median(seconds)
        n_tok = tokens.get(name)
        out[name] = {
            "seconds": median,
            "seconds_min": min(seconds),
            "seconds_all": seconds,
            "tokens": n_tok,
            "tokens_per_s": (n_tok / median) if n_tok and median > 0 else None,
            "peak_mib": max(
                (s[name][1] for s in ([memory] if memory else samples) if s[name][1] is not None), default=None
            ),
        }
    return out


# ---------------------------------------------------------------------------------------------- ours
def workload_kwargs(model: str, args, num_agents: int) -> dict:
    """Constructor arguments every algorithm module of the benchmark shares: the same workload and sampling."""
    return dict(
        agents=model,
        num_agents=num_agents,
        reward_func=brevity_reward,
        num_generations=args.k,
        max_new_tokens=args.tokens,
        generation_kwargs={"min_new_tokens": args.tokens},  # exactly T new tokens: fair timing
        eval_interval=0,
        log_completions=False,
        **SAMPLING,
    )


def assert_forced(masks, args, num_agents: int) -> None:
    """The workload must be exactly what it claims to be: N x M x K completions of exactly T tokens."""
    rows = torch.cat([mask.reshape(-1, mask.shape[-1]) for mask in masks])  # masks: [T] or [rows, T] each
    assert rows.shape[0] == num_agents * args.prompts * args.k, f"{rows.shape[0]} completions"
    assert rows.shape[1] == args.tokens and bool(rows.all()), f"completion lengths {rows.sum(-1).tolist()}"


def build_module(model: str, args, num_agents: int, device: str, **options) -> MAGRPO:
    module = MAGRPO(**workload_kwargs(model, args, num_agents), rollout_buffer_size=args.prompts, **options)
    return module.to(device)


def precision(args):
    """``--precision bf16-mixed``: bf16 autocast, as Lightning's ``trainer.precision: bf16-mixed`` runs a step."""
    if args.precision == "bf16-mixed":
        return torch.autocast(args.device, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def ours_once(module: MAGRPO, optimizer, items, args) -> dict[str, tuple[float, float]]:
    """One team update through the package's code path; returns {phase: (seconds, peak MiB)}."""
    device = args.device
    with Phase(device) as rollout_phase, precision(args):
        rollout = module.engine.rollout(module.agents, module.tokenizers, items)
    nodes = rollout.nodes
    assert_forced([agent.completion_mask for node in nodes for agent in node.agents], args, module.num_agents)

    with Phase(device) as score:  # batched, no grad: the reference / old log-prob pass
        for i, model in enumerate(module.agents):
            samples = [n.agents[i] for n in nodes]
            inputs = collate_rows(
                [s.prompt_ids for s in samples],
                [s.completion_ids for s in samples],
                [s.completion_mask for s in samples],
                module.tokenizers[i].pad_token_id,
            )
            model.eval()
            with torch.no_grad(), precision(args):
                token_logprobs(model, inputs)
            model.train()

    with Phase(device) as update:  # MAGRPO.update without Lightning's wrappers: one graph (agent) at a time
        optimizer.zero_grad()
        for i, model in enumerate(module.agents):
            batch = module.agent_batch(nodes, i)
            with precision(args):
                logp = token_logprobs(model, batch.inputs)
                loss, _ = policy_gradient_loss(logp, batch.advantages.to(logp.device), batch.weights.to(logp.device))
            loss.backward()
        clip_and_measure(trained_parameters(module.trained_models(), optimizer), module.max_grad_norm)
        optimizer.step()
        weights_changed()  # what MultiAgentModule.update tells the generation copies

    gen, rew = rollout.timings["generate"], rollout.timings["reward"]
    return {
        "generate": (gen, rollout_phase.peak_mib),
        "reward": (rew, 0.0),
        "score": (score.seconds, score.peak_mib),
        "update": (update.seconds, update.peak_mib),
    }


class Ours:
    """``MAGRPO`` on the workload; ``once()`` runs one timed team update."""

    impl = "ours"

    def __init__(self, model: str, args, num_agents: int):
        torch.manual_seed(0)
        self.model, self.num_agents, self.args = model, num_agents, args
        self.module = build_module(model, args, num_agents, args.device, generation_dtype=args.generation_dtype)
        self.optimizer = self.module.configure_optimizers()
        self.items = workload_items(args)
        self.params = n_params(self.module.agents[0])

    def once(self) -> dict[str, tuple[float, float]]:
        return ours_once(self.module, self.optimizer, self.items, self.args)


# ---------------------------------------------------------------------------------------------- actor-critic
AC_VARIANTS = {  # row label -> (module class, critic arguments given the model factory name)
    "iac": (IAC, lambda model: {"use_separate_critic": True, "critic_model": model}),
    "iac-shared": (IAC, lambda model: {"use_separate_critic": False}),
    "maac": (MAAC, lambda model: {"critic_model": model}),
}


def attach_trainer(module, device: str, logging_step: bool = False) -> None:
    """Give ``module`` what its ``update`` reads from Lightning (``self.optimizers()``, ``manual_backward``,
    ``global_step``) without ``fit``: a bare Trainer whose strategy is connected to the module and holds the
    module's own ``configure_optimizers()`` (wrapped as a LightningOptimizer, as ``fit`` would).

    ``logging_step``: also put the Trainer in its training stage and mark the module as inside ``training_step``,
    so ``self.log`` / ``log_dict`` write into the fit loop's result collection (as in ``fit``) instead of raising."""
    from lightning.pytorch import Trainer

    log = logging.getLogger("lightning.pytorch")  # mute the "GPU available" / tip lines of a throwaway Trainer
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        trainer = Trainer(
            accelerator="gpu" if device == "cuda" else "cpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
    finally:
        log.setLevel(level)
    trainer.strategy.connect(module)
    module.trainer = trainer
    trainer.strategy.optimizers = [module.configure_optimizers()]
    if logging_step:
        trainer.training = True
        module._current_fx_name = "training_step"


class ActorCritic:
    """``IAC`` / ``MAAC`` on the workload (one update on all M x K joint samples); ``once()`` times one update.

    generate / reward / score: ``collect_rollout``'s own phase timings (score = reward shaping + the critics'
    no-grad old values and targets); its peak memory is reported on the generate row. update: the module's own
    schedule of the drained buffer (``prepare_group``: the advantages, then one mini-batch of every record) and its
    real ``update``: actor and critic forwards, one backward, one AdamW step.
    """

    def __init__(self, variant: str, model: str, args, num_agents: int):
        torch.manual_seed(0)
        cls, critic_kwargs = AC_VARIANTS[variant]
        self.impl, self.model, self.num_agents, self.args = variant, model, num_agents, args
        self.module = cls(
            **workload_kwargs(model, args, num_agents),
            **critic_kwargs(model),
            critic_type=args.critic_type,
            rollout_buffer_size=args.prompts * args.k,
            train_batch_size=args.prompts * args.k,
        ).to(args.device)
        attach_trainer(self.module, args.device)
        self.items = workload_items(args)
        self.params = n_params(self.module.agents[0])  # iac-shared: the actor plus its value head

    def once(self) -> dict[str, tuple[float, float | None]]:
        device = self.args.device
        self.module.record.phase_seconds.clear()
        with Phase(device) as rollout_phase:
            rollout = self.module.collect_rollout(self.items)
        assert_forced([a.completion_mask for n in rollout.nodes for a in n.agents], self.args, self.num_agents)
        (batch,) = self.module.schedule(self.module.records(rollout))  # advantages, then one mini-batch
        with warnings.catch_warnings(), Phase(device) as update:
            warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad=True to a scalar")
            self.module.update(batch)
        t = self.module.record.phase_seconds
        return {
            "generate": (t["generate"], rollout_phase.peak_mib),
            "reward": (t["reward"], None),
            "score": (t["score"], None),
            "update": (update.seconds, update.peak_mib),
        }


# ---------------------------------------------------------------------------------------------- preference
def preference_kwargs(model: str, args, num_agents: int) -> dict:
    """``workload_kwargs`` for MADPO / MARLHF: K_c = ``--candidates`` joint candidates per prompt instead of K
    samples, and ``letter_reward`` as the oracle (``brevity_reward`` is 0 for nearly every 32-token sample, so the
    candidates would tie and no pair would form; ``letter_reward`` is a share of letters, distinct per sample)."""
    kwargs = workload_kwargs(model, args, num_agents)
    kwargs.pop("num_generations")
    kwargs.update(
        reward_func=letter_reward,
        preference_num_candidates=args.candidates,
        preference_pairs_per_sample=args.pairs_per_sample,
    )
    return kwargs


def add_pair_rates(result: dict, counts: list[dict[str, tuple[int, int]]]) -> None:
    """Fill pairs, pairs/s, tokens and tokens/s of each phase from the per-round (pairs, tokens) counts (median)."""
    for name, phase in result["phases"].items():
        pairs = statistics.median(c[name][0] for c in counts)
        tokens = statistics.median(c[name][1] for c in counts)
        phase.update(
            pairs=pairs,
            pairs_all=[c[name][0] for c in counts],
            pairs_per_s=pairs / phase["seconds"],
            tokens=tokens,
            tokens_per_s=tokens / phase["seconds"],
        )


class PairCollection:
    """``MADPO`` on the preference workload; ``once()`` collects pairs and runs one update on a pair batch.

    collect: the data module's ``collect_pairs(items)`` with the module's pair plan — K_c candidates per agent per prompt (one batched ``generate`` per agent),
    the oracle reward of every joint candidate, pair selection (``reward_gap``, ``--pairs-per-sample`` per prompt);
    tokens = the N·M·K_c·T generated tokens. update: the module's real ``training_step`` on the first
    ``--pair-batch`` pairs (per agent one forward over winner and loser rows, ``madpo_loss``, one ``manual_backward``,
    one AdamW step, ``self.log_dict``); tokens = the N·2·P·T completion tokens scored.
    """

    impl = "madpo"

    def __init__(self, model: str, args, num_agents: int):
        torch.manual_seed(0)
        self.model, self.num_agents, self.args = model, num_agents, args
        self.module = MADPO(**preference_kwargs(model, args, num_agents), train_batch_size=args.pair_batch).to(
            args.device
        )
        attach_trainer(self.module, args.device, logging_step=True)
        self.items = workload_items(args)
        self.params = n_params(self.module.agents[0])
        self.counts: list[dict[str, tuple[int, int]]] = []
        self.generate_seconds: list[float] = []
        self.batch: list = []
        self.data = PreferenceDataModule(dataset=self.items, show_progress=False)
        self.data.attach(self.module.pairs.plan())
        engine = self.module.pairs.policy.engine  # the candidates' engine (K_c aligned samples per task)
        rollout = engine.rollout

        def timed_rollout(*a, **kw):  # keep the engine's own generate / reward split of the collection
            out = rollout(*a, **kw)
            self.generate_seconds.append(out.timings["generate"])
            return out

        engine.rollout = timed_rollout

    def once(self) -> dict[str, tuple[float, float]]:
        args, device = self.args, self.args.device
        with Phase(device) as collect:
            pairs = self.data.collect_pairs(self.items)
        lengths = {len(ids) for p in pairs for ids in (*p.winner_ids, *p.loser_ids)}
        assert pairs and lengths == {args.tokens}, f"{len(pairs)} pairs, completion lengths {lengths}"
        self.batch = batch = pairs[: args.pair_batch]  # fewer when candidates tied (the pair count shows it)
        with Phase(device) as update:
            self.module.training_step(batch, 0)
        generated = self.num_agents * args.prompts * args.candidates * args.tokens
        self.counts.append(
            {
                "collect pairs": (len(pairs), generated),
                "update": (len(batch), self.num_agents * 2 * len(batch) * args.tokens),
            }
        )
        return {"collect pairs": (collect.seconds, collect.peak_mib), "update": (update.seconds, update.peak_mib)}

    def annotate(self, result: dict) -> None:
        timed = slice(1, 1 + self.args.repeats)  # not the warm-up round, nor a memory round after the timed ones
        add_pair_rates(result, self.counts[timed])
        result["phases"]["collect pairs"]["generate_seconds"] = statistics.median(self.generate_seconds[timed])


class RewardModelUpdate:
    """``MARLHF(rl_algorithm="magrpo")`` in its reward-model stage; ``once()`` runs one real reward-model ``update``
    (winner and loser joint texts through the joint reward model, Bradley–Terry loss, ``manual_backward``, one AdamW
    step) on the pair batch that ``source`` (a ``PairCollection`` measured just before it) last updated on.
    tokens = the tokens of the 2·P re-tokenized joint texts (counted outside the timed block)."""

    impl = "marlhf-rm"

    def __init__(self, source: PairCollection):
        torch.manual_seed(0)
        model, args = source.model, source.args
        self.source, self.model, self.num_agents, self.args = source, model, source.num_agents, args
        self.module = MARLHF(
            rl_algorithm="magrpo",
            reward_model_name=model,
            num_generations=args.k,
            reward_train_batch_size=args.pair_batch,
            **preference_kwargs(model, args, source.num_agents),
        ).to(args.device)
        attach_trainer(self.module, args.device, logging_step=True)
        self.module.on_train_epoch_start()  # epoch 0: the reward-model stage (reward model trainable)
        self.params = n_params(self.module.reward_model)  # the reward model's backbone + head
        self.counts: list[dict[str, tuple[int, int]]] = []

    def once(self) -> dict[str, tuple[float, float]]:
        from comlrl_lightning.agents.reward_model import joint_texts

        pairs, rm = self.source.batch, self.module.reward_model
        prompts = [[p.prompts[i] for p in pairs] for i in range(self.num_agents)]
        texts = [
            text
            for side in ("winner_completions", "loser_completions")
            for text in joint_texts(prompts, [[getattr(p, side)[i] for p in pairs] for i in range(self.num_agents)])
        ]
        tokens = int(rm.tokenize(texts)["attention_mask"].sum())
        with Phase(self.args.device) as update:
            self.module.update_reward_model(pairs)
        self.counts.append({"reward-model update": (len(pairs), tokens)})
        return {"reward-model update": (update.seconds, update.peak_mib)}

    def annotate(self, result: dict) -> None:
        add_pair_rates(result, self.counts[1 : 1 + self.args.repeats])  # the timed rounds


# ---------------------------------------------------------------------------------------------- per-sample
class PerSampleBaseline:
    """CoMLRL-style per-sample, per-token MAGRPO step in CoMLRL's style (docs/differences.md).

    generate: per agent, per prompt, one ``generate`` with ``num_return_sequences=K`` in eval mode with
    ``requires_grad`` switched off and under ``inference_mode``; reward: one call per joint action;
    score / loss: one forward per completion over ``prompt + completion[:-1]`` (all-ones mask), a Python loop
    over the completion positions with one ``log_softmax`` each (the last token is not scored, as in CoMLRL);
    update: one backward per completion, then one step of each agent's own AdamW.
    """

    impl = "per-sample"

    def __init__(self, model: str, args, num_agents: int):
        torch.manual_seed(0)
        module = build_module(model, args, num_agents, args.device)
        self.model, self.num_agents, self.params = model, num_agents, n_params(module.agents[0])
        self.items = workload_items(args)
        self.models, self.tokenizers = list(module.agents), module.tokenizers
        self.k, self.tokens, self.device = args.k, args.tokens, args.device
        self.optimizers = [
            torch.optim.AdamW(m.parameters(), lr=module.team.learning_rates[i], weight_decay=module.weight_decay)
            for i, m in enumerate(self.models)
        ]

    def generate(self, prompt: str, agent: int) -> tuple[torch.Tensor, list[torch.Tensor], list[str]]:
        model, tok = self.models[agent], self.tokenizers[agent]
        enc = tok(prompt, return_tensors="pt", add_special_tokens=False).to(self.device)
        flags = [p.requires_grad for p in model.parameters()]
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        try:
            with torch.inference_mode():
                out = model.generate(
                    **enc,
                    do_sample=True,
                    num_beams=1,
                    num_return_sequences=self.k,
                    max_new_tokens=self.tokens,
                    min_new_tokens=self.tokens,
                    pad_token_id=tok.pad_token_id,
                    return_dict_in_generate=True,
                    **SAMPLING,
                )
        finally:
            for p, flag in zip(model.parameters(), flags):
                p.requires_grad_(flag)
            model.train()
        prompt_ids = enc["input_ids"][0].clone()
        completions = [row[prompt_ids.shape[0] :].clone() for row in out.sequences]  # full padded length
        texts = [tok.decode(c, skip_special_tokens=True) for c in completions]
        return prompt_ids, completions, texts

    def sequence_logprob(self, model, prompt_ids: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
        """Σ_t log π(y_t) for t < L-1: one forward, then one log_softmax per position in Python."""
        inputs = torch.cat([prompt_ids, completion[:-1]]).unsqueeze(0)
        logits = model(input_ids=inputs, attention_mask=torch.ones_like(inputs), use_cache=False).logits[0]
        start = prompt_ids.shape[0] - 1
        total = logits.new_zeros(())
        for t in range(completion.shape[0] - 1):
            total = total + F.log_softmax(logits[start + t], dim=-1)[completion[t]]
        return total

    def once(self) -> dict[str, tuple[float, float]]:
        N, items = len(self.models), self.items
        with Phase(self.device) as gen:
            samples = [[self.generate(item["prompt"], i) for i in range(N)] for item in items]  # [M][N]
        with Phase(self.device) as rew:
            rewards = [
                torch.tensor([brevity_reward(*[[s[i][2][k]] for i in range(N)])[0] for k in range(self.k)])
                for s in samples
            ]  # one reward call per joint action
        with Phase(self.device) as score:
            with torch.no_grad():
                for i, model in enumerate(self.models):
                    model.eval()
                    for s in samples:
                        for completion in s[i][1]:
                            self.sequence_logprob(model, s[i][0], completion)
                    model.train()
        with Phase(self.device) as update:
            for i, model in enumerate(self.models):
                self.optimizers[i].zero_grad()
                for s, r in zip(samples, rewards):
                    advantages = compute_advantages(r)  # mean baseline, normalised (same as ours)
                    prompt_ids, completions, _ = s[i]
                    for k, completion in enumerate(completions):  # one backward per sample
                        loss = -advantages[k] * self.sequence_logprob(model, prompt_ids, completion) / len(completions)
                        loss.backward()
                self.optimizers[i].step()
        return {
            "generate": (gen.seconds, gen.peak_mib),
            "reward": (rew.seconds, rew.peak_mib),
            "score": (score.seconds, score.peak_mib),
            "update": (update.seconds, update.peak_mib),
        }


def measure(runners: list, args) -> list[dict]:
    """One warm-up each, then ``args.repeats`` rounds in which every runner runs once (interleaved, so load
    from other processes hits all implementations alike); median per phase."""
    for runner in runners:
        runner.once()
    runs: list[list[dict]] = [[] for _ in runners]
    for _ in range(args.repeats):
        for runner, out in zip(runners, runs):
            out.append(runner.once())
    memory = [None] * len(runners)
    if not Phase.measure_memory:  # the timed rounds kept their memory: one more round measures it
        Phase.measure_memory = True
        try:
            memory = [runner.once() for runner in runners]
        finally:
            Phase.measure_memory = False
    results = []
    for r, out, peaks in zip(runners, runs, memory):
        tokens = {} if hasattr(r, "annotate") else workload_tokens(args, r.num_agents, r.impl)
        result = {
            "impl": r.impl,
            "model": r.model,
            "num_agents": r.num_agents,
            "params_per_agent": r.params,
            "phases": summarize(out, tokens, peaks),
        }
        if hasattr(r, "annotate"):  # preference runners count their own pairs and tokens per round
            r.annotate(result)
        results.append(result)
    return results


# ---------------------------------------------------------------------------------------------- trl
def run_trl(model_name: str, args) -> dict:
    """One GRPOTrainer step (generate + reward + loss/backward/step) on the same N=1 workload."""
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        return {
            "impl": "trl",
            "model": model_name,
            "error": f"trl is not importable ({exc}); install the bench extra: pip install -e '.[bench]'",
        }

    from comlrl_lightning.agents.factories import MODEL_FACTORIES

    torch.manual_seed(0)
    model, tokenizer = MODEL_FACTORIES[model_name]()
    rows = args.prompts * (1 + args.repeats) * 2
    items = workload_items(args)  # the same M prompts every step, as in ours
    dataset = Dataset.from_dict({"prompt": [items[r % len(items)]["prompt"] for r in range(rows)]})

    def trivial_reward(completions, **kwargs):
        return [float(-len(c)) for c in completions]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps: list[tuple[float, float]] = []

        def on_step_begin(self, *a, **kw):
            gc.collect()
            cpu_memory = args.device == "cpu" and Phase.measure_memory  # off: the process keeps what it frees
            if cpu_memory:
                _malloc_trim()
            sync(args.device)
            self._gen = 0.0
            self._rss = _rss_kib()[0] if cpu_memory and _reset_peak_rss() and _rss_kib() else None
            if args.device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                self._rss = torch.cuda.memory_allocated()
            self._tic = time.perf_counter()

        def on_step_end(self, *a, **kw):
            sync(args.device)
            seconds = time.perf_counter() - self._tic
            if args.device == "cuda":
                peak = (torch.cuda.max_memory_allocated() - self._rss) / 2**20
            else:
                peak = (_rss_kib()[1] - self._rss) / 1024 if self._rss is not None else None
            self.steps.append((seconds, self._gen, peak))

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out_dir:
        config = GRPOConfig(
            output_dir=out_dir,
            num_generations=args.k,
            max_completion_length=args.tokens,
            per_device_train_batch_size=args.k * args.prompts,
            gradient_accumulation_steps=1,
            generation_kwargs={"min_new_tokens": args.tokens},
            max_steps=1 + args.repeats,
            learning_rate=5e-6,
            beta=0.0,  # no reference model (MAGRPO's default has no KL either)
            report_to="none",
            use_cpu=args.device == "cpu",
            bf16=False,
            logging_steps=10_000,
            save_strategy="no",
            log_completions=False,
            shuffle_dataset=False,
            dataloader_num_workers=0,
            seed=0,
            **SAMPLING,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = GRPOTrainer(
                model=model,
                reward_funcs=trivial_reward,
                args=config,
                train_dataset=dataset,
                processing_class=tokenizer,
                callbacks=[timer],
            )
            generate_and_score = trainer._generate_and_score_completions

            def timed(*a, **kw):  # split the step: sampling + reward vs. the rest (loss, backward, step)
                sync(args.device)
                tic = time.perf_counter()
                result = generate_and_score(*a, **kw)
                sync(args.device)
                timer._gen += time.perf_counter() - tic
                lengths = result["completion_mask"].sum(-1)
                assert bool((lengths == args.tokens).all()), f"trl generated lengths {lengths.tolist()}"
                return result

            trainer._generate_and_score_completions = timed
            trainer.train()
    steps = timer.steps[1:]  # drop the warm-up step
    tokens = args.prompts * args.k * args.tokens
    phase = {
        "step": [(s, p) for s, _, p in steps],
        "generate+reward": [(g, None) for _, g, _ in steps],
        "loss+backward+step": [(s - g, None) for s, g, _ in steps],
    }
    samples = [{name: values[r] for name, values in phase.items()} for r in range(len(steps))]
    return {
        "impl": "trl",
        "model": model_name,
        "num_agents": 1,
        "params_per_agent": n_params(model),
        "phases": summarize(samples, {"generate+reward": tokens, "loss+backward+step": tokens}),
    }


# ---------------------------------------------------------------------------------------------- report
def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def workload_items(args) -> list[dict]:
    return [{"prompt": PROMPTS[m % len(PROMPTS)]} for m in range(args.prompts)]


def workload_tokens(args, num_agents: int, impl: str = "ours") -> dict[str, int]:
    """Tokens per phase for tokens/s. The actor-critic score phase reads critic inputs (V: prompts only; MAAC:
    the re-tokenized joint text), not the N x M x K x T completion tokens, so it gets no tokens/s."""
    tokens = num_agents * args.prompts * args.k * args.tokens
    if impl in AC_VARIANTS:
        return {"generate": tokens, "update": tokens}
    return {"generate": tokens, "score": tokens, "update": tokens}


def fmt(value, spec: str) -> str:
    if value is None:
        return format("-", spec.split(".")[0])  # keep the column aligned
    return format(value, spec)


STEP_ROWS = {  # impl -> (label, phases of one training step with the default config)
    "ours": ("gen+reward+update", ("generate", "reward", "update")),
    "per-sample": ("gen+reward+update", ("generate", "reward", "update")),
    **{variant: ("gen+rew+score+upd", PHASES) for variant in AC_VARIANTS},  # old values are always needed
}


def step_seconds(result: dict) -> float:
    return sum(result["phases"][p]["seconds"] for p in STEP_ROWS[result["impl"]][1])


def print_table(results: list[dict]) -> None:
    header = f"{'model':<8} {'impl':<11} {'N':>2} {'phase':<19} {'seconds':>9} {'tokens/s':>10} {'peak MiB':>9}"
    pairs = any("pairs_per_s" in p for r in results if "error" not in r for p in r["phases"].values())
    header += f" {'pairs/s':>8}" if pairs else ""  # preference rows only
    print(header)
    print("-" * len(header))
    for r in results:
        if "error" in r:
            print(f"{r['model']:<8} {r['impl']:<11}    {r['error']}")
            continue
        for name, p in r["phases"].items():
            print(
                f"{r['model']:<8} {r['impl']:<11} {r['num_agents']:>2} {name:<19} {p['seconds']:>9.4f} "
                f"{fmt(p['tokens_per_s'], '>10.0f')} {fmt(p['peak_mib'], '>9.1f')}"
                + (f" {fmt(p.get('pairs_per_s'), '>8.1f')}" if pairs else "")
            )
        if r["impl"] in STEP_ROWS:
            label = STEP_ROWS[r["impl"]][0]
            print(f"{r['model']:<8} {r['impl']:<11} {r['num_agents']:>2} {label:<19} {step_seconds(r):>9.4f}")
    print()


def comparisons(results: list[dict], args) -> dict:
    out = {}
    by = {(r["impl"], r["model"], r.get("num_agents")): r for r in results if "error" not in r}
    for model in args.models:
        ours, base = by.get(("ours", model, args.agents)), by.get(("per-sample", model, args.agents))
        if ours and base:
            ratio = ours["phases"]["update"]["seconds"] / base["phases"]["update"]["seconds"]
            best = ours["phases"]["update"]["seconds_min"] / base["phases"]["update"]["seconds_min"]
            score = ours["phases"]["score"]["seconds"] / base["phases"]["score"]["seconds"]
            out[f"{model}/update_ours_over_per_sample"] = ratio
            out[f"{model}/update_ours_over_per_sample_min"] = best
            out[f"{model}/score_ours_over_per_sample"] = score
            print(
                f"{model}: update ours / per-sample = {ratio:.3f} median ({1 / ratio:.1f}x faster), {best:.3f} on "
                f"the fastest runs; score ours / per-sample = {score:.3f}"
            )
        ours1, trl = by.get(("ours", model, 1)), by.get(("trl", model, 1))
        if ours1 and trl:
            ours_step = step_seconds(ours1)
            trl_step = trl["phases"]["step"]["seconds"]
            upd = ours1["phases"]["update"]["seconds"] / trl["phases"]["loss+backward+step"]["seconds"]
            out[f"{model}/n1_step_ours_over_trl"] = ours_step / trl_step
            out[f"{model}/n1_update_ours_over_trl"] = upd
            print(
                f"{model} (N=1): step ours / trl = {ours_step:.3f}s / {trl_step:.3f}s = {ours_step / trl_step:.3f}; "
                f"update ours / trl loss+backward+step = {upd:.3f}"
            )
        ac = [by[(v, model, args.agents)] for v in AC_VARIANTS if (v, model, args.agents) in by]
        ours = by.get(("ours", model, args.agents))
        if ours and ac:
            parts = []
            for r in ac:
                update = r["phases"]["update"]["seconds"] / ours["phases"]["update"]["seconds"]
                step = step_seconds(r) / step_seconds(ours)
                out[f"{model}/update_{r['impl']}_over_magrpo"] = update
                out[f"{model}/step_{r['impl']}_over_magrpo"] = step
                parts.append(f"{r['impl']} {update:.2f} / {step:.2f}")
            print(f"{model}: actor-critic / MAGRPO (ours), update / whole step: {'; '.join(parts)}")
        madpo, rm = by.get(("madpo", model, args.agents)), by.get(("marlhf-rm", model, args.agents))
        if madpo and rm:
            c, u, r = madpo["phases"]["collect pairs"], madpo["phases"]["update"], rm["phases"]["reward-model update"]
            out.update(
                {
                    f"{model}/collect_pairs_per_s": c["pairs_per_s"],
                    f"{model}/collect_tokens_per_s": c["tokens_per_s"],
                    f"{model}/madpo_update_pairs_per_s": u["pairs_per_s"],
                    f"{model}/rm_update_pairs_per_s": r["pairs_per_s"],
                    f"{model}/rm_update_over_madpo_update": r["seconds"] / u["seconds"],
                }
            )
            print(
                f"{model}: preference (K_c={args.candidates}, M={args.prompts}): collect {c['pairs']:g} pairs in "
                f"{c['seconds']:.3f}s ({c['pairs_per_s']:.0f} pairs/s, {c['tokens_per_s']:.0f} generated tok/s, "
                f"generate {c['generate_seconds']:.3f}s); MADPO update on {u['pairs']:g} pairs {u['seconds']:.3f}s "
                f"({u['pairs_per_s']:.0f} pairs/s); reward-model update {r['seconds']:.3f}s ({r['pairs_per_s']:.0f} "
                f"pairs/s, {r['seconds'] / u['seconds']:.2f}x the MADPO update)"
            )
    key = "tiny-5m/update_ours_over_per_sample"
    if key in out:
        workload = (args.agents, args.k, args.tokens) == (2, 4, 32)
        met = out[key] <= TARGET_RATIO
        out["target_met"] = met if workload else None
        note = "" if workload else " (the target is defined for 2 agents x K=4 x 32 tokens; this workload differs)"
        print(f"target: tiny-5m update ours / per-sample <= 1/3: {out[key]:.3f} -> {'MET' if met else 'NOT MET'}{note}")
    return out


def machine(args) -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": args.device,
        "load_average_1_5_15": load,
    }
    if args.device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,tiny-5m", help="comma-separated factory names (default: tiny,tiny-5m)")
    p.add_argument("--agents", type=int, default=2, help="N agents (default 2)")
    p.add_argument("--k", type=int, default=4, help="K samples per prompt (default 4)")
    p.add_argument("--tokens", type=int, default=32, help="T new tokens per sample, forced (default 32)")
    p.add_argument(
        "--prompts",
        type=int,
        default=None,
        help="M prompts per update (default 1; with --preference, enough prompts for one pair batch: "
        "ceil(pair-batch / pairs-per-sample), 2 by default)",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up; median (default 3)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads on CPU (default 1: stable on shared machines; 0 = torch's default)",
    )
    p.add_argument("--baseline", action="store_true", help="also time the per-sample, per-token implementation")
    p.add_argument(
        "--precision",
        choices=("32", "bf16-mixed"),
        default="32",
        help="ours only: bf16-mixed runs its rollout, scoring and loss under bf16 autocast",
    )
    p.add_argument(
        "--generation-dtype",
        choices=("model", "bfloat16", "float16"),
        default="model",
        help="ours only: the generation_dtype field (sample from a half-precision copy)",
    )
    p.add_argument("--trl", action="store_true", help="also time trl's GRPOTrainer on the same workload at N=1")
    p.add_argument(
        "--actor-critic",
        action="store_true",
        help="also time IAC (separate critics and value heads on the actors) and MAAC updates",
    )
    p.add_argument(
        "--critic-type",
        choices=("v", "q"),
        default="v",
        help="critic_type of the actor-critic modules (default v, the modules' default)",
    )
    p.add_argument(
        "--preference",
        action="store_true",
        help="also time MADPO pair collection and update and a MARLHF reward-model update",
    )
    p.add_argument(
        "--candidates", type=int, default=8, help="K_c joint candidates per prompt for --preference (default 8)"
    )
    p.add_argument(
        "--pairs-per-sample", type=int, default=4, help="preference pairs kept per prompt for --preference (default 4)"
    )
    p.add_argument(
        "--pair-batch", type=int, default=8, help="pairs per MADPO / reward-model update for --preference (default 8)"
    )
    p.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a CPU, keep the memory a step frees for the next, as fit does (keep_freed_cpu_memory): "
        "process-wide, so for every implementation timed; each phase's memory is then measured in "
        "one more, untimed round (default on)",
    )
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    if args.k < 2:
        p.error("--k must be >= 2 (group baseline)")
    if args.candidates < 2 or args.pairs_per_sample < 1 or args.pair_batch < 1:
        p.error("--candidates must be >= 2, --pairs-per-sample and --pair-batch >= 1")
    if args.prompts is None:
        args.prompts = -(-args.pair_batch // args.pairs_per_sample) if args.preference else 1
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.device == "cpu" and args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.device == "cpu" and args.keep_freed_memory:
        Phase.measure_memory = not keep_freed_memory()  # as fit does on a CPU (agents/memory.py)
    info = machine(args)
    print(
        f"workload: N={args.agents} agents x M={args.prompts} prompt(s) x K={args.k} samples x T={args.tokens} "
        f"tokens; median of {args.repeats} after 1 warm-up"
    )
    if args.preference:
        print(
            f"preference: K_c={args.candidates} candidates per prompt (oracle letter_reward), "
            f"{args.pairs_per_sample} pairs kept per prompt, {args.pair_batch} pairs per update"
        )
    print(
        f"machine: {info['cpu_count']} CPUs, torch {info['torch']} ({info['torch_threads']} threads), "
        f"device {args.device}, load average {info['load_average_1_5_15']}"
    )
    import roofline  # benchmarks/roofline.py: the machine's measured limit, printed with every run

    limits = roofline.machine_limits(args.device, args.threads)
    info["roofline"] = roofline.as_dict(limits)
    print(roofline.describe(limits))
    load, threads = info["load_average_1_5_15"], torch.get_num_threads()
    if args.device == "cpu" and load and threads > 1 and load[0] + threads > (os.cpu_count() or 1) + 0.5:
        print(
            f"warning: load average {load[0]:.1f} on {os.cpu_count()} CPUs with {threads} torch threads: "
            "oversubscribed OpenMP threads can slow torch down by orders of magnitude; use --threads 1"
        )
    started = time.perf_counter()
    results = []
    for model in args.models:
        runners = [Ours(model, args, args.agents)]
        if args.baseline:
            runners.append(PerSampleBaseline(model, args, args.agents))
        if args.actor_critic:
            runners.extend(ActorCritic(variant, model, args, args.agents) for variant in AC_VARIANTS)
        if args.preference:
            pairs = PairCollection(model, args, args.agents)
            runners.extend([pairs, RewardModelUpdate(pairs)])  # in this order: the second uses the first's batch
        if args.trl and args.agents != 1:
            runners.append(Ours(model, args, 1))  # trl's side of the comparison is single-agent
        results.extend(measure(runners, args))
        if args.trl:
            try:
                results.append(run_trl(model, args))
            except Exception as exc:  # keep the rest of the report when trl cannot run here
                results.append(
                    {"impl": "trl", "model": model, "error": f"trl GRPOTrainer failed: {type(exc).__name__}: {exc}"}
                )
    print()
    print_table(results)
    ratios = comparisons(results, args)
    info["load_average_after"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    info["wall_seconds"] = time.perf_counter() - started
    print(f"\ntotal wall time {info['wall_seconds']:.0f}s, load average after {info['load_average_after']}")
    report = {
        "machine": info,
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "results": results,
        "comparisons": ratios,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return report


if __name__ == "__main__":
    main()
