"""vLLM flags that m31ctl sets from the plan: engine.extra_args may not set them again.

argparse keeps the last value of a repeated flag, so `--port 9000` in extra_args (appended last)
would win over runtime.port while the container still publishes runtime.port, the URL, the probes
and the Service point at it, and capacity, the lock and the rendered files describe the plan's
layout. Such a flag is refused (exit 2) naming the setting to use instead, in every spelling vLLM
reads (m31ctl/vllm_argv.py: `_` or `-`, an unambiguous prefix, `--flag=value`, a dotted key of
a JSON flag such as `-ac.key`, a short alias such as `-tp`).

The owned set is what the adapter emits: `emitted_flags()` runs the adapter's own argv sections
over settings that switch every section on (and the multi-node flags for each role), so a flag the
adapter learns to emit is owned from then on. A few flags the adapter never emits are owned too
(`ALSO_OWNED`): they would change where the server listens, how it speaks, or bypass the plan.

`--hf-overrides` is no setting's: m31ctl writes none. vLLM merges it into the checkpoint's
config.json before anything reads that (vllm/config/model.py: dict values into the sub-config,
the rest through config.update), the config every fact of the plan was read from (geometry,
quantization, positions, the sparse block: plan/checkpoint_facts.py) and the recipe was written
for. Its keys are refused (`overridden_key`) except RoPE scaling, the one override m31ctl reads
and checks (plan/engine_rules.py: the 1M opt-in, docs/decisions.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from m31ctl import vllm_argv as argv

if TYPE_CHECKING:
    from collections.abc import Iterable

_NODES = "parallelism.nodes (multi-node flags are set per pod)"
_HTTP = "runtime (m31ctl's probes, URLs and Services speak plain HTTP to the port it publishes)"
# The setting that owns each flag the adapter emits, for the message. A flag emitted but missing
# here is still owned (named by its argv section): tests/engine/test_engine_schema.py keeps them equal.
SETTING_FOR: dict[str, str] = {
    "--served-model-name": "model.served_name",
    "--tensor-parallel-size": "parallelism.tensor",
    "--pipeline-parallel-size": "parallelism.pipeline",
    "--data-parallel-size": "parallelism.data",
    "--enable-expert-parallel": "parallelism.expert",
    "--decode-context-parallel-size": "parallelism.decode_context",
    "--data-parallel-size-local": _NODES,
    "--data-parallel-address": _NODES,
    "--data-parallel-rpc-port": _NODES,
    "--data-parallel-start-rank": _NODES,
    "--headless": _NODES,
    "--distributed-executor-backend": _NODES,
    "--kv-cache-dtype": "cache.kv_dtype",
    "--attention-config": "cache.indexer_dtype and cache.indexer_context_parallel",
    "--block-size": "cache.block_size",
    "--kv-offloading-backend": "cache.cpu_offload_gib",
    "--kv-offloading-size": "cache.cpu_offload_gib",
    "--attention-backend": "attention_backend",
    "--speculative-config": "speculative.*",
    "--moe-backend": "moe.backend",
    "--language-model-only": "multimodal.text_only",
    "--limit-mm-per-prompt": "multimodal.image and multimodal.video",
    "--mm-encoder-tp-mode": "multimodal.encoder_data_parallel",
    "--mm-encoder-attn-backend": "multimodal.encoder_attention_backend",
    "--mm-processor-cache-type": "multimodal.encoder_data_parallel",
    "--max-model-len": "serving.max_model_len",
    "--max-num-seqs": "serving.max_num_seqs",
    "--gpu-memory-utilization": "serving.gpu_memory_utilization",
    "--enable-auto-tool-choice": "serving.tool_call_parser",
    "--tool-call-parser": "serving.tool_call_parser",
    "--reasoning-parser": "serving.reasoning_parser",
    "--trust-remote-code": "serving.trust_remote_code",
    "--shutdown-timeout": "serving.shutdown_timeout",
    # Each P/D role's connector and kv_role (adapter.kv_transfer_args); on an aggregated server it
    # would make the one engine half of a pair no router or peer was rendered for.
    "--kv-transfer-config": "disaggregation.enabled and disaggregation.connector",
}
# Owned though the adapter's `vllm serve` argv does not carry them (canonical long options).
ALSO_OWNED: dict[str, str] = {
    "--model": "model.path",
    "--revision": "the checkpoint commit m31ctl lock pins",
    "--host": "runtime.bind",
    "--port": "runtime.port",
    "--uds": "runtime.bind and runtime.port",
    "--data-parallel-rank": _NODES,
    "--nnodes": _NODES,
    "--node-rank": _NODES,
    "--master-addr": _NODES,
    "--master-port": _NODES,
    # The shortcuts write the speculative config (vllm/engine/arg_utils.py --spec-*).
    "--spec-method": "speculative.method",
    "--spec-model": "speculative.* (the DSpark draft ships in the checkpoint)",
    "--spec-tokens": "speculative.tokens",
    # A YAML file of flags: m31ctl cannot see what it sets, so none of the plan's checks would hold.
    "--config": "the plan itself (put each flag in its setting, or in engine.extra_args)",
    "--ssl-keyfile": _HTTP,
    "--ssl-certfile": _HTTP,
    "--ssl-ca-certs": _HTTP,
    "--ssl-cert-reqs": _HTTP,
    "--ssl-ciphers": _HTTP,
    "--enable-ssl-refresh": _HTTP,
}


def owned_settings(emitted: frozenset[str], version: str | None = None) -> dict[str, str]:
    """Owned flag -> the setting that owns it, for the flags the adapter `emitted` (its
    emitted_flags: passed in, as the adapter imports this module); with `version`, keyed by vLLM's
    canonical option of each (the adapter's `--gpu-memory-utilization` is `--device-memory-utilization`)."""
    owned = {flag: SETTING_FOR.get(flag, "the plan (the adapter emits it)") for flag in emitted}
    owned = {**owned, **ALSO_OWNED}
    if version is None:
        return owned
    try:
        groups = argv.option_groups(version)
    except argv.UnknownSchema:
        return owned
    return {groups.get(flag, flag): setting for flag, setting in owned.items()}


def owned_flag(arg: str, emitted: frozenset[str], version: str = "0.32.0") -> str | None:
    """The owned flag (canonical) that `arg` sets when vLLM `version` parses it, or None."""
    spelled = argv.spell(arg, fold_case=True)
    if spelled is None:
        return None
    owned = owned_settings(emitted, version)
    try:
        found = argv.canonical(arg, version, fold_case=True)
    except argv.UnknownSchema:
        found = argv.Resolution(None, ())
    if found.flag is not None:
        return found.flag if found.flag in owned else None
    # A version without a schema, or a name vLLM does not list: read it against the owned names
    # alone (an exact name or the prefix of one).
    if spelled.name in owned:
        return spelled.name
    if found.candidates:  # ambiguous in vLLM: it refuses the token itself
        return None
    return argv.prefix_of(spelled.name, sorted(owned))


HF_OVERRIDES = "--hf-overrides"
# What --hf-overrides may set, at the top level or under text_config (the decoder's config).
ROPE_KEYS = frozenset({"rope_scaling", "rope_parameters"})
_TEXT_CONFIG = "text_config"


def overridden_key(args: Iterable[str]) -> str | None:
    """The first key that --hf-overrides in `args` sets beyond RoPE scaling, dotted
    (`text_config.num_hidden_layers`), in every spelling vLLM merges (m31ctl/vllm_argv.py
    json_config: `=`, `_`, a prefix, a dotted key); None where it sets RoPE scaling alone."""
    for key, value in argv.json_config(args, HF_OVERRIDES).items():
        path = tuple(key.split("."))  # a dotted key (`--hf-overrides.text_config.x`) is a nested one
        if path == (_TEXT_CONFIG,) and isinstance(value, dict):
            found = [f"{_TEXT_CONFIG}.{k}" for k in value if k not in ROPE_KEYS]
        elif path[-1] in ROPE_KEYS and path[:-1] in ((), (_TEXT_CONFIG,)):
            found = []
        else:
            found = [key]
        if found:
            return found[0]
    return None
