"""Rollout workers: the prompts shared out among processes that read the policy's weights in place."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from experiments.rollout import Samples, concat_samples, generate_rollout, generation_options
from experiments.rollout_workers import RolloutWorkers
from experiments.tasks import build_task
from experiments.train import train
from models.policy import ModelConfig, build_policy
from models.routing import NO_ROUTE, RoutingTrace
from tests.conftest import MICRO_MODEL
from tests.test_train import compose_train, read_metrics

CONFIG = ModelConfig(**MICRO_MODEL)


@pytest.fixture(scope="module")
def pooled():
    """(model, tokenizer, workers): the micro MoE and two samplers of it, this process and one helper."""
    model, tokenizer = build_policy(CONFIG)
    model.eval()
    workers = RolloutWorkers(model, CONFIG, workers=2, threads=2, seed=0)
    yield model, tokenizer, workers
    workers.close()


def _examples(count: int = 7):
    task = build_task("addition", digits=2, train_size=50, test_size=10)
    return task, task.examples("train")[:count]


def _greedy(model, tokenizer, group_size, workers=None):
    task, examples = _examples()  # 7 prompts: chunks of 4 and 3, so the split is uneven
    return generate_rollout(model, tokenizer, task, examples, group_size, 6, temperature=1.0, greedy=True,
                            record=True, logprobs=True, workers=workers)


def _assert_same_rollout(pooled_rollout, local_rollout):
    assert torch.equal(pooled_rollout.input_ids, local_rollout.input_ids)
    assert torch.equal(pooled_rollout.attention_mask, local_rollout.attention_mask)
    assert torch.equal(pooled_rollout.trace.experts, local_rollout.trace.experts)
    torch.testing.assert_close(pooled_rollout.rollout_logp, local_rollout.rollout_logp, rtol=0, atol=1e-5)


@pytest.mark.parametrize("group_size", [1, 3])
def test_workers_give_the_rollout_of_one_generate_call(pooled, group_size):
    """Token ids, masks, routing and log-probs of the pooled rollout are those sampled in-process, row for row."""
    model, tokenizer, workers = pooled
    local = _greedy(model, tokenizer, group_size)
    _assert_same_rollout(_greedy(model, tokenizer, group_size, workers), local)
    assert len(set(local.completions)) > 1, "a degenerate model would make this comparison vacuous"


def test_workers_sample_from_the_weights_the_optimizer_updated(pooled):
    """An in-place optimizer step in this process is what the helper samples from next: nothing is copied."""
    model, tokenizer, workers = pooled
    before = _greedy(model, tokenizer, 2, workers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    after = _greedy(model, tokenizer, 2, workers)
    assert after.completions != before.completions, "the update must change the greedy completions to be seen"
    _assert_same_rollout(after, _greedy(model, tokenizer, 2))


def test_chunks_that_stop_early_are_padded_as_generate_pads_finished_rows():
    trace = RoutingTrace(experts=torch.zeros(2, 1, 3, 2, dtype=torch.int16), layer_names=("a", "b"), num_experts=4)
    short = Samples(sequences=torch.tensor([[5, 6, 7]]), logp=torch.tensor([[-0.5]]), trace=trace)
    long = Samples(sequences=torch.tensor([[5, 6, 7, 8, 9]]), logp=torch.tensor([[-0.5, -1.0, -2.0]]),
                   trace=RoutingTrace(experts=torch.ones(2, 1, 5, 2, dtype=torch.int16), layer_names=("a", "b"),
                                      num_experts=4))
    merged = concat_samples([short, long], pad_id=0)
    assert merged.sequences.tolist() == [[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]]
    assert merged.logp.tolist() == [[-0.5, 0.0, 0.0], [-0.5, -1.0, -2.0]]
    assert merged.trace.shape == (2, 2, 5, 2)
    assert (merged.trace.experts[:, 0, 3:] == NO_ROUTE).all() and (merged.trace.experts[:, 0, :3] == 0).all()


def test_a_failing_chunk_leaves_the_workers_usable_and_a_dead_helper_is_named(pooled):
    model, tokenizer, workers = pooled
    prompts = dict(tokenizer(["1+2=", "3+4="], return_tensors="pt", padding=True, add_special_tokens=False))
    options = generation_options(tokenizer, 4, 1.0, greedy=True, fixed_length=False, logprobs=False)
    with pytest.raises(ValueError):
        workers.sample(prompts, 1, {**options, "max_new_tokens": -1}, 1.0, False)
    # Both chunks failed; the helper's reply was read, so the next rollout gets its own answer.
    assert workers.sample(prompts, 1, options, 1.0, False).sequences.shape[0] == 2
    helper = RolloutWorkers(model, CONFIG, workers=2, threads=2, seed=0)
    helper.processes[0].kill()
    with pytest.raises(RuntimeError, match="rollout worker 1 failed: exited with code"):
        helper.sample(prompts, 1, options, 1.0, False)
    helper.close()


def test_workers_need_two_processes_and_cpu_weights(pooled):
    model, _, _ = pooled
    with pytest.raises(ValueError, match="workers >= 2"):
        RolloutWorkers(model, CONFIG, workers=1, threads=1, seed=0)


def test_runs_with_workers_are_reproducible_and_stop_their_helpers(tmp_path):
    helpers_before = _helpers()
    cfg = compose_train("trainer.rollout_workers=2", "trainer.steps=2", "trainer.eval_every=1")
    train(cfg, tmp_path / "a")
    train(cfg, tmp_path / "b")

    def strip(lines):
        return [{k: v for k, v in line.items() if not k.startswith("perf/")} for line in lines]

    assert strip(read_metrics(tmp_path / "a")) == strip(read_metrics(tmp_path / "b"))
    assert "eval/greedy_accuracy" in read_metrics(tmp_path / "a")[0], "evaluation samples through the workers too"
    assert _helpers() == helpers_before, "a run's helpers outlived it"


def _helpers() -> list:
    return [child for child in multiprocessing.active_children() if child.name.startswith("rollout-worker")]
