"""The demo/test task rewards, on hand-built completions with hand-computed totals."""

import pytest

from comlrl_lightning.envs import toy

ITEM = {"topic": "a lighthouse keeper", "prompt": "a lighthouse keeper"}


def test_story_reward_perfect_pair():
    opening = "The lighthouse keeper lit the lamp as the storm rolled in."  # 11 words, on topic, finished
    closing = "By dawn the ships were safe."  # 6 words, no topic word, finished
    # 0.5+0.25+0.25 (opening) + 0.5+0+0.25 (closing); word sets of 9 and 6 share {the}: Jaccard 1/14
    jaccard = 1 / 14
    expected = 1.0 + 0.75 + (1 - jaccard / 0.6)
    assert toy.story_reward([opening], [closing], batch_items=[ITEM]) == [pytest.approx(expected)]


def test_story_reward_penalises_long_unfinished_and_repeated_parts():
    long_text = " ".join(["keeper"] * 30)  # 30 words -> brevity 0; on topic; unfinished
    (reward,) = toy.story_reward([long_text], [long_text], batch_items=[ITEM])
    assert reward == pytest.approx(0.25 + 0.25)  # topic twice; identical parts -> complementarity 0


def test_story_reward_short_text_scales_brevity():
    (reward,) = toy.story_reward(["Keeper."], ["Gone."], batch_items=[ITEM])
    # 1 word each: brevity 1/5; opening on topic; both finished; disjoint words -> complementarity 1
    assert reward == pytest.approx(0.5 * 0.2 * 2 + 0.25 + 0.25 * 2 + 1.0)


def test_brevity_and_letter_rewards():
    assert toy.brevity_reward(["abcd"], ["abcdefgh"], max_chars=40) == [pytest.approx(1 - 6 / 40)]
    assert toy.brevity_reward(["x" * 80]) == [0.0]
    assert toy.letter_reward(["eeee", "abcd"], ["e e!", ""]) == [pytest.approx(1.0), pytest.approx(0.0)]


def test_revise_transition_returns_one_prompt_per_agent():
    prompts = toy.revise_transition(
        prompt="a kite",
        agent_completions=["Up it went.", "Down it came."],
        num_agents=2,
        prompt_history_per_agent=[[], []],
        response_history_per_agent=[[], []],
    )
    assert len(prompts) == 2 and "Part 1: Up it went." in prompts[1] and "Rewrite part 2" in prompts[1]


def test_story_tasks():
    assert len(toy.story_tasks()) == len(toy.STORY_TOPICS)
    assert len(toy.story_tasks(45)) == 45
    assert toy.opening_prompt(ITEM).startswith("Write the opening sentence")
