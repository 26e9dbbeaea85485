"""OpenAI-compatible serving: `leanlm serve MODEL`, or `serve(llm, name)` from Python."""

from __future__ import annotations

import copy

from leanlm.engine.llm import EngineFront


def serve(llm: EngineFront, model_name: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          max_requests: int = 512, log_level: str = "info", drain_seconds: int = 60,
          prompt_scorer: str = "smollm2-135m", max_n: int = 16, prepare_compression: str | None = None) -> None:
    """Serve until SIGINT/SIGTERM: then stop accepting, let requests in flight finish (up to drain_seconds), stop the
    engine and return."""
    # uvicorn, and fastapi under leanlm.serve.app: heavy, only a running server needs them (the CLI imports this
    # package at every start)
    import uvicorn

    from leanlm.serve.app import build_app

    app = build_app(llm, model_name, api_key, max_requests, prompt_scorer, max_n, prepare_compression)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_seconds,
                            log_config=_log_config())
    try:
        uvicorn.Server(config).run()
    finally:
        llm.shutdown()


def _log_config() -> dict:
    """uvicorn's logging setup with its access log on stderr too (its default writes that one to stdout, which
    carries a command's result only)."""
    from uvicorn.config import LOGGING_CONFIG  # heavy: see serve()

    config = copy.deepcopy(LOGGING_CONFIG)
    for handler in config["handlers"].values():
        if handler.get("stream") == "ext://sys.stdout":
            handler["stream"] = "ext://sys.stderr"
    return config
