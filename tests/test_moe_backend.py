"""The experts backend switch on CPU: lossless layout conversion, the PyTorch dMoE reference against
transformers' experts (outputs and gradients), whole-model parity, checkpoints in transformers' layout, refusals.

Tolerances are for float32: the reference sums the same products in another order than transformers'
eager experts, so outputs and gradients agree to rounding (atol 1e-6 on O(1) values), log-probs to 1e-5.
"""

import copy
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import models.megablocks_experts as megablocks_experts
from models.dmoe_reference import RoutedGLU, dmoe_glu_reference
from models.moe_backend import (
    MOE_BACKENDS,
    DroplessGLUExperts,
    apply_moe_backend,
    describe_experts_backend,
    find_moe_experts,
    hf_to_megablocks,
    megablocks_to_hf,
)

ATOL = 1e-6
LOGP_ATOL = 1e-5
SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def qwen3_moe() -> Qwen3MoeForCausalLM:
    cfg = Qwen3MoeConfig(
        **SMALL,
        intermediate_size=64,
        moe_intermediate_size=16,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        max_position_embeddings=64,
    )
    return build(Qwen3MoeForCausalLM, cfg)


def build(model_class, cfg):
    torch.manual_seed(0)
    model = model_class(cfg).float().eval()
    model.set_experts_implementation("eager")
    # Decisive routers (std 1, not 0.02): near-ties would let rounding flip experts between backends.
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("mlp.gate"):
                module.weight.normal_(0.0, 1.0)
    return model


def swapped(model: torch.nn.Module, backend: str = "torch_dmoe") -> torch.nn.Module:
    other = copy.deepcopy(model)
    apply_moe_backend(other, backend)
    return other


def experts_of(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(find_moe_experts(model).values())


def next_token_logp(model, input_ids, attention_mask) -> torch.Tensor:
    """log p(x_{t+1} | x_<=t) [B, S-1], the policy quantity an RL loss uses."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, 64, (3, 12), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, pad in enumerate((0, 4, 7)):
        input_ids[row, :pad] = 0
        attention_mask[row, :pad] = 0
    return input_ids, attention_mask


# ---------------------------------------------------------------- layout conversion


def test_conversion_round_trip_is_exact_and_places_each_weight_where_megablocks_expects_it():
    num_experts, width, hidden = 3, 4, 5
    gate_up_proj = torch.randn(num_experts, 2 * width, hidden)
    down_proj = torch.randn(num_experts, hidden, width)

    w1, v1, w2 = hf_to_megablocks(gate_up_proj, down_proj)
    assert w1.shape == v1.shape == w2.shape == (num_experts * width, hidden)
    # Row e*F + f of the stacked matrices is row f of expert e.
    assert torch.equal(w1[1 * width + 2], gate_up_proj[1, 2])
    assert torch.equal(v1[2 * width + 3], gate_up_proj[2, width + 3])
    assert torch.equal(w2[0 * width + 1], down_proj[0, :, 1])

    back_gate_up, back_down = megablocks_to_hf(w1, v1, w2, num_experts)
    assert torch.equal(back_gate_up, gate_up_proj) and torch.equal(back_down, down_proj)
    again = hf_to_megablocks(back_gate_up, back_down)
    assert all(torch.equal(a, b) for a, b in zip(again, (w1, v1, w2)))


def test_conversion_refuses_inconsistent_shapes():
    with pytest.raises(ValueError, match="do not describe the same experts"):
        hf_to_megablocks(torch.zeros(2, 8, 5), torch.zeros(2, 5, 3))
    with pytest.raises(ValueError, match="num_experts=3"):
        megablocks_to_hf(torch.zeros(8, 5), torch.zeros(8, 5), torch.zeros(8, 5), num_experts=3)


# ---------------------------------------------------------------- reference vs transformers' experts

FAMILIES = {
    "qwen3_moe": qwen3_moe,
    "qwen2_moe": lambda: build(
        Qwen2MoeForCausalLM,
        Qwen2MoeConfig(
            **SMALL,
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        ),
    ),
    "olmoe": lambda: build(
        OlmoeForCausalLM,
        OlmoeConfig(**SMALL, intermediate_size=16, num_experts=8, num_experts_per_tok=2, max_position_embeddings=64),
    ),
    "mixtral": lambda: build(
        MixtralForCausalLM,
        MixtralConfig(
            **SMALL,
            intermediate_size=16,
            num_local_experts=8,
            num_experts_per_tok=2,
            head_dim=8,
            max_position_embeddings=64,
        ),
    ),
}


def routing(num_tokens: int, num_experts: int, top_k: int, used_experts: int, seed: int):
    """Distinct experts per token drawn from the first `used_experts` (the rest get no token), and weights."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, used_experts, generator=generator)
    top_k_index = scores.topk(top_k, dim=-1).indices
    top_k_weights = torch.softmax(torch.randn(num_tokens, top_k, generator=generator), -1)
    assert int(top_k_index.max()) < num_experts
    return top_k_index, top_k_weights


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_reference_matches_transformers_experts_in_output_and_every_gradient(family):
    hf_experts = experts_of(FAMILIES[family]())[0]
    num_experts, _, hidden = hf_experts.gate_up_proj.shape
    dmoe = DroplessGLUExperts(hf_experts, "torch_dmoe")
    # Expert 6 and 7 receive no token: their gradient must be exactly zero in both.
    top_k_index, top_k_weights = routing(num_tokens=29, num_experts=num_experts, top_k=2, used_experts=6, seed=0)
    hidden_states = torch.randn(29, hidden, generator=torch.Generator().manual_seed(2))
    upstream = torch.randn(29, hidden, generator=torch.Generator().manual_seed(3))

    def run(experts):
        x = hidden_states.clone().requires_grad_(True)
        w = top_k_weights.clone().requires_grad_(True)
        out = experts(x, top_k_index, w)
        (out * upstream).sum().backward()
        return out.detach(), x.grad, w.grad

    hf_out, hf_dx, hf_dw = run(hf_experts)
    ref_out, ref_dx, ref_dw = run(dmoe)
    torch.testing.assert_close(ref_out, hf_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(ref_dx, hf_dx, atol=ATOL, rtol=0)
    torch.testing.assert_close(ref_dw, hf_dw, atol=ATOL, rtol=0)
    hf_param_grads = hf_to_megablocks(hf_experts.gate_up_proj.grad, hf_experts.down_proj.grad)
    for name, expected in zip(("w1", "v1", "w2"), hf_param_grads):
        got = getattr(dmoe, name).grad
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        unused_rows = got.view(num_experts, -1, hidden)[6:]
        assert torch.count_nonzero(unused_rows) == 0, name


def test_reference_weights_each_slot_and_sums_the_top_k_by_hand():
    """One token, two experts with hand-set weights: y = sum_j weight_j * expert_j(x)."""
    hf_experts = experts_of(qwen3_moe())[0]
    dmoe = DroplessGLUExperts(hf_experts, "torch_dmoe")
    x = torch.randn(1, 32)
    gate, up, down = (w.view(8, 16, 32) for w in (dmoe.w1, dmoe.v1, dmoe.w2))

    def expert(e):
        return (torch.nn.functional.silu(x @ gate[e].T) * (x @ up[e].T)) @ down[e]

    out = dmoe(x, torch.tensor([[5, 2]]), torch.tensor([[0.75, 0.25]]))
    torch.testing.assert_close(out, 0.75 * expert(5) + 0.25 * expert(2), atol=ATOL, rtol=0)


class FakeMegaBlocksOps:
    """MegaBlocks' op contracts (megablocks/ops/*.py over backend/kernels.py, v0.10) in PyTorch, for CPU.

    sort -> (sorted expert ids, slot permutation), both int32; gather copies token `slot // k` to each sorted
    row; scatter writes row i, times the weight of its slot, to slot `indices[i]` and sums each token's k slots.
    """

    @staticmethod
    def sort(x, end_bit):
        assert x.dtype == torch.int32 and int(x.max()) < 2**end_bit
        values, order = torch.sort(x, stable=True)
        return values, order.int()

    @staticmethod
    def histogram(x, num_bins):
        return torch.bincount(x, minlength=num_bins).int()

    @staticmethod
    def inclusive_cumsum(x, dim):
        return torch.cumsum(x, dim).int().squeeze()

    @staticmethod
    def gather(x, indices, bin_ids, bins, top_k):
        return x[indices.long() // top_k]

    @staticmethod
    def scatter(x, indices, bin_ids, weights, bins, top_k):
        slots = indices.long()
        per_slot = torch.zeros_like(x).index_copy(0, slots, x * weights[slots, None])
        return per_slot.view(-1, top_k, x.shape[1]).sum(1)


def fake_gmm(a, b, batch_sizes, trans_b=False):
    """grouped_gemm's `gmm`: expert e multiplies its contiguous rows of `a` by b[e] (or b[e].T); sizes on the host."""
    assert batch_sizes.device.type == "cpu" and batch_sizes.dtype == torch.long
    return torch.cat([rows @ (b[e].T if trans_b else b[e]) for e, rows in enumerate(a.split(batch_sizes.tolist()))])


def test_megablocks_glue_matches_the_reference_when_the_ops_follow_megablocks_contracts():
    """The GPU path's own code (sort, gather, three grouped GEMMs, weighted scatter) on CPU stand-ins of the ops."""
    dmoe = DroplessGLUExperts(experts_of(qwen3_moe())[0], "torch_dmoe")
    top_k_index, top_k_weights = routing(num_tokens=17, num_experts=8, top_k=2, used_experts=7, seed=4)
    hidden_states = torch.randn(17, 32, generator=torch.Generator().manual_seed(5))
    kernels = megablocks_experts.MegaBlocksKernels(ops=FakeMegaBlocksOps, gmm=fake_gmm)

    def run(forward):
        x = hidden_states.clone().requires_grad_(True)
        w = top_k_weights.clone().requires_grad_(True)
        dmoe.zero_grad()
        out = forward(RoutedGLU(x, top_k_index, w, dmoe.w1, dmoe.v1, dmoe.w2, 8, dmoe.act_fn))
        out.square().sum().backward()
        return [out, x.grad, w.grad] + [p.grad.clone() for p in (dmoe.w1, dmoe.v1, dmoe.w2)]

    glue = run(lambda call: megablocks_experts.grouped_glu(kernels, call))
    reference = run(dmoe_glu_reference)
    for got, expected in zip(glue, reference):
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


# ---------------------------------------------------------------- whole models


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_swaps_every_moe_block_and_keeps_its_logits(family):
    model = FAMILIES[family]()
    input_ids, attention_mask = left_padded_batch()
    other = swapped(model)
    assert all(isinstance(m, DroplessGLUExperts) for m in experts_of(other))
    assert len(experts_of(other)) == model.config.num_hidden_layers
    with torch.no_grad():
        torch.testing.assert_close(
            other(input_ids, attention_mask=attention_mask).logits,
            model(input_ids, attention_mask=attention_mask).logits,
            atol=LOGP_ATOL,
            rtol=0,
        )


@pytest.mark.parametrize("experts_implementation", ["eager", "grouped_mm"])
def test_policy_log_probs_match_hf_on_a_left_padded_batch(experts_implementation):
    model = qwen3_moe()
    model.set_experts_implementation(experts_implementation)
    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        hf_logp = next_token_logp(model, input_ids, attention_mask)
        dmoe_logp = next_token_logp(swapped(model), input_ids, attention_mask)
    real = attention_mask[:, 1:].bool()
    torch.testing.assert_close(dmoe_logp[real], hf_logp[real], atol=LOGP_ATOL, rtol=0)


def test_router_modules_are_the_same_objects_and_keep_their_hooks():
    model = qwen3_moe()
    routers = {name: module for name, module in model.named_modules() if name.endswith("mlp.gate")}
    router_weights = {name: module.weight for name, module in routers.items()}
    calls = []
    for module in routers.values():
        module.register_forward_hook(lambda *_: calls.append(1))

    apply_moe_backend(model, "torch_dmoe")

    after = {name: module for name, module in model.named_modules() if name.endswith("mlp.gate")}
    assert all(after[name] is module for name, module in routers.items())
    assert all(after[name].weight is weight for name, weight in router_weights.items())
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 5)))
    assert len(calls) == len(routers)


def test_switching_back_to_hf_restores_the_original_experts_exactly():
    model = qwen3_moe()
    input_ids, attention_mask = left_padded_batch()
    other = swapped(model)
    apply_moe_backend(other, "hf")
    for original, restored in zip(experts_of(model), experts_of(other)):
        assert type(restored) is type(original)
        assert torch.equal(restored.gate_up_proj, original.gate_up_proj)
        assert torch.equal(restored.down_proj, original.down_proj)
    with torch.no_grad():
        assert torch.equal(other(input_ids).logits, model(input_ids).logits)


def test_describe_experts_backend_names_each_implementation():
    model = qwen3_moe()
    assert describe_experts_backend(model) == "hf:eager"
    model.set_experts_implementation("grouped_mm")
    assert describe_experts_backend(model) == "hf:grouped_mm"
    apply_moe_backend(model, "torch_dmoe")
    assert describe_experts_backend(model) == "torch_dmoe"
    for experts in experts_of(model):
        experts.backend = "megablocks"
    assert describe_experts_backend(model) == "megablocks:grouped"


# ---------------------------------------------------------------- checkpoints keep transformers' layout


def perturb_experts(model: torch.nn.Module) -> None:
    """Stand-in for training on the swapped backend, so a checkpoint's experts differ from the initial ones."""
    with torch.no_grad():
        for experts in experts_of(model):
            for weight in (experts.w1, experts.v1, experts.w2):
                weight.add_(0.01 * torch.randn_like(weight))


def safetensors_keys(directory) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as handle:
        return set(handle.keys())


def test_state_dict_of_a_swapped_model_is_in_transformers_layout():
    model = qwen3_moe()
    other = swapped(model)
    state, hf_state = other.state_dict(), model.state_dict()
    assert set(state) == set(hf_state)
    assert all(torch.equal(state[key], hf_state[key]) for key in hf_state)


def test_save_pretrained_from_swapped_loads_into_hf_and_back(tmp_path):
    model = qwen3_moe()
    trained = swapped(model)
    perturb_experts(trained)
    input_ids, attention_mask = left_padded_batch()
    trained.save_pretrained(tmp_path / "dmoe")
    model.save_pretrained(tmp_path / "hf")
    assert safetensors_keys(tmp_path / "dmoe") == safetensors_keys(tmp_path / "hf")

    loaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "dmoe", experts_implementation="eager").eval()
    for saved, hf_experts in zip(experts_of(trained), experts_of(loaded)):
        gate_up_proj, down_proj = megablocks_to_hf(saved.w1, saved.v1, saved.w2, saved.num_experts)
        assert torch.equal(hf_experts.gate_up_proj, gate_up_proj) and torch.equal(hf_experts.down_proj, down_proj)
    with torch.no_grad():
        trained_logits = trained(input_ids, attention_mask=attention_mask).logits
        torch.testing.assert_close(
            loaded(input_ids, attention_mask=attention_mask).logits, trained_logits, atol=LOGP_ATOL, rtol=0
        )
        apply_moe_backend(loaded, "torch_dmoe")
        for saved, reloaded in zip(experts_of(trained), experts_of(loaded)):
            assert all(torch.equal(getattr(saved, n), getattr(reloaded, n)) for n in ("w1", "v1", "w2"))
        assert torch.equal(loaded(input_ids, attention_mask=attention_mask).logits, trained_logits)


def test_save_pretrained_from_hf_loads_into_the_dmoe_backend(tmp_path):
    model = qwen3_moe()
    model.save_pretrained(tmp_path)
    loaded = Qwen3MoeForCausalLM.from_pretrained(tmp_path, experts_implementation="eager").eval()
    apply_moe_backend(loaded, "torch_dmoe")
    for original, converted in zip(experts_of(model), experts_of(loaded)):
        expected = hf_to_megablocks(original.gate_up_proj, original.down_proj)
        assert all(torch.equal(getattr(converted, n), e) for n, e in zip(("w1", "v1", "w2"), expected))
    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids, attention_mask=attention_mask).logits,
            model(input_ids, attention_mask=attention_mask).logits,
            atol=LOGP_ATOL,
            rtol=0,
        )


def test_load_state_dict_accepts_transformers_layout_strictly():
    model = qwen3_moe()
    other = swapped(model)
    perturb_experts(other)
    other.load_state_dict(model.state_dict(), strict=True)
    for original, converted in zip(experts_of(model), experts_of(other)):
        expected = hf_to_megablocks(original.gate_up_proj, original.down_proj)
        assert all(torch.equal(getattr(converted, n), e) for n, e in zip(("w1", "v1", "w2"), expected))


# ---------------------------------------------------------------- refusals


def test_unknown_backend_is_refused_with_the_valid_names():
    model = qwen3_moe()
    with pytest.raises(ValueError) as error:
        apply_moe_backend(model, "deepspeed")
    assert "'deepspeed'" in str(error.value)
    assert all(repr(name) in str(error.value) for name in MOE_BACKENDS)


def test_dense_model_is_refused():
    dense = Qwen3ForCausalLM(Qwen3Config(**SMALL, intermediate_size=64, head_dim=8, max_position_embeddings=64))
    with pytest.raises(ValueError, match="no MoE experts module"):
        apply_moe_backend(dense, "torch_dmoe")
    with pytest.raises(ValueError, match="no MoE experts module"):
        describe_experts_backend(dense)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_megablocks_without_cuda_is_refused_in_one_line_and_nothing_is_swapped():
    model = qwen3_moe()
    with pytest.raises(RuntimeError) as error:
        apply_moe_backend(model, "megablocks")
    message = str(error.value)
    assert "\n" not in message and "CUDA" in message and "torch_dmoe" in message
    assert describe_experts_backend(model) == "hf:eager"


def test_megablocks_without_the_package_is_refused_with_the_install_recipe(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # A None entry in sys.modules makes `import` raise ImportError, as on a machine without the packages.
    monkeypatch.setitem(sys.modules, "megablocks", None)
    monkeypatch.setitem(sys.modules, "grouped_gemm", None)
    megablocks_experts.load_megablocks_kernels.cache_clear()
    model = qwen3_moe()
    with pytest.raises(RuntimeError) as error:
        apply_moe_backend(model, "megablocks")
    message = str(error.value)
    assert "\n" not in message and "cannot import" in message
    assert "megablocks==0.10.0" in message and "grouped_gemm==0.3.0" in message and "--no-build-isolation" in message
    assert describe_experts_backend(model) == "hf:eager"


@pytest.mark.parametrize(
    ("hidden", "width", "dtype", "expected"),
    [
        (32, 16, torch.bfloat16, None),
        (32, 16, torch.float32, "bfloat16 only"),
        (36, 16, torch.bfloat16, "hidden size that is a multiple of 8, got 36"),
        (32, 12, torch.bfloat16, "expert width that is a multiple of 8, got 12"),
    ],
)
def test_megablocks_kernel_limits(hidden, width, dtype, expected):
    problem = megablocks_experts.megablocks_kernel_problem(hidden, width, dtype)
    assert problem == expected if expected is None else expected in problem


def test_megablocks_refuses_float32_experts_at_apply_time(monkeypatch):
    """With CUDA and the packages present (stubbed), a float32 policy is refused before anything is swapped."""
    monkeypatch.setattr(megablocks_experts, "load_megablocks_kernels", lambda: object())
    model = qwen3_moe()
    with pytest.raises(ValueError, match="bfloat16 only.*model.dtype=bfloat16"):
        apply_moe_backend(model, "megablocks")
    assert describe_experts_backend(model) == "hf:eager"


def test_megablocks_forward_refuses_tensors_off_cuda():
    dmoe = DroplessGLUExperts(experts_of(qwen3_moe())[0], "megablocks").to(torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA bfloat16"):
        megablocks_experts.megablocks_glu_forward(
            None,
            RoutedGLU(
                torch.zeros(2, 32, dtype=torch.bfloat16),
                torch.zeros(2, 2, dtype=torch.long),
                torch.ones(2, 2),
                dmoe.w1,
                dmoe.v1,
                dmoe.w2,
                8,
                dmoe.act_fn,
            ),
        )
