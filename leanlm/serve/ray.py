"""N engine replicas behind one OpenAI endpoint on Ray Serve (`pip install 'leanlm[ray]'`).

Each replica is a whole leanlm server (an AsyncLLM and the same FastAPI app as `leanlm serve`) built on its Ray
actor when it starts; Ray Serve's HTTP proxy spreads requests over the replicas (power of two choices on their
queue lengths). Every replica holds its own copy of the weights and its own KV pool, so replicas pay only where
there are cores (or machines) to give them: on a 2-core box two replicas split the same two cores.

    leanlm serve MODEL --replicas 2 [--ray-address ADDR]   # ADDR: an existing cluster; default a local one

/metrics is answered by whichever replica the proxy picks (each counts its own requests); Ray's own metrics
cover the whole application."""

from __future__ import annotations

from leanlm.engine.config import EngineConfig
from leanlm.engine.llm import AsyncLLM
from leanlm.errors import LeanLMError
from leanlm.runtime import cpu_count

APP_NAME = "leanlm"


def _replica_class():
    # Ray (optional, leanlm[ray]) and fastapi (under leanlm.serve.app): heavy, only --replicas needs them
    from ray import serve

    from leanlm.serve.app import build_app

    @serve.ingress()
    class LeanLMReplica:
        def __init__(self, model: str, name: str, api_key: str | None, max_requests: int, config: EngineConfig,
                     load_options: dict, prompt_scorer: str, max_n: int, prepare_compression: str | None):
            self.llm = AsyncLLM(model, config=config, **load_options)
            self.app_args = name, api_key, max_requests, prompt_scorer, max_n, prepare_compression

        def __serve_build_asgi_app__(self):
            return build_app(self.llm, *self.app_args)

        def __del__(self):
            self.llm.shutdown()

    return LeanLMReplica


def serve_replicas(model: str, name: str, replicas: int, host: str = "127.0.0.1", port: int = 8000,
                   api_key: str | None = None, max_requests: int = 512, config: EngineConfig | None = None,
                   ray_address: str | None = None, blocking: bool = True, prompt_scorer: str = "smollm2-135m",
                   max_n: int = 16, prepare_compression: str | None = None, **load_options) -> None:
    """Start `replicas` engines on Ray Serve behind http://host:port (a local Ray instance unless ray_address).
    config: every replica's engine (a draft in it by name: each replica loads its own); load_options: AsyncLLM's
    (dtype, device, threads, quiet)."""
    try:  # Ray: optional (leanlm[ray]) and heavy
        import ray
        from ray import serve
    except ImportError:
        raise LeanLMError("--replicas needs Ray Serve: pip install 'leanlm[ray]'") from None
    if replicas < 1:
        raise LeanLMError(f"--replicas must be >= 1, got {replicas}")
    options = dict(load_options)
    if options.get("threads") is None:  # each replica's share of the cores (one process each; more oversubscribe)
        options["threads"] = max(1, cpu_count() // replicas)
    if not ray.is_initialized():
        if ray_address and ray_address != "local":
            ray.init(address=ray_address)
        else:  # a local instance on loopback only
            ray.init(address="local", include_dashboard=False, num_cpus=cpu_count(), _node_ip_address="127.0.0.1")
    serve.start(http_options={"host": host, "port": port})
    deployment = serve.deployment(_replica_class(), name="LeanLMReplica", num_replicas=replicas,
                                  ray_actor_options={"num_cpus": options["threads"]},
                                  max_ongoing_requests=max_requests)
    serve.run(deployment.bind(model, name, api_key, max_requests, config or EngineConfig(), options, prompt_scorer,
                              max_n, prepare_compression), name=APP_NAME, route_prefix="/", blocking=blocking)


def shutdown() -> None:
    """Stop the Serve application and the Ray instance this process started."""
    import ray  # optional and heavy, as above
    from ray import serve

    serve.shutdown()
    ray.shutdown()
