"""Environments: the `Env` protocol and the built-in verifiable environments."""

from sao.envs.base import Env, Feedback

__all__ = ["Env", "Feedback"]
