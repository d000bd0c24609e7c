"""The benchmark harness on a micro model: FLOP counts by hand, the worker protocol, the CLI end to end, and the
TRL settings that make TRL's generation batch the work of one of our RL steps."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from benchmarks import rl_step
from benchmarks.module_time import ModuleTimer
from benchmarks.roofline import ModelShape, matmul_gflops, rl_step_flops
from benchmarks.worker import Worker
from benchmarks.workload import compose_workload
from tests.conftest import MICRO_MODEL

pytestmark = pytest.mark.slow  # the benchmarks' workers, tens of seconds each: not in the fast lane

MICRO_OVERRIDES = [f"model.{key}={value}" for key, value in MICRO_MODEL.items() if key != "name"] + [
    "trainer.prompts_per_step=4",
    "trainer.group_size=4",
    "trainer.minibatches=2",
    "trainer.max_new_tokens=4",
    "dataset.train_size=200",
    "dataset.test_size=20",
]


def test_rl_step_flops_match_a_count_by_hand():
    # hidden 2, one layer, one head of width 2 (q, k, v, o: 2x2 each), 2 experts top-1 of width 1, vocab 3.
    shape = ModelShape(hidden=2, layers=1, heads=1, kv_heads=1, head_dim=2, vocab=3, mlp_width=1, experts=2, top_k=1)
    # per token: 2 * (projections 4*4 + router 2*2 + expert 3*2*1) = 52; LM head 2*2*3 = 12;
    # attention 2*2*1*2 = 8 per attended position.
    assert shape.token_flops == 52 and shape.lm_head_flops == 12 and shape.attention_flops(1) == 8
    flops = rl_step_flops(shape, completions=1, prompt_width=1, new_tokens=2)
    # generation: prefill 52 + 8*1 + 12 = 72; one decode step at position 1: 52 + 12 + 8*2 = 80
    # scoring feeds all but the last token: 2 tokens * 52 + 8*(1+2) + 2 logits * 12 = 152 (the same work as
    # generating them); training: 3 * 152
    assert flops == {"generation": 152.0, "scoring": 152.0, "training": 456.0, "total": 760.0}


def test_model_shape_of_the_bench_tiny_config():
    from models.policy import ModelConfig, config_in_code
    from models.tokenizer import build_char_tokenizer

    shape = ModelShape.from_config(config_in_code(ModelConfig(), build_char_tokenizer()))
    # per layer: q, o 256x256, k, v 256x128; router 256x16; 2 experts x 3 matrices 256x128; 4 layers
    assert shape.token_flops == 2 * 4 * (2 * 65536 + 2 * 32768 + 4096 + 2 * 3 * 32768)


def test_matmul_gflops_measures_and_refuses_bad_sizes():
    assert matmul_gflops(64, seconds=0.01, trials=1) > 0
    with pytest.raises(ValueError, match="size >= 1"):
        matmul_gflops(0)


def test_cli_runs_our_loop_and_reports_the_work(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--variants", "grpo", "--steps", "2", "--warmup", "0", "--threads", "1", "--json-out", str(out)]
    for override in MICRO_OVERRIDES:
        args += ["--override", override]
    rl_step.main(args)
    printed = capsys.readouterr().out
    assert "| ours grpo |" in printed and "of the best matmul measured" in printed
    result = json.loads(out.read_text())
    steps = result["main"]["ours grpo"]["steps"]
    assert len(steps) == 2
    for step in steps:
        assert step["tokens"] == 4 * 4 * 4, "fixed length: prompts x group x new tokens"
        assert 4 <= step["prompt_width"] <= 6, "'a+b=' with a, b < 100 is 4 to 6 characters"
        assert step["rollout_s"] + step["score_s"] + step["train_s"] <= step["seconds"]
    fractions = result["main"]["ours grpo"]["peak_fraction"]
    assert len(fractions) == 2 and all(0 < f < 1 for f in fractions)


def test_profile_section_splits_the_step_into_the_models_parts(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = [
        "--variants",
        "grpo",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--profile",
        "--json-out",
        str(out),
    ]
    for override in MICRO_OVERRIDES:
        args += ["--override", override]
    rl_step.main(args)
    assert "## Where grpo's step goes" in capsys.readouterr().out
    profile = json.loads(out.read_text())["profile"]
    rollout, training = profile["medians"]["rollout"], profile["medians"]["scoring + training"]
    for part in ("experts", "router", "attention", "norms", "lm head"):
        assert rollout[part] > 0 and training[part] > 0, part
    assert rollout["backward"] == rollout["optimizer step"] == 0.0, "no backward or update while sampling"
    assert training["backward"] > 0 and training["gradient clipping"] > 0 and training["optimizer step"] > 0
    step = profile["steps"][0]
    timed = sum(step["profile"]["scoring + training"].values())
    assert timed <= step["score_s"] + step["train_s"], "self times never exceed the phase they are part of"


def test_compare_steps_two_override_sets_alternately_and_alone(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["--compare", "algo=gspo", "", "--steps", "2", "--warmup", "0", "--threads", "1", "--json-out", str(out)]
    for override in MICRO_OVERRIDES:
        args += ["--override", override]
    rl_step.main(args)
    assert "## A / B, stepped alternately (A = algo=gspo; B = grpo (workload))" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["main"] == {}, "--compare alone runs only the comparison"
    compare = result["compare"]
    assert compare["A"]["overrides"] == ["algo=grpo", "algo=gspo"] and compare["B"]["overrides"] == ["algo=grpo"]
    a, b = compare["A"]["steps"], compare["B"]["steps"]
    assert len(a) == len(b) == 2
    assert compare["ratios"]["step"] == [x["seconds"] / y["seconds"] for x, y in zip(a, b)]
    training = [(x["score_s"] + x["train_s"]) / (y["score_s"] + y["train_s"]) for x, y in zip(a, b)]
    assert compare["ratios"]["scoring + training"] == pytest.approx(training)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--compare", "algo=nope", ""], "Could not find 'algo/nope'"),
        (["--compare", "", "trainer.nokey=1"], "Could not override 'trainer.nokey'"),
        (["--override", "trainer.lr=abc"], "trainer.lr=abc"),
    ],
)
def test_cli_names_a_bad_override_before_starting_workers(args, message, capsys):
    with pytest.raises(SystemExit):
        rl_step.main(args)
    assert message in capsys.readouterr().err


def test_module_timer_charges_each_part_its_self_time(micro_policy):
    """With a clock that ticks once per reading, self times are exact: they partition the outermost call."""
    model, tokenizer = micro_policy
    ticks = itertools.count()
    timer = ModuleTimer(model, clock=lambda: float(next(ticks)))
    ids = tokenizer(["12+34="], return_tensors="pt", add_special_tokens=False).input_ids

    def two_forwards():
        with torch.no_grad():
            model(input_ids=ids)
            model(input_ids=ids)

    timer.around(two_forwards, "backward")()
    readings = next(ticks)  # every enter and leave read the clock once: readings 0 .. readings - 1
    parts = timer.take()["unattributed"]
    assert sum(parts.values()) == readings - 1, "self times add up to the outermost call's time"
    assert parts["backward"] == 3, "the wrapper's own time is the three gaps around its two forwards"
    assert all(parts[part] > 0 for part in ("experts", "router", "attention", "norms", "lm head", "embeddings"))
    assert timer.take() == {}, "take() starts a new tally"
    timer.remove()
    model(input_ids=ids)
    assert timer.take() == {}, "removed hooks time nothing"


def test_worker_probe_times_plain_generate(tmp_path):
    args = ["--overrides", json.dumps(MICRO_OVERRIDES), "--threads", "1", "--probe-generate"]
    with Worker("probe", "benchmarks.lab_worker", args, tmp_path / "probe.log") as worker:
        assert worker.info["threads"] == 1
        report = worker.step()
    assert report["generate_s"] > 0 and report["tokens"] == 64


def test_a_worker_that_dies_is_reported_with_its_log(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 1.*No module named"):
        Worker("broken", "benchmarks.no_such_worker", [], tmp_path / "broken.log")


def test_cli_refuses_bad_counts():
    with pytest.raises(SystemExit):
        rl_step.main(["--steps", "0"])


def test_bench_deep_is_the_deep_long_cell_and_composes_alike_on_top_of_bench_tiny():
    from benchmarks.workload import BENCH_DEEP

    deep = compose_workload([], "deep")
    model, t = deep.model, deep.trainer
    assert (model.name, model.num_hidden_layers, model.num_experts, model.num_experts_per_tok) == (
        "qwen30b_l16",
        16,
        128,
        8,
    )
    assert model.hidden_size == 64 and model.path is None, "random weights from the config, as bench-tiny's"
    assert deep.dataset.name == "scratchpad" and t.max_new_tokens == 33 and t.lr == 3e-4
    assert (t.prompts_per_step, t.group_size, t.minibatches) == (32, 8, 4)
    # What a worker of an older commit composes: its bench-tiny, then the whole of bench-deep as overrides.
    assert compose_workload(BENCH_DEEP, "tiny") == deep
    with pytest.raises(ValueError, match="workload 'huge' is not one of"):
        compose_workload([], "huge")


def test_baseline_steps_the_loop_of_another_commit_beside_ours(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = [
        "--variants",
        "grpo",
        "--baseline",
        "HEAD",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--json-out",
        str(out),
    ]
    for override in MICRO_OVERRIDES:
        args += ["--override", override]
    rl_step.main(args)
    assert "## Ours / ours at HEAD, same work, stepped alternately" in capsys.readouterr().out
    result = json.loads(out.read_text())
    ours, theirs = result["main"]["ours grpo"]["steps"], result["main"]["ours grpo at HEAD"]["steps"]
    assert [step["tokens"] for step in theirs] == [4 * 4 * 4] * 2, "the same work, composed by the other checkout"
    assert result["vs_baseline"]["grpo"] == [a["seconds"] / b["seconds"] for a, b in zip(ours, theirs)]


def test_cli_refuses_a_baseline_that_is_no_commit(capsys):
    with pytest.raises(SystemExit):
        rl_step.main(["--baseline", "no-such-revision"])
    assert "--baseline 'no-such-revision' is not a commit" in capsys.readouterr().err


def test_trl_settings_reproduce_our_step():
    pytest.importorskip("trl")
    from benchmarks.trl_worker import trl_arguments

    for algo, level, clip in [("grpo", "token", (0.2, 0.27)), ("gspo", "sequence", (3e-4, 4e-4))]:
        args = trl_arguments(compose_workload([f"algo={algo}"]), "unused")
        # 32 prompts x 8 completions, 4 updates of 64 completions, 16 tokens each, fp32, no checkpointing
        assert args.generation_batch_size == 256 and args.per_device_train_batch_size == 64
        assert args.steps_per_generation == 4 and args.gradient_accumulation_steps == 1
        assert args.num_iterations == 1 and args.num_generations == 8
        assert args.generation_kwargs == {"min_new_tokens": 16} and args.max_completion_length == 16
        assert not args.bf16 and not args.activation_checkpointing and args.beta == 0.0
        assert args.importance_sampling_level == level and (args.epsilon, args.epsilon_high) == clip
    with pytest.raises(ValueError, match="algo='dapo'"):
        trl_arguments(compose_workload(["algo=dapo"]), "unused")


def test_every_overhead_pair_passes_the_start_up_checks():
    from benchmarks.workload import VARIANTS
    from experiments.step.checks import check_run

    for sides in rl_step.OVERHEADS.values():
        for side in sides:
            check_run(compose_workload([*MICRO_OVERRIDES, *VARIANTS["grpo"], *side]))


def test_replay_gap_full_replay_closes_what_the_engines_router_noise_opens(tmp_path, capsys):
    """An engine whose only difference is noise on its router logits: replaying its experts and gates leaves the
    KV cache's rounding, replaying its experts alone leaves the gates' difference, and no replay more."""
    from benchmarks import replay_gap
    from tests.conftest import MICRO_RUN

    out = tmp_path / "gap.json"
    replay_gap.main(
        [*MICRO_RUN, "rollout.router_noise=0.5", "trainer.lr=5e-2", "--warm-steps", "0", "--json-out", str(out)]
    )
    r3 = json.loads(out.read_text())["r3"]
    for minibatch in r3:
        assert minibatch["ID + gate weights"]["mean_abs"] < 1e-5 < minibatch["ID replay"]["mean_abs"]
        assert minibatch["expert_change_frac"] > 0
    (r2,) = json.loads(out.read_text())["r2"]
    assert r2["updates"] == 1 and all(r2[name]["mean_abs"] > 0 for name in replay_gap.SETTINGS)
    assert "| R3: to μ_old (router_noise=0.5), at θ_old |" in capsys.readouterr().out


def test_experts_paths_agree_with_grouped_mm_under_uneven_routing_with_idle_experts():
    from benchmarks.experts_paths import EXPERTS, SortedRows, _mkl_batch_gemm, measure, ways

    batch = SortedRows.draw(64, skew=8.0, generator=torch.Generator().manual_seed(1))
    assert (batch.counts == 0).any() and batch.max_over_mean_load > 2  # the cases padding and loops get wrong
    weight = torch.randn(EXPERTS, 64, 48)
    outputs = {name: call() for name, call in ways(batch, weight).items()}
    expected = torch.stack([batch.rows[i] @ weight[e] for i, e in enumerate(batch.experts.tolist())])
    for name, output in outputs.items():
        torch.testing.assert_close(output, expected, rtol=1e-4, atol=1e-4, msg=name)
    assert _mkl_batch_gemm() is None or "MKL batch" in outputs, "torch links MKL's batch GEMM: it must be timed"
    load, seconds = measure(64, skew=8.0, rounds=1)
    assert load > 2 and set(seconds) == set(outputs)


def test_concurrent_steps_the_loops_in_turn_on_the_same_work_and_reports_their_ratios(tmp_path, capsys):
    """One round of the local loop against the synchronous one (the Ray loops run the same worker with other
    overrides, which `test_concurrent_loops_are_runs_the_checks_accept` composes; the order of later rounds is
    `test_concurrent_rounds_change_which_loop_follows_which`'s)."""
    from benchmarks import concurrent
    from experiments.step.metrics import STALENESS_MAX

    out = tmp_path / "concurrent.json"
    args = ["--rounds", "1", "--steps", "2", "--warmup", "0", "--threads", "1", "--json-out", str(out)]
    args += ["--loops", "local"]
    for override in MICRO_OVERRIDES:
        args += ["--override", override]
    concurrent.main(args)
    assert "step throughput / synchronous" in capsys.readouterr().out
    result = json.loads(out.read_text())
    rounds = result["rounds"]
    assert [r["order"] for r in rounds] == [["synchronous", "local"]]
    mean = lambda steps: sum(step["seconds"] for step in steps) / len(steps)  # noqa: E731
    for r in rounds:
        synchronous, sampled = r["synchronous"], r["local"]
        assert len(synchronous) == len(sampled) == 2
        assert all(step["tokens"] == 4 * 4 * 4 for step in synchronous + sampled), "the same fixed-length work"
        assert all(step[STALENESS_MAX] <= 1 for step in sampled) and all(STALENESS_MAX not in s for s in synchronous)
        assert r["ratio"]["local"] == pytest.approx(mean(synchronous) / mean(sampled))
        assert r["separate_devices"] >= 1, "a step is never longer than its rollout and the rest side by side"
    assert result["ratios"] == {"local": [r["ratio"]["local"] for r in rounds]}


def test_concurrent_loops_are_runs_the_checks_accept():
    from benchmarks.concurrent import CONCURRENT_LOOPS
    from benchmarks.workload import VARIANTS, compose_workload
    from experiments.step.checks import check_run

    for label, overrides in CONCURRENT_LOOPS.items():
        cfg = compose_workload([*VARIANTS["grpo"], "rollout.source=concurrent", *overrides], "tiny")
        assert check_run(cfg, memory=False).source.name == "concurrent", label
        assert cfg.rollout.transport == ("ray" if label.startswith("ray") else "local")
        assert cfg.rollout.ray.workers == (2 if label == "ray2" else 1)


def test_concurrent_rounds_change_which_loop_follows_which():
    from benchmarks.concurrent import SYNCHRONOUS, round_order

    loops = ["local", "ray1", "ray2"]
    orders = [round_order(loops, index) for index in range(6)]
    assert all(sorted(order) == sorted([SYNCHRONOUS, *loops]) for order in orders), "every loop once a round"
    assert {order[0] for order in orders} == {SYNCHRONOUS, *loops}, "each loop leads some round"
    follows = {(order[i], order[i + 1]) for order in orders for i in range(len(order) - 1)}
    assert all((a, b) in follows or (b, a) in follows for a in orders[0] for b in orders[0] if a != b)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rounds", "0"], "--rounds=0"),
        (["--override", "trainer.nokey=1"], "Could not override 'trainer.nokey'"),
        (["--loops", "local,grpc"], "--loops=local,grpc: name each of local, ray1, ray2 at most once"),
        (["--loops", "local,local"], "--loops=local,local: name each of local, ray1, ray2 at most once"),
    ],
)
def test_concurrent_refuses_bad_arguments_before_starting_workers(args, message, capsys):
    from benchmarks import concurrent

    with pytest.raises(SystemExit):
        concurrent.main(args)
    assert message in capsys.readouterr().err
