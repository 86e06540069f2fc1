"""A catalogue of bad configurations, tried through the CLI as a user would type them.

Every case must end with exit code 2 and one message on stderr that names the field (and, where the message can,
the value given and what is allowed): no traceback, no model loaded (every model factory is booby-trapped), nothing
written under the run's directory, and never the comparator API key. A case runs ``fit`` unless its config is
prefixed with another subcommand (``validate:magrpo``). ``LATE_CASES`` are mistakes only a loaded model reveals: one
message still, after the model loads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from comlrl_lightning.agents.factories import MODEL_FACTORIES

REPO = Path(__file__).resolve().parents[1]
SECRET = "sk-CATALOGUE-SECRET-42"
M = "--model.init_args."
D = "--data.init_args."

CASES = [
    # ------------------------------------------------------------------ MAGRPO family: rollout, schedule, losses
    ("magrpo", [M + "num_generations=1"], "num_generations must be >= 2"),
    ("magrpo", [M + "num_turns=0"], "num_turns must be >= 1"),
    ("magrpo", [M + "num_turns=2"], "requires an external_transition"),
    ("magrpo", [M + "rollout_buffer_size=0"], "rollout_buffer_size must be >= 1"),
    ("magrpo", [M + "train_batch_size=0"], "train_batch_size must be >= 1"),
    ("magrpo", [M + "generation_batch_size=0"], "generation_batch_size must be >= 1"),
    ("magrpo", [M + "micro_batch_size=0"], "micro_batch_size must be >= 1"),
    ("magrpo", [M + "micro_batch_tokens=0"], "micro_batch_tokens must be >= 1"),
    ("magrpo", [M + "discount=1.5"], "discount must be in [0, 1]"),
    ("magrpo", [M + "advantage_mode=midrange"], "advantage_mode must be one of"),
    ("magrpo", [M + "loss_aggregation=mean_of_means"], "loss_aggregation must be one of"),
    ("magrpo", [M + "reference_kl_coef=-0.1"], "reference_kl_coef must be >= 0"),
    ("magrpo", [M + "reference_kl_estimator=k9"], "reference_kl_estimator must be one of"),
    ("magrpo", [M + "reference_kl_placement=nowhere"], "reference_kl_placement must be one of"),
    ("magrpo", [M + "joint_mode=diagonal"], "joint_mode"),
    ("magrpo", [M + "reward_timeout=0"], "reward_timeout must be > 0"),
    ("magrpo", [M + "eval_interval=-1"], "eval_interval must be >= 0"),
    ("magrpo", [M + "eval_num_samples=-1"], "eval_num_samples must be >= 0"),
    ("magrpo", [M + "eval_logger=comlrl_lightning.envs.toy.story_reward"], "eval_logger and eval_aggregator"),
    ("magrpo", [M + "reward_func=null"], "reward_func must be a callable"),
    ("magrpo", [M + "reward_func=comlrl_lightning.envs.toy.no_such_reward"], "reward_func"),
    ("magrpo", [M + "reward_func=comlrl_lightning.envs.toy.opening_prompt"], "cannot take the completions of 2 agents"),
    ("magrpo", [M + "reward_processor=42"], "reward_processor"),
    (
        "magrpo",
        [
            M + "formatters=[comlrl_lightning.envs.toy.opening_prompt,comlrl_lightning.envs.toy.opening_prompt,"
            "comlrl_lightning.envs.toy.closing_prompt]"
        ],
        "number of formatters (3) must match num_agents (2)",
    ),
    ("magrpo", [M + "max_new_tokens=0"], "max_new_tokens must be >= 1"),
    (
        "magrpo",
        [M + "max_new_tokens=100000"],
        "max_new_tokens = 100000 does not fit the context of the model 'smollm2-135m-instruct'",
    ),
    ("magrpo", [M + "temperature=0"], "temperature must be > 0"),
    ("magrpo", [M + "top_p=1.5"], "top_p must be in (0, 1]"),
    ("magrpo", [M + "top_k=0"], "top_k must be >= 1"),
    ("magrpo", [M + "generation_kwargs={do_sample: false}"], "generation_kwargs must not set ['do_sample']"),
    ("magrpo", [M + "num_generations=many"], "num_generations"),
    ("magrpo", [M + "no_such_field=1"], "no_such_field"),
    ("magrpo", [M + "num_generaton=4"], "'num_generaton' is not accepted; did you mean 'num_generations'?"),
    ("magrpo", [D + "prompts_per_stp=2"], "'prompts_per_stp' is not accepted; did you mean 'prompts_per_step'?"),
    ("magrpo", ["--trainer.max_stepz=3"], "--trainer.max_stepz=3; did you mean 'trainer.max_steps'?"),
    ("magrpo", [M + "collaboration_mode=hybrid"], "collaboration_mode must be one of: decentralized, centralized"),
    # ------------------------------------------------------------------ agents, optimizer, devices
    ("magrpo", [M + "agents=null"], "agents is required (got None)"),  # never a random test model by default
    ("magrpo", [M + "agents=./no/such/model"], "agents = './no/such/model' looks like a local path"),
    ("magrpo", [M + "agents={tmp}/not_a_dataset_dir"], "not_a_dataset_dir' is an empty folder"),
    ("magrpo", [M + "agents=[tiny,{tmp}/not_a_dataset_dir]"], "agents[1] = "),
    ("magrpo", [M + "agents=[smollm2-135m-instruct,./no/such/model]"], "agents[1] = './no/such/model'"),
    ("magrpo", [M + "num_agents=0"], "num_agents must be >= 1"),
    ("magrpo", [M + "agents=[tiny,tiny]", M + "num_agents=3"], "agents length (2) must match num_agents (3)"),
    ("magrpo", [M + "tokenizers=[tiny,tiny,tiny]"], "tokenizers length must match agents"),
    ("magrpo", [M + "agent_learning_rate=0"], "agent_learning_rate must be > 0"),
    ("magrpo", [M + "agent_learning_rate=[1e-5,1e-5,1e-5]"], "agent_learning_rate must be one value or one per agent"),
    ("magrpo", [M + "weight_decay=-1"], "weight_decay must be >= 0"),
    ("magrpo", [M + "max_grad_norm=0"], "max_grad_norm must be > 0"),
    ("magrpo", [M + "parallel_training=ddp"], "parallel_training must be one of: none, mp"),
    ("magrpo", [M + "parallel_training=mp"], "parallel_training='mp' requires explicit agent_devices"),
    (
        "magrpo",
        [M + "parallel_training=mp", M + "agent_devices=[]"],
        "agent_devices must be a non-empty list or 'auto'",
    ),
    ("magrpo", [M + "agent_devices=[gpu0,cpu]"], "agent_devices has an invalid device 'gpu0'"),  # without mp too
    ("magrpo", [M + "parallel_training=mp", M + "agent_devices=[gpu0,gpu1]"], "agent_devices"),
    ("magrpo", [M + "model_config={flash: true}"], "model_config has unknown keys ['flash']"),
    ("magrpo", [M + "model_config={dtype: float99}"], "dtype must be"),
    ("magrpo", [M + "model_config={gradient_checkpointing: maybe}"], "model_config.gradient_checkpointing"),
    ("magrpo", [M + "model_config={model_kwargs: {hidden: 3}}", M + "agents=tiny"], "model_kwargs not accepted"),
    # ------------------------------------------------------------------ data
    ("magrpo", [D + "dataset=./no/such/items.jsonl"], "looks like a local path but does not exist"),
    ("magrpo", [D + "dataset={tmp}/items.txt"], "unsupported extension .txt"),
    ("magrpo", [D + "dataset={tmp}/empty.jsonl"], "has no items"),
    ("magrpo", [D + "dataset={tmp}/truncated.json"], "could not be read as json"),
    ("magrpo", [D + "dataset={tmp}/malformed.jsonl"], "could not be read as json: line 2, column 11"),
    ("magrpo", [D + "dataset={tmp}/not_a_dataset_dir"], "not one written by Dataset.save_to_disk"),
    ("magrpo", [D + "dataset=null"], "dataset is required"),
    ("magrpo", [D + "eval_dataset=./no/such/eval.jsonl"], "does not exist"),
    ("magrpo", [D + "eval_dataset={tmp}/empty.jsonl"], "eval_dataset"),
    ("magrpo", [D + "dataset=no-org/no-such-dataset"], "could not be loaded"),
    ("magrpo", [D + "prompts_per_step=0"], "prompts_per_step must be >= 1"),
    ("magrpo", [D + "eval_batch_size=0"], "eval_batch_size must be >= 1"),
    ("magrpo", [D + "max_train_items=0"], "max_train_items must be >= 1"),
    ("magrpo", [D + "max_eval_items=0"], "max_eval_items must be >= 1"),
    ("magrpo", [D + "shuffle=perhaps"], "shuffle"),
    # ------------------------------------------------------------------ trainer and CLI
    ("magrpo", ["--checkpoint_every_n_updates=-1"], "checkpoint_every_n_updates must be >= 0"),
    ("magrpo", ["--checkpoint_total_limit=0"], "checkpoint_total_limit must be >= 1 or null (got 0)"),
    ("magrpo", ["--ckpt_path=last"], "ckpt_path last: no checkpoint under"),
    ("magrpo", ["--trainer.default_root_dir={tmp}/items.txt/run"], "trainer.default_root_dir '"),
    ("magrpo", ["--ckpt_path=./no/such.ckpt"], "ckpt_path './no/such.ckpt' is not a checkpoint"),
    ("magrpo", ["--trainer.max_steps=many"], "max_steps"),
    ("magrpo", ["--trainer.no_such_option=1"], "no_such_option"),
    ("magrpo", ["--trainer.max_steps", "-5"], "trainer.max_steps: `max_steps` must be a non-negative integer or -1"),
    ("magrpo", [M + "agent_learning_rate", "-1e-4"], "agent_learning_rate must be > 0"),  # a negative number parses
    ("magrpo", [M + "temperature", "-.5"], "temperature must be > 0"),
    *([] if torch.cuda.is_available() else [("magrpo", ["--trainer.accelerator", "gpu"], "no CUDA GPU is available")]),
    ("magrpo", ["--ckpt_path={tmp}/truncated.ckpt"], "cannot be read as a checkpoint"),
    ("magrpo", ["--ckpt_path={tmp}/notes.ckpt"], "cannot be read as a checkpoint"),
    ("magrpo", ["--ckpt_path=best"], "ckpt_path best: no checkpoint under"),
    ("validate:magrpo", ["--ckpt_path=last"], "ckpt_path last: no checkpoint under"),
    ("test:magrpo", ["--ckpt_path=best"], "ckpt_path best: no checkpoint under"),
    ("predict:magrpo", ["--ckpt_path={tmp}/truncated.ckpt"], "cannot be read as a checkpoint"),
    ("validate:magrpo", ["--ckpt_path=./no/such.ckpt"], "ckpt_path './no/such.ckpt' is not a checkpoint"),
    # ------------------------------------------------------------------ user code and files, before any model loads
    ("magrpo", [M + "agents={tmp}/team"], "is a team folder written by save_pretrained"),
    ("magrpo", [D + "eval_dataset={tmp}/other_keys.jsonl"], "failed on the first item of the evaluation items"),
    ("magrpo", [D + "dataset={tmp}/other_keys.jsonl"], "failed on the first item of the training items"),
    ("validate:magrpo", [D + "eval_dataset={tmp}/other_keys.jsonl"], "needs the key 'topic'"),
    ("predict:magrpo", [D + "predict_dataset={tmp}/other_keys.jsonl"], "failed on the first item of the predict items"),
    # ------------------------------------------------------------------ IAC / MAAC
    ("iac", [M + "num_generations=0"], "num_generations must be >= 1"),
    (
        "iac",
        [
            M + "num_turns=2",
            M + "num_generations=2",
            M + "external_transition=comlrl_lightning.envs.toy.revise_transition",
        ],
        "Multi-turn IAC currently supports num_generations == 1",
    ),
    ("iac", [M + "num_turns=2", M + "num_generations=1"], "Multi-turn IAC requires an external_transition"),
    ("iac", [M + "critic_type=w"], "critic_type must be one of"),
    ("iac", [M + "value_loss_coef=0"], "value_loss_coef must be > 0"),
    ("iac", [M + "value_clip_range=0"], "value_clip_range must be > 0"),
    ("iac", [M + "critic_learning_rate=0"], "critic_learning_rate must be > 0"),
    ("iac", [M + "discount=2"], "discount must be in [0, 1]"),
    (
        "iac",
        [M + "use_separate_critic=true", M + "critic_model=null"],
        "Either critic_model or critics must be provided",
    ),
    ("iac", [M + "use_separate_critic=true", M + "critic_model=./no/such/critic"], "critic_model = './no/such/critic'"),
    (
        "iac",
        [M + "use_separate_critic=true", M + "critics=[tiny,tiny,tiny]"],
        "critics length (3) must match the number of agents (2)",
    ),
    (
        "iac",
        [M + "use_separate_critic=false", M + "critics=[tiny,tiny]"],
        "critics can only be provided when use_separate_critic=True",
    ),
    ("iac", [M + "critic_devices=[gpu0,cpu]"], "critic_devices has an invalid device 'gpu0'"),
    (
        "iac",
        [
            M + "use_separate_critic=true",
            M + "critic_model=tiny",
            M + "parallel_training=mp",
            M + "agent_devices=[cpu,cpu]",
        ],
        "parallel_training='mp' requires explicit critic_devices",
    ),
    ("iac", [M + "critic_value_head_hidden_dim=-1"], "critic_value_head_hidden_dim must be >= 0"),
    ("iac", [M + "reward_timeout=-5"], "reward_timeout must be > 0"),
    ("maac", [M + "critics=[tiny,tiny]", M + "critic_model=null"], "critics length (2) must match 1 critic for MAAC"),
    ("maac", [M + "critic_model=null"], "Either critic_model or critics must be provided for MAAC"),
    ("maac", [M + "critic_type=z"], "critic_type must be one of"),
    # ------------------------------------------------------------------ MADPO / MARLHF
    ("madpo", [M + "dpo_beta=0"], "dpo_beta must be > 0"),
    ("madpo", [M + "preference_num_candidates=1"], "preference_num_candidates must be >= 2"),
    ("madpo", [M + "preference_pairs_per_sample=0"], "preference_pairs_per_sample must be >= 1"),
    ("madpo", [M + "pair_selection=best"], "pair_selection must be one of"),
    (
        "madpo",
        [M + "pair_selection=all", M + "preference_pairs_per_sample=2"],
        "preference_pairs_per_sample must be null when pair_selection='all'",
    ),
    ("madpo", [M + "environment_steps_per_pair=0"], "environment_steps_per_pair must be >= 1"),
    ("madpo", [M + "train_batch_size=0"], "train_batch_size must be >= 1"),
    ("madpo", [M + "num_turns=2"], "MADPO currently supports num_turns=1 only"),
    ("madpo", [M + "joint_mode=cross"], "supports aligned joint_mode only"),
    ("madpo", [D + "pairs_file={tmp}"], "pairs_file must be a file path"),
    ("marlhf", [M + "rl_algorithm=ppo"], "rl_algorithm must be one of"),
    ("marlhf", [M + "reward_learning_rate=0"], "reward_learning_rate must be > 0"),
    ("marlhf", [M + "reward_num_train_epochs=0"], "reward_num_train_epochs must be >= 1"),
    ("marlhf", [M + "reward_train_batch_size=0"], "reward_train_batch_size must be >= 1"),
    ("marlhf", [M + "reward_max_length=0"], "reward_max_length must be >= 1"),
    ("marlhf", [M + "reward_model_name=./no/such/rm"], "reward_model_name = './no/such/rm'"),
    ("marlhf", [M + "rl_algorithm=maac", M + "critic_model_name=./no/such/critic"], "critic_model_name = "),
    (
        "marlhf",
        [
            M + "rl_algorithm=iac",
            M + "collaboration_mode=centralized",
            M + "agents=smollm2-135m-instruct",
            M + "num_agents=2",
        ],
        "with collaboration_mode='centralized' is not supported",
    ),
    ("marlhf", [M + "num_generations=1"], "num_generations must be >= 2 for MAGRPO-family MARLHF backends"),
    # ------------------------------------------------------------------ iterative variants
    ("madpo_iter", [M + "num_iterations=0"], "num_iterations must be >= 1"),
    ("madpo_iter", [M + "dpo_epochs_per_round=0"], "dpo_epochs_per_round must be >= 1"),
    # CoMLRL's one name for two settings: the message says where each lives here
    ("madpo_iter", [M + "num_train_epochs=2"], "model.init_args.dpo_epochs_per_round, DPO passes per round"),
    ("madpo_iter", [M + "preference_replay_mode=forever"], "preference_replay_mode"),
    (
        "madpo_iter",
        [M + "preference_replay_mode=nearest_k", M + "preference_replay_lambda=null"],
        "preference_replay_k is required when preference_replay_mode='nearest_k'",
    ),
    ("madpo_iter", [M + "preference_replay_lambda=2"], "preference_replay_lambda must be in [0, 1]"),
    (
        "madpo_iter",
        [M + "preference_replay_mode=current", M + "preference_replay_lambda=null", M + "preference_replay_k=3"],
        "preference_replay_k is only valid",
    ),
    ("madpo_iter", [M + "preference_replay_sample_size=0"], "preference_replay_sample_size must be >= 1"),
    ("madpo_iter", [M + "comparator_policy=nope"], "comparator_policy must be one of"),
    ("madpo_iter", [M + "comparator_generation_mode=nope"], "comparator_generation_mode"),
    (
        "madpo_iter",
        [M + "comparator_generation_mode=centralized", M + "comparator_centralized_agent_index=5"],
        "comparator_centralized_agent_index must be smaller than num_agents",
    ),
    ("madpo_iter", [M + "comparator_num_candidates=0"], "comparator_num_candidates must be >= 1"),
    ("madpo_iter", [M + "comparator_history_k=0"], "comparator_history_k must be >= 1"),
    ("madpo_iter", [M + "comparator_model_name=tiny"], "comparator_model_name and comparator_agents are only valid"),
    (
        "madpo_iter",
        [M + "comparator_policy=model", M + "comparator_history_k=null"],
        "comparator_model_name or comparator_agents is required when comparator_policy='model'",
    ),
    ("madpo_iter", [M + "comparator_tokenizers=tiny"], "comparator_tokenizers is only valid"),
    (
        "madpo_iter",
        [
            M + "comparator_policy=model",
            M + "comparator_history_k=null",
            M + "comparator_model_name=./no/such/comparator",
        ],
        "comparator_model_name = './no/such/comparator'",
    ),
    ("madpo_iter", [M + "preference_replay_dir={tmp}/items.txt"], "preference_replay_dir must be a directory"),
    ("madpo_iter", [M + "policy_checkpoint_dir={tmp}/items.txt"], "policy_checkpoint_dir must be a directory"),
    (
        "madpo_iter",
        [M + "log_reward_distribution=true", M + "reward_func=cli_fixtures.story_reward_without_range"],
        "reward_func",
    ),
    ("madpo_iter_api", [M + "comparator_api_url=ftp://example.com/v1"], "comparator_api_url must start with http"),
    ("madpo_iter_api", [M + "comparator_api_key_env=COMLRL_TEST_UNSET_KEY"], "which is not set"),
    ("madpo_iter_api", [M + "comparator_api_timeout=0"], "comparator_api_timeout must be > 0"),
    ("madpo_iter_api", [M + "comparator_api_max_retries=-1"], "comparator_api_max_retries must be >= 0"),
    ("madpo_iter_api", [M + "comparator_api_backoff_s=-1"], "comparator_api_backoff_s must be >= 0"),
    ("madpo_iter_api", [M + "comparator_api_max_concurrency=0"], "comparator_api_max_concurrency must be >= 1"),
    ("madpo_iter_api", [M + "comparator_api_format=grpc"], "comparator_api_format"),
    ("madpo_iter_api", [M + "comparator_api_deadline_s=0"], "comparator_api_deadline_s must be > 0"),
    ("madpo_iter_api", [M + "comparator_api_max_retry_after_s=-3"], "comparator_api_max_retry_after_s must be > 0"),
    ("madpo_iter_api", [M + "comparator_api_max_n_per_request=0"], "comparator_api_max_n_per_request must be >= 1"),
    ("madpo_iter_api", [M + f"comparator_api_key={SECRET}", M + "dpo_beta=-1"], "dpo_beta must be > 0"),
    ("madpo_iter_api", [M + f"comparator_api_key={SECRET}", M + "num_iterations=lots"], "num_iterations"),
    ("marlhf_iter", [M + "preference_scoring_reward=vibes"], "preference_scoring_reward must be one of"),
    ("centralized_magrpo", [M + "agents=[tiny,tiny]"], "requires exactly one actor"),
    (
        "centralized_magrpo",
        [M + "num_turns=2", M + "external_transition=comlrl_lightning.envs.toy.revise_transition"],
        "num_turns=1",
    ),
]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "items.txt").write_text("a story\n")
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "truncated.json").write_text('[{"topic": "a kite"}, {"topic": "a bo')
    (tmp_path / "not_a_dataset_dir").mkdir()
    (tmp_path / "malformed.jsonl").write_text('{"topic": "a kite"}\n{"topic": "a bo\n')
    (tmp_path / "other_keys.jsonl").write_text('{"subject": "a kite"}\n')  # the formatters read 'topic'
    torch.save({"state_dict": {}, "global_step": 3}, tmp_path / "whole.ckpt")
    whole = (tmp_path / "whole.ckpt").read_bytes()
    (tmp_path / "truncated.ckpt").write_bytes(whole[: len(whole) // 2])  # a copy that did not finish
    (tmp_path / "notes.ckpt").write_text("[1, 2, 3]\n")  # torch: "Unsupported operand 91"
    for i in range(2):  # what MultiAgentModule.save_pretrained writes: one folder per agent
        (tmp_path / "team" / f"agent_{i}").mkdir(parents=True)
        (tmp_path / "team" / f"agent_{i}" / "config.json").write_text("{}")
    return tmp_path


@pytest.fixture
def no_models(monkeypatch):
    import functools

    def trap_for(factory):
        @functools.wraps(factory)  # keeps the factory's signature, which the model_kwargs check reads
        def trap(**_):
            raise AssertionError("a model was loaded before the configuration was checked")

        return trap

    for name, factory in list(MODEL_FACTORIES.items()):
        monkeypatch.setitem(MODEL_FACTORIES, name, trap_for(factory))


def test_the_catalogue_is_large():
    assert len(CASES) >= 100


@pytest.mark.parametrize(
    "config,overrides,fragment",
    CASES,
    ids=[f"{c}-{'-'.join(o.split('.')[-1].split('=')[0] for o in ov)}" for c, ov, _ in CASES],
)
def test_a_bad_configuration_is_one_clear_message(config, overrides, fragment, files, no_models, capsys, monkeypatch):
    from comlrl_lightning.cli import main

    monkeypatch.chdir(files)
    monkeypatch.setenv("COMPARATOR_API_KEY", "sk-env-key")  # madpo_iter_api.yaml reads its key from here
    monkeypatch.delenv("COMLRL_TEST_UNSET_KEY", raising=False)
    run_dir = files / "run"
    args = [a.replace("{tmp}", str(files)) for a in overrides]
    subcommand, _, config = config.rpartition(":")
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                subcommand or "fit",
                "--config",
                str(REPO / "configs" / f"{config}.yaml"),
                "--trainer.default_root_dir",
                str(run_dir),
                *args,
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert fragment in err, err
    assert "Traceback" not in err and SECRET not in err, err
    assert err.count("error:") == 1 and len(err.splitlines()) <= 6, err
    assert not run_dir.exists() or not any(run_dir.rglob("*")), "something was written"


# Mistakes only a loaded model reveals (the tiny models load; still one message, no traceback).
LATE_CASES = [
    (
        "fit",
        [M + "lora_rank=4", M + "lora_target_modules=[no_such_proj]"],
        "lora_target_modules ['no_such_proj'] does not fit this model",
    ),
    ("validate", ["--ckpt_path={tmp}/other_team.ckpt"], "does not fit the model this config builds"),
]


@pytest.mark.parametrize("subcommand,overrides,fragment", LATE_CASES, ids=["lora_target_modules", "other_team"])
def test_a_mistake_found_when_the_models_load_is_one_clear_message(
    subcommand, overrides, fragment, files, capsys, monkeypatch
):
    from comlrl_lightning.cli import main

    monkeypatch.chdir(files)
    torch.save(
        {
            "state_dict": {"agents.0.no_such.weight": torch.zeros(1)},
            "global_step": 1,
            "pytorch-lightning_version": "2.6.0",
        },
        files / "other_team.ckpt",
    )
    args = [a.replace("{tmp}", str(files)) for a in overrides]
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                subcommand,
                "--config",
                str(REPO / "configs" / "quickstart.yaml"),
                "--trainer.default_root_dir",
                str(files / "run"),
                "--trainer.enable_progress_bar=false",
                *args,
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert fragment in err, err
    assert "Traceback" not in err and err.count("error:") == 1 and len(err.splitlines()) <= 6, err
