"""verify's function checks: each feature the plan configures (structured output, a tool call,
the reasoning split, an image input) asked of the server, and its answer judged.

A checkpoint m31ctl made with random weights (its m31ctl-rehearsal.json) writes noise: the tool
call and the reasoning split are then requested and must be served, but what the model wrote is
not judged (skipped, saying why); structured output still is, its grammar constrains any
weights. A text-only checkpoint is sent no image. Every answer is read defensively
(http_answers.py): a broken or hostile server fails a check, it does not crash verify.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from m31ctl.deployment import Deployment
from m31ctl.plan import Plan
from m31ctl.served.http_answers import Answer, as_list, as_object, as_str, fetch, glimpse
from m31ctl.served.verified import VerifyReport

# 1x1 transparent PNG: the smallest image input every vision processor accepts.
PIXEL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="


def random_weights(deployment: Deployment) -> str | None:
    """Why the served model's words mean nothing, or None: a local checkpoint m31ctl made on the
    spot (make_tiny_model.py, make_tiny_m3.py) has random weights and says so in its
    m31ctl-rehearsal.json."""
    directory = deployment.model.host_path
    marker = Path(directory) / "m31ctl-rehearsal.json" if directory else None
    try:
        made = json.loads(marker.read_text()) if marker is not None and marker.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(made, dict) or made.get("made_by") != "m31ctl":
        return None
    return f"the checkpoint's weights are random ({marker}), so what the model writes is noise"


def text_only_checkpoint(deployment: Deployment) -> str | None:
    """Why a local checkpoint serves no images, or None: its config.json names a causal-LM
    architecture and no vision tower (the tiny MiniMax-M3 is the text backbone alone, which
    vLLM refuses an image for: "... is not a multimodal model")."""
    directory = deployment.model.host_path
    config = Path(directory) / "config.json" if directory else None
    try:
        data = json.loads(config.read_text()) if config is not None and config.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("vision_config"):
        return None
    names = [str(a) for a in data.get("architectures") or []]
    if not names or not all(a.endswith("ForCausalLM") for a in names):
        return None
    return f"the checkpoint is text-only ({config}: {', '.join(names)}, no vision_config)"


def _unjudged(report: VerifyReport, name: str, answer: Answer, detail: str, noise: str) -> None:
    """A check of what the model writes, on random weights: the request must be served (HTTP
    200 with a message), the rest is skipped and says why."""
    served = answer.status == 200 and bool(_message(answer))
    report.check(
        name,
        None if served else False,
        f"{detail}; not judged: {noise}" if served else detail + answer.evidence(),
    )


def _chat(client: Any, body: dict[str, Any]) -> Answer:
    return fetch(client, "POST", "/v1/chat/completions", body)


def _message(answer: Answer) -> dict[str, Any]:
    """The first choice's message, or {} for an answer of another shape."""
    choices = as_list(answer.obj().get("choices"))
    return as_object(as_object(choices[0]).get("message")) if choices else {}


def said_if_failed(answer: Answer, ok: bool) -> str:
    """A failed check quotes what the server sent; a passed one does not need to."""
    return "" if ok else answer.evidence()


def check_structured(client: Any, served: str, report: VerifyReport, noise: str | None = None) -> None:
    """A JSON-schema response: the engine's structured outputs must constrain the answer. On
    random weights (`noise`) with a reasoning parser, what comes before the grammar engages is
    noise too: the answer must end in the schema's value."""
    schema = {"type": "string", "enum": ["yes", "no"]}
    answer = _chat(
        client,
        {
            "model": served,
            "messages": [{"role": "user", "content": "Answer yes or no: is the sky blue?"}],
            "max_tokens": 32,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        },
    )
    content = as_str(_message(answer).get("content"))
    try:
        value = json.loads(content) if content is not None else None
    except (ValueError, RecursionError):
        value = None
    ok = answer.status == 200 and value in ("yes", "no")
    detail = f"HTTP {answer.status}, content {glimpse(content, 60)}"
    if not ok and noise and answer.status == 200 and content and content.rstrip().endswith(('"yes"', '"no"')):
        ok, detail = True, f"{detail}: the grammar's value ends it; what precedes is noise ({noise})"
    report.check("structured-output", ok, detail + said_if_failed(answer, ok or content is not None))


def check_tool_call(client: Any, plan: Plan, report: VerifyReport, noise: str | None = None) -> None:
    parser = plan.settings.serving.tool_call_parser
    if not parser:
        report.check("tool-call", None, "the plan sets no tool-call parser")
        return
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    answer = _chat(
        client,
        {
            "model": plan.settings.model.served_name,
            "messages": [{"role": "user", "content": "What is the weather in Paris? Use the tool."}],
            "tools": [tool],
            "tool_choice": "auto",
            "max_tokens": 512,
            "temperature": 0,
        },
    )
    sent = _message(answer).get("tool_calls")
    names = [as_str(as_object(as_object(c).get("function")).get("name")) for c in as_list(sent)]
    ok = answer.status == 200 and "get_weather" in names
    shown = glimpse(", ".join(n for n in names if n), 80) if any(names) else "no tool call"
    if noise:
        _unjudged(report, "tool-call", answer, f"HTTP {answer.status}, {parser} parsed {shown}", noise)
        return
    # Tool calls of another shape are quoted themselves: the answer's first bytes may not reach them.
    said = f"; tool_calls {glimpse(sent)}" if sent and not ok else said_if_failed(answer, ok)
    report.check("tool-call", ok, f"HTTP {answer.status}, {parser} parsed {shown}" + said)


def check_reasoning(client: Any, plan: Plan, report: VerifyReport, noise: str | None = None) -> None:
    parser = plan.settings.serving.reasoning_parser
    if not parser:
        report.check("reasoning", None, "the plan sets no reasoning parser")
        return
    answer = _chat(
        client,
        {
            "model": plan.settings.model.served_name,
            "messages": [{"role": "user", "content": "What is 17 * 23? Think, then answer."}],
            "max_tokens": 1024,
            "temperature": 0,
            # MiniMax-M3's template: thinking on for this request (vLLM recipes, "Thinking Modes").
            "chat_template_kwargs": {"thinking_mode": "enabled"},
        },
    )
    message = _message(answer)
    reasoning = as_str(message.get("reasoning")) or as_str(message.get("reasoning_content")) or ""
    content = as_str(message.get("content")) or ""
    ok = answer.status == 200 and bool(reasoning) and "<mm:think>" not in content
    detail = f"HTTP {answer.status}, {parser}: {len(reasoning)} characters of reasoning in their own field"
    if noise:
        _unjudged(report, "reasoning", answer, detail, noise)
        return
    report.check("reasoning", ok, detail + said_if_failed(answer, ok))


def check_image(client: Any, plan: Plan, report: VerifyReport, text_only: str | None = None) -> None:
    mm = plan.settings.multimodal
    if mm.text_only or not mm.image or "image" not in plan.model.modalities:
        report.check("image-input", None, "the plan serves no image input")
        return
    if text_only:
        report.check("image-input", None, f"not sent: {text_only}")
        return
    answer = _chat(
        client,
        {
            "model": plan.settings.model.served_name,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What color is this pixel?"},
                        {"type": "image_url", "image_url": {"url": PIXEL}},
                    ],
                }
            ],
            "max_tokens": 32,
            "temperature": 0,
        },
    )
    ok = answer.status == 200 and as_str(_message(answer).get("content")) is not None
    report.check("image-input", ok, f"HTTP {answer.status}" + said_if_failed(answer, ok))
