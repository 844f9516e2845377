"""Runners: many episodes of an agent over tasks from a file or the TASKS work queue, agent loading
(proxy-style agents through an in-process gateway included) and live progress."""

from pipeline.runners.loading import import_object, load_agent, load_reward_function

__all__ = ["import_object", "load_agent", "load_reward_function"]
