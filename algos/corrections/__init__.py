"""Rollout corrections, interchangeable by name (`build_correction`, `CORRECTIONS`); see `base` for the contract."""

# Importing a module registers its correction.
from algos.corrections import geo_rs, icepop, mis, opsm, tis  # noqa: F401
from algos.corrections.base import CORRECTIONS, Correction, CorrectionInputs, CorrectionOutput, build_correction

__all__ = ["CORRECTIONS", "Correction", "CorrectionInputs", "CorrectionOutput", "build_correction"]
