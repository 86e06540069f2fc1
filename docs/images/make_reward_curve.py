"""Draws ``docs/images/reward_curve.png``, the README's picture, from a run of the MAGRPO demo
(``configs/magrpo.yaml``: two SmolLM2-135M-Instruct agents writing a story's opening and closing sentence).

The PNG in the repository was made with these two commands (offline, CPU; the fit is the config's 24 updates: about
7 minutes on 2 idle cores, 42 minutes on the 2 shared cores it ran on)::

    python -m comlrl_lightning fit --config configs/magrpo.yaml --trainer.max_steps 24 \\
        --trainer.default_root_dir /tmp/demo
    python docs/images/make_reward_curve.py /tmp/demo

The picture is ``comlrl_lightning.analysis.plot_run`` of the run's ``metrics.csv``: the team reward of the sampled
completions (± one standard deviation) and the evaluation reward on held-out topics, against ``env_step``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from comlrl_lightning.analysis import load_run, plot_run

OUTPUT = Path(__file__).with_name("reward_curve.png")


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="the demo run's directory (its --trainer.default_root_dir, or version_N)")
    parser.add_argument("--output", type=Path, default=OUTPUT, help=f"where the PNG goes (default {OUTPUT})")
    args = parser.parse_args(argv)
    run = load_run(args.run)
    figure = plot_run(
        run,
        ["rewards", "eval"],
        title="MAGRPO demo: two SmolLM2-135M-Instruct agents co-write a story (configs/magrpo.yaml)",
    )
    figure.savefig(args.output, dpi=110)
    print(f"{args.output} from {run.attrs['source']}")
    return args.output


if __name__ == "__main__":
    main()
