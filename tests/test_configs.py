"""Every config group composes through Hydra's compose API, and the named experiments say what they promise."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from algos import OBJECTIVES
from algos.routing_variants import ROUTING_VARIANTS
from experiments.config import PROJECT_ROOT, register_configs
from experiments.step.checks import algo_hyperparameters
from experiments.tasks import TASKS

CONF = PROJECT_ROOT / "conf"
register_configs()


def _compose(name: str, overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(name, overrides=overrides)


def _choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def test_every_group_has_its_options():
    assert _choices("algo") == sorted(OBJECTIVES)
    assert _choices("dataset") == sorted(TASKS)
    assert _choices("routing_variant") == sorted(ROUTING_VARIANTS)
    assert {"tiny_moe", "deep_moe", "tiny_dense"} <= set(_choices("model"))
    assert {"quickstart", "paper"} <= set(_choices("experiment"))


@pytest.mark.parametrize("group", ["algo", "model", "dataset", "arm", "experiment", "routing_variant"])
def test_every_option_composes_with_typed_schema(group):
    for choice in _choices(group):
        cfg = _compose("train", [f"{group}={choice}"])
        resolved = OmegaConf.to_container(cfg, resolve=True)
        assert resolved["algo"]["name"] in OBJECTIVES
        assert resolved["dataset"]["name"] in TASKS
        if group == "algo":
            name, _, hyperparameters = algo_hyperparameters(cfg.algo)
            assert name == choice and set(hyperparameters) <= set(OBJECTIVES[choice].__dataclass_fields__)


def test_arm_sets_objective_and_replay_together():
    cfg = _compose("train", ["arm=grpo_r2"])
    assert (cfg.algo.name, cfg.routing.replay) == ("grpo", "r2")
    cfg = _compose("train", ["arm=gspo"])
    assert (cfg.algo.name, cfg.routing.replay, cfg.algo.clip_low) == ("gspo", "none", 3e-4)


def test_experiments_start_from_the_cold_start_checkpoint():
    for experiment in ("quickstart", "paper"):
        cfg = _compose("train", [f"experiment={experiment}"])
        assert cfg.model.path == str(PROJECT_ROOT / "checkpoints" / "cold_start" / f"{cfg.model.name}-addition")
    sft = _compose("sft", ["model=deep_moe"])
    assert sft.sft.output_dir == str(PROJECT_ROOT / "checkpoints" / "cold_start" / "deep_moe-addition")


def test_the_quickstart_runs_each_synthetic_drift_alone_with_each_arms_own_replay():
    """`make run`'s sweep, as Hydra's sweeper splits it into jobs: GRPO and GRPO + R2 on seeds 0-2 in two cells, the
    SYNTHETIC flips alone and the SYNTHETIC router noise alone, not their product. A cell is a dict merged into
    `routing`; were it to replace the node, GRPO + R2 would lose its replay and each cell compare GRPO with itself."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        sweep = compose("train", overrides=["experiment=quickstart"], return_hydra_config=True)
        params = OmegaConf.to_container(sweep.hydra.sweeper.params)
        parsed = OverridesParser.create().parse_overrides([f"{key}={value}" for key, value in params.items()])
        jobs = [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
        runs = [compose("train", overrides=["experiment=quickstart", *job]) for job in jobs]
    ran = sorted((cfg.routing.replay.value, cfg.routing.flip_rate, cfg.routing.perturb_rate, cfg.seed) for cfg in runs)
    cells = ((0.2, 0.0), (0.0, 0.1))  # (flip_rate, perturb_rate)
    assert ran == sorted(
        (replay, flip, noise, seed) for replay in ("none", "r2") for flip, noise in cells for seed in range(3)
    )


@pytest.mark.parametrize(
    "override, key",
    [
        ("trainer.stpes=3", "stpes"),
        ("trainer.steps=many", "steps"),
        ("model.hiden_size=8", "hiden_size"),
        ("dataset.digitz=3", "digitz"),
        ("routing.replai=r2", "replai"),
    ],
)
def test_misspelt_or_mistyped_keys_fail_at_composition(override, key):
    with pytest.raises(Exception, match=key):
        _compose("train", [override])


@pytest.mark.parametrize(
    "override, allowed",
    [
        ("routing.replay=r5", "[none, r2, r3]"),
        ("trainer.pi_old=cached", "[auto, bypass, decoupled]"),
        ("trainer.minibatch_layout=prompts", "[auto, groups, rows]"),
        ("model.moe_backend=cuda", "[hf, torch_dmoe"),
        ("algo.loss_agg=sum", "[token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm]"),
        ("logger.wandb.mode=on", "[offline, online, disabled]"),
        ("model.dtype=fp8", "[float32, bfloat16, float16]"),
        ("comparison.primary=reward", "[gain, gain_area, split_gain]"),
        ("comparison.early_stopped=ignored", "[exclude, failed]"),
    ],
)
def test_a_value_outside_an_enum_is_refused_at_composition_naming_the_allowed_ones(override, allowed):
    with pytest.raises(Exception) as raised:
        _compose("train", [override])
    text = f"{raised.value} {raised.value.__cause__}"
    assert f"Invalid value '{override.split('=')[1]}', expected one of {allowed}" in text


def _parents(path: Path, group: str, schema: object) -> DictConfig:
    """What the yaml `path` of `group` inherits: the schema, merged with each of its defaults resolved in turn."""
    own = OmegaConf.load(path)
    base = OmegaConf.structured(schema)
    for parent in [entry for entry in own.get("defaults", []) if entry != "_self_"]:
        base = OmegaConf.merge(base, _resolved(CONF / group / f"{parent}.yaml", group, schema))
    return base


def _resolved(path: Path, group: str, schema: object) -> DictConfig:
    """The yaml `path` of `group` with everything it inherits."""
    own = OmegaConf.load(path)
    return OmegaConf.merge(_parents(path, group, schema), {k: v for k, v in own.items() if k != "defaults"})


def test_each_yaml_holds_only_what_differs_from_what_it_inherits():
    """A yaml value equal to what its parent (another file of the group, or the schema) already gives would
    declare it twice; a value that differs from the parent is a delta even when it equals the schema default."""
    from experiments.config import TrainConfig
    from models.policy import ModelConfig

    for path in sorted((CONF / "model").glob("*.yaml")):
        own, base = OmegaConf.load(path), _parents(path, "model", ModelConfig())
        restated = [key for key in own if key not in ("defaults", "name") and key in base and own[key] == base[key]]
        assert not restated, f"{path.name} restates inherited values {restated}"
    top = OmegaConf.load(CONF / "train.yaml")
    schema = OmegaConf.structured(TrainConfig)
    assert not [key for key in top if key not in ("defaults", "hydra") and top[key] == schema.get(key)]


SWEEP_GROUPS = ("experiment", "search")


def _leaves(node: dict, prefix: str = "") -> dict[str, object]:
    """`{"a.b": value}` of a yaml's own keys; a sweep's params are leaves under `hydra.sweeper.params.<key>`."""
    flat = {}
    for key, value in node.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name != "hydra.sweeper.params":
            flat.update(_leaves(value, f"{name}."))
        elif isinstance(value, dict):
            flat.update({f"{name}.{param}": choice for param, choice in value.items()})
        else:
            flat[name] = value
    return flat


def _inherited(conf: Path, group: str, name: str) -> dict[str, object]:
    """What `group=name` composes to without its own keys (its defaults list only: the schema, the groups and the
    files it names), with Hydra's node, uninterpolated."""
    path = conf / group / f"{name}.yaml"
    own = OmegaConf.to_container(OmegaConf.load(path))
    path.write_text("# @package _global_\n" + OmegaConf.to_yaml({"defaults": own.get("defaults", [])}))
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        composed = compose("train", overrides=[f"{group}={name}"], return_hydra_config=True)
    return _leaves(OmegaConf.to_container(composed, resolve=False))


def test_experiment_and_search_yamls_hold_only_what_differs_from_what_they_inherit(tmp_path):
    """An experiment or a search is a delta: a value equal to what its defaults already give (the schema's default,
    another file's, a parent's sweep) is a second copy of that value."""
    restated = []
    for group in SWEEP_GROUPS:
        for path in sorted((CONF / group).glob("*.yaml")):
            own = _leaves({k: v for k, v in OmegaConf.to_container(OmegaConf.load(path)).items() if k != "defaults"})
            conf = tmp_path / group / path.stem
            shutil.copytree(CONF, conf)
            base = _inherited(conf, group, path.stem)
            restated += [
                f"{group}/{path.name}: {key}: {value}"
                for key, value in own.items()
                if key in base and base[key] == value
            ]
    assert not restated, "yaml values that repeat what the file inherits:\n" + "\n".join(restated)


def test_every_search_the_regimes_cite_is_a_file_that_composes():
    """docs/regimes.md names the sweeps its table was made from: each one is `search=` or `experiment=` here."""
    regimes = (PROJECT_ROOT / "docs" / "regimes.md").read_text(encoding="utf-8")
    made_by = regimes.split("python -m analysis.regimes ", 1)[1].split("`", 1)[0].split()
    cited = {line.split("|")[1].strip() for line in regimes.splitlines() if line.startswith("| ")} - {"search", "---"}
    assert set(made_by) == cited
    for name in sorted(cited):
        group = next((g for g in SWEEP_GROUPS if (CONF / g / f"{name}.yaml").exists()), None)
        assert group is not None, f"docs/regimes.md cites {name}, which no conf/experiment or conf/search file holds"
        cfg = _compose("train", [f"{group}={name}"])
        assert cfg.model.name == "paper_moe" and cfg.model.path.endswith("-addition")


def test_the_declared_comparison_is_no_setting_a_resume_compares():
    """`comparison` says how a report decides, not what a run computes: a run recorded before the node existed, or
    under another declaration, resumes under today's (it is not another experiment)."""
    from experiments.run.resume import differences, settings

    cfg = _compose("train", ["experiment=deep_long_seeds"])
    assert list(cfg.comparison.family) == ["gspo", "grpo + r2"]
    recorded = {key: value for key, value in settings(cfg).items() if not key.startswith("comparison.")}
    assert differences(recorded, cfg) == []
    assert differences({**recorded, "comparison.primary": "gain"}, cfg) == []


GROUPS = ("algo", "dataset", "correction", "routing_variant", "routers", "hydra")  # keys that depend on a choice


def test_every_setting_the_docs_name_is_a_key_of_a_schema():
    """docs/reproduce.md named `sft.cpu_kernels=portable`, which Hydra refuses: the key is the top-level
    `cpu_kernels` of the cold start's config. Every `a.b=...` written in backticks in the docs is a key of the RL
    run's or the cold start's composed config (those under a config group's choice excepted)."""
    composed = [_compose("train", []), _compose("sft", [])]

    def holds(cfg, key: str) -> bool:
        node = cfg
        for part in key.split("."):
            if not isinstance(node, DictConfig) or part not in node:
                return False
            node = node._get_node(part)
        return True

    named = set()
    for page in [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md"))]:
        for quoted in re.findall(r"`([^`]+)`", page.read_text(encoding="utf-8")):
            named |= {(page.name, key) for key in re.findall(r"(?<![\w./-])([a-z_]+(?:\.[a-z_0-9]+)+)=", quoted)}
    checked = [(page, key) for page, key in sorted(named) if key.split(".")[0] not in GROUPS]
    assert len(checked) > 20, checked
    unknown = [f"{page}: {key}" for page, key in checked if not any(holds(cfg, key) for cfg in composed)]
    assert not unknown, unknown
