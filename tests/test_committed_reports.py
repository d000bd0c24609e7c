"""The committed reports that their committed inputs can make again, made again by the command each report names: byte
for byte, except where the CPU's rounding reaches the output (the drift law's fit, below), which is compared at a
stated tolerance.

The runs behind most of docs/results are not in the repository (multirun/ is ignored), so `analysis.report`'s reports
cannot be made again here; `python -m tests.analysis_outputs` checks that path on synthetic runs. What the repository
does hold makes these again:
- every report of `analysis.compare` (its inputs are other reports' per-seed tables), in a copy of docs/results, by
  the command line its report names;
- every section `analysis.legacy_intervals` added to a report made before per-seed values were kept (it reads the
  report's own tables and replaces itself);
- every `analysis.margins` table from the margins.json written beside it (the rows it measured);
- `analysis.drift_law`'s fit, figures and report from the drift_law.csv and precision.csv written beside them (the
  probes' rows, read back); its fit.json and figures at stated tolerances, since LAPACK's last digits follow the CPU
  (the report prints the fit to three decimals, which every x86-64 CPU gives alike).
A report named in `EARLIER` was made by an earlier version of its command and holds what that version wrote (columns
or sentences since changed); it is left as committed and is not compared.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from analysis import compare, drift_law, legacy_intervals, margins
from analysis.drift_fit import fit_law, fit_record
from experiments.config import PROJECT_ROOT

RESULTS = Path("docs") / "results"
# Reports made by an earlier version of their command, with what it wrote differently.
EARLIER = {
    "confounds/clip_compared": "compared before per-seed tables named the start (no note on the starts' identity)",
    "confounds/step_compared": "compared before per-seed tables named the start (no note on the starts' identity)",
    "deep_long_seeds/all_arms": "compared before per-seed tables named the start (no note on the starts' identity)",
    "long_answers/ten_seeds": "compared before per-seed tables named the start (no note on the starts' identity)",
    "margins": "measured before margins.json held each checkpoint's sha256",
    "drift_law": "tabulated before the probed settings' table had a start-margin column (fit and figure are checked)",
}
COMPARE_FILES = ("report.md", "per_seed.csv", "comparisons.csv", "left_out.csv")


def made_with(module: str) -> list[tuple[str, str]]:
    """(result folder, command arguments) of every committed report whose `Made with` line names `module`."""
    found = []
    for report in sorted((PROJECT_ROOT / RESULTS).rglob("report.md")):
        match = re.search(rf"Made with `python -m {re.escape(module)} (.*?)`\.", report.read_text(encoding="utf-8"))
        if match:
            found.append((report.parent.relative_to(PROJECT_ROOT / RESULTS).as_posix(), match.group(1)))
    return found


def assert_same_numbers(made, committed, relative: float, where: str = "") -> None:
    """`made` and `committed` (parsed JSON) alike in every key, string and count, and every float within `relative`
    of the committed one."""
    if isinstance(committed, dict):
        assert isinstance(made, dict) and list(made) == list(committed), f"{where}: keys {list(made)}"
        for key in committed:
            assert_same_numbers(made[key], committed[key], relative, f"{where}.{key}")
    elif isinstance(committed, list):
        assert isinstance(made, list) and len(made) == len(committed), f"{where}: {made}"
        for index, (one, other) in enumerate(zip(made, committed)):
            assert_same_numbers(one, other, relative, f"{where}[{index}]")
    elif isinstance(committed, float):
        assert math.isclose(made, committed, rel_tol=relative), f"{where}: {made!r}, committed {committed!r}"
    else:
        assert made == committed and type(made) is type(committed), f"{where}: {made!r}, committed {committed!r}"


# How far a pixel's channel may move between CPUs: a line drawn from a fit whose last digits follow the CPU is
# anti-aliased a few levels apart at its edges (up to 7 of 255 seen on an AMD EPYC against the Intel Xeon that drew
# the committed figure); a line, a point or a label moved by a pixel changes some pixel by far more.
SHADE = 16


def same_pixels(first: Path, second: Path) -> bool:
    """The two figures alike, up to `SHADE` of anti-aliasing in any channel of any pixel."""
    a, b = (np.asarray(Image.open(path).convert("RGBA")).astype(int) for path in (first, second))
    return a.shape == b.shape and int(np.abs(a - b).max()) <= SHADE


@pytest.fixture
def copy_of_results(tmp_path, monkeypatch):
    """The text of docs/results in a folder of its own, the working directory: a command writes there, by the paths
    its report names, and reads the committed tables."""
    for path in (PROJECT_ROOT / RESULTS).rglob("*"):
        if path.is_file() and path.suffix in (".csv", ".md", ".json"):
            copy = tmp_path / path.relative_to(PROJECT_ROOT)
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, copy)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    "folder, arguments", [pair for pair in made_with("analysis.compare") if pair[0] not in EARLIER]
)
def test_a_comparison_is_made_again_from_the_per_seed_tables_it_names(copy_of_results, capsys, folder, arguments):
    compare.main(shlex.split(arguments))
    for name in COMPARE_FILES:
        made, committed = copy_of_results / RESULTS / folder / name, PROJECT_ROOT / RESULTS / folder / name
        assert made.read_bytes() == committed.read_bytes(), f"{RESULTS / folder / name} is not made again"


def test_every_committed_comparison_is_made_again_or_named_as_earlier():
    folders = [folder for folder, _ in made_with("analysis.compare")]
    assert len(folders) >= 11 and set(EARLIER) - set(folders) == {"margins", "drift_law"}


@pytest.mark.parametrize(
    "report",
    sorted(
        path.relative_to(PROJECT_ROOT).as_posix()
        for path in (PROJECT_ROOT / RESULTS).rglob("report.md")
        if legacy_intervals.SECTION in path.read_text(encoding="utf-8")
    ),
)
def test_the_intervals_from_the_recorded_means_are_made_again(copy_of_results, capsys, report):
    legacy_intervals.main([str(Path(report).parent)])
    assert (copy_of_results / report).read_bytes() == (PROJECT_ROOT / report).read_bytes()


@pytest.mark.parametrize("folder", ["margins/remade", "gate_mass"])
def test_a_margin_table_is_made_again_from_the_rows_it_measured(tmp_path, folder):
    committed = PROJECT_ROOT / RESULTS / folder
    command = re.search(r"Made with `(.*?)`\.", (committed / "report.md").read_text(encoding="utf-8")).group(1)
    margins.report(json.loads((committed / "margins.json").read_text(encoding="utf-8")), tmp_path, command)
    for name in ("report.md", "margins.json"):
        assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), f"{folder}/{name}"


@pytest.mark.parametrize("folder", ["drift_law", "drift_law_routers"])
def test_the_drift_law_is_fitted_drawn_and_reported_again_from_its_rows(tmp_path, folder):
    committed = PROJECT_ROOT / RESULTS / folder
    rows = pd.read_csv(committed / "drift_law.csv")
    rows["drift_per_layer"] = [
        ast.literal_eval(profile) if isinstance(profile, str) else profile for profile in rows["drift_per_layer"]
    ]
    precision = pd.read_csv(committed / "precision.csv")
    command = re.search(r"Made with `(.*?)`\.", (committed / "report.md").read_text(encoding="utf-8")).group(1)
    fit = fit_law(rows)
    # At a tolerance, not byte for byte: the fit is LAPACK's least squares, whose kernels OpenBLAS picks by the CPU,
    # and the last digits of its 16 differ between an Intel Xeon and an AMD EPYC (1e-13 apart, relative, seen).
    assert_same_numbers(
        fit_record(fit, rows), json.loads((committed / "fit.json").read_text(encoding="utf-8")), relative=1e-9
    )
    drift_law.report(rows, precision, fit, tmp_path, command, drift_law.figure(rows, fit, tmp_path))
    for png in committed.glob("*.png"):
        assert same_pixels(tmp_path / png.name, png), f"{folder}/{png.name}"
    if folder not in EARLIER:
        assert (tmp_path / "report.md").read_bytes() == (committed / "report.md").read_bytes()


DOCS_BUDGET_BYTES = (
    10_000_000  # docs/ is read in a browser and cloned by every user: its tracked files stay under 10 MB
)
EMBEDDED_FIGURE = re.compile(r"!\[[^\]]*\]\(([^)\s]+\.png)\)")


def tracked_docs() -> list[Path]:
    """The files under docs/ that git tracks (what a clone holds), as paths from the project's root."""
    listed = subprocess.run(["git", "ls-files", "-z", "docs"], cwd=PROJECT_ROOT, capture_output=True, check=True)
    return [Path(name) for name in listed.stdout.decode().split("\0") if name]


def test_docs_are_held_under_their_budget():
    sizes = {path: (PROJECT_ROOT / path).stat().st_size for path in tracked_docs()}
    largest = sorted(sizes, key=sizes.__getitem__, reverse=True)[:5]
    assert sum(sizes.values()) < DOCS_BUDGET_BYTES, (
        f"docs/ holds {sum(sizes.values()) / 1e6:.2f} MB of tracked files, over its 10 MB; the largest: "
        + ", ".join(f"{path} ({sizes[path] / 1e3:.0f} kB)" for path in largest)
    )


def test_every_figure_a_page_embeds_is_committed():
    tracked = set(tracked_docs()) | {Path("README.md")}
    pages = [path for path in tracked if path.suffix == ".md"]
    dangling = [
        f"{page}: {target}"
        for page in pages
        for target in EMBEDDED_FIGURE.findall((PROJECT_ROOT / page).read_text())
        if Path(os.path.normpath(page.parent / target)) not in tracked
    ]
    assert not dangling, "figures embedded but not committed:\n" + "\n".join(dangling)
