"""dataset=reasoning_gym: the library's items, seeded splits and score_answer; bad input refused in one line before any
work (an unknown dataset or setting, answers longer than the generation budget, characters the tokenizer does not
know, the library missing); and a reasoning-gym task trained end to end: a cold start, then RL steps from it."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from hydra import compose, initialize_config_dir

from experiments.config import PROJECT_ROOT
from experiments.tasks import Example, build_task
from experiments.tasks.reasoning_gym import SEED_STRIDE
from models.registry import ConfigError
from tests.conftest import MICRO_MODEL, MICRO_RUN

needs_library = pytest.mark.skipif(
    importlib.util.find_spec("reasoning_gym") is None,
    reason="reasoning-gym is the extra make installs: pip install -c constraints.txt -e '.[reasoning]'",
)

CHAIN_SUM = {"task": "chain_sum", "params": {"max_terms": 2, "max_digits": 2}, "train_size": 300, "test_size": 50}
# One-digit operands, two terms, no parentheses: answers of at most 3 characters ("-81"), prompts of at most 27
# ("Calculate -5 * -9.\nAnswer: "), within the micro model's 64 positions. Hydra adds a key to a dict with `+`.
SMALL_ARITHMETIC = [
    "dataset=reasoning_gym",
    "dataset.task=basic_arithmetic",
    "+dataset.params.max_terms=2",
    "+dataset.params.max_digits=1",
    "+dataset.params.allow_parentheses=false",
]


def library_items(task: str, params: dict, seed: int, count: int) -> list[dict]:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, seed=seed, size=count, **params)
    return [dataset[i] for i in range(count)]


@needs_library
def test_the_splits_are_the_librarys_items_seeded_and_disjoint():
    task = build_task("reasoning_gym", **CHAIN_SUM)
    train, test = task.examples("train"), task.examples("test")
    assert (len(train), len(test)) == (300, 50)
    assert len({ex.prompt for ex in test}) == 50 and not {ex.prompt for ex in train} & {ex.prompt for ex in test}
    assert train == build_task("reasoning_gym", **CHAIN_SUM).examples("train")
    first = library_items("chain_sum", CHAIN_SUM["params"], 0, 1)[0]
    assert test[0].prompt == f"{first['question']}\nAnswer: "
    assert test[0].answer == test[0].demonstration == first["answer"]
    # seed 1 is the library's seed 2**32, not seed 0's stream shifted by one item
    other = build_task("reasoning_gym", **{**CHAIN_SUM, "seed": 1}).examples("test")
    assert other[0].prompt.startswith(library_items("chain_sum", CHAIN_SUM["params"], SEED_STRIDE, 1)[0]["question"])
    assert [ex.prompt for ex in other[:10]] != [ex.prompt for ex in test[1:11]]
    spaced = build_task("reasoning_gym", **CHAIN_SUM, prompt_template="Q: {question} A:").examples("test")[0]
    assert spaced.prompt == f"Q: {first['question']} A:"


@needs_library
def test_the_reward_is_the_librarys_score_answer():
    """chain_sum's score: numbers compared as numbers, else len(answer) / len(completion) when the completion holds
    the answer, else 0 (reasoning_gym.utils.compute_decimal_reward)."""
    task = build_task("reasoning_gym", **CHAIN_SUM)
    example = task.examples("test")[0]
    assert example.prompt.endswith("15 - 43 =\nAnswer: ") and example.answer == "-28"
    for completion, reward in [
        ("-28", 1.0),
        (" -28\n", 1.0),
        ("-028.0", 1.0),
        ("-28 0", 0.6),
        ("28", 0.0),
        ("", 0.0),
        ("x-28", 0.75),
    ]:
        assert task.reward(completion, example) == pytest.approx(reward), completion
        assert task.is_correct(completion, example) == (reward == 1.0)
    with pytest.raises(ValueError, match="not a prompt of its splits"):
        task.reward("-28", Example("15 - 43 =", "-28", "-28"))


@needs_library
@pytest.mark.parametrize(
    "params, message",
    [
        ({"task": "chain_summ"}, "reasoning_gym.task='chain_summ' is not a reasoning-gym dataset; one of: ab, acre, "),
        (
            {"task": "chain_sum", "params": {"max_term": 2}},
            "reasoning_gym.params has no setting 'max_term' for task=chain_sum; its settings: allow_negation, "
            "max_digits, ",
        ),
        ({"task": "chain_sum", "params": {"min_terms": 3, "max_terms": 2}}, "max_terms must be >= min_terms"),
        ({"task": "chain_sum", "params": {"seed": 3}}, "dataset.seed, dataset.train_size and dataset.test_size set"),
        ({"task": "chain_sum", "params": [2]}, "reasoning_gym.params=[2] must be of type dict"),
        ({"task": "chain_sum", "prompt_template": "Q: {q}"}, "prompt_template='Q: {q}' must contain the field"),
        (
            {"task": "coin_flip", "params": {"min_trials": 1, "max_trials": 2}},
            "drew 10 distinct questions and 0 train ones in 41000 draws",
        ),
    ],
)
def test_bad_settings_are_refused_in_one_line(params, message):
    with pytest.raises(ConfigError) as raised:
        build_task("reasoning_gym", **params).examples("test")
    assert message in str(raised.value) and "\n" not in str(raised.value)


@needs_library
def test_a_task_left_unset_names_the_key_and_the_datasets():
    task = build_task("reasoning_gym")  # the yaml's default: composes, refused where its examples are asked for
    with pytest.raises(ConfigError, match=r"reasoning_gym.task is not set: name a reasoning-gym dataset \(dataset"):
        task.examples("train")


def test_without_the_library_the_refusal_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym.factory", None)  # what `import` meets where it is not installed
    with pytest.raises(ConfigError, match=r"package: pip install -c constraints.txt -e '\.\[reasoning\]'"):
        build_task("reasoning_gym", task="chain_sum")


def compose_train(*overrides: str):
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        return compose("train", overrides=[*MICRO_RUN, *overrides])  # MICRO_RUN: 200 train and 20 test problems


@needs_library
@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["dataset=reasoning_gym", "dataset.task=chain_summ"],
            "reasoning_gym.task='chain_summ' is not a reasoning-gym",
        ),
        # basic_arithmetic's own settings: up to 6 terms of 4 digits, answers of up to 17 characters
        (
            ["dataset=reasoning_gym", "dataset.task=basic_arithmetic", "trainer.max_new_tokens=8"],
            "trainer.max_new_tokens=8 cannot hold the answers of dataset 'reasoning_gym': up to ",
        ),
        (
            ["dataset=reasoning_gym", "dataset.task=prime_factorization"],
            "dataset 'reasoning_gym' writes characters the model's tokenizer does not know: '×'",
        ),
    ],
)
def test_a_run_refuses_a_task_it_cannot_train_before_any_work(tmp_path, overrides, message):
    from experiments.train import train

    with pytest.raises(SystemExit) as raised:
        train(compose_train(*overrides), tmp_path / "run")
    assert message in str(raised.value) and "\n" not in str(raised.value)


@needs_library
@pytest.mark.slow
def test_a_reasoning_gym_task_trains_end_to_end_from_a_cold_start(tmp_path):
    from experiments.sft import cold_start
    from experiments.step.metrics import EVAL_GREEDY, REWARD, SFT_LOSS, STEP, started
    from experiments.train import train

    sft_overrides = [f"model.{key}={value}" for key, value in MICRO_MODEL.items()] + [
        *SMALL_ARITHMETIC,
        "dataset.train_size=200",
        "dataset.test_size=20",
        "sft.max_steps=6",
        "sft.batch_size=16",
        "sft.eval_every=3",
        "sft.eval_prompts=8",
        "sft.lr=3e-3",
        f"sft.output_dir={tmp_path / 'ckpt'}",
        "logger.wandb.mode=disabled",
        "cpu_kernels=native",
    ]
    with initialize_config_dir(config_dir=str(PROJECT_ROOT / "conf"), version_base="1.3"):
        sft_cfg = compose("sft", overrides=sft_overrides)
    with pytest.warns(UserWarning, match="below sft.target_accuracy"):  # 6 steps teach little: it says so
        cold_start(sft_cfg, tmp_path / "sft")
    losses = [json.loads(line)[SFT_LOSS] for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 6 and losses[-1] < losses[0]
    recorded = json.loads((tmp_path / "ckpt" / "cold_start.json").read_text())["dataset"]
    assert recorded["task"] == "basic_arithmetic" and recorded["params"]["max_digits"] == 1

    summary = train(
        compose_train(*SMALL_ARITHMETIC, f"model.path={tmp_path / 'ckpt'}", "trainer.steps=2", "trainer.eval_every=1"),
        tmp_path / "rl",
    )
    lines = [json.loads(line) for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [line[STEP] for line in lines] == [1, 2]
    assert all(0.0 <= line[REWARD] <= 1.0 for line in lines)
    assert 0.0 <= lines[0][started(EVAL_GREEDY)] <= 1.0 and EVAL_GREEDY in lines[-1]
    assert summary["status"] == "finished" and summary["steps"] == 2
