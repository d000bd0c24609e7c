"""Figures and a stability report from finished, crashed or running RL runs (local directories or W&B).

`python -m analysis.report` is the entry point; `load` reads runs into long frames, `aggregate` averages seeds
and computes the stability verdict, `figures` draws the GSPO paper's figures and the routing-drift mechanism,
`style` fixes colours and sizes.
"""
