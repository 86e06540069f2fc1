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


# ----------------------------------------------------------------------------------------------- self-play
def test_word_chain_rule_transition_and_revision_by_hand():
    from comlrl_lightning.envs.toy import (
        revise_word_transition,
        word_chain_prompt,
        word_chain_tasks,
        word_chain_transition,
        word_rule_reward,
    )

    item = word_chain_tasks()[1]
    assert item["letter"] == "b"
    first = word_chain_prompt(item)
    # one clean word with the letter: 1; starts right but more than a word: 0.5; wrong letter, empty: 0
    assert word_rule_reward(["Banana", "bat and ball", "apple", ""], prompts=[first] * 4) == [1.0, 0.5, 0.0, 0.0]
    history = [[first]]
    (reply,) = word_chain_transition("word chain from b", ["Banana"], 1, history, [["Banana"]])
    assert "said 'banana'" in reply and "starts with 'a'" in reply  # the other player answers from the last letter
    assert word_rule_reward(["apple", "Banana"], prompts=[reply] * 2) == [1.0, 0.0]
    (revise,) = revise_word_transition("word chain from b", ["apple"], 1, history, [["apple"]])
    assert "starts with 'b'" in revise and "It breaks the rule." in revise  # a revision keeps the rule
    (kept,) = revise_word_transition("word chain from b", ["bread"], 1, history, [["bread"]])
    assert "It keeps the rule." in kept


def test_one_agent_plays_both_roles_rewarded_by_the_role_of_the_turn():
    from comlrl_lightning.envs.toy import proposer_prompt, role_reward, switch_roles

    assert proposer_prompt({"topic": "rain"}).startswith("You are the proposer.")
    assert proposer_prompt({"topic": "rain"}).endswith("write with the letter e")
    (second,) = switch_roles("rain", ["eee"], 1, [["p"]], [["eee"]])
    assert second.startswith("You are the solver.") and "The proposer wrote: eee" in second
    assert second.endswith("write with vowels only")
    (third,) = switch_roles("rain", ["aa"], 1, [["p", second]], [["eee", "aa"]])
    assert third.startswith("You are the proposer.") and "The solver wrote: aa" in third
    # turn 1 (no history): the proposer's share of e; turn 2 (one turn played): the solver's share of vowels
    texts = ["eeaa", "eb ob!"]
    assert role_reward(texts, response_history_per_agent=[[[]], [[]]]) == [0.5, 0.25]
    assert role_reward(texts, response_history_per_agent=[[["x"]], [["x"]]]) == [1.0, 0.5]
