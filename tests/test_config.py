"""Config: precedence of file, env and overrides; bad values fail naming the field."""

import os

import pytest
from pydantic import BaseModel

from sao.config import ConfigError, load_config, machine_cpu_ids, to_toml


def test_defaults_validate():
    config = load_config(environ={})
    assert config.trainer.checkpoint_every == 100
    assert config.topics.tasks == "sao.tasks"


def test_precedence_file_env_overrides(tmp_path):
    path = tmp_path / "sao.toml"
    path.write_text("[trainer]\nbatch_size = 4\nlearning_rate = 1e-4\n[env]\nmax_turns = 5\n")
    config = load_config(path, ["trainer.batch_size=16"], environ={"SAO__TRAINER__LEARNING_RATE": "2e-5",
                                                                  "SAO__ENV__MAX_TURNS": "2"})
    assert config.trainer.batch_size == 16  # --set beats the file
    assert config.trainer.learning_rate == 2e-5  # env beats the file
    assert config.env.max_turns == 2


@pytest.mark.parametrize("override, field", [
    ("trainer.batch_size=0", "trainer.batch_size"),
    ("trainer.grad_clip=-1", "trainer.grad_clip"),
    ("policy.temperature=0", "policy.temperature"),
    ("trainer.baseline_key=\"group\"", "trainer.baseline_key"),
    ("trainer.no_such_knob=1", "trainer.no_such_knob"),
    ("nosection.x=1", "nosection"),
    ("trainer.lora.rank=-1", "trainer.lora.rank"),
    ("trainer.lora.alpha=0", "trainer.lora.alpha"),
    ("trainer.lora.lr_scale=0", "trainer.lora.lr_scale"),
    ("trainer.lora.targets=[]", "trainer.lora.targets"),
    ("trainer.lora.targets=[\"all-linear\", \"q_proj\"]", "trainer.lora.targets"),
])
def test_bad_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        load_config(overrides=[override], environ={})


def test_lora_is_off_by_default_and_scales_the_learning_rate_when_on():
    config = load_config(environ={})
    assert config.trainer.lora.rank == 0 and config.trainer.optimizer_learning_rate == config.trainer.learning_rate
    lora = load_config(overrides=["trainer.lora.rank=8", "trainer.lora.lr_scale=4"],
                       environ={"SAO__TRAINER__LEARNING_RATE": "2e-5"})
    assert lora.trainer.optimizer_learning_rate == pytest.approx(8e-5)


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=r"section\.knob=value"):
        load_config(overrides=["trainer.batch_size"], environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})


def test_toml_rendering_round_trips(tmp_path):
    config = load_config(overrides=["trainer.deepspeed={ zero_optimization = { stage = 3 } }",
                                    "policy.system_prompt=\"say \\\"hi\\\"\""], environ={})
    path = tmp_path / "effective.toml"
    path.write_text(to_toml(config))
    # The overrides took (an inline table, an escaped quote), so the round trip compares
    # non-default values rather than defaults with defaults.
    assert config.trainer.deepspeed == {"zero_optimization": {"stage": 3}}
    assert config.policy.system_prompt == 'say "hi"'
    assert load_config(path, environ={}) == config


def test_config_show_prints_the_env_filled_generation_settings():
    from typer.testing import CliRunner

    from sao.cli import app

    shown = CliRunner().invoke(app, ["config", "show", "--set", 'env.name="humaneval"'])
    assert shown.exit_code == 0, shown.output
    assert "[policy]" in shown.output and "#   max_new_tokens = 384" in shown.output
    wrong = CliRunner().invoke(app, ["config", "show", "--set", 'env.name="no_such_env"'])
    assert wrong.exit_code != 0 and "env.name" in wrong.output


def test_config_show_lists_every_knob_unset_ones_too_and_describes_them_on_request(tmp_path):
    from typer.testing import CliRunner

    from sao.cli import app
    from sao.config import SaoConfig

    def knobs(model, prefix=""):
        for name, field in type(model).model_fields.items():
            value = getattr(model, name)
            yield from knobs(value, f"{prefix}{name}.") if isinstance(value, BaseModel) else [(prefix + name, field)]

    every = dict(knobs(SaoConfig()))
    shown = CliRunner().invoke(app, ["config", "show", "--set", "trainer.max_steps=5"])
    assert shown.exit_code == 0, shown.output
    for knob in ("broker.bootstrap_servers", "sampler.policy_dir", "policy.max_new_tokens"):  # unset by default
        assert f"# {knob.split('.')[1]} = (unset)" in shown.output
    assert "\nmax_steps = 5\n" in shown.output
    # What it prints is the config: TOML that loads back to the same effective values.
    path = tmp_path / "shown.toml"
    path.write_text(shown.output.split("# effective generation settings")[0])
    assert load_config(path, environ={}) == load_config(overrides=["trainer.max_steps=5"])  # the suite's SAO__ vars too
    described = CliRunner().invoke(app, ["config", "show", "--describe"])
    assert described.exit_code == 0
    comments = " ".join(" ".join(line[2:].split()) for line in described.output.splitlines() if line.startswith("# "))
    missing = [knob for knob, field in every.items() if " ".join(field.description.split()) not in comments]
    assert not missing and len(every) > 100


@pytest.mark.parametrize("typo, nearest", [("trainer.batchsize=3", "trainer.batch_size"), ("tranier.batch_size=3", "trainer"),
                                           ("trainer.lora.rnk=2", "trainer.lora.rank")])
def test_an_unknown_knob_names_the_nearest_valid_ones(typo, nearest):
    with pytest.raises(ConfigError, match=rf"did you mean {nearest}\b"):
        load_config(overrides=[typo], environ={})


@pytest.mark.parametrize("section", ["sampler", "trainer"])
def test_cpu_affinity_takes_only_cpus_this_machine_has_naming_the_field(section):
    cpus = sorted(os.sched_getaffinity(0))
    assert getattr(load_config(overrides=[f"{section}.cpu_affinity={cpus[:1]}"], environ={}),
                   section).cpu_affinity == cpus[:1]
    for bad, why in (([max(cpus) + 1], "not available"), ([cpus[0], cpus[0]], "repeat"), ([], "empty"),
                     ([-1], "not available")):
        with pytest.raises(ConfigError, match=rf"`{section}\.cpu_affinity`.*{why}"):
            load_config(overrides=[f"{section}.cpu_affinity={bad}"], environ={})


def test_cpu_affinity_may_name_cpus_outside_the_launching_process_affinity():
    """`sao run` pinned to some CPUs may pin its trainer to others (async_vs_sync's pinned arms do)."""
    cpus = machine_cpu_ids()
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    own = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus[:1])
        config = load_config(overrides=[f"trainer.cpu_affinity={cpus[1:]}"], environ={})
    finally:
        os.sched_setaffinity(0, own)
    assert config.trainer.cpu_affinity == cpus[1:]


def test_sync_mode_needs_a_publish_every_step_and_the_feeder_batch():
    assert load_config(overrides=['run.mode="sync"'], environ={}).run.mode == "sync"
    with pytest.raises(ConfigError, match="sync_every must be 1"):
        load_config(overrides=['run.mode="sync"', "trainer.sync_every=2"], environ={})
    with pytest.raises(ConfigError, match="train_batch_size"):
        load_config(overrides=['run.mode="sync"', "trainer.deepspeed={ train_batch_size = 16 }"], environ={})
    with pytest.raises(ConfigError, match=r"run\.mode"):
        load_config(overrides=['run.mode="lockstep"'], environ={})


def test_trainer_threads_auto_shares_this_process_cpus_among_the_local_ranks(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    trainer = load_config(environ={}).trainer
    assert trainer.torch_threads == "auto"  # the default: the trainer takes what the samplers leave idle
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert trainer.threads() == cpus
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus * 2))  # more ranks than CPUs: still one thread each
    assert trainer.threads() == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert trainer.threads() == max(1, cpus // 2)
    assert load_config(overrides=["trainer.torch_threads=3"], environ={}).trainer.threads() == 3


def test_sampler_threads_auto_is_one_beside_the_trainer_and_the_machine_in_turn_with_it():
    cpus = len(os.sched_getaffinity(0))
    sampler = load_config(environ={}).sampler
    assert sampler.torch_threads == "auto"
    assert sampler.threads("async") == 1  # samplers and the trainer compute at once
    assert sampler.threads("sync") == cpus  # sampling and training take turns: each phase gets every CPU
    two = load_config(overrides=["sampler.num_samplers=2"], environ={}).sampler
    assert two.threads("sync") == max(1, cpus // 2)
    assert load_config(overrides=["sampler.torch_threads=3"], environ={}).sampler.threads("async") == 3
    with pytest.raises(ConfigError, match=r"sampler\.torch_threads"):
        load_config(overrides=["sampler.torch_threads=0"], environ={})


@pytest.mark.parametrize("old, new", [("trainer.whiten_advantages=false", "trainer.scale_advantages"),
                                      ("run.max_tasks_in_flight=4", "run.max_trajectories_in_flight"),
                                      ("trainer.eval_every=2", "trainer.shadow_every"),
                                      ("env.step_timeout_s=5", "env.turn_timeout_s")])
def test_old_knob_names_are_refused_naming_the_new_one(old, new):
    with pytest.raises(ConfigError, match=new.replace(".", r"\.")) as refused:
        load_config(overrides=[old], environ={})
    assert old.split("=")[0] in str(refused.value)


def test_algorithm_and_objective_are_tables_of_their_own_knobs_and_the_flat_knobs_still_load(caplog):
    grpo = load_config(overrides=['trainer.algorithm="grpo"', "trainer.algorithm.group_size=2"], environ={})
    assert grpo.trainer.algorithm.group_size == 2 and grpo.trainer.algorithm.copies_per_task == 2
    ppo = load_config(overrides=["trainer.objective={type = 'ppo', clip = 0.1}"], environ={}).trainer.objective
    assert (ppo.type, ppo.clip, ppo.dual_clip) == ("ppo", 0.1, 3.0)
    assert load_config(overrides=["trainer.objective.clip=3.0"], environ={}).trainer.objective.clip == 3.0  # tis's
    with pytest.raises(ConfigError, match=r"trainer\.objective\.dual_clip"):  # a knob of another objective
        load_config(overrides=["trainer.objective.dual_clip=4.0"], environ={})
    with pytest.raises(ConfigError, match=r"trainer\.algorithm\.group_size"):
        load_config(overrides=['trainer.algorithm="grpo"', "trainer.algorithm.group_size=3"], environ={})

    old = load_config(overrides=['trainer.algorithm="grpo"', "trainer.group_size=4", 'trainer.objective="ppo"',
                                 "trainer.ppo_clip=0.3"], environ={}).trainer
    assert old.algorithm.group_size == 4 and old.objective.clip == 0.3
    assert "trainer.group_size is now trainer.algorithm.group_size" in caplog.text
    assert "trainer.ppo_clip is now trainer.objective.clip" in caplog.text


def test_the_weights_transport_is_a_tagged_table_too():
    assert load_config(environ={}).policy.transport.type == "folder"
    kafka = load_config(overrides=['policy.transport="kafka"', "policy.transport.chunk_bytes=1048576"], environ={})
    assert kafka.policy.transport.chunk_bytes == 1 << 20
    kafka.policy.transport = "folder"  # the short form on assignment too
    assert kafka.policy.transport.type == "folder"
    with pytest.raises(ConfigError, match=r"policy\.transport\.chunk_bytes.*belongs to type 'kafka'"):
        load_config(overrides=["policy.transport.chunk_bytes=1048576"], environ={})
    old = load_config(overrides=['policy.transport="kafka"', "policy.chunk_bytes=1048576"], environ={})
    assert old.policy.transport.chunk_bytes == 1 << 20


def test_the_generation_engine_is_a_tagged_table_whose_vllm_knobs_hf_refuses(caplog):
    assert load_config(environ={}).sampler.engine.type == "auto"
    vllm = load_config(overrides=['sampler.engine="vllm"', "sampler.engine.kv_cache_gib=2"], environ={})
    assert (vllm.sampler.engine.type, vllm.sampler.engine.kv_cache_gib) == ("vllm", 2)
    with pytest.raises(ConfigError, match=r"sampler\.engine\.compile.*belongs to type 'auto' or 'vllm'"):
        load_config(overrides=['sampler.engine="hf"', "sampler.engine.compile=true"], environ={})
    old = load_config(overrides=["sampler.vllm_kv_cache_gib=3"], environ={})  # auto takes vLLM's knobs too
    assert old.sampler.engine.kv_cache_gib == 3
    assert "sampler.vllm_kv_cache_gib is now sampler.engine.kv_cache_gib" in caplog.text
