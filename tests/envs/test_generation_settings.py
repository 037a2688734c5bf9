"""Generation settings: each env suggests its own; a `policy.*` knob the user sets wins."""

from sao.config import load_config
from sao.envs.registry import generation_settings


def test_env_defaults_apply_when_policy_knobs_are_unset():
    arithmetic = generation_settings(load_config(environ={}))
    assert arithmetic.system_prompt.startswith("You are a calculator") and arithmetic.max_new_tokens == 24
    textworld = generation_settings(load_config(overrides=['env.name="textworld"'], environ={}))
    assert "command" in textworld.system_prompt and textworld.max_new_tokens == 16
    assert arithmetic.stop == () and arithmetic.top_p == 1.0


def test_policy_knobs_override_the_env():
    settings = generation_settings(load_config(
        overrides=['policy.system_prompt="Be brief."', "policy.max_new_tokens=7", 'policy.stop=["\\n\\n"]',
                   "policy.top_p=0.9"], environ={}))
    assert (settings.system_prompt, settings.max_new_tokens, settings.stop, settings.top_p) == \
        ("Be brief.", 7, ("\n\n",), 0.9)


def test_a_plugin_env_without_defaults_gets_generic_ones():
    settings = generation_settings(load_config(overrides=['env.name="support.plain_env:EchoEnv"'], environ={}))
    assert settings.system_prompt == "You are a helpful assistant." and settings.max_new_tokens == 64
