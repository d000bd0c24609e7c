"""The HF rollout engine: one prefill per prompt shared by its G completions, μ_old's log-probs and routing equal to a
full forward of the trainer's model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from experiments.step.batch import collect_rollout
from experiments.step.engines import HFEngine, KVCache, Sampling
from experiments.step.engines.hf import PreallocatedLayer, rollout_cache
from experiments.step.metrics import MISMATCH_K3
from experiments.step.scoring import FED, score_responses
from experiments.tasks import build_task
from models.registry import ConfigError
from models.routing.hooks import record_routing
from models.routing.measures import routing_drift
from models.routing.trace import NO_ROUTE

G, NEW = 4, 5


def _examples():
    task = build_task("addition", digits=2, train_size=50, test_size=10)
    examples = task.examples("train")[:6]
    widths = {len(example.prompt) for example in examples}
    assert len(widths) > 1, "the batch must mix prompt lengths, so that left padding is exercised"
    return task, examples


def test_shared_prefill_rollout_matches_a_full_forward(micro_policy):
    """The sampler's log-probs and routing are those of one forward over the finished sequences."""
    model, tokenizer = micro_policy
    task, examples = _examples()
    torch.manual_seed(0)
    engine = HFEngine(model, tokenizer, min_new_tokens=NEW)
    rollout = collect_rollout(engine, task, examples, Sampling(G, NEW, 0.7, record_routing=True))
    assert rollout.routes.shape[1:3] == tuple(rollout.input_ids.shape)
    with torch.no_grad(), record_routing(model) as scored:
        full = score_responses(model, rollout, 0.7)
    torch.testing.assert_close(rollout.logp, full.logp.masked_fill(~rollout.response_mask, 0.0), rtol=0, atol=1e-5)
    # The scoring forward feeds every position but the last (`FED`), whose token never went through the model
    # during generation either: the rollout's trace is NO_ROUTE there.
    assert (rollout.routes.experts[:, :, -1] == NO_ROUTE).all()
    seen = rollout.attention_mask[:, FED].bool()
    drift = routing_drift(rollout.routes.positions(FED), scored.trace, seen)
    assert drift.tokens == int(seen.sum()), "prompt tokens (shared prefill) and generated tokens are all recorded"
    assert drift.expert_change_frac == 0.0


@pytest.mark.parametrize("group_size", [1, G])
def test_the_cache_written_in_place_samples_what_the_concatenating_one_samples(micro_policy, group_size):
    """The same tokens, μ_old log-probs and routing, bit for bit, with the shared prefill (G rows per prompt) and
    without it (one row: generate fills the cache from the whole prompt), at a budget that needs every reserved
    position."""
    model, tokenizer = micro_policy
    task, examples = _examples()
    rollouts = {}
    for kind in KVCache:
        torch.manual_seed(0)
        engine = HFEngine(model, tokenizer, min_new_tokens=NEW, kv_cache=kind)
        rollouts[kind] = collect_rollout(engine, task, examples, Sampling(group_size, NEW, 1.0, record_routing=True))
    reference, rollout = rollouts[KVCache.concat], rollouts[KVCache.preallocated]
    assert torch.equal(rollout.input_ids, reference.input_ids)
    assert torch.equal(rollout.logp, reference.logp)
    assert torch.equal(rollout.routes.experts, reference.routes.experts)
    assert len(set(rollout.completions)) > 1, "a degenerate model would make this comparison vacuous"


def test_the_cache_written_in_place_copies_only_when_it_must(micro_policy):
    """Steps within the reserve write into the same buffer; a row repeat (which transformers does by assigning new
    tensors) or a step past the reserve moves the layer to a new buffer holding every position so far."""
    model, _ = micro_policy
    layer = rollout_cache(model, KVCache.preallocated, reserve=2).layers[0]
    assert isinstance(layer, PreallocatedLayer)
    generator = torch.Generator().manual_seed(0)
    written = []

    def step(rows: int, positions: int = 1) -> torch.Tensor:
        states = torch.randn(rows, 1, positions, 4, generator=generator)
        written.append(states)
        keys, values = layer.update(states, -states)
        assert torch.equal(values, -keys)
        return keys

    step(2, positions=3)  # room for 3 + 2 positions
    buffer = layer._key_buffer
    for _ in range(2):
        assert step(2)._base is buffer
    layer.batch_repeat_interleave(2)  # rows 0, 0, 1, 1
    written = [torch.cat(written, dim=-2).repeat_interleave(2, dim=0)]
    keys = step(4)
    assert layer._key_buffer is not buffer and keys._base is layer._key_buffer
    buffer = layer._key_buffer  # room for 6 + 2
    for _ in range(2):
        assert step(4)._base is buffer
    keys = step(4)  # the 9th position
    assert layer._key_buffer is not buffer
    assert torch.equal(keys, torch.cat(written, dim=-2))


def test_a_cache_written_in_place_refuses_a_model_with_sliding_windows(micro_policy):
    model, tokenizer = micro_policy
    model.config.sliding_window, model.config.use_sliding_window = 4, True
    try:
        with pytest.raises(
            ConfigError,
            match=r"rollout.kv_cache='preallocated' .* DynamicSlidingWindowLayer layers: "
            r"use rollout.kv_cache=concat",
        ):
            HFEngine(model, tokenizer)
        assert isinstance(HFEngine(model, tokenizer, kv_cache=KVCache.concat), HFEngine)
    finally:
        model.config.sliding_window, model.config.use_sliding_window = None, False


def test_shared_prefill_changes_nothing_but_the_cost(micro_policy):
    """Greedy completions equal those of `generate` over the B·G rows, each prompt prefilled G times."""
    model, tokenizer = micro_policy
    task, examples = _examples()
    rollout = collect_rollout(HFEngine(model, tokenizer), task, examples, Sampling(G, NEW, 1.0, greedy=True))
    prompts = [example.prompt for example in examples for _ in range(G)]
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    plain = model.generate(
        **encoded,
        max_new_tokens=NEW,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    expected = tokenizer.batch_decode(plain[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
    assert rollout.completions == expected
    assert len(set(rollout.completions)) > 1, "a degenerate model would make this comparison vacuous"


def test_the_documented_example_engine_returns_text_only_and_the_run_adapts(tmp_path):
    """`Add an engine` in docs/extending.md is code a newcomer copies: it must run as printed. An engine that returns no
    log-probs makes the run recompute π_old, and what reads μ_old is refused in one line."""
    from experiments.step.engines import ENGINES
    from experiments.train import train
    from tests.test_train import compose_train, read_metrics

    readme = (Path(__file__).resolve().parents[1] / "docs" / "extending.md").read_text(encoding="utf-8")
    code = readme.split("## Add an engine", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    try:
        exec(compile(code, "docs/extending.md", "exec", dont_inherit=True), {"__name__": "readme"})
        summary = train(compose_train("rollout.engine=text_only", "trainer.steps=1"), tmp_path / "run")
        assert summary["engine"] == "text_only" and summary["pi_old"] == "decoupled"
        assert MISMATCH_K3 not in read_metrics(tmp_path / "run")[0], "no μ_old to measure the mismatch against"
        with pytest.raises(
            SystemExit,
            match="correction=tis / algo=grpo read μ_old's log-probs, which rollout.engine=text_only does not return",
        ):
            train(compose_train("rollout.engine=text_only", "correction=tis"), tmp_path / "refused")
        with pytest.raises(
            SystemExit,
            match="routing.replay=r3 replays the engine's experts, which rollout.engine=text_only does not report",
        ):
            train(compose_train("rollout.engine=text_only", "routing.replay=r3"), tmp_path / "r3")
    finally:
        ENGINES._classes.pop("text_only", None)


def test_an_unknown_engine_is_refused_naming_the_registered_ones(tmp_path):
    from experiments.train import train
    from tests.test_train import compose_train

    with pytest.raises(SystemExit, match="unknown rollout engine 'sglang'; valid names: hf, vllm"):
        train(compose_train("rollout.engine=sglang"), tmp_path)


def test_vllm_refuses_the_hf_engines_cache_setting(micro_policy):
    """vLLM pages its own KV cache: a run that asks it for the hf engine's concatenating cache is refused by name,
    before vLLM is started (or found missing)."""
    from experiments.step.engines import ENGINES, EngineNumerics
    from tests.test_train import compose_train

    model, tokenizer = micro_policy
    cfg = compose_train("rollout.engine=vllm", "rollout.kv_cache=concat")
    with pytest.raises(ConfigError, match=r"rollout.kv_cache='concat' chooses the hf engine's cache; vLLM pages"):
        ENGINES["vllm"].build(cfg, model, tokenizer, EngineNumerics(), None, False)
