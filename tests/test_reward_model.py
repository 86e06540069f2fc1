"""JointRewardModel, joint_text and RewardModelReward on the tiny Qwen2 model (docs/algorithms.md#marlhf,
docs/differences.md)."""

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from comlrl_lightning.agents import MODEL_FACTORIES, JointRewardModel, RewardModelReward, joint_text
from comlrl_lightning.agents.reward_model import REWARD_MODEL_CONFIG_NAME, last_token_positions
from comlrl_lightning.agents.value_head import VALUE_HEAD_WEIGHTS_NAME
from comlrl_lightning.core.losses import bradley_terry_loss
from comlrl_lightning.rollout.rewards import RewardCaller

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Two agents",
    "Write a function that returns the sum of two numbers.",
]


@pytest.fixture()
def rm():
    torch.manual_seed(0)
    return JointRewardModel.from_pretrained("tiny")


def test_joint_text_layout():
    text = joint_text(["Write a story.", "Continue it."], ["Once upon a time.", "The end."])
    assert text == (
        "Joint multi-agent response\n\n"
        "Agent 1 prompt:\nWrite a story.\n\n"
        "Agent 1 response:\nOnce upon a time.\n\n"
        "Agent 2 prompt:\nContinue it.\n\n"
        "Agent 2 response:\nThe end."
    )
    assert joint_text(["p"], ["r"]) == "Joint multi-agent response\n\nAgent 1 prompt:\np\n\nAgent 1 response:\nr"
    with pytest.raises(ValueError, match="one prompt per response"):
        joint_text(["a", "b"], ["x"])


def test_structure_and_from_pretrained(rm):
    assert isinstance(rm.reward_head, nn.Linear)
    assert rm.reward_head.in_features == rm.backbone.config.hidden_size and rm.reward_head.out_features == 1
    assert rm.tokenizer.pad_token_id is not None and rm.max_length is None
    assert rm.backbone.config._name_or_path == "tiny"
    assert last_token_positions(torch.tensor([[0, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])).tolist() == [2, 0, 3]
    with pytest.raises(ValueError, match="non-pad"):
        last_token_positions(torch.tensor([[0, 0]]))


@pytest.mark.parametrize("side", ["left", "right"])
def test_pooling_at_last_real_token_any_padding(rm, side):
    tok = rm.tokenizer
    rm.eval()
    with torch.no_grad():
        single = torch.stack([rm(**tok([t], return_tensors="pt")).squeeze(0) for t in TEXTS])  # unpadded
        enc = tok(TEXTS, return_tensors="pt", padding=True, padding_side=side)
        assert (enc["attention_mask"] == 0).any()  # really padded
        batched = rm(enc["input_ids"], enc["attention_mask"])
        assert batched.shape == (3,) and batched.dtype == torch.float32
        torch.testing.assert_close(batched, single, atol=1e-5, rtol=1e-5)

        # ... and equals the head on the backbone's last-layer hidden state at the last real token.
        for row, text in enumerate(TEXTS):
            ids = tok([text], return_tensors="pt")["input_ids"]
            hidden = rm.backbone(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1]
            torch.testing.assert_close(batched[row], rm.reward_head(hidden).squeeze(-1), atol=1e-5, rtol=1e-5)

        # score_texts uses the tokenizer's own side (left for loaded agents) and chunks consistently.
        torch.testing.assert_close(rm.score_texts(TEXTS), single, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(rm.score_texts(TEXTS, batch_size=2), single, atol=1e-5, rtol=1e-5)
        assert rm.score_texts([]).shape == (0,)


def test_freeze_backbone_trains_only_the_head():
    torch.manual_seed(0)
    rm = JointRewardModel.from_pretrained("tiny", freeze_backbone=True)
    assert all(not p.requires_grad for p in rm.backbone.parameters())
    assert all(p.requires_grad for p in rm.reward_head.parameters())
    head_before = rm.reward_head.weight.detach().clone()
    backbone_before = [p.detach().clone() for p in rm.backbone.parameters()]
    opt = torch.optim.AdamW([p for p in rm.parameters() if p.requires_grad], lr=1e-2)
    rm.train()
    rm.score_texts(TEXTS).sum().backward()
    assert all(p.grad is None for p in rm.backbone.parameters())
    assert rm.reward_head.weight.grad is not None and rm.reward_head.weight.grad.abs().sum() > 0
    opt.step()
    assert not torch.equal(rm.reward_head.weight, head_before)
    assert all(torch.equal(p, q) for p, q in zip(rm.backbone.parameters(), backbone_before))


def test_bradley_terry_training_learns_a_preference(rm):
    subjects = [
        "The answer",
        "This story",
        "The summary",
        "The code",
        "The plan",
        "The essay",
        "The reply",
        "The result",
    ]
    winners = [f"{s} is good." for s in subjects]
    losers = [f"{s} is bad." for s in subjects]

    def evaluate():
        with torch.no_grad():
            loss, stats = bradley_terry_loss(rm.score_texts(winners), rm.score_texts(losers))
        return float(loss), float(stats["accuracy"])

    with torch.no_grad():  # start from a head that prefers the losers, so accuracy has to rise
        if evaluate()[1] > 0.5:
            rm.reward_head.weight.neg_()
    loss0, acc0 = evaluate()
    assert acc0 <= 0.5
    opt = torch.optim.AdamW(rm.parameters(), lr=3e-3)
    rm.train()
    for _ in range(15):
        loss, _ = bradley_terry_loss(rm.score_texts(winners), rm.score_texts(losers))
        opt.zero_grad()
        loss.backward()
        opt.step()
    rm.eval()
    loss1, acc1 = evaluate()
    assert loss1 < loss0 - 0.1
    assert acc1 == 1.0 > acc0


def test_truncation_with_max_length(rm):
    rm.max_length = 4
    enc = rm.tokenize(TEXTS)
    assert enc["input_ids"].shape[1] == 4
    long_text = TEXTS[0]
    prefix = rm.tokenizer.decode(rm.tokenizer(long_text)["input_ids"][:4])
    with torch.no_grad():
        torch.testing.assert_close(rm.score_texts([long_text]), rm.score_texts([prefix]), atol=1e-5, rtol=1e-5)
    rm.max_length = None
    assert rm.tokenize(TEXTS)["input_ids"].shape[1] > 4


def test_save_load_round_trip(rm, tmp_path):
    with torch.no_grad():
        rm.reward_head.weight.normal_(0, 1.0)  # a head that differs from any fresh init
        rm.reward_head.bias.fill_(0.25)
    rm.max_length = 32
    rm.eval()
    with torch.no_grad():
        expected = rm.score_texts(TEXTS)
    rm.save_pretrained(tmp_path / "rm")
    assert (tmp_path / "rm" / VALUE_HEAD_WEIGHTS_NAME).is_file()
    assert json.loads((tmp_path / "rm" / REWARD_MODEL_CONFIG_NAME).read_text())["max_length"] == 32
    loaded = JointRewardModel.from_pretrained(tmp_path / "rm")
    assert loaded.max_length == 32 and loaded.tokenizer is not None
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded.score_texts(TEXTS), expected, atol=1e-5, rtol=1e-5)
    assert JointRewardModel.from_pretrained(str(tmp_path / "rm"), max_length=8).max_length == 8


def test_from_model_object_requires_tokenizer():
    model, tok = MODEL_FACTORIES["tiny"]()
    rm = JointRewardModel.from_pretrained(model, tokenizer=tok)
    assert rm.backbone is model and rm.tokenizer is tok
    with pytest.raises(ValueError, match="Tokenizer"):
        JointRewardModel.from_pretrained(model)


def test_score_joint_and_reward_model_reward(rm):
    rm.train()
    prompts = [["Write the start.", "Write the start."], ["Write the end.", "Write the end."]]
    responses = [["Once upon a time.", "It was dark."], ["The end.", "They slept."]]
    with torch.no_grad():
        direct = rm.score_texts([joint_text([p[j] for p in prompts], [r[j] for r in responses]) for j in range(2)])
        joint = rm.score_joint(prompts, responses)
    torch.testing.assert_close(joint, direct)

    reward = RewardModelReward(rm, batch_size=1)
    values = reward(*responses, agent_prompts=prompts)
    assert isinstance(values, list) and len(values) == 2 and all(isinstance(v, float) for v in values)
    assert values == pytest.approx(direct.tolist(), abs=1e-5)  # raw scores
    assert rm.training  # mode restored

    # Only `prompts` (one per joint action): every agent gets that prompt.
    shared = reward(*responses, prompts=["Write a story.", "Write a story."])
    with torch.no_grad():
        expected = rm.score_joint([["Write a story."] * 2] * 2, responses)
    assert shared == pytest.approx(expected.tolist(), abs=1e-5)

    # Formatters build per-agent prompts from batch_items; RewardCaller passes prompts/batch_items.
    fmt = RewardModelReward(rm, formatters=[lambda it: "Write the start.", lambda it: "Write the end."])
    assert fmt(*responses, batch_items=[{"prompt": "x"}]) == pytest.approx(values, abs=1e-5)
    via_caller = RewardCaller(fmt).raw(responses, prompts=["ignored"] * 2, batch_items=[{}, {}])
    assert via_caller == pytest.approx(values, abs=1e-5)
    with pytest.raises(ValueError, match="requires batch_items"):
        fmt(*responses)
    with pytest.raises(ValueError, match="one prompt list per agent"):
        reward(*responses, agent_prompts=prompts[:1])
    with pytest.raises(ValueError, match="agent's prompt"):
        reward(*responses)


def test_hidden_size_inference_and_error():
    enc_dec_like = nn.Linear(2, 2)
    enc_dec_like.config = SimpleNamespace(d_model=8)
    assert JointRewardModel(enc_dec_like).reward_head.in_features == 8
    bad = nn.Linear(2, 2)
    bad.config = SimpleNamespace(vocab_size=10)
    with pytest.raises(ValueError, match="Could not infer reward model hidden size."):
        JointRewardModel(bad)


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_max_length(bad):
    model, tok = MODEL_FACTORIES["tiny"]()
    with pytest.raises(ValueError, match=r"reward_max_length must be >= 1 or null\."):
        JointRewardModel(model, tok, max_length=bad)
    with pytest.raises(ValueError, match=r"reward_max_length must be >= 1 or null\."):
        JointRewardModel.from_pretrained("tiny", max_length=bad)
