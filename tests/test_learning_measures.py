"""What tells a run that learns from one that holds level (docs/results/learnability): the unbiased pass@k of the
held-out evaluation against every subset of the samples, each update's size against the weights, the KL from the
start, the reward's spread within groups, and training-prompt accuracy beside held-out accuracy."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from algos.objective import within_group_std
from experiments.step import metrics as m
from experiments.step.batch import pass_at_k
from experiments.step.hooks import LearningMeasures, Update
from experiments.train import train
from tests.test_train import compose_train, read_metrics


@pytest.mark.parametrize("n, k", [(8, 8), (10, 8), (16, 8), (5, 1)])
def test_pass_at_k_is_the_share_of_k_subsets_with_a_right_answer(n, k):
    """Unbiased: the mean over every k-subset of n samples of whether it holds a right answer, for each count c."""
    for c in range(n + 1):
        right = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(right, k))
        expected = sum(any(subset) for subset in subsets) / len(subsets)
        assert float(pass_at_k(torch.tensor([c]), n, k)) == pytest.approx(expected, abs=1e-12), (n, k, c)
        assert expected == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_within_group_std_is_the_mean_of_each_groups_unbiased_std():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    assert within_group_std(rewards, 4) == pytest.approx((0 + torch.tensor([0.0, 1.0, 0.0, 1.0]).std().item()) / 2)
    assert rewards.std().item() != pytest.approx(within_group_std(rewards, 4)), "not the step's overall spread"


def test_the_update_ratio_is_the_norm_of_the_move_over_the_norm_of_the_weights():
    model = torch.nn.Linear(3, 2)
    hook, update = LearningMeasures(model, model, score=None), Update(step=1, mb=None, old=None)
    hook.before_step(update)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    ratio = hook.after_step(update)[m.UPDATE_RATIO]
    assert ratio == pytest.approx(float((after - before).norm() / before.norm()), rel=1e-5)
    assert not update.held, "the snapshot is dropped once measured"


@pytest.mark.slow
def test_a_run_that_barely_moves_stays_at_the_start_and_one_that_moves_leaves_it(tmp_path):
    """The KL from the start and the update's size follow the learning rate; the evaluations carry pass@8, the share
    of prompts whose samples agree, and the training prompts' greedy accuracy."""
    logs = {}
    for lr in ("1e-9", "3e-2"):
        train(compose_train("trainer.measure_learning=true", "trainer.eval_train=true", "trainer.eval_samples=8",
                            "trainer.eval_every=3", f"trainer.lr={lr}"), tmp_path / lr)
        logs[lr] = read_metrics(tmp_path / lr)
    still, moved = logs["1e-9"][-1], logs["3e-2"][-1]
    assert still[m.KL_TO_START] < 1e-6 < 1e-3 < moved[m.KL_TO_START]
    assert still[m.UPDATE_RATIO] < 1e-7 < 1e-3 < moved[m.UPDATE_RATIO]
    for key in (m.EVAL_PASS_AT_K, m.EVAL_ALL_SAME, m.EVAL_TRAIN_GREEDY, m.WITHIN_GROUP_STD):
        assert key in moved and 0 <= moved[key] <= 1, key
    assert moved[m.EVAL_PASS_AT_K] >= moved[m.EVAL_ACCURACY], "pass@8 of the same samples is at least their pass@1"
