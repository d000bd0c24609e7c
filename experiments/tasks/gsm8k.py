"""GSM8K-format question/answer files for real checkpoints: a loader with errors that point at the line.

File format (the GSM8K release, Cobbe et al. 2021): JSON Lines, one object per line with string fields
`question` and `answer`; the answer is a worked solution whose last line is `#### <final answer>`. Blank lines
are skipped. The reward compares final numbers only, the way GSM8K is usually scored.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

from experiments.tasks.base import TASKS, Example, Task, check_question_template, check_split
from models.registry import ConfigError

FINAL_ANSWER_MARK = "####"
# A number as written in solutions: optional sign and dollar sign, digits (commas only between groups of three,
# so a list "1,2,3" reads as three numbers), optional decimals.
NUMBER = re.compile(r"-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def normalize_number(text: str) -> str:
    """Canonical form of a number: no `$` or commas, no leading zeros, no trailing fractional zeros.

    `"$1,200.50"` -> `"1200.5"`, `"72.0"` -> `"72"`, `"-0"` -> `"0"`.
    """
    text = text.replace("$", "").replace(",", "")
    sign = "-" if text.startswith("-") else ""
    whole, _, fraction = text.lstrip("-").partition(".")
    whole = whole.lstrip("0") or "0"
    fraction = fraction.rstrip("0")
    number = whole + ("." + fraction if fraction else "")
    return number if number == "0" else sign + number


def extract_final_number(text: str) -> str | None:
    """The final answer of a solution or completion, normalised; None when there is no number.

    With a `####` mark: the first number after the first mark (a model that runs on past its answer and
    writes another `####` is scored on the first). Without one: the last number in the text.
    """
    head, mark, tail = text.partition(FINAL_ANSWER_MARK)
    if mark:
        match = NUMBER.search(tail)
        return normalize_number(match.group()) if match else None
    numbers = NUMBER.findall(head)
    return normalize_number(numbers[-1]) if numbers else None


@TASKS.register("gsm8k")
@dataclass(frozen=True)
class GSM8KTask(Task):
    """Grade-school math word problems from GSM8K-format JSONL files (train_path, test_path).

    Prompt: `prompt_template.format(question=...)`, by default `"Question: {question}\\nAnswer:"`.
    Answer: the reference's final number after `####`, normalised (`$` and commas dropped, `72.0` -> `72`).
    Demonstration: the full reference solution ending in `#### <answer>`, with one leading space when the prompt
    does not end in whitespace (`"Answer: Natalia sold ..."`).
    Example: prompt `"Question: Natalia sold 48 clips in April and half as many in May. How many in all?\\nAnswer:"`,
    answer `"72"`, demonstration `" She sold 48/2 = 24 in May.\\n48+24 = 72\\n#### 72"`.

    Difficulty: fixed by the files (`max_examples` keeps the first N examples of each split). The splits are the
    two files as given; nothing is shuffled, so there is no seed.
    Reward: 1.0 when the completion's final number (first number after `####` if the completion has one, else
    its last number; normalised as above) equals the answer, else 0.0. No partial credit.
    """

    train_path: str | None = None  # GSM8K-format JSONL of the train split (required)
    test_path: str | None = None  # and of the held-out split (required)
    prompt_template: str = "Question: {question}\nAnswer:"  # must hold {question} and no other field
    max_examples: int | None = None  # keep the first N examples of each split; None: all

    def __post_init__(self) -> None:
        super().__post_init__()
        check_question_template(self.prompt_template, "gsm8k.prompt_template")
        if self.max_examples is not None and self.max_examples < 1:
            raise ConfigError(f"gsm8k.max_examples={self.max_examples} must be >= 1 or null (all examples)")

    def examples(self, split: str) -> list[Example]:
        check_split(split)
        key = f"{split}_path"
        path = getattr(self, key)
        if path is None:
            raise ConfigError(f"gsm8k.{key} is not set; point it at a GSM8K-format JSONL file (dataset.{key}=/path)")
        return [self._example(*record) for record in read_qa_jsonl(Path(path), key)[: self.max_examples]]

    def _example(self, question: str, solution: str, answer: str) -> Example:
        prompt = self.prompt_template.format(question=question)
        separator = "" if prompt[-1:].isspace() else " "
        return Example(prompt=prompt, answer=answer, demonstration=separator + solution)

    def reward(self, completion: str, example: Example) -> float:
        return 1.0 if extract_final_number(completion) == example.answer else 0.0


def read_qa_jsonl(path: Path, config_key: str) -> list[tuple[str, str, str]]:
    """(question, solution, normalised final answer) of each line of a GSM8K-format file.

    Every problem raises with `path:line` in the message; `config_key` names the setting that chose the file.
    """
    if not path.is_file():
        raise ConfigError(f"gsm8k: {path} does not exist or is not a file (set dataset.{config_key})")
    records = []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{path}:{number}"
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as error:
                column = len(raw[: error.start].decode("utf-8")) + 1  # in characters, as an editor counts them
                raise ConfigError(
                    f"{where}: not UTF-8 (byte {raw[error.start]:#04x} at column {column}); "
                    "GSM8K-format files are UTF-8 JSON lines"
                ) from None
            if not line.strip():
                continue
            try:
                # without its line break: a line cut short is then wrong at its end, not at column 1 of a next line
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
            if not isinstance(record, dict):
                raise ConfigError(
                    f"{where}: expected a JSON object with 'question' and 'answer', got {type(record).__name__}"
                )
            for field in ("question", "answer"):
                if field not in record:
                    raise ConfigError(f"{where}: missing field {field!r} (fields present: {sorted(record)})")
                if not isinstance(record[field], str):
                    raise ConfigError(f"{where}: field {field!r} must be a string, got {type(record[field]).__name__}")
            solution = record["answer"]
            _, mark, final = solution.partition(FINAL_ANSWER_MARK)
            if not mark:
                raise ConfigError(f"{where}: answer has no '{FINAL_ANSWER_MARK} <final answer>' line")
            if not NUMBER.fullmatch(final.strip()):
                raise ConfigError(
                    f"{where}: final answer after '{FINAL_ANSWER_MARK}' is not a number: {final.strip()!r}"
                )
            records.append((record["question"], solution, normalize_number(final.strip())))
    if not records:
        raise ConfigError(f"gsm8k: {path} has no examples (empty file)")
    return records
