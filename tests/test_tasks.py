"""The verifiable tasks: rewards on hand-checked answers, split determinism and disjointness, the JSONL loader's
errors, the registry's errors, and that conf/dataset/*.yaml matches the task dataclasses."""

import dataclasses
import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from experiments.config import register_configs
from experiments.tasks import TASKS, Example, Task, build_task
from experiments.tasks.gsm8k import extract_final_number, normalize_number
from models.registry import ConfigError
from models.tokenizer import ALPHABET

CONF_DATASET = Path(__file__).resolve().parents[1] / "conf" / "dataset"
SYNTHETIC = ["addition", "sorting", "scratchpad"]
SMALL = {"train_size": 300, "test_size": 50}


def example(answer: str) -> Example:
    return Example(prompt="unused=", answer=answer, demonstration=answer)


# --- rewards on known answers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, reward",
    [
        ("46", 1.0),
        (" 46\n", 1.0),  # surrounding whitespace is not part of the answer
        ("47", 0.25),  # 1 of 2 characters in place
        ("64", 0.0),
        ("", 0.0),
        ("46 0", 0.5),  # trailing text: not exact, both answer characters in place
        ("4", 0.25),
    ],
)
def test_addition_reward(completion: str, reward: float) -> None:
    task = build_task("addition", **SMALL)
    assert task.reward(completion, example("46")) == pytest.approx(reward)
    assert task.is_correct(completion, example("46")) == (reward == 1.0)


@pytest.mark.parametrize(
    "completion, reward", [("13578", 1.0), ("13587", 0.3), ("87531", 0.1), ("", 0.0), ("135789", 0.5), ("1357", 0.4)]
)
def test_sorting_reward(completion: str, reward: float) -> None:
    task = build_task("sorting", **SMALL)
    assert task.reward(completion, example("13578")) == pytest.approx(reward)
    assert task.is_correct(completion, example("13578")) == (reward == 1.0)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_reference_answers_earn_full_reward(name: str) -> None:
    task = build_task(name, **SMALL)
    for ex in task.examples("test"):
        assert task.reward(ex.demonstration, ex) == 1.0
        assert ex.demonstration == ex.answer


def test_addition_answers_are_the_sums() -> None:
    for ex in build_task("addition", digits=3, **SMALL).examples("train"):
        a, b = ex.prompt.removesuffix("=").split("+")
        assert ex.prompt.endswith("=") and ex.answer == str(int(a) + int(b))
        assert a == str(int(a)) and b == str(int(b))  # no leading zeros


@pytest.mark.parametrize(
    "completion, reward",
    [("21119060", 1.0), ("21119061", 0.5 * 7 / 8), ("2111", 0.25), ("", 0.0), ("211190600", 0.5), ("12111906", 0.125)],
)
def test_scratchpad_reward(completion: str, reward: float) -> None:
    task = build_task("scratchpad", digits=4, **SMALL)
    assert task.reward(completion, example("21119060")) == pytest.approx(reward)
    assert task.is_correct(completion, example("21119060")) == (reward == 1.0)


def test_scratchpad_answers_add_the_columns_with_their_carries() -> None:
    for ex in build_task("scratchpad", digits=6, **SMALL).examples("train"):
        columns = ex.prompt.removesuffix("=")
        a, b = int(columns[0::2][::-1]), int(columns[1::2][::-1])  # least significant column first
        digits, carries = ex.answer[0::2], ex.answer[1::2]
        assert len(ex.answer) == 12 and set(carries) <= {"0", "1"}
        assert int(carries[-1] + digits[::-1]) == a + b
        carry_in = [0] + [int(c) for c in carries[:-1]]
        for i in range(6):
            total = int(columns[2 * i]) + int(columns[2 * i + 1]) + carry_in[i]
            assert (int(digits[i]), int(carries[i])) == (total % 10, total // 10)


def test_sorting_answers_are_sorted_prompts() -> None:
    for ex in build_task("sorting", length=6, **SMALL).examples("train"):
        digits = ex.prompt.removeprefix("sort ").removesuffix("=")
        assert ex.prompt == f"sort {digits}=" and ex.answer == "".join(sorted(digits))


# --- splits ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SYNTHETIC)
def test_splits_are_deterministic_sized_and_disjoint(name: str) -> None:
    task = build_task(name, **SMALL)
    train, test = task.examples("train"), task.examples("test")
    assert (len(train), len(test)) == (300, 50)
    assert train == build_task(name, **SMALL).examples("train")
    assert test == build_task(name, **SMALL).examples("test")
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in test}
    assert len({ex.prompt for ex in test}) == len(test)
    other_seed = build_task(name, seed=1, **SMALL)
    assert other_seed.examples("train") != train and other_seed.examples("test") != test


def test_small_problem_space_keeps_splits_disjoint() -> None:
    # 1-digit addition has only 100 prompts: half go to test, train repeats the rest
    task = build_task("addition", digits=1, train_size=400, test_size=50)
    train, test = task.examples("train"), task.examples("test")
    assert len({ex.prompt for ex in test}) == 50
    assert not {ex.prompt for ex in train} & {ex.prompt for ex in test}


@pytest.mark.parametrize("name", SYNTHETIC)
def test_unknown_split_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="validation"):
        build_task(name, **SMALL).examples("validation")


def test_difficulty_knobs_change_lengths() -> None:
    for digits in (1, 3, 5):
        operands = [
            operand
            for ex in build_task("addition", digits=digits, train_size=200, test_size=20).examples("train")
            for operand in ex.prompt.removesuffix("=").split("+")
        ]
        assert max(map(len, operands)) == digits
    for length in (2, 7):
        for ex in build_task("sorting", length=length, **SMALL).examples("test"):
            assert len(ex.answer) == length
    for digits in (2, 16, 64):
        for ex in build_task("scratchpad", digits=digits, **SMALL).examples("test"):
            assert (len(ex.prompt), len(ex.answer)) == (2 * digits + 1, 2 * digits)


@pytest.mark.parametrize("name", SYNTHETIC)
def test_synthetic_text_fits_the_character_tokenizer(name: str) -> None:
    task = build_task(name, **SMALL)
    for ex in task.examples("train") + task.examples("test"):
        assert set(ex.prompt + ex.answer + ex.demonstration) <= set(ALPHABET), ex


@pytest.mark.parametrize(
    "name, params, message",
    [
        ("addition", {"digits": 0}, "addition.digits=0"),
        ("addition", {"digits": 1, "test_size": 51}, "test_size=51"),
        ("addition", {"train_size": 0}, "train_size=0"),
        ("addition", {"test_size": 0}, "test_size=0"),
        ("addition", {"digits": "2"}, "digits='2' must be of type int"),
        ("addition", {"digits": True}, "digits=True must be of type int"),
        ("sorting", {"length": 1}, "sorting.length=1"),
        ("scratchpad", {"digits": 1}, "scratchpad.digits=1"),
        ("gsm8k", {"prompt_template": "Q: {q}"}, "prompt_template"),
        ("gsm8k", {"prompt_template": "Q: no field"}, "prompt_template"),
        ("gsm8k", {"max_examples": 0}, "max_examples=0"),
        ("gsm8k", {"train_path": 3}, r"train_path=3 must be of type str \| None"),
    ],
)
def test_bad_parameters_are_refused(name: str, params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_task(name, **params)


# --- GSM8K JSONL loader ---------------------------------------------------------------------------------------


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def record(question: str, answer: str) -> str:
    return json.dumps({"question": question, "answer": answer})


def test_gsm8k_loads_a_good_file(tmp_path: Path) -> None:
    train = write_jsonl(
        tmp_path / "train.jsonl",
        [
            record("What is 2+3?", "2+3 = <<2+3=5>>5\n#### 5"),
            "",  # blank lines are skipped
            record("How many cents in $12?", "12*100 = 1200\n#### 1,200"),
        ],
    )
    test = write_jsonl(tmp_path / "test.jsonl", [record("What is 1+1?", "#### 2")])
    task = build_task("gsm8k", train_path=str(train), test_path=str(test))
    examples = task.examples("train")
    assert examples == [
        Example("Question: What is 2+3?\nAnswer:", "5", " 2+3 = <<2+3=5>>5\n#### 5"),
        Example("Question: How many cents in $12?\nAnswer:", "1200", " 12*100 = 1200\n#### 1,200"),
    ]
    assert task.examples("test") == [Example("Question: What is 1+1?\nAnswer:", "2", " #### 2")]
    assert build_task("gsm8k", train_path=str(train), max_examples=1).examples("train") == examples[:1]
    # a template ending in whitespace gets no extra space before the solution
    spaced = build_task("gsm8k", train_path=str(train), prompt_template="Q: {question}\nA: ")
    assert spaced.examples("train")[0].demonstration == "2+3 = <<2+3=5>>5\n#### 5"
    for ex in examples:
        assert task.reward(ex.demonstration, ex) == 1.0


@pytest.mark.parametrize(
    "completion, reward",
    [
        (" 2+3 = 5\n#### 5", 1.0),
        ("#### 5.0", 1.0),
        ("The answer is $5.", 1.0),  # no mark: the last number
        ("#### 5\nQuestion: what is 7?\n#### 7", 1.0),  # ran on past its answer: the first mark counts
        ("4 apples plus 1 is 6", 0.0),
        ("#### 6", 0.0),
        ("#### five", 0.0),
        ("", 0.0),
    ],
)
def test_gsm8k_reward(tmp_path: Path, completion: str, reward: float) -> None:
    task = build_task("gsm8k")
    assert task.reward(completion, Example("q", "5", "#### 5")) == reward
    assert task.is_correct(completion, Example("q", "5", "#### 5")) == (reward == 1.0)


@pytest.mark.parametrize(
    "text, number",
    [
        ("#### 72", "72"),
        ("so $1,200.50 in all\n#### $1,200.50", "1200.5"),
        ("#### 72.0", "72"),
        ("#### -3", "-3"),
        ("#### 007", "7"),
        ("she had 3 then 4, so 7.", "7"),
        ("12 and 15,000", "15000"),
        ("the numbers 1,2,3", "3"),  # commas that do not group thousands separate numbers
        ("no number here", None),
        ("#### 42 apples\n", "42"),
        ("#### none", None),  # a mark without a number: no answer, even if numbers come before it
        ("3 apples #### none", None),
    ],
)
def test_gsm8k_final_number_extraction(text: str, number: str | None) -> None:
    assert extract_final_number(text) == number


def test_normalize_number_zero_has_no_sign() -> None:
    assert normalize_number("-0.00") == "0"


def test_gsm8k_missing_file_names_path_and_key(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match=r"nope\.jsonl.*dataset\.test_path"):
        build_task("gsm8k", test_path=str(missing)).examples("test")


def test_gsm8k_unset_path_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"gsm8k\.train_path is not set"):
        build_task("gsm8k").examples("train")


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"question": "q", "answer": "#### 1"', "not valid JSON"),
        ('["q", "#### 1"]', "expected a JSON object"),
        (json.dumps({"answer": "#### 1"}), "missing field 'question'"),
        (json.dumps({"question": "q"}), "missing field 'answer'"),
        (json.dumps({"question": "q", "answer": 1}), "field 'answer' must be a string"),
        (json.dumps({"question": "q", "answer": "the answer is 1"}), "no '#### <final answer>' line"),
        (json.dumps({"question": "q", "answer": "#### one"}), "not a number: 'one'"),
    ],
)
def test_gsm8k_bad_line_names_file_and_line(tmp_path: Path, bad_line: str, message: str) -> None:
    path = write_jsonl(tmp_path / "bad.jsonl", [record("q1", "#### 1"), "", bad_line, record("q2", "#### 2")])
    with pytest.raises(ValueError, match=message) as error:
        build_task("gsm8k", train_path=str(path)).examples("train")
    assert f"{path}:3:" in str(error.value)


def test_gsm8k_empty_file_is_refused(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(ValueError, match=r"empty\.jsonl has no examples"):
        build_task("gsm8k", train_path=str(path)).examples("train")


# --- registry -------------------------------------------------------------------------------------------------


def test_registry_has_the_tasks() -> None:
    assert {"addition", "sorting", "gsm8k"} <= set(TASKS)
    for name, cls in TASKS.items():
        assert cls.name == name and issubclass(cls, Task)
        assert "name" not in {field.name for field in dataclasses.fields(cls)}


def test_build_task_unknown_name_lists_valid_names() -> None:
    with pytest.raises(
        ValueError, match=r"unknown task 'additon'; valid names: addition, gsm8k, reasoning_gym, scratchpad, sorting"
    ):
        build_task("additon")


def test_build_task_unknown_param_names_it_and_the_fields() -> None:
    with pytest.raises(ValueError, match=r"no parameter digit; it takes digits, train_size, test_size, seed"):
        build_task("addition", digit=3)


def test_tasks_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        build_task("addition").digits = 3


def test_register_task_refuses_duplicates_and_non_frozen_classes() -> None:
    with pytest.raises(ValueError, match="already registered"):
        TASKS.register("addition")(TASKS["sorting"])

    @dataclasses.dataclass
    class Mutable(Task):
        size: int = 1

        def examples(self, split: str) -> list[Example]:
            return []

        def reward(self, completion: str, example: Example) -> float:
            return 0.0

    with pytest.raises(ValueError, match="frozen dataclass"):
        TASKS.register("mutable")(Mutable)
    assert "mutable" not in TASKS


# --- Hydra yamls ----------------------------------------------------------------------------------------------


def test_every_task_has_a_yaml() -> None:
    assert {path.stem for path in CONF_DATASET.glob("*.yaml")} == set(TASKS)


@pytest.mark.parametrize("path", sorted(CONF_DATASET.glob("*.yaml")), ids=lambda path: path.stem)
def test_dataset_yaml_only_selects_the_dataclass_whose_defaults_compose(path: Path) -> None:
    assert OmegaConf.to_container(OmegaConf.load(path)) == {"defaults": [f"/schema/dataset/{path.stem}@_here_"]}
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DATASET.parent), version_base="1.3"):
        config = OmegaConf.to_container(compose("train", overrides=[f"dataset={path.stem}"]).dataset)
    assert config.pop("name") == path.stem
    cls = TASKS[path.stem]
    defaults = {
        field.name: field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
        for field in dataclasses.fields(cls)
    }
    assert config == defaults
    assert build_task(path.stem, **config) == cls()


@pytest.mark.parametrize(
    "bad_line, column",
    [
        (b'{"question": "q", "answer": "#### 1"', 37),  # cut short: wrong at its end, not at column 1
        (b'{"question": "q" "answer": "#### 1"}', 18),
        ('{"question": "café \xff"}'.encode().replace(b"\xc3\xbf", b"\xff"), 20),  # in characters, not bytes
    ],
)
def test_gsm8k_bad_line_names_the_column_where_it_goes_wrong(tmp_path: Path, bad_line: bytes, column: int) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(record("q1", "#### 1").encode() + b"\n" + bad_line + b"\n")
    with pytest.raises(ValueError) as error:
        build_task("gsm8k", train_path=str(path)).examples("train")
    assert f"{path}:2: " in str(error.value) and f"at column {column})" in str(error.value)
