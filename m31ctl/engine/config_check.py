"""Build vLLM's engine configuration from a plan's exact `vllm serve` argv, with the engine's own
Python (in its image, or natively), without loading weights or starting workers.

vLLM checks most of a configuration only when it builds it (ModelConfig.verify_with_parallel_config,
the max-length check, CacheConfig, SpeculativeConfig, the platform's check_and_update_config):
this runs exactly that, EngineArgs.from_cli_args(...).create_engine_config(), on the host's
platform with HF_HUB_OFFLINE=1 (a model directory or a cached checkpoint's config is read; nothing
is downloaded). It prints one JSON object on stdout:

    {"ok": true, "vllm": "0.32.0", "platform": "cpu", "resolved": {...}}
    {"ok": false, "stage": "config", "error": "ValueError", "message": "<vLLM's own words>", ...}

`stage` says where it stopped: "import" (vLLM did not import), "parse" (vLLM's `vllm serve`
parser refused the argv), "config" (create_engine_config refused it). Exit status: 0 ok, 1 refused,
2 not run. Standalone: imports nothing from m31ctl (m31ctl/engine/dry_run.py runs it).

    python config_check.py -- MODEL --tensor-parallel-size 2 --decode-context-parallel-size 2

The answer also carries "schema": what this vLLM's `vllm serve` accepts (extract_schema.py,
beside this file), from the same import, so doctor checks the argv against the engine's own
schema (an older or newer vLLM than the one m31ctl ships a schema for) without a second vLLM
start-up; "schema_error" where it could not be made.
"""

import contextlib
import io
import json
import os
import sys
import traceback
from typing import Any

# Before vLLM (and huggingface_hub, which reads it at import) is imported: never download.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _emit(result: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(result, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def _reason(exc: BaseException) -> str:
    """vLLM's own sentence: a config validator's ValueError comes wrapped in pydantic's
    ValidationError ("1 validation error for VllmConfig ... Value error, <vLLM's words>")."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            first = errors()[0]
            message = str(first.get("msg", ""))
            return message.removeprefix("Value error, ").removeprefix("Assertion failed, ")
        except Exception:
            pass
    return str(exc)


def _refusal(stage: str, exc: BaseException, **extra: Any) -> dict[str, Any]:
    # The innermost vLLM message is what a user would read in the engine's log; pydantic wraps
    # config validators' ValueErrors, so the chain is kept too.
    chain: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(chain) < 5:
        chain.append(f"{type(seen).__name__}: {seen}")
        seen = seen.__cause__ or seen.__context__
    return {
        "ok": False,
        "stage": stage,
        "error": type(exc).__name__,
        "message": str(exc),
        "reason": _reason(exc),
        "chain": chain,
        "where": traceback.format_exception(type(exc), exc, exc.__traceback__)[-2].strip()[:500],
        **extra,
    }


def _parser() -> Any:
    # vLLM: in the engine's Python only, once check() has imported it (or reported why not)
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # vLLM 0.32
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        try:  # 0.33
            from vllm.entrypoints.common.cli_args import make_arg_parser
        except ImportError:  # 0.26 and earlier
            from vllm.entrypoints.openai.cli_args import make_arg_parser
    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def _name(value: Any) -> Any:
    """Enum members and classes by name; everything else as JSON can carry it."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if hasattr(value, "name") and not isinstance(value, type):
        return value.name
    if isinstance(value, type):
        return value.__name__
    return str(value)


def _attention_backend(config: Any) -> dict[str, Any]:
    """The main model's attention backend as vLLM selects it on this platform (the selector the
    workers call), for the model's head size, dtype and cache dtype."""
    try:  # vLLM, as in _parser; a selector that moved is a finding, not a crash
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend

        model = config.model_config
        with set_current_vllm_config(config):
            backend = get_attn_backend(
                model.get_head_size(),
                model.dtype,
                config.cache_config.cache_dtype,
                use_mla=bool(getattr(model, "use_mla", False)),
            )
        return {"attention_backend": backend.get_name()}
    except Exception as exc:  # the configuration stands; only the selection could not be shown
        return {"attention_backend": None, "attention_backend_error": f"{type(exc).__name__}: {exc}"[:500]}


def _resolved(config: Any) -> dict[str, Any]:
    model, cache, parallel = config.model_config, config.cache_config, config.parallel_config
    attention = getattr(config, "attention_config", None)
    resolved: dict[str, Any] = {
        "model": model.model,
        "architectures": list(getattr(model, "architectures", None) or []),
        "dtype": str(model.dtype).removeprefix("torch."),
        "max_model_len": model.max_model_len,
        "kv_cache_dtype": cache.cache_dtype,
        "block_size": cache.block_size,
        "tensor_parallel_size": parallel.tensor_parallel_size,
        "pipeline_parallel_size": parallel.pipeline_parallel_size,
        "data_parallel_size": parallel.data_parallel_size,
        "decode_context_parallel_size": getattr(parallel, "decode_context_parallel_size", 1),
        "enable_expert_parallel": parallel.enable_expert_parallel,
        "total_num_kv_heads": model.get_total_num_kv_heads(),
        "configured_attention_backend": _name(getattr(attention, "backend", None)),
        "indexer_kv_dtype": getattr(attention, "indexer_kv_dtype", None),
        "kv_offloading_size": getattr(cache, "kv_offloading_size", None),
        "kv_connector": getattr(config.kv_transfer_config, "kv_connector", None),
    }
    spec = config.speculative_config
    resolved["speculative"] = (
        None
        if spec is None
        else {
            key: _name(getattr(spec, key, None))
            for key in (
                "method",
                "num_speculative_tokens",
                "model",
                "attention_backend",
                "draft_sample_method",
                "draft_tensor_parallel_size",
            )
        }
    )
    resolved.update(_attention_backend(config))
    return resolved


def _schema() -> dict[str, Any]:
    """extract_schema.py's document, or why it could not be made (the check goes on without it)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import extract_schema  # type: ignore[import-not-found]  # beside this script, wherever it runs

        return {"schema": extract_schema.extract()}
    except Exception as exc:
        return {"schema_error": f"{type(exc).__name__}: {exc}"[:500]}


def check(argv: list[str]) -> tuple[int, dict[str, Any]]:
    try:  # vLLM, imported here so that failing to import it is the "import" stage's refusal
        import vllm
        from vllm.engine.arg_utils import EngineArgs
        from vllm.platforms import current_platform
    except Exception as exc:
        return 2, _refusal("import", exc)
    facts = {"vllm": getattr(vllm, "__version__", None), "platform": str(current_platform.device_type)}
    facts.update(_schema())
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse reports to stderr and exits
        message = captured.getvalue().strip().splitlines()
        return 1, {
            "ok": False,
            "stage": "parse",
            "error": "ArgumentError",
            "message": message[-1] if message else f"exit {exc.code}",
            "chain": message[-5:],
            **facts,
        }
    except Exception as exc:
        return 1, _refusal("parse", exc, **facts)
    if getattr(args, "model_tag", None):  # `vllm serve MODEL` (vllm/entrypoints/cli/serve.py)
        args.model = args.model_tag
    try:
        config = EngineArgs.from_cli_args(args).create_engine_config()
    except Exception as exc:
        return 1, _refusal("config", exc, **facts)
    return 0, {"ok": True, **facts, "resolved": _resolved(config)}


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        _emit(
            {
                "ok": False,
                "stage": "usage",
                "error": "UsageError",
                "message": "usage: config_check.py -- MODEL [FLAGS...]",
            }
        )
        return 2
    # vLLM logs to stdout: keep stdout for the one JSON object.
    real_stdout = sys.stdout
    sys.stdout = sys.stderr
    try:
        code, result = check(argv)
    finally:
        sys.stdout = real_stdout
    _emit(result)
    return code


if __name__ == "__main__":
    sys.exit(main())
