"""Figures, tables and reports from finished, crashed or running RL runs (local directories or W&B): rooms of one job
each, bottom to top.

- the runs: `configs` (a run's settings and its series label), `records` (the `RunSet` every source becomes), `load`
  (local run directories), `wandb_runs` (a W&B project);
- what they show: `summaries` (curves, collapse, the stability table), `diagnostics` (drift per layer, mismatch, early
  warning), `arms` (an arm, the sweep's axes and cells), `recipe_starts` (which starts of each recipe the runs come
  from, and why one between them is missing), `gains` (held-out accuracy gained per run), `statistics` and
  `verdicts` (paired comparisons and what they decide), `declaration` and `references` (what the runs declared and
  the committed results beside them);
- how it is shown: `style` and `plotting` (the look and the prelude of every figure), `sweep_figure`,
  `curve_figures`, `routing_figures` (the report's figures, one function each) and `figures` (their order), `tables`,
  `sections`, `headline` (report.md's parts);
- the commands, one shape each (`cli.Command`): `report` (`python -m analysis.report`, the entry point), `compare`,
  `panels`, `calibrate`, `regimes`, `drift_law` (with `drift_fit`), `cold_starts`, `margins`, `legacy_intervals`.
"""
