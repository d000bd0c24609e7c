"""The drift law (`python -m analysis.drift_law`) on probe summaries whose drift follows a known power law."""

from __future__ import annotations

import json
import math

import pytest

from algos.objective import TOKEN_RATIO_VAR
from analysis import drift_fit, drift_law
from experiments.step.metrics import (
    DRIFT_PER_UPDATE,
    ENGINE_EXPERTS,
    ENGINE_TOKENS,
    LENGTH,
    LOGIT_MARGIN,
    MISMATCH_K3,
    ROUTING_SHARE,
    TOPK_MARGIN_MEDIAN,
)

EXPONENTS = {"layers": -0.5, "lr": 1.0, "experts_per_slot": 0.3}
CONSTANT = 50.0


def law(layers: int, lr: float, experts: int, top_k: int) -> float:
    return (
        CONSTANT
        * layers ** EXPONENTS["layers"]
        * lr ** EXPONENTS["lr"]
        * (experts / top_k) ** EXPONENTS["experts_per_slot"]
    )


def write_probe(
    root, name, layers, experts, top_k, lrs, diverged_lr=None, drift=None, cold_start=None, model_type=None
):
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("model:\n  name: m\n  path: null\n  hidden_size: 64\n")
    drift = drift or (lambda lr: law(layers, lr, experts, top_k))
    settings = [
        {
            "lr": lr,
            DRIFT_PER_UPDATE: drift(lr),
            "drift_per_layer": [drift(lr)] * layers,
            ROUTING_SHARE: 0.1,
            LOGIT_MARGIN: 0.2,
            TOKEN_RATIO_VAR: 0.01,
            LENGTH: 3.5,
        }
        for lr in lrs
    ]
    if diverged_lr:
        settings.append({"lr": diverged_lr, "diverged": "the trainer's model produced logits that are NaN or inf"})
    summary = {
        "status": "finished",
        "model": name,
        "dataset": {"name": "addition", "digits": 2},
        "answer_tokens": 3.9,
        "policy": {
            "num_moe_layers": layers,
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            **({"model_type": model_type} if model_type else {}),
        },
        "cold_start": cold_start,
        "settings": settings,
        "precision_mismatch": [{"precision": "bf16", ENGINE_EXPERTS: 0.01, ENGINE_TOKENS: 0.2, MISMATCH_K3: 1e-4}],
    }
    (run / "summary.json").write_text(json.dumps(summary))


def test_the_fit_recovers_a_known_law_and_where_it_reaches_the_papers_drift(tmp_path):
    lrs = [1e-5, 1e-4, 1e-3]
    for layers in (8, 16, 48):
        for experts, top_k in ((32, 8), (128, 8)):
            write_probe(tmp_path, f"l{layers}_e{experts}", layers, experts, top_k, lrs, diverged_lr=1e-2)
    rows, precision = drift_law.load_probes([tmp_path])
    assert len(rows) == 24 and rows["diverged"].notna().sum() == 6 and len(precision) == 6
    fit = drift_fit.fit_law(rows)
    assert fit.regressors == ["layers", "lr", "experts_per_slot"]  # answer length and width do not vary: not fitted
    for name, value in EXPONENTS.items():
        assert fit.coef[1 + fit.regressors.index(name)] == pytest.approx(value, abs=1e-9)
    assert fit.coef[0] == pytest.approx(math.log(CONSTANT)) and fit.r2 == pytest.approx(1.0)
    paper = {"layers": 48, "experts_per_slot": 16}
    needed = drift_fit.lr_for_paper_drift(fit, rows)
    assert law(48, needed, 128, 8) == pytest.approx(drift_fit.PAPER_DRIFT)
    assert fit.predict({**drift_fit.paper_point(fit, rows, 1e-4), **paper}) == pytest.approx(law(48, 1e-4, 128, 8))
    # lr over 100x moves drift 100x; depth over 6x moves it by 6^-0.5; 4x more experts per slot by 4^0.3
    effects = drift_fit.knob_effects(fit, rows)
    assert [name for name, *_ in effects] == ["lr", "layers", "experts_per_slot"]
    assert [factor for *_, factor in effects] == pytest.approx([100.0, 6**-0.5, 4**0.3])


def test_the_cli_writes_its_report_and_refuses_a_folder_without_probes(tmp_path, capsys):
    for layers in (8, 16):
        for experts in (32, 64):
            write_probe(tmp_path / "probes", f"l{layers}_e{experts}", layers, experts, 8, [1e-5, 1e-4])
    drift_law.main([str(tmp_path / "probes"), "--out", str(tmp_path / "law")])
    report = (tmp_path / "law" / "report.md").read_text()
    assert "| l16_e64 | l16_e64 | addition digits=2 | 16 | 64/8 | – | 1e-04 | 3.9 |" in report  # no margin recorded
    assert "The fit has no term for" not in report  # depth and experts per slot vary: the paper's routing enters
    assert json.loads((tmp_path / "law" / "fit.json").read_text())["n"] == 8
    assert (tmp_path / "law" / "drift_law.png").stat().st_size > 1000
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit) as stop:
        drift_law.main([str(tmp_path / "empty"), "--out", str(tmp_path / "law2")])
    assert stop.value.code == 2 and "no finished probe" in capsys.readouterr().err


def test_the_cold_starts_margin_and_the_family_enter_the_law_and_give_the_margin_a_drift_needs(tmp_path):
    """drift = 0.02 · (lr / 1e-4)^0.9 · (m / 0.01)^-0.5 · e^{0.7 · sigmoid}: the fit recovers the margin's exponent and
    the family's factor, and the margin it says 5% drift needs at lr 1e-4 on a softmax start gives 5% under the true
    law."""

    def truth(lr, margin, sigmoid):
        return 0.02 * (lr / 1e-4) ** 0.9 * (margin / 0.01) ** -0.5 * math.exp(0.7 * sigmoid)

    lrs = [3e-5, 1e-4, 3e-4]
    starts = [("qwen3_moe", 0.002), ("qwen3_moe", 0.01), ("glm4_moe", 0.01), ("glm4_moe", 0.05)]
    for i, (family, margin) in enumerate(starts):
        sigmoid = float(family == "glm4_moe")
        write_probe(
            tmp_path,
            f"s{i}",
            16,
            128,
            8,
            lrs,
            drift=lambda lr, m=margin, s=sigmoid: truth(lr, m, s),
            cold_start={"eval_greedy_accuracy": 0.5, "routing": {TOPK_MARGIN_MEDIAN: margin}},
            model_type=family,
        )
    rows, _ = drift_law.load_probes([tmp_path])
    fit = drift_fit.fit_law(rows)
    assert fit.regressors == ["lr", "margin", "sigmoid"]
    assert fit.exponent("lr") == pytest.approx(0.9) and fit.exponent("margin") == pytest.approx(-0.5)
    assert fit.exponent("sigmoid") == pytest.approx(0.7)  # a factor e^0.7 for the sigmoid family, not a power of 0/1
    needed = drift_fit.margin_for_drift(fit, rows, lr=1e-4, drift=0.05)
    assert truth(1e-4, needed, 0.0) == pytest.approx(0.05)
    effects = dict((name, factor) for name, _, _, factor in drift_fit.knob_effects(fit, rows))
    assert effects["sigmoid"] == pytest.approx(math.exp(0.7)) and effects["margin"] == pytest.approx(25**-0.5)
    drift_law.main([str(tmp_path), "--out", str(tmp_path / "law")])
    report = (tmp_path / "law" / "report.md").read_text()
    assert f"- lr 1e-04: m ≈ {needed:.2g}" in report
    # every start has 16 layers and 128 experts top-8: the extrapolation says the paper's routing cannot enter
    assert "The fit has no term for MoE layers L or experts per top-k slot E/k" in report


def test_a_margin_that_does_not_lower_drift_gives_no_margin_to_aim_for(tmp_path):
    for i, margin in enumerate((0.002, 0.02)):
        write_probe(
            tmp_path,
            f"s{i}",
            16,
            128,
            8,
            [1e-4, 3e-4],
            drift=lambda lr, m=margin: 10 * lr * m,
            cold_start={"routing": {TOPK_MARGIN_MEDIAN: margin}},
            model_type="qwen3_moe",
        )
    rows, _ = drift_law.load_probes([tmp_path])
    fit = drift_fit.fit_law(rows)
    assert fit.exponent("margin") == pytest.approx(1.0) and drift_fit.margin_for_drift(fit, rows, 1e-4) is None
