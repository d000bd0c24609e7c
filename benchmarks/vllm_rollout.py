"""`python -m benchmarks.vllm_rollout`: the vLLM rollout engine against the HF engine, and what vLLM runs here.

    python -m benchmarks.vllm_rollout                   # rollout time vLLM vs HF, bench-tiny and a 64-expert MoE
    python -m benchmarks.vllm_rollout --rounds 5        # more alternating rounds per model
    python -m benchmarks.vllm_rollout --families        # only: every model family through vLLM (docs/vllm.md)
    python -m benchmarks.vllm_rollout --json-out vllm.json

Rollout section. Per model, one rollout of the bench-tiny workload (`benchmarks.workload`: 32 addition prompts x 8
completions of exactly 16 new tokens, temperature 1, routing recorded as the RL loop asks by default) with
`HFEngine` on the trainer's own model (the default `rollout.engine=hf`) and with `VLLMEngine` (fp32) on a copy of
the same weights, one after the other and alternating order each round (HF then vLLM, then vLLM then HF, ...),
after one untimed warm-up call of each, so that the load of a shared machine hits both alike; the table gives the
median seconds of each and the median of the per-round ratios HF / vLLM (> 1: vLLM is faster). Models:
  tiny_moe   the workload's own model (hidden 256, 4 layers, 16 experts top-2, expert width 128: 7.1 M parameters);
  moe64      a Qwen3-MoE built from a config with random weights: hidden 512, 4 layers, 64 experts top-8, expert
             width 256, 8 heads of 64 (about 101 M parameters), the same prompts.
The same again without routing ("no routing" columns, after the first vLLM engine is closed: one engine per
process): HF without its routing hooks, and a vLLM engine built with `routing=False`, i.e. without the CPU capture
workaround and with prefix caching on. Also per model: vLLM's start-up (seconds, once per run) and its in-place
weight sync (median of 5, the trainer's weights perturbed before each).

Families section (`--families`): a random model of every family the project supports (MoE: qwen3_moe,
qwen2_moe, olmoe, mixtral; dense: qwen3, qwen2, llama), each at hidden 64 with heads of 32 (what vLLM's CPU
attention and MoE kernels accept), sampled through vLLM (6 prompts x 4 completions x 6 tokens, temperature 0.7):
max |μ_old - an fp32 transformers forward of the same tokens|, routing agreement with transformers' routers on the
same tokens, and both again after perturbing the weights and syncing them in place. A family that fails prints
its error in one line.

Threads: torch runs with `--threads` (default 1) intra-op threads for both engines; vLLM in this process uses the
same ones. Without vLLM installed the script says so in one line and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import torch
from omegaconf import DictConfig
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from analysis.report import markdown_table
from benchmarks.workload import compose_workload
from experiments.step.engines.base import RolloutEngine, Sampling, full_weights
from experiments.step.engines.hf import HFEngine
from experiments.step.engines.vllm import SUPPORTED_FAMILIES, VLLMEngine, VLLMStart, derived_model_len
from experiments.step.scoring import FED, score_responses
from experiments.tasks import build_task
from models.policy import ModelConfig, build_policy
from models.registry import node_settings
from models.routing.families import router_weight
from models.routing.hooks import Recording, record_routing
from models.routing.trace import RoutingTrace, find_routers
from models.tokenizer import build_char_tokenizer

MOE64 = [
    "model.hidden_size=512",
    "model.num_hidden_layers=4",
    "model.num_attention_heads=8",
    "model.num_key_value_heads=4",
    "model.head_dim=64",
    "model.num_experts=64",
    "model.num_experts_per_tok=8",
    "model.moe_intermediate_size=256",
    "model.name=moe64",
]


def _prompts(cfg: DictConfig, count: int) -> list[str]:
    """`count` train prompts picked as the trainer picks them (its seed's generator)."""
    dataset = dict(node_settings(cfg.dataset))
    examples = build_task(dataset.pop("name"), **dataset).examples("train")
    picks = torch.randint(len(examples), (count,), generator=torch.Generator().manual_seed(cfg.seed))
    return [examples[i].prompt for i in picks.tolist()]


def collected(result: dict[str, Any]) -> dict[str, Any]:
    """`result`, once the garbage collector has freed what the section that made it held (its vLLM engines' cycles)."""
    gc.collect()
    return result


def rollout_section(name: str, overrides: list[str], rounds: int) -> dict[str, Any]:
    """HF engine vs vLLM engine on one model, alternating (module docstring). Its engines and model are collected
    before the next model's section (`collected`)."""
    cfg = compose_workload(overrides)
    t = cfg.trainer
    model, tokenizer = build_policy(ModelConfig(**node_settings(cfg.model)))
    model.eval()
    prompts = _prompts(cfg, t.prompts_per_step)
    hf = HFEngine(model, tokenizer, min_new_tokens=t.max_new_tokens)
    max_model_len = derived_model_len(cfg, tokenizer, model)
    seconds: dict[str, list[float]] = {}

    def timed(engine: RolloutEngine, routing: bool) -> float:
        start = time.perf_counter()
        samples = engine.sample(
            prompts, Sampling(t.group_size, t.max_new_tokens, t.temperature, record_routing=routing)
        )
        elapsed = time.perf_counter() - start
        responses = int(samples.response_mask.sum())
        assert responses == len(prompts) * t.group_size * t.max_new_tokens, "fixed-length rollout"
        return elapsed

    def alternate(vllm: VLLMEngine, routing: bool, suffix: str) -> None:
        """HF and vLLM one after the other, the order swapped every round, after a warm-up of each."""
        pair = {f"hf{suffix}": hf, f"vllm{suffix}": vllm}
        for engine in pair.values():
            timed(engine, routing)
        for key in pair:
            seconds[key] = []
        for r in range(rounds):
            for key in list(pair) if r % 2 == 0 else list(pair)[::-1]:
                seconds[key].append(timed(pair[key], routing))

    # One vLLM engine per process at a time (experiments.step.engines.vllm): first the loop's default, routing recorded
    # (the CPU capture, prefix caching off); then vLLM built with routing=False (no capture, prefix caching on)
    # against HF without its routing hooks.
    start = VLLMStart(
        max_model_len=max_model_len, max_num_seqs=t.prompts_per_step * t.group_size, min_new_tokens=t.max_new_tokens
    )
    vllm = VLLMEngine(model, tokenizer, start)
    startup = vllm.startup_s
    alternate(vllm, True, "")
    sync = []
    with torch.no_grad():
        for _ in range(5):
            for p in model.parameters():
                p.add_(1e-3 * torch.randn_like(p))
            began = time.perf_counter()
            vllm.sync_weights(full_weights(model))
            sync.append(time.perf_counter() - began)
    vllm.close()
    bare = VLLMEngine(model, tokenizer, replace(start, routing=False))
    alternate(bare, False, "_no_routing")
    bare.close()
    ratios = {
        "routing": [h / v for h, v in zip(seconds["hf"], seconds["vllm"])],
        "no_routing": [h / v for h, v in zip(seconds["hf_no_routing"], seconds["vllm_no_routing"])],
    }
    result = {
        "model": name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "completion_tokens": len(prompts) * t.group_size * t.max_new_tokens,
        "seconds": seconds,
        "ratio_hf_over_vllm": ratios,
        "vllm_startup_s": startup,
        "vllm_sync_s": sync,
    }
    return result


def family_config(family: str, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    """A random model config of `family`: hidden 64, 2 layers, heads of 32, 8 experts top-2 of width 32 (MoE)."""
    import transformers

    # Any: each config's keyword arguments, of several types, which `**` cannot tell apart.
    shared: dict[str, Any] = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    moe: dict[str, Any] = dict(num_experts_per_tok=2)
    configs = {
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **shared,
            **moe,
            # transformers keeps a key its signature does not list as an attribute; its typed signature refuses it.
            head_dim=32,  # type: ignore[call-arg]
            num_experts=8,
            moe_intermediate_size=32,
            intermediate_size=64,
            norm_topk_prob=True,
            decoder_sparse_step=1,
        ),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **shared,
            **moe,
            num_experts=8,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            intermediate_size=64,
            decoder_sparse_step=1,
        ),
        "olmoe": lambda: transformers.OlmoeConfig(**shared, **moe, num_experts=8, intermediate_size=32),
        "mixtral": lambda: transformers.MixtralConfig(**shared, **moe, num_local_experts=8, intermediate_size=32),
        "qwen3": lambda: transformers.Qwen3Config(**shared, head_dim=32, intermediate_size=64),
        "qwen2": lambda: transformers.Qwen2Config(**shared, intermediate_size=64),
        "llama": lambda: transformers.LlamaConfig(**shared, intermediate_size=64),
    }
    return configs[family]()


def _compare(engine: VLLMEngine, model: PreTrainedModel, prompts: list[str]) -> tuple[float, float | None]:
    """(max |μ_old − fp32 transformers|, routing agreement or None for a dense model) on one fresh sample."""
    moe = bool(find_routers(model))
    samples = engine.sample(prompts, Sampling(4, 6, 0.7, record_routing=moe))
    with torch.no_grad(), record_routing(model) if moe else contextlib.nullcontext() as recording:
        scored = score_responses(model, samples, 0.7)
    mu_logp = cast(torch.Tensor, samples.logp)  # sampled at temperature 0.7: the engine's log-probs are there
    diff = float((scored.logp.masked_fill(~samples.response_mask, 0.0) - mu_logp).abs().max())
    if not moe:
        return diff, None
    # An MoE model's sample records its routes, and its scoring forward was recorded.
    engine_routes = cast(RoutingTrace, samples.routes).positions(FED).experts
    seen = engine_routes[0, ..., 0] != -1
    recorded = cast(Recording, recording).trace.experts
    same = (engine_routes.sort(-1).values == recorded.sort(-1).values).all(-1)  # [L, B, S]
    return diff, float(same[:, seen].float().mean())


def families_section() -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    tokenizer = build_char_tokenizer()
    prompts = ["12+34=", "7+8=", "100+23=", "5+61=", "9+9=", "40+2="]
    results = []
    for family in SUPPORTED_FAMILIES:
        row: dict[str, Any] = {"family": family}
        engine = None
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(family_config(family, tokenizer)).eval()
            for router in find_routers(model).values():
                torch.nn.init.normal_(router_weight(router), std=1.0)  # decisive routing, as models.policy does
            engine = VLLMEngine(model, tokenizer, VLLMStart(max_model_len=64, max_num_seqs=64))
            row["logp_diff"], row["routing_agreement"] = _compare(engine, model, prompts)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.05 * torch.randn_like(p))
            engine.sync_weights(full_weights(model))
            row["synced_logp_diff"], row["synced_routing_agreement"] = _compare(engine, model, prompts)
            row["sync_s"] = engine.sync_s[-1]
        except Exception as error:  # noqa: BLE001 - the table reports each family's failure in one line
            row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        finally:
            if engine is not None:
                engine.close()
            gc.collect()
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed rounds per model")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (both engines)")
    parser.add_argument("--families", action="store_true", help="only: every model family through vLLM")
    parser.add_argument("--models", nargs="+", default=["tiny_moe", "moe64"], choices=["tiny_moe", "moe64"])
    parser.add_argument("--json-out", type=Path, help="write every measured number here")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        print(
            "benchmarks.vllm_rollout: vLLM is not installed in this environment, nothing to measure "
            "(make test-vllm builds .venv-vllm; docs/vllm.md)"
        )
        return {}
    torch.set_num_threads(args.threads)
    results: dict[str, Any] = {"threads": args.threads}
    if args.families:
        results["families"] = families_section()
        rows = [
            [
                r["family"],
                r.get("error") or f"{r['logp_diff']:.1e}",
                _pct(r.get("routing_agreement")),
                f"{r['synced_logp_diff']:.1e}" if "synced_logp_diff" in r else "",
                _pct(r.get("synced_routing_agreement")),
            ]
            for r in results["families"]
        ]
        print(markdown_table(["family", "max |dlogp|", "routing", "after sync", "routing after sync"], rows))
    else:
        sections = {"tiny_moe": [], "moe64": MOE64}
        results["rollout"] = [collected(rollout_section(name, sections[name], args.rounds)) for name in args.models]
        rows = []
        for r in results["rollout"]:
            med = {key: statistics.median(values) for key, values in r["seconds"].items()}
            rows.append(
                [
                    r["model"],
                    f"{r['parameters'] / 1e6:.1f} M",
                    f"{med['hf']:.2f}",
                    f"{med['vllm']:.2f}",
                    f"{statistics.median(r['ratio_hf_over_vllm']['routing']):.2f}",
                    f"{med['hf_no_routing']:.2f}",
                    f"{med['vllm_no_routing']:.2f}",
                    f"{statistics.median(r['ratio_hf_over_vllm']['no_routing']):.2f}",
                    f"{r['vllm_startup_s']:.1f}",
                    f"{statistics.median(r['vllm_sync_s']):.3f}",
                ]
            )
        print(
            markdown_table(
                [
                    "model",
                    "params",
                    "HF s",
                    "vLLM s",
                    "HF/vLLM",
                    "HF s (no routing)",
                    "vLLM s (no routing)",
                    "HF/vLLM (no routing)",
                    "vLLM start s",
                    "sync s",
                ],
                rows,
            )
        )
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2))
    return results


def _pct(value: float | None) -> str:
    return "" if value is None else f"{value:.2%}"


if __name__ == "__main__":
    main(sys.argv[1:])
