"""What the plan asks of the engine, gathered once for every rule and capability asked of it.

A `RuleContext` holds the settings, the host, the model and the checkpoint's facts, and what
engine.extra_args says through vLLM's own argv grammar (--hf-overrides, --monokernel): the
engine rules (plan/engine_rules.py) and the capabilities a plan uses (plan/engine_capabilities.py)
read this one context, so they cannot disagree about what the plan is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from m31ctl import vllm_argv as argv
from m31ctl.hardware import Hardware, Platform, vendor_facts
from m31ctl.plan.catalog import ModelFacts
from m31ctl.plan.checkpoint_facts import CheckpointFacts, checkpoint_facts
from m31ctl.plan.settings import PlanSettings


def _switch(args: tuple[str, ...], *names: str) -> bool:
    groups = dict.fromkeys(names, names[0])
    return any(True for _ in argv.occurrences(args, groups, ()))


class RuleContext(NamedTuple):
    settings: PlanSettings
    hardware: Hardware
    model: ModelFacts
    facts: CheckpointFacts
    hf_overrides: dict[str, Any]
    monokernel: bool

    @property
    def platform(self) -> Platform:
        # The vendor's platform (hardware.VENDORS): CUDA, ROCm, or the CPU build (a GPU-less host too).
        return vendor_facts(self.hardware.vendor).platform

    @property
    def env(self) -> Mapping[str, str]:
        return self.settings.runtime.env

    @property
    def indexer_cp(self) -> bool:
        return self.settings.cache.indexer_context_parallel

    @property
    def minimax_m3(self) -> bool:
        """A MiniMax Sparse Attention model (the checkpoint states an MSA block size)."""
        return self.facts.sparse_block_size is not None


def rule_context(settings: PlanSettings, hw: Hardware, model: ModelFacts) -> RuleContext:
    extra = settings.engine.extra_args
    return RuleContext(
        settings=settings,
        hardware=hw,
        model=model,
        facts=checkpoint_facts(settings, model),
        hf_overrides=argv.json_config(extra, "--hf-overrides"),
        monokernel=_switch(extra, "--monokernel") and not _switch(extra, "--no-monokernel"),
    )
