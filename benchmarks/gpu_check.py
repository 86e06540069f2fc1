"""CUDA correctness and throughput of a team on a ~0.4B model built from a config (run by ``gpu_check.sh``).

Checks (each prints PASS/FAIL and lands in the JSON):

1. ``magrpo``: MAGRPO updates of two full agents (Qwen2.5-0.5B-shaped body: 24 layers, hidden 896, 14 heads,
   2 KV heads, MLP 4864; the in-memory BPE vocabulary of the ``tiny`` factory, ~1k tokens, so ~0.36B parameters
   each) on the GPU: finite losses, changed weights, ``global_step`` counts updates, env_step counts joint actions.
2. ``lora``: the same team as a LoRA team on ONE base (rank 16, every linear layer), reference KL on: the base is
   unchanged, every adapter trained, the reference is the base with adapters off; peak GPU memory of 2 and 4
   agents, full copies against LoRA, one update each.
3. ``fsdp``: the same team sharded with FSDP2 (``ModelParallelStrategy``) over the GPUs present (one GPU: one
   rank, which still runs the gather / reduce-scatter path of ``agents/sharding.py`` on CUDA): updates run, weights
   change. ``ddp``: Lightning DDP over the GPUs present — skipped on one GPU (NCCL cannot put two ranks on one device).
4. ``shared_prefix``: sampling with each prompt's KV cache kept once against the cache repeated K times, seed for
   seed: the same tokens and log-probs in float32 (bfloat16's differences recorded), and each form's time.
5. Throughput: generated tokens/s and updates/s of MAGRPO steps (N=2, K=8, T=128 forced new tokens, 4 prompts per
   step), full and LoRA, bf16 and fp32; the first step (warm-up) is not timed.

    python benchmarks/gpu_check.py --json benchmarks/results/gpu_check.json           # on a GPU machine
    python benchmarks/gpu_check.py --smoke                                           # CPU, small, seconds
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
import traceback
import warnings
from pathlib import Path

import torch

warnings.filterwarnings("ignore")
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

BODY = dict(
    hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, intermediate_size=4864, max_position_embeddings=1024
)
SMOKE = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=128,  # heads of 32: vLLM's CPU minimum
    max_position_embeddings=512,
)


def module(
    args,
    num_agents=2,
    lora=None,
    dtype="float32",
    k=4,
    tokens=16,
    reference=False,
    lr=1e-5,
    backend="hf",
    generation_kwargs=None,
):
    from comlrl_lightning import MAGRPO
    from comlrl_lightning.envs import toy

    extra = {"lora_rank": lora, "lora_alpha": 2.0 * lora} if lora else {}
    if backend != "hf":
        extra["generation_backend"] = backend
    if reference:
        extra.update(reference_kl_enabled=True, reference_kl_coef=0.05)
    return MAGRPO(
        agents="tiny",
        num_agents=num_agents,
        reward_func=toy.letter_reward,
        num_generations=k,
        max_new_tokens=tokens,
        generation_kwargs={"min_new_tokens": tokens, **(generation_kwargs or {})},
        temperature=1.0,
        top_p=1.0,
        top_k=None,
        rollout_buffer_size=args.prompts,
        agent_learning_rate=lr,
        eval_interval=0,
        log_completions=False,
        model_config={"model_kwargs": args.body, "dtype": dtype},
        **extra,
    )


def fit(args, mod, steps, callbacks=(), strategy="auto"):
    from lightning.pytorch import Trainer, seed_everything

    from comlrl_lightning import TaskDataModule
    from comlrl_lightning.envs import toy

    seed_everything(0)
    trainer = Trainer(
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator=args.accelerator,
        devices=1,
        callbacks=list(callbacks),
        strategy=strategy,
    )
    trainer.fit(mod, datamodule=TaskDataModule(dataset=toy.story_tasks, prompts_per_step=args.prompts))
    return trainer


def snapshot(params):
    return [p.detach().float().clone() for p in params]


def changed(before, params):
    return all(not torch.equal(b, p.detach().float()) for b, p in zip(before, params))


def check_magrpo(args, report):
    from lightning.pytorch import Callback

    class Where(Callback):  # Lightning moves the module back to the CPU when the fit ends
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.device = str(pl_module.agent_device(0))

    where = Where()
    mod = module(args)
    agents = list(mod.agents)
    before = [snapshot(a.parameters()) for a in agents]
    trainer = fit(args, mod, steps=2, callbacks=[where])
    finite = all(torch.isfinite(p).all() for p in mod.parameters())
    on_device = where.device.startswith("cuda" if args.accelerator == "gpu" else "cpu")
    ok = (
        trainer.global_step == 2
        and finite
        and all(changed(b, a.parameters()) for b, a in zip(before, agents))
        and mod.env_step == 2 * args.prompts * 4
        and on_device
    )
    report["magrpo"] = {
        "pass": bool(ok),
        "global_step": trainer.global_step,
        "env_step": mod.env_step,
        "finite": bool(finite),
        "params_per_agent": sum(p.numel() for p in agents[0].parameters()),
        "trained_on": where.device,
    }


def check_lora(args, report):
    mod = module(args, lora=16, reference=True, lr=1e-3)
    team = mod.agents[0].team
    base_before = snapshot(p for n, p in team.base.named_parameters() if "lora_" not in n)
    adapters_before = [snapshot(mod.agents[i].trainable_parameters()) for i in range(2)]
    trainer = fit(args, mod, steps=2)
    base_same = all(
        torch.equal(b, p.detach().float())
        for b, p in zip(base_before, (p for n, p in team.base.named_parameters() if "lora_" not in n))
    )
    trained = [
        any(not torch.equal(b, p.detach().float()) for b, p in zip(before, mod.agents[i].trainable_parameters()))
        for i, before in enumerate(adapters_before)
    ]
    ids = torch.tensor([[5, 17, 42, 9, 3]], device=mod.agent_device(0))
    with torch.no_grad():
        with team.peft.disable_adapter():
            plain = team.peft(input_ids=ids).logits
        reference = mod.reference.models[0](input_ids=ids).logits
    ok = trainer.global_step == 2 and base_same and all(trained) and torch.equal(plain, reference)
    report["lora"] = {
        "pass": bool(ok),
        "base_unchanged": base_same,
        "adapters_trained": trained,
        "reference_is_base": bool(torch.equal(plain, reference)),
        "adapter_params_per_agent": sum(p.numel() for p in mod.agents[0].trainable_parameters()),
    }


def check_fsdp(args, report):
    """Agents sharded with FSDP2 (ModelParallelStrategy) on the GPUs present: updates run, weights change."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    mod = module(args)
    before = snapshot(mod.agents[0].parameters())
    gpus = max(torch.cuda.device_count(), 1)
    trainer = fit(
        args,
        mod,
        steps=2,
        strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1) if gpus == 1 else "auto",
    )
    after = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in mod.agents[0].parameters()]
    ok = trainer.global_step == 2 and all(torch.isfinite(p).all() for p in after) and changed(before, after)
    report["fsdp"] = {"pass": bool(ok), "global_step": trainer.global_step, "sharded": type(mod.agents[0]).__name__}


def check_shared_prefix(args, report):
    """Sampling with each prompt's KV cache kept once (rollout/backends/hf_shared_prefix.py) against the cache repeated K times,
    on the device, seed for seed, prompts of several lengths (left padding): in float32 the rows' tokens agree and
    the kept log-probs agree to rounding up to a row's first differing token; bfloat16's numbers are recorded. Each
    form's sampling time is recorded too."""
    from comlrl_lightning.agents.factories import MODEL_FACTORIES
    from comlrl_lightning.rollout.backends import hf as sampling

    device = "cuda" if args.accelerator == "gpu" else "cpu"
    prompts = [" ".join(["the quick brown fox jumps"] * n) for n in (2, 8, 20, 40)][: args.prompts]
    cfg = sampling.SamplingConfig(
        max_new_tokens=args.tokens, temperature=1.0, top_p=1.0, top_k=None, keep_logprobs=True
    )
    share = sampling.can_share
    rows = {}
    for dtype in ("float32", "bfloat16"):
        model, tok = MODEL_FACTORIES["tiny"](**args.body, dtype=dtype)
        model.to(device).eval()
        runs, seconds = {}, {}
        for form in ("warm-up", "shared", "repeated"):
            sampling.can_share = (lambda cache, model: False) if form == "repeated" else share
            try:
                torch.manual_seed(0)
                if device == "cuda":
                    torch.cuda.synchronize()
                tic = time.perf_counter()
                # no forced length: its logits processors would keep the log-probs from being recorded
                runs[form] = sampling.sample_completions(model, tok, prompts, args.k, cfg)
                if device == "cuda":
                    torch.cuda.synchronize()
                seconds[form] = time.perf_counter() - tic
            finally:
                sampling.can_share = share
        shared, repeated = runs["shared"], runs["repeated"]
        differ = shared.completion_ids != repeated.completion_ids
        # up to each row's first differing token, both forms condition on the same tokens
        same_so_far = (differ.long().cumsum(dim=1) == 0) & shared.completion_mask & repeated.completion_mask
        gap = (shared.logprobs - repeated.logprobs).abs()[same_so_far]
        rows[dtype] = {
            "rows_identical": float((~differ).all(dim=1).float().mean()),
            "max_logprob_gap": float(gap.max()) if gap.numel() else 0.0,
            "shared_seconds": seconds["shared"],
            "repeated_seconds": seconds["repeated"],
            "shared_over_repeated": seconds["shared"] / seconds["repeated"],
        }
        print(
            f"  {dtype}: rows identical {rows[dtype]['rows_identical']:.2f}, max log-prob gap "
            f"{rows[dtype]['max_logprob_gap']:.2e}, sampling shared / repeated "
            f"{rows[dtype]['shared_over_repeated']:.2f} ({seconds['shared']:.2f} / {seconds['repeated']:.2f} s)",
            flush=True,
        )
        del model
    fp32 = rows["float32"]
    report["shared_prefix"] = {"pass": fp32["rows_identical"] >= 0.9 and fp32["max_logprob_gap"] <= 1e-3, **rows}


def peak_memory(args, num_agents, lora):
    """Peak GPU memory (GiB) of one update of a team, and the weights' share of it."""
    import gc

    gc.collect()
    if args.accelerator != "gpu":
        return None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    mod = module(args, num_agents=num_agents, lora=lora)
    mod.agents  # noqa: B018  (loads the team)
    weights = sum(p.numel() * p.element_size() for p in mod.parameters())
    fit(args, mod, steps=1)
    peak = torch.cuda.max_memory_allocated()
    del mod
    gc.collect()
    torch.cuda.empty_cache()
    return {"agents": num_agents, "lora": bool(lora), "weights_gib": weights / 2**30, "peak_gib": peak / 2**30}


def throughput(args, lora, dtype, report, backend="hf", generation_kwargs=None, label=None):
    from lightning.pytorch import Callback

    class Clock(Callback):
        def __init__(self):
            self.marks = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if args.accelerator == "gpu":
                torch.cuda.synchronize()
            self.marks.append((time.perf_counter(), pl_module.env_step, dict(pl_module.record.phase_seconds)))

    clock = Clock()
    mod = module(
        args,
        lora=lora,
        dtype=dtype,
        k=args.k,
        tokens=args.tokens,
        lr=1e-5 if not lora else 1e-4,
        backend=backend,
        generation_kwargs=generation_kwargs,
    )
    fit(args, mod, steps=args.steps, callbacks=[clock])
    (t0, e0, _), (t1, e1, _) = clock.marks[0], clock.marks[-1]
    steps = len(clock.marks) - 1
    samples = e1 - e0
    phases = {}
    for _, _, step in clock.marks[1:]:  # each step's own phase times (PhaseTimer resets them after our callback)
        for phase, seconds in step.items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    row = {
        "engine": label or backend,
        "lora": bool(lora),
        "dtype": dtype,
        "steps_timed": steps,
        "seconds_per_step": (t1 - t0) / steps,
        "phase_seconds_per_step": {k: v / steps for k, v in phases.items()},
        "generate_tokens_per_s": samples * 2 * args.tokens / phases["generate"] if phases.get("generate") else None,
        "updates_per_s": steps / (t1 - t0),
        "samples_per_s": samples / (t1 - t0),
        "generated_tokens_per_s_overall": samples * 2 * args.tokens / (t1 - t0),
    }
    report.setdefault("throughput", []).append(row)
    print(
        f"  {row['engine']} {'lora' if lora else 'full'} {dtype}: {row['seconds_per_step']:.2f} s/step, "
        f"{row['generated_tokens_per_s_overall']:.0f} generated tokens/s (whole step), "
        f"{row['generate_tokens_per_s'] or 0:.0f} in generation, "
        f"{row['updates_per_s']:.2f} updates/s",
        flush=True,
    )


def run_check(name, function, report, *args):
    """Run one check; an exception fails it (with its trace in the report) and the others still run."""
    tic, error = time.perf_counter(), None
    try:
        function(*args)
    except Exception as err:  # keep going: every check reports
        error = f"{type(err).__name__}: {err}"
        report[f"{name}_error"] = traceback.format_exc()[-3000:]
        if isinstance(report.get(name), dict) or name not in report:
            report[name] = {**report.get(name, {}), "pass": False, "error": error}
    report.setdefault("seconds", {})[name] = time.perf_counter() - tic
    result = report.get(name)
    passed = result.get("pass") if isinstance(result, dict) else None
    label = "FAIL" if error or passed is False else "PASS" if passed else "DONE"
    print(f"[{label}] {name} ({time.perf_counter() - tic:.0f} s) {error or ''}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small model, CPU allowed: checks the script itself")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--only", choices=["fsdp", "engines"], default=None, help="run one check only")
    args = parser.parse_args()
    args.accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    args.body = SMOKE if args.smoke else BODY
    if args.smoke:
        args.k, args.tokens, args.steps = 2, 8, 2
    report = {
        "machine": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "gpus": torch.cuda.device_count(),
        },
        "config": {k: v for k, v in vars(args).items()},
    }
    print(json.dumps(report["machine"]), flush=True)

    def engines():
        """The generation engines on the throughput workload (full copies, bf16): transformers' continuous
        batching and a static KV cache with compiled decoding against plain hf, and vLLM where it is installed (the
        lent GPU machine has no network to install it). Each row's generated tokens/s in generation against hf's."""
        import importlib.util

        plain = dict(backend="hf", label="hf")
        points = [
            plain,
            dict(backend="transformers_cb", label="transformers_cb"),
            dict(backend="hf", label="hf static cache, compiled", generation_kwargs={"cache_implementation": "static"}),
        ]
        if importlib.util.find_spec("vllm") is not None:
            points.append(dict(backend="vllm", label="vllm"))
        else:
            report["engines_note"] = "vLLM not installed here: its point is not measured"
            print("  vllm: not installed on this machine, not measured", flush=True)
        rows = []
        for point in points:
            try:
                throughput(args, None, "bfloat16", report, **point)
                rows.append(report["throughput"][-1])
            except Exception as err:  # one engine failing must not hide the others' numbers
                rows.append({"engine": point["label"], "error": f"{type(err).__name__}: {err}"})
                print(f"  {point['label']}: FAILED {type(err).__name__}: {err}", flush=True)
        base = rows[0].get("generate_tokens_per_s")
        for row in rows:
            if base and row.get("generate_tokens_per_s"):
                row["generate_over_hf"] = row["generate_tokens_per_s"] / base
        report["engines"] = rows

    if args.only == "engines":
        run_check("engines", engines, report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        raise SystemExit(0)
    if args.only == "fsdp":
        run_check("fsdp", check_fsdp, report, args, report)
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
        raise SystemExit(0 if report["fsdp"].get("pass") else 1)
    run_check("magrpo", check_magrpo, report, args, report)
    run_check("fsdp", check_fsdp, report, args, report)
    run_check("lora", check_lora, report, args, report)
    run_check("shared_prefix", check_shared_prefix, report, args, report)
    if torch.cuda.device_count() > 1:
        report["ddp"] = {"pass": None, "note": "run benchmarks/bench_scaling.py --device cuda --processes 1,2"}
    else:
        report["ddp"] = {
            "pass": None,
            "note": f"{torch.cuda.device_count()} GPU(s): DDP needs one GPU per rank; "
            "skipped (CPU gloo tests cover it)",
        }
    print("[SKIP] ddp:", report["ddp"]["note"], flush=True)

    def memory():
        report["memory"] = [peak_memory(args, n, lora) for n in (2, 4) for lora in (None, 16)]
        for row in report["memory"]:
            if row:
                print(
                    f"  {row['agents']} agents {'LoRA' if row['lora'] else 'full'}: weights "
                    f"{row['weights_gib']:.2f} GiB, peak {row['peak_gib']:.2f} GiB",
                    flush=True,
                )

    run_check("memory", memory, report)

    def speed():
        for lora, dtype in ((None, "bfloat16"), (16, "bfloat16"), (None, "float32")):
            throughput(args, lora, dtype, report)

    run_check("throughput", speed, report)
    run_check("engines", engines, report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    failed = [k for k in ("magrpo", "fsdp", "lora", "shared_prefix") if not report.get(k, {}).get("pass")]
    print("FAILED: " + ", ".join(failed) if failed else "all checks passed", flush=True)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
