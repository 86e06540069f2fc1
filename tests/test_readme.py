"""The README as a user meets it: its Python example and every ``python -m comlrl_lightning`` command it shows run as
written, in README order in one working directory, with the tiny model in place of SmolLM2 (and a few updates).

The commands are read from the README itself (code blocks and inline code), so a command that stops working, or a
new one that does not work, fails here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")
# The tiny model and a short run in place of the demo's SmolLM2 run: the same config otherwise.
TINY = [
    "--model.init_args.agents=tiny",
    "--model.init_args.max_new_tokens=4",
    "--model.init_args.eval_num_samples=1",
    "--model.init_args.keep_freed_cpu_memory=false",
    "--data.init_args.max_eval_items=2",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


def readme_commands() -> list[str]:
    """Every ``python -m comlrl_lightning ...`` of the README, in order, once each, without trailing comments."""
    found = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", README, re.S):
        found += [
            line.split("  #")[0].strip()
            for line in block.splitlines()
            if line.strip().startswith("python -m comlrl_lightning")
        ]
    spans = [(m.start(), m.group(1)) for m in re.finditer(r"(?<!`)`(python -m comlrl_lightning[^`]*)`", README)]
    blocks = [(README.index(c), c) for c in found]
    ordered = [c for _, c in sorted(blocks + spans)]
    return list(dict.fromkeys(ordered))


def test_the_readme_shows_the_commands_this_test_runs():
    commands = readme_commands()
    assert "python -m comlrl_lightning fit --model.help comlrl_lightning.MAGRPO" in commands
    assert "python -m comlrl_lightning validate --config configs/magrpo.yaml --ckpt_path last" in commands
    assert not any("..." in c for c in commands), "a README command with a placeholder cannot be run as written"


def test_every_readme_command_runs_as_written(tmp_path, monkeypatch, capsys):
    from comlrl_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(REPO / "configs")  # the commands name configs/... from the repository root
    ran = []
    for command in readme_commands():
        args = shlex.split(command)[3:]
        if "--help" in args or any(a.endswith(".help") for a in args):
            capsys.readouterr()
            with pytest.raises(SystemExit) as exit_info:
                main(args)
            out = capsys.readouterr().out
            assert exit_info.value.code == 0, command
            if "--model.help" in args:  # the model's fields, each with its description
                assert "--model.num_generations" in out, out[:2000]
                assert "samples per agent per prompt" in out, out[:2000]
            ran.append(command)
            continue
        if "configs/paper/" in command:  # GPU recipes: tests/test_paper_recipes.py fits each with tiny stand-ins
            assert (REPO / args[args.index("--config") + 1]).is_file(), command
            continue
        steps = ["--trainer.max_steps=2" if "--ckpt_path" in args else "--trainer.max_steps=1"]
        cli = main([*args, *TINY, *steps])
        assert cli.trainer.state.finished, command
        ran.append(command)
    capsys.readouterr()
    outputs = tmp_path / "outputs"
    # the resume commands continued version_0; validate --ckpt_path last evaluated the newest checkpoint in its run
    assert sorted(p.name for p in (outputs / "magrpo").iterdir()) == ["version_0", "version_1", "version_2"]
    assert (outputs / "magrpo" / "version_2" / "validate" / "version_0" / "metrics.csv").is_file()
    assert len(ran) >= 8, ran


def test_a_configuration_error_names_the_readme_command_that_lists_the_fields(tmp_path, monkeypatch, capsys):
    """A misspelt model field: the message names the closest field, and its hint a command of the README (run as
    written above) whose output lists that field (``fit --help`` shows the model only as ``--model CONFIG``)."""
    from comlrl_lightning.cli import main

    monkeypatch.chdir(REPO)
    config = ["--config", "configs/magrpo.yaml", "--trainer.default_root_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *config, "--model.init_args.num_generaton=4"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "did you mean 'num_generations'?" in err, err
    hint = re.search(r"`(python -m comlrl_lightning [^`]*)` lists its fields", err)
    assert hint and hint.group(1) in readme_commands(), err
    with pytest.raises(SystemExit) as exit_info:
        main(shlex.split(hint.group(1))[3:])
    assert exit_info.value.code == 0 and "--model.num_generations" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    assert "--model.num_generations" not in capsys.readouterr().out  # what the hint said before


def test_the_readme_python_example_runs_as_written(tmp_path, monkeypatch, capsys):
    """The Python API example with the tiny model: a plain ``Trainer(max_steps=20)`` gets a metrics row per update,
    a readable bar (lines, as stdout is not a terminal here) and last.ckpt; save_pretrained writes the team."""
    from comlrl_lightning.analysis import load_run

    section = README[README.index("## Python API") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert '"smollm2-135m-instruct"' in code
    monkeypatch.chdir(tmp_path)
    exec(compile(code.replace('"smollm2-135m-instruct"', '"tiny"'), "README.md", "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert all(re.search(rf"^update {n}/20 \| reward [-\d.]+ \| loss ", out, re.M) for n in range(1, 21)), out
    run = load_run(tmp_path / "lightning_logs", verbose=False)
    assert run["loss"].dropna().size == 20 and run["step"].max() == 19
    assert (tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt").exists()
    assert (tmp_path / "team" / "agent_0").is_dir() and (tmp_path / "team" / "agent_1").is_dir()


DOCS = sorted((REPO / "docs").glob("*.md"))


def docs_commands() -> list[tuple[str, str]]:
    """Every ``python -m comlrl_lightning ...`` of docs/*.md: ``(file name, command)``, code blocks with their
    backslash continuations joined, and inline code; a command with a placeholder (``<recipe>``) is left out."""
    found = []
    for doc in DOCS:
        text = doc.read_text(encoding="utf-8")
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            joined = re.sub(r"\\\n\s*", " ", block)
            found += [(doc.name, line.split("  #")[0].strip()) for line in joined.splitlines()]
        found += [(doc.name, m) for m in re.findall(r"(?<!`)`(python -m comlrl_lightning[^`]*)`", text)]
    return [
        (name, " ".join(command.split()))
        for name, command in dict.fromkeys(found)
        if command.startswith("python -m comlrl_lightning") and "<" not in command and "..." not in command
    ]


@pytest.mark.parametrize("doc,command", docs_commands(), ids=lambda v: v if v.endswith(".md") else None)
def test_every_docs_command_parses_as_written(doc, command, tmp_path, monkeypatch, capsys):
    """The docs' commands (many need a GPU or hours) are each parsed as written with ``--print_config``: a field or
    value that no longer exists fails here. The README's are run (above)."""
    from comlrl_lightning.cli import main

    monkeypatch.chdir(REPO)
    args = shlex.split(command)[3:]
    if args[0] == "serve":  # the vLLM launcher (comlrl_lightning/serve.py): its own arguments, a config that exists
        from comlrl_lightning.serve import build_parser

        parsed = build_parser().parse_args(args[1:])
        assert Path(parsed.config).is_file(), f"{doc}: {command}"
        return
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"] if "--help" not in args and not any(a.endswith(".help") for a in args) else args)
    captured = capsys.readouterr()
    assert exit_info.value.code in (0, None), f"{doc}: {command}\n{captured.err[-2000:]}"
