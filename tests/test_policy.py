"""Building and loading policies: checkpoints of every supported family, refusals with one clear line."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, OlmoeConfig, Qwen2MoeConfig

from experiments.step.scoring import position_ids
from models.policy import ModelConfig, build_policy, describe_policy
from models.registry import ConfigError
from models.routing.hooks import record_routing, replay_routing
from models.routing.measures import routing_drift
from models.routing.trace import find_routers
from models.tokenizer import build_char_tokenizer

SMALL = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=32,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)


def _save(tmp_path, config):
    tokenizer = build_char_tokenizer()
    config.vocab_size = len(tokenizer)
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for router in find_routers(model).values():
        torch.nn.init.normal_(router.weight, std=1.0)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


# The MoE families besides the Qwen3-MoE built in code, each as a small config to save as a local checkpoint.
OTHER_FAMILIES = {
    "qwen2_moe": Qwen2MoeConfig(**SMALL, num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=16),
    "olmoe": OlmoeConfig(**SMALL, num_experts=8, norm_topk_prob=False),
    "mixtral": MixtralConfig(**SMALL, num_local_experts=8),
}
# Every family: `config=None` stands for the Qwen3-MoE built in code.
every_family = pytest.mark.parametrize("config", [None, *OTHER_FAMILIES.values()], ids=["qwen3_moe", *OTHER_FAMILIES])


@pytest.mark.parametrize("config", list(OTHER_FAMILIES.values()), ids=list(OTHER_FAMILIES))
def test_local_checkpoints_of_other_moe_families_load_and_replay(tmp_path, config):
    model, tokenizer = build_policy(
        ModelConfig(name="ckpt", path=_save(tmp_path, config), experts_implementation="eager")
    )
    model.eval()
    assert describe_policy(model)["num_moe_layers"] == 2
    enc = tokenizer(["12+34=", "7+8="], return_tensors="pt", padding=True, add_special_tokens=False)
    kwargs = dict(enc, position_ids=position_ids(enc["attention_mask"]))
    with torch.no_grad(), record_routing(model) as recording:
        free = model(**kwargs).logits
    # Replaying the model's own routing must reproduce it: same experts, gates renormalised as the family does
    # (OLMoE with norm_topk_prob=False keeps raw softmax weights; Mixtral always renormalises).
    with torch.no_grad(), replay_routing(model, recording.trace) as replay:
        replayed = model(**kwargs).logits
    valid = enc["attention_mask"].bool()
    torch.testing.assert_close(replayed[valid], free[valid], rtol=0, atol=1e-5)
    assert routing_drift(recording.trace, replay.router_choice, valid).expert_change_frac == 0.0


def test_unsupported_family_is_refused(tmp_path):
    from transformers import GPT2Config

    path = _save(tmp_path, GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(ValueError, match="'gpt2' model; supported"):
        build_policy(ModelConfig(path=path))


def test_missing_or_empty_checkpoint_path_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        build_policy(ModelConfig(path=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="no config.json"):
        build_policy(ModelConfig(path=str(tmp_path)))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("experts_implementation", "fast", "experts_implementation='fast'"),
        ("dtype", "fp8", "dtype='fp8'"),
        ("attn_implementation", "fast", "attn_implementation='fast' is not one of"),
        ("architecture", "llama", "architecture='llama'"),
        ("num_experts_per_tok", 20, "num_experts_per_tok=20"),
        ("router_init_std", 0.0, "router_init_std=0.0"),
    ],
)
def test_bad_model_settings_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build_policy(ModelConfig(**{field: value}))  # raised by ModelConfig itself for enum fields


def test_models_built_in_code_depend_on_init_seed_only():
    a, _ = build_policy(ModelConfig(hidden_size=32, num_hidden_layers=1, head_dim=8, moe_intermediate_size=16))
    torch.manual_seed(123)
    b, _ = build_policy(ModelConfig(hidden_size=32, num_hidden_layers=1, head_dim=8, moe_intermediate_size=16))
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_attention_implementation_is_applied_to_models_built_in_code(attention):
    model, _ = build_policy(
        ModelConfig(
            hidden_size=32,
            num_hidden_layers=1,
            head_dim=8,
            num_experts=4,
            moe_intermediate_size=16,
            attn_implementation=attention,
        )
    )
    assert model.config._attn_implementation == attention
    assert describe_policy(model)["attention"] == attention
