"""One MAGRPO training step as a user runs it, phase by phase, against the machine's limit and against another
checkout of the package (benchmarks/README.md#one-training-step).

Workload: ``--model`` (default the embedded SmolLM2-135M-Instruct), N agents, M prompts per step from ``--task``
(``story``: a short writing prompt; ``mbpp``/``che``: the real MBPP / CoopHumanEval prompts through the coding
formatters and chat template), K samples per prompt of exactly T new tokens (EOS suppressed by ``min_new_tokens``).
Phases, each through the package's own code:

    generate   ``module.engine.rollout`` → its ``generate`` timing
    reward     the same rollout → its ``reward`` timing (``--reward task``: the task's real reward, e.g. the
               sandboxed coding reward; default ``trivial``, a length check)
    score      one no-grad forward per agent over every sample (what the reference KL or old log-probs cost)
    update     forward + backward of every agent's policy loss (``module.agent_batch`` → ``token_logprobs`` → loss)
    optimizer  the AdamW step the module configures (``configure_optimizers``)
    step       generate + reward + update + optimizer: a default MAGRPO step

Each implementation (this checkout, and with ``--before DIR`` another checkout, e.g. a ``git worktree`` of the
commit before a change) runs in its own process: one warm-up step, then ``--steps`` timed steps; ``--repeats``
rounds alternate the implementations so that load hits them alike. Medians, the ratio after / before per phase, and the
fraction of the limit (``roofline.py``) are printed; ``--json`` keeps every number.

    python benchmarks/bench_step.py --before /tmp/before --json benchmarks/results/step_smollm2.json

``--backends hf vllm transformers_cb`` times the generation backends side by side in one run instead (the same
workload through each; ratios against the first).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = ("generate", "reward", "score", "update", "optimizer")
STEP = ("generate", "reward", "update", "optimizer")
STORY = "Write a short story about a cat who learns to swim, in three sentences."


# ---------------------------------------------------------------------------------------------- the worker
def peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def worker(args) -> dict:
    """Run in a fresh process whose ``comlrl_lightning`` is the checkout under test: warm-up, then one timed step."""
    import torch

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    from comlrl_lightning import MAGRPO
    from comlrl_lightning.core.losses import policy_gradient_loss
    from comlrl_lightning.envs import toy
    from comlrl_lightning.rollout.sampling import token_logprobs

    if args.task in ("mbpp", "che"):
        from comlrl_lightning.envs import coding, datasets

        items = (datasets.mbpp_train_tasks() if args.task == "mbpp" else datasets.che_train_tasks())[: args.prompts]
        task = dict(
            formatters=[coding.aux_formatter, coding.main_formatter][: args.agents] if args.agents <= 2 else None,
            reward_func=coding.coding_reward if args.reward == "task" else toy.brevity_reward,
        )
        if task["formatters"] is None:
            task.pop("formatters")
    else:
        items = [{"prompt": STORY} for _ in range(args.prompts)]
        task = dict(reward_func=toy.brevity_reward)
    import contextlib
    import inspect

    if args.role == "before" and args.before_defaults:
        args.precision, args.generation_dtype = "32", "model"
    supported = any(
        "generation_dtype" in inspect.signature(k.__init__).parameters for k in MAGRPO.__mro__ if "__init__" in vars(k)
    )
    if args.generation_dtype != "model" and supported:
        task["generation_dtype"] = args.generation_dtype
    else:
        args.generation_dtype = "model"

    def precision():
        if args.precision == "bf16-mixed":
            return torch.autocast(args.device, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    if args.backend != "hf":
        task["generation_backend"] = args.backend
    torch.manual_seed(0)
    module = MAGRPO(
        agents=args.model,
        num_agents=args.agents,
        num_generations=args.k,
        max_new_tokens=args.tokens,
        generation_kwargs={"min_new_tokens": args.tokens},
        eval_interval=0,
        log_completions=False,
        rollout_buffer_size=args.prompts,
        temperature=0.6,
        top_p=0.6,
        top_k=50,
        use_chat_template=True,
        lora_rank=args.lora_rank,
        **task,
    ).to(args.device)
    if args.device == "cpu" and getattr(module, "keep_freed_cpu_memory", False):  # as fit starts (on_fit_start)
        from comlrl_lightning.agents.memory import keep_freed_memory

        keep_freed_memory()
    try:
        from comlrl_lightning.rollout.weights import weights_changed  # what an update tells the generation copies
    except ImportError:

        def weights_changed():
            pass

    optimizer = module.configure_optimizers()
    optimizer = optimizer["optimizer"] if isinstance(optimizer, dict) else optimizer
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    def timed(fn):
        sync()
        start = time.perf_counter()
        out = fn()
        sync()
        return out, time.perf_counter() - start

    def step() -> dict:
        with precision():
            rollout = module.engine.rollout(module.agents, module.tokenizers, items)
        nodes = rollout.nodes
        masks = torch.cat([a.completion_mask for n in nodes for a in n.agents])
        assert masks.shape == (args.agents * args.prompts * args.k, args.tokens) and bool(masks.all()), masks.shape
        seconds = {"generate": rollout.timings["generate"], "reward": rollout.timings["reward"]}
        if args.generate_only:
            return {
                "seconds": {**seconds, "score": 0.0, "update": 0.0, "optimizer": 0.0},
                "prompt_tokens": statistics.mean(len(n.agents[0].prompt_ids) for n in nodes),
            }

        # MAGRPO's rows and advantages (step 2 of its update): the module's agent_batch; a checkout from before
        # objectives were losses of tensors: its objective's policy_batch (before objectives: the module's).
        policy_batch = getattr(module, "agent_batch", None) or getattr(module, "objective", module).policy_batch

        def score():
            with torch.no_grad(), precision():
                for i, model in enumerate(module.agents):
                    token_logprobs(model, policy_batch(nodes, i).inputs)

        def update():
            optimizer.zero_grad()
            for i, model in enumerate(module.agents):
                batch = policy_batch(nodes, i)
                with precision():
                    logp = token_logprobs(model, batch.inputs)
                    loss, _ = policy_gradient_loss(
                        logp, batch.advantages.to(logp.device), batch.weights.to(logp.device)
                    )
                loss.backward()

        def optimize():
            optimizer.step()
            weights_changed()

        _, seconds["score"] = timed(score)
        _, seconds["update"] = timed(update)
        _, seconds["optimizer"] = timed(optimize)
        prompt_tokens = [len(n.agents[0].prompt_ids) for n in nodes]
        return {"seconds": seconds, "prompt_tokens": statistics.mean(prompt_tokens)}

    step()  # warm-up
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps = [step() for _ in range(args.steps)]
    out = {"steps": [s["seconds"] for s in steps], "prompt_tokens": steps[0]["prompt_tokens"]}
    out["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20 if args.device == "cuda" else peak_rss_mib()
    from roofline import ModelCosts

    agent = module.agents[0]
    costs = ModelCosts.of(agent.team.base if hasattr(agent, "team") else agent)  # a LoRA agent: its team's base
    out["costs"] = costs.__dict__
    out["trainable"] = sum(p.numel() for g in optimizer.param_groups for p in g["params"]) // args.agents
    out["optimizer"] = type(optimizer).__name__ + str({k: optimizer.defaults.get(k) for k in ("fused", "foreach")})
    out["settings"] = {"precision": args.precision, "generation_dtype": args.generation_dtype}
    return out


# ---------------------------------------------------------------------------------------------- the parent
def run_worker(checkout: Path, args, argv: list[str], role: str = "after", backend: str = "hf") -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": f"{checkout}{os.pathsep}{REPO / 'benchmarks'}",
        "OMP_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
    }
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--role", role, *argv, "--backend", backend]
    done = subprocess.run(command, env=env, cwd=checkout, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the worker on {checkout} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return {}
    sys.path.insert(0, str(REPO / "benchmarks"))
    import roofline
    import torch

    # Implementations: this checkout with each backend (named by it when several are compared), and another checkout.
    backends = list(dict.fromkeys(args.backends))
    if args.before and len(backends) > 1:
        sys.exit("--before compares two checkouts with one backend; give one --backends value with it")
    impls = {(b if len(backends) > 1 else "after"): (REPO, b) for b in backends}
    if args.before:
        impls["before"] = (Path(args.before).resolve(), backends[0])
    print(
        f"workload: {args.model}{f' LoRA r={args.lora_rank}' if args.lora_rank else ''}, task {args.task}, N={args.agents} x M={args.prompts} prompt(s) x K={args.k} x "
        f"T={args.tokens} forced tokens, {args.threads} thread(s), device {args.device}; {args.repeats} rounds; "
        f"generation backend(s) {', '.join(backends)}"
    )
    limits = roofline.machine_limits(args.device, args.threads)
    print(roofline.describe(limits))
    if args.precision != "32" or args.generation_dtype != "model":
        print("note: the limit is float32's (matmul and weight bytes); half-precision phases can read above 1")
    runs: dict[str, list[dict]] = {name: [] for name in impls}
    started = time.perf_counter()
    for r in range(args.repeats):
        for name, (checkout, backend) in impls.items() if r % 2 == 0 else reversed(impls.items()):
            runs[name].append(run_worker(checkout, args, argv, "before" if name == "before" else "after", backend))
    limit = limits[0]  # the benchmark's own thread count (CPU) or the GPU
    first = next(iter(runs.values()))[0]
    costs = roofline.ModelCosts(**first["costs"])
    bounds = roofline.lower_bounds(
        costs,
        limit,
        agents=args.agents,
        prompts=args.prompts,
        k=args.k,
        prompt=round(first["prompt_tokens"]),
        tokens=args.tokens,
        trainable=first.get("trainable"),
    )
    bounds["step"] = sum(bounds[p] for p in STEP if p in bounds)
    samples = args.agents * args.prompts * args.k
    report = {
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "config": vars(args),
        "limits": roofline.as_dict(limits),
        "lower_bounds_s": bounds,
        "prompt_tokens": first["prompt_tokens"],
        "impls": {},
    }
    print(
        f"prompt tokens (mean) {first['prompt_tokens']:.0f}; limit per phase (s): "
        + ", ".join(f"{k} {v:.3f}" for k, v in bounds.items())
    )
    header = f"{'impl':<7} {'phase':<10} {'median s':>9} {'min s':>8} {'of limit':>8} {'tok/s':>8} {'samples/s':>9}"
    print(header + "\n" + "-" * len(header))
    for name, out in runs.items():
        table = {}
        for phase in (*PHASES, "step"):
            values = [sum(s[p] for p in STEP) if phase == "step" else s[phase] for o in out for s in o["steps"]]
            median = statistics.median(values)
            table[phase] = {
                "median": median,
                "min": min(values),
                "all": values,
                "fraction_of_limit": bounds.get(phase, 0) / median if median > 0 else None,
            }
            tokens = samples * args.tokens if phase in ("generate", "update", "score") else None
            print(
                f"{name:<7} {phase:<10} {median:>9.3f} {min(values):>8.3f} "
                f"{table[phase]['fraction_of_limit'] or 0:>8.2f} {tokens / median if tokens and median else 0:>8.0f} "
                f"{samples / median if phase == 'step' and median else 0:>9.2f}"
            )
        report["impls"][name] = {
            "phases": table,
            "peak_mib": statistics.median(o["peak_mib"] for o in out),
            "optimizer": out[0]["optimizer"],
            "settings": out[0].get("settings"),
        }
        print(f"{name:<7} settings: {out[0].get('settings', 'precision 32, generation with the model')}")
        if args.reward == "task" and table["reward"]["median"] > 0:  # one program per joint action (aligned)
            rate = args.prompts * args.k / table["reward"]["median"]
            report["impls"][name]["reward_joint_actions_per_s"] = rate
            print(f"{name:<7} reward: {rate:.1f} joint actions (programs) per second")
    if "before" in runs:
        ratios = {
            p: report["impls"]["after"]["phases"][p]["median"] / report["impls"]["before"]["phases"][p]["median"]
            for p in (*PHASES, "step")
            if report["impls"]["before"]["phases"][p]["median"] > 0
        }

        def round_step(o: dict) -> float:
            return statistics.median(sum(s[p] for p in STEP) for s in o["steps"])

        per_round = [round_step(a) / round_step(b) for a, b in zip(runs["after"], runs["before"])]
        report["after_over_before"] = ratios
        report["after_over_before_min"] = {
            p: report["impls"]["after"]["phases"][p]["min"] / report["impls"]["before"]["phases"][p]["min"]
            for p in (*PHASES, "step")
            if report["impls"]["before"]["phases"][p]["min"] > 0
        }
        print(
            "after / before (fastest steps): "
            + ", ".join(f"{p} {v:.2f}" for p, v in report["after_over_before_min"].items())
        )
        report["step_after_over_before_per_round"] = per_round
        print("after / before (medians): " + ", ".join(f"{p} {v:.2f}" for p, v in ratios.items()))
        print("step after / before per round: " + ", ".join(f"{v:.2f}" for v in per_round))
    if len(backends) > 1:  # each backend against the first (hf), phase by phase
        base = report["impls"][backends[0]]["phases"]
        report["over_first_backend"] = {
            b: {
                p: report["impls"][b]["phases"][p]["median"] / base[p]["median"]
                for p in ("generate", "step")
                if base[p]["median"] > 0
            }
            for b in backends[1:]
        }
        for b, ratios in report["over_first_backend"].items():
            print(f"{b} / {backends[0]} (medians): " + ", ".join(f"{p} {v:.2f}" for p, v in ratios.items()))
    print("peak memory (MiB): " + ", ".join(f"{n} {r['peak_mib']:.0f}" for n, r in report["impls"].items()))
    report["wall_seconds"] = time.perf_counter() - started
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    return report


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model factory name, path or hub id")
    p.add_argument("--task", choices=("story", "mbpp", "che"), default="story", help="where the prompts come from")
    p.add_argument(
        "--reward",
        choices=("trivial", "task"),
        default="trivial",
        help="trivial (a length check) or the task's own reward (coding: sandboxed execution)",
    )
    p.add_argument("--agents", type=int, default=2, help="N agents")
    p.add_argument("--k", type=int, default=4, help="K samples per prompt")
    p.add_argument("--tokens", type=int, default=32, help="T new tokens per sample, forced")
    p.add_argument("--prompts", type=int, default=1, help="M prompts per step")
    p.add_argument(
        "--lora-rank", type=int, default=None, help="a LoRA team of this rank on one base (default: full copies)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (CPU)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--repeats", type=int, default=3, help="rounds; each implementation runs once per round")
    p.add_argument("--steps", type=int, default=3, help="timed steps per process, after one warm-up step")
    p.add_argument("--before", default=None, help="another checkout to time in the same run (e.g. a git worktree)")
    p.add_argument("--generate-only", action="store_true", help="time sampling (and the reward) only")
    p.add_argument(
        "--precision",
        choices=("32", "bf16-mixed"),
        default="32",
        help="bf16-mixed: the step under bf16 autocast, as Lightning's trainer.precision bf16-mixed runs it",
    )
    p.add_argument(
        "--generation-dtype",
        choices=("model", "bfloat16", "float16"),
        default="model",
        help="the generation_dtype field (a checkout without it samples with the model)",
    )
    p.add_argument(
        "--before-defaults",
        action="store_true",
        help="time --before with the default precision and generation dtype (today's time of a user who "
        "changes nothing), the current checkout with the options given",
    )
    p.add_argument(
        "--backends",
        nargs="+",
        choices=("hf", "vllm", "transformers_cb"),
        default=["hf"],
        help="generation backends to time side by side in one run (each in its own processes)",
    )
    p.add_argument("--backend", default="hf", help=argparse.SUPPRESS)
    p.add_argument("--role", default="after", help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help="write every number here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
