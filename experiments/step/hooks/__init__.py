"""The parts a run switches on, as hooks the step calls at fixed points: the update never asks which are on.

The start-up plan (`experiments.step.plan`) decides what a run is made of; `assemble` turns that into objects: where
π_old comes from (`experiments.step.old_policy`) and the list of step hooks, in the order they act. An update calls
every hook at each fixed point, in that order; a hook that has nothing to do there inherits the base's no-op:

    options(update, options)          what the update's forward computes (replay, recording, router calls, ...)
    around_forward(update)            a context held around the update's forward (SYNTHETIC flips, router inputs)
    objective_inputs(update, inputs)  what the objective is given (RSPO's shifted π_old, a correction's weights)
    loss(update)                      a term added to the update's loss (load balancing, PR2's predictors)
    before_step(update)               after the backward, before the optimizer step: metrics of θ before it moves
                                      (the ratio decomposition's extra forwards)
    after_step(update)                after an applied optimizer step: what acts on the weights between updates
                                      (router switches, the SYNTHETIC router noise), with its metrics
    measure(update, rows)             metrics of the update over every rank's rows (`Rows` gathers each tensor once)

A hook keeps what it needs between its fixed points in `update.held[hook]`. Each hook is the adapter of one part of
`algos/` or `models/` (a correction, a routing variant, the router switches, an intervention) to the step; the parts
themselves stay pure functions of tensors. A new switch is a new hook in the module of its job (`routing`,
`interventions`, `mismatch`, `learning`) and one line in `assembly.assemble`.
"""

from experiments.step.hooks.assembly import Assembly, StepParts, assemble
from experiments.step.hooks.base import Rows, StepHook, Update
from experiments.step.hooks.learning import LearningMeasures

__all__ = ["Assembly", "LearningMeasures", "Rows", "StepHook", "StepParts", "Update", "assemble"]
