"""vLLM's /metrics (Prometheus text) and the speculative-decoding counters in it.

Speculative decoding's figures are counter deltas over one benchmark point: the counters are
cumulative since the engine started, so a point's own acceptance is (after - before). vLLM
0.32 exports, per engine (v1/spec_decode/metrics.py):

    vllm:spec_decode_num_drafts_total                    verification steps that carried a draft
    vllm:spec_decode_num_draft_tokens_total              drafted tokens
    vllm:spec_decode_num_accepted_tokens_total           drafted tokens the target model accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total   the same, by draft position {position="i"}
"""

from __future__ import annotations

from typing import NamedTuple

from m31ctl.served import prometheus

DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


class SpecCounters(NamedTuple):
    """The cumulative counters, summed over engines (data-parallel replicas each count)."""

    drafts: float
    draft_tokens: float
    accepted: float
    per_position: tuple[float, ...]


class SpecFigures(NamedTuple):
    """One point's speculative decoding: what a verification step yields."""

    drafts: int
    draft_tokens: int
    accepted_tokens: int
    # Tokens per step: the target's own token plus the accepted drafts (vLLM's "mean acceptance
    # length", the figure the MiniMax launch post quotes for DSpark).
    acceptance_length: float
    # Share of drafts whose token at position i was accepted (position 0 first).
    per_position: tuple[float, ...]


def acceptance_length(drafts: float, accepted: float) -> float:
    """vLLM's mean acceptance length: tokens a verification step yields, the target's own token
    plus the accepted drafts (drafts > 0)."""
    return 1 + accepted / drafts


def spec_counters(text: str) -> SpecCounters | None:
    """The counters in a /metrics text, or None when the engine exports none (not speculating)."""
    return counters_of(prometheus.parse(text))  # prometheus_client's parser


def counters_of(found: prometheus.ServedMetrics) -> SpecCounters | None:
    """The counters in parsed /metrics, or None when the engine exports none."""
    if DRAFTS not in found.samples:
        return None
    by_position: dict[int, float] = {}
    for sample in found.samples.get(ACCEPTED_PER_POSITION, ()):
        position = sample.labels.get("position", "")
        if position.isdigit():
            by_position[int(position)] = by_position.get(int(position), 0.0) + sample.value
    positions = tuple(by_position.get(i, 0.0) for i in range(max(by_position, default=-1) + 1))
    return SpecCounters(found.total(DRAFTS), found.total(DRAFT_TOKENS), found.total(ACCEPTED), positions)


def spec_figures(before: SpecCounters | None, after: SpecCounters | None) -> SpecFigures | None:
    """The point's own figures (after - before); None when no draft was proposed in between."""
    if after is None:
        return None
    base = before or SpecCounters(0.0, 0.0, 0.0, ())
    drafts = after.drafts - base.drafts
    if drafts <= 0:
        return None
    accepted = after.accepted - base.accepted
    earlier = base.per_position + (0.0,) * (len(after.per_position) - len(base.per_position))
    per_position = tuple(
        round((now - then) / drafts, 4) for now, then in zip(after.per_position, earlier, strict=False)
    )
    return SpecFigures(
        drafts=round(drafts),
        draft_tokens=round(after.draft_tokens - base.draft_tokens),
        accepted_tokens=round(accepted),
        acceptance_length=round(acceptance_length(drafts, accepted), 4),
        per_position=per_position,
    )
