"""SGLang backends: an engine inside this process (`SGLangEngineBackend`) or running servers over HTTP
(`SGLangServerBackend`).

SGLang is an optional extra (its wheel pins its own torch and about 10 GB of CUDA libraries):
``pip install "mt-env[sglang]"`` on the GPU machine that serves the model. It is imported only when an engine is
built. The server client needs only ``httpx``.

The request and response fields, stop and logprob conventions, seeds and weight-sync calls this code relies on,
with where SGLang defines them: docs/sglang.md ("The protocol, as mt_env reads it").
How to start servers and point mt_env at them: docs/sglang.md.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from mt_env.turn import FINISH_REASONS, ModelTurn

from .backend import Backend, BackendError, GenerationError, SamplingParams, check_prompt_ids

INSTALL_HINT = 'pip install "mt-env[sglang]"'
_RETRY_STATUSES = (502, 503, 504)  # a router without workers, an overloaded or restarting server: try another one


# --------------------------------------------------------------------------------------------- translation
def sglang_sampling_params(params: SamplingParams, send_seed: bool = True) -> dict[str, Any]:
    """`SamplingParams` as SGLang's ``sampling_params`` dict (every field explicit: servers have model defaults)."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
    }
    if params.stop_token_ids:
        out["stop_token_ids"] = list(params.stop_token_ids)
    if send_seed and params.seed is not None:
        out["sampling_seed"] = params.seed
    return out


def generation_from_sglang(output: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> ModelTurn:
    """A `ModelTurn` from one SGLang ``/generate`` / ``async_generate`` answer (shapes in the module docstring).

    Ids and logprobs come from ``meta_info["output_token_logprobs"]``; ``output_ids`` (or ``token_ids``), when
    present, must agree with them. The stop token is kept as SGLang reports it; nothing is added or removed.
    """
    if isinstance(output, Sequence) and not isinstance(output, (str, bytes)):
        if len(output) != 1:
            raise GenerationError(f"expected one SGLang answer for one prompt, got {len(output)}")
        output = output[0]
    if not isinstance(output, Mapping) or not isinstance(output.get("meta_info"), Mapping):
        keys = list(output) if isinstance(output, Mapping) else type(output).__name__
        raise GenerationError(f"SGLang's answer has no meta_info (got {keys})")
    meta = output["meta_info"]
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        raise GenerationError("SGLang returned no meta_info.output_token_logprobs: the request needs return_logprob")
    try:
        ids = [int(entry[1]) for entry in pairs]
        logprobs = [float(entry[0]) for entry in pairs]
    except (TypeError, ValueError, IndexError, KeyError) as e:
        raise GenerationError(f"unexpected output_token_logprobs entries (want [logprob, token_id, text]): "
                              f"{list(pairs)[:3]!r}") from e
    reported = output.get("output_ids", output.get("token_ids"))
    if reported is not None and [int(t) for t in reported] != ids:
        raise GenerationError(f"SGLang's output_ids {list(reported)[:8]}... disagree with the ids of "
                              f"output_token_logprobs {ids[:8]}...")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, Mapping) else finish
    if kind not in FINISH_REASONS:
        raise GenerationError(f"unexpected SGLang finish_reason {finish!r} (want type stop/length/abort)")
    extra: dict[str, Any] = {"backend": "sglang", "finish": dict(finish) if isinstance(finish, Mapping) else finish}
    for key in ("id", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"):
        if key in meta:
            extra[key] = meta[key]
    return ModelTurn(ids, logprobs, kind, extra)


def import_sglang():
    """The `sglang` module, or ImportError saying how to install it."""
    try:
        return importlib.import_module("sglang")
    except ImportError as e:
        raise ImportError(
            f"this backend needs SGLang, an optional extra of mt_env: {INSTALL_HINT} (it pins its own torch and "
            f"CUDA libraries: install it on the GPU machine that serves the model). Importing it failed: {e}"
        ) from e


# --------------------------------------------------------------------------------------------- in-process engine
class SGLangEngineBackend(Backend):
    """An SGLang engine in this process: ``sglang.Engine(model_path=..., **engine_kwargs)``, one
    ``await engine.async_generate(input_ids=..., sampling_params=..., return_logprob=True)`` per request (the
    engine batches them itself).

    Args:
        model_path: a model folder or hub id; `engine_kwargs` go to ``sglang.Engine`` (its ``ServerArgs``:
            ``tp_size``, ``mem_fraction_static``, ``dtype``, ``enable_memory_saver``, ...).
            ``skip_tokenizer_init=True`` is the default here: ids in, ids out.
        engine: an engine built elsewhere (anything with SGLang's ``async_generate``) instead of `model_path`.
            It is not shut down by `close`.
        send_seed: send `SamplingParams.seed` as ``sampling_seed`` (False for SGLang versions without it).
    """

    def __init__(self, model_path: str | None = None, *, engine: Any = None, send_seed: bool = True,
                 **engine_kwargs: Any):
        if (model_path is None) == (engine is None):
            raise ValueError("pass exactly one of model_path= (to start an engine) or engine= (an existing one)")
        if engine is not None and engine_kwargs:
            raise ValueError(f"engine options {sorted(engine_kwargs)} apply only when starting an engine")
        self._owns_engine = engine is None
        if engine is None:
            sglang = import_sglang()
            engine_kwargs.setdefault("skip_tokenizer_init", True)
            engine = sglang.Engine(model_path=model_path, **engine_kwargs)
        self.engine = engine
        self.send_seed = send_seed
        self._closed = False

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> ModelTurn:
        params = params or SamplingParams()
        prompt = check_prompt_ids(prompt_ids)
        if self._closed:
            raise BackendError("this SGLangEngineBackend is closed")
        started = time.perf_counter()
        try:
            output = await self.engine.async_generate(
                input_ids=prompt, sampling_params=sglang_sampling_params(params, self.send_seed), return_logprob=True)
        except (ValueError, RuntimeError) as e:  # SGLang raises ValueError for requests it rejects
            raise GenerationError(f"the SGLang engine failed the request: {type(e).__name__}: {e}") from e
        generation = generation_from_sglang(output)
        generation.meta["request_s"] = time.perf_counter() - started
        return generation

    async def close(self) -> None:
        """Shut the engine down if this backend started it."""
        if not self._closed:
            self._closed = True
            if self._owns_engine:
                self.engine.shutdown()

    # The Engine's own control methods call `run_until_complete` and cannot run inside an event loop; these await
    # the tokenizer-manager coroutines that those methods wrap (see the module docstring).
    async def update_weights(
        self,
        named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        *,
        model_path: str | None = None,
        load_format: str | None = None,
        flush_cache: bool = True,
    ) -> None:
        """From tensors of this process (``update_weights_from_tensor``) or from a checkpoint folder
        (``update_weights_from_disk``). Exactly one of `named_tensors` and `model_path`."""
        if (named_tensors is None) == (model_path is None):
            raise ValueError("pass exactly one of named_tensors= or model_path=")
        io = importlib.import_module("sglang.srt.managers.io_struct")
        manager = self.engine.tokenizer_manager
        if model_path is not None:
            request = io.UpdateWeightFromDiskReqInput(model_path=model_path, load_format=load_format)
            _check_result("update_weights_from_disk", await manager.update_weights_from_disk(request, None))
            return
        from sglang.srt.utils import MultiprocessingSerializer

        named = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        ranks = getattr(getattr(self.engine, "server_args", None), "tp_size", 1)
        request = io.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(named) for _ in range(ranks)],
            load_format=load_format, flush_cache=flush_cache)
        _check_result("update_weights_from_tensor", await manager.update_weights_from_tensor(request, None))

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Free weights and KV cache memory (the engine must be started with ``enable_memory_saver=True``)."""
        io = importlib.import_module("sglang.srt.managers.io_struct")
        result = await self.engine.tokenizer_manager.release_memory_occupation(
            io.ReleaseMemoryOccupationReqInput(tags=tags), None)
        _check_result("release_memory_occupation", result)

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        io = importlib.import_module("sglang.srt.managers.io_struct")
        result = await self.engine.tokenizer_manager.resume_memory_occupation(
            io.ResumeMemoryOccupationReqInput(tags=tags), None)
        _check_result("resume_memory_occupation", result)

    async def flush_cache(self) -> None:
        _check_result("flush_cache", await self.engine.tokenizer_manager.flush_cache())


# --------------------------------------------------------------------------------------------- HTTP servers
class SGLangServerBackend(Backend):
    """Running SGLang servers (``python -m sglang.launch_server``), or one router in front of them, over HTTP.

    Each request goes to the server with the fewest requests in flight (ties in turn). A server that cannot be
    reached (connection refused or reset) is skipped for `retry_cooldown_s` and the request is retried once on
    each other server; a 502/503/504 answer is retried the same way. Any other error answer, and a timeout, fail
    the request with `GenerationError` (a slow request is not re-sent: it may still be running).

    Args:
        urls: one base URL (``"http://host:30000"``) or several; a router's URL works as one server.
        timeout_s: limit for one request (connect, send, generate, read), also for weight updates.
        connect_timeout_s: limit for opening a connection, and for each ``/health`` probe.
        check_health: probe ``GET /health`` on every server before the first request; failure raises
            `BackendError` naming the servers that did not answer.
        admin_urls: where weight-sync calls go (default `urls`); give the workers' URLs when `urls` is a router.
        retry_cooldown_s: how long an unreachable server is passed over.
        max_connections: open connections at most (requests beyond wait for one).
        send_seed: send `SamplingParams.seed` as ``sampling_seed`` (False for SGLang versions without it).
        headers: extra HTTP headers, e.g. ``{"Authorization": "Bearer ..."}`` for servers started with an API key.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        check_health: bool = True,
        admin_urls: Sequence[str] | None = None,
        retry_cooldown_s: float = 5.0,
        max_connections: int = 1024,
        send_seed: bool = True,
        headers: Mapping[str, str] | None = None,
    ):
        self._httpx = _import_httpx()
        self.urls = _clean_urls(urls)
        self.admin_urls = _clean_urls(admin_urls) if admin_urls is not None else list(self.urls)
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError("timeouts must be positive")
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.retry_cooldown_s = retry_cooldown_s
        self.max_connections = max_connections
        self.send_seed = send_seed
        self.headers = dict(headers or {})
        self.in_flight = {url: 0 for url in self.urls}  #: requests outstanding per server
        self._down_until = {url: 0.0 for url in self.urls}
        self._turn = itertools.count()
        self._healthy = not check_health
        self._health_task: asyncio.Task | None = None
        self._client = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ----------------------------------------------------------------------------------------- generation
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> ModelTurn:
        params = params or SamplingParams()
        prompt = check_prompt_ids(prompt_ids)
        if self._closed:
            raise BackendError("this SGLangServerBackend is closed")
        await self._ensure_healthy()
        payload = {"input_ids": prompt, "sampling_params": sglang_sampling_params(params, self.send_seed),
                   "return_logprob": True}
        httpx = self._httpx
        tried: set[str] = set()
        failures: list[str] = []
        while (url := self._pick_server(tried)) is not None:
            tried.add(url)
            self.in_flight[url] += 1
            started = time.perf_counter()
            try:
                response = await self._http().post(f"{url}/generate", json=payload)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                self._mark_down(url)
                failures.append(f"{url}: cannot connect ({type(e).__name__}: {e})")
                continue
            except httpx.TimeoutException as e:
                raise GenerationError(f"{url}/generate timed out after {self.timeout_s:g} s "
                                      f"({type(e).__name__}); raise timeout_s if generations are this long") from e
            except httpx.TransportError as e:  # the connection broke mid-request (server died or restarted)
                self._mark_down(url)
                failures.append(f"{url}: {type(e).__name__}: {e}")
                continue
            finally:
                self.in_flight[url] -= 1
            if response.status_code in _RETRY_STATUSES:
                failures.append(f"{url}: HTTP {response.status_code}: {_error_message(response)}")
                continue
            if response.status_code != 200:
                raise GenerationError(f"{url}/generate answered HTTP {response.status_code}: "
                                      f"{_error_message(response)}")
            try:
                answer = response.json()
            except ValueError as e:
                raise GenerationError(f"{url}/generate answered non-JSON: {response.text[:200]!r}") from e
            generation = generation_from_sglang(answer)
            generation.meta.update(server=url, request_s=time.perf_counter() - started)
            return generation
        raise GenerationError("no SGLang server could take the request: " + "; ".join(failures))

    def _pick_server(self, exclude: set[str]) -> str | None:
        """The reachable server with the fewest requests in flight (ties in turn), or None when all were tried."""
        candidates = [u for u in self.urls if u not in exclude]
        if not candidates:
            return None
        now = time.monotonic()
        reachable = [u for u in candidates if self._down_until[u] <= now] or candidates
        fewest = min(self.in_flight[u] for u in reachable)
        tied = [u for u in reachable if self.in_flight[u] == fewest]
        return tied[next(self._turn) % len(tied)]

    def _mark_down(self, url: str) -> None:
        self._down_until[url] = time.monotonic() + self.retry_cooldown_s

    # ----------------------------------------------------------------------------------------- health
    async def check_health(self) -> None:
        """Probe ``GET /health`` on every server; raise `BackendError` listing those that did not answer 200."""
        problems = await asyncio.gather(*(self._probe(url) for url in self.urls))
        bad = [f"{url}: {problem}" for url, problem in zip(self.urls, problems) if problem]
        if bad:
            raise BackendError(
                f"{len(bad)} of {len(self.urls)} SGLang server(s) are not healthy: " + "; ".join(bad)
                + ". Start each with `python -m sglang.launch_server --model-path ... --port ...` and wait for "
                  "'The server is fired up' (see docs/sglang.md), or check the URLs."
            )
        self._healthy = True

    async def _probe(self, url: str) -> str | None:
        try:
            response = await self._http().get(f"{url}/health", timeout=self.connect_timeout_s)
        except self._httpx.HTTPError as e:
            return f"{type(e).__name__}: {e or 'no answer'}"
        return None if response.status_code == 200 else f"/health answered HTTP {response.status_code}"

    async def _ensure_healthy(self) -> None:
        """Run one health check shared by all requests that arrive before it is done; re-run it after a failure."""
        if self._healthy:
            return
        loop = asyncio.get_running_loop()
        task = self._health_task
        if task is None or task.get_loop() is not loop or task.done():
            task = self._health_task = loop.create_task(self.check_health())
        await asyncio.shield(task)

    # ----------------------------------------------------------------------------------------- weight sync
    async def update_weights(
        self,
        named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
        *,
        model_path: str | None = None,
        load_format: str | None = None,
    ) -> None:
        """Make every server load the checkpoint folder `model_path` (``/update_weights_from_disk``); the folder
        must be readable by the servers (shared storage for several nodes)."""
        if named_tensors is not None:
            raise NotImplementedError(
                "an SGLang server runs in another process and cannot take this process's tensors over HTTP: save a "
                "checkpoint and pass model_path=..., or use SGLangEngineBackend (update_weights_from_tensor)")
        if model_path is None:
            raise ValueError("update_weights needs model_path= (a checkpoint folder the servers can read)")
        body: dict[str, Any] = {"model_path": model_path}
        if load_format is not None:
            body["load_format"] = load_format
        await self._broadcast("/update_weights_from_disk", body)

    async def release_memory(self, tags: list[str] | None = None) -> None:
        """Free weights/KV cache memory on every server (servers need ``--enable-memory-saver``)."""
        await self._broadcast("/release_memory_occupation", {"tags": tags} if tags else {})

    async def resume_memory(self, tags: list[str] | None = None) -> None:
        await self._broadcast("/resume_memory_occupation", {"tags": tags} if tags else {})

    async def flush_cache(self) -> None:
        """Drop every server's prefix cache (SGLang refuses while requests are running)."""
        await self._broadcast("/flush_cache", None)

    async def _broadcast(self, path: str, body: dict | None) -> None:
        problems = await asyncio.gather(*(self._admin_call(url, path, body) for url in self.admin_urls))
        failed = [p for p in problems if p]
        if failed:
            raise BackendError(f"{path} failed on {len(failed)} of {len(self.admin_urls)} server(s): "
                              + "; ".join(failed))

    async def _admin_call(self, url: str, path: str, body: dict | None) -> str | None:
        try:
            response = await self._http().post(url + path, json=body)
        except self._httpx.HTTPError as e:
            return f"{url}: {type(e).__name__}: {e}"
        if response.status_code != 200:
            return f"{url}: HTTP {response.status_code}: {_error_message(response)}"
        try:
            answer = response.json()
        except ValueError:  # /flush_cache answers plain text
            return None
        if isinstance(answer, Mapping) and answer.get("success") is False:
            return f"{url}: {answer.get('message', 'success=false')}"
        return None

    # ----------------------------------------------------------------------------------------- plumbing
    def _http(self):
        """The HTTP client of the running event loop (httpx connection pools belong to one loop)."""
        loop = asyncio.get_running_loop()
        if self._client is None or self._client_loop is not loop:
            self._client = self._httpx.AsyncClient(
                timeout=self._httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s),
                limits=self._httpx.Limits(max_connections=self.max_connections,
                                          max_keepalive_connections=min(self.max_connections, 256)),
                headers=self.headers,
            )
            self._client_loop = loop
        return self._client

    async def close(self) -> None:
        self._closed = True
        client, self._client = self._client, None
        if client is not None and self._client_loop is asyncio.get_running_loop():
            await client.aclose()

    def __repr__(self) -> str:
        return f"SGLangServerBackend({self.urls}, in_flight={self.in_flight})"


# --------------------------------------------------------------------------------------------- helpers
def _import_httpx():
    try:
        return importlib.import_module("httpx")
    except ImportError as e:
        raise ImportError("SGLangServerBackend needs httpx: pip install httpx") from e


def _clean_urls(urls: str | Sequence[str]) -> list[str]:
    if isinstance(urls, str):
        urls = [urls]
    cleaned = [str(u).rstrip("/") for u in urls]
    if not cleaned:
        raise ValueError("give at least one server URL, e.g. 'http://localhost:30000'")
    bad = [u for u in cleaned if not u.startswith(("http://", "https://"))]
    if bad:
        raise ValueError(f"server URLs must start with http:// or https://, got {bad}")
    if len(set(cleaned)) != len(cleaned):
        raise ValueError(f"duplicate server URLs in {cleaned}")
    return cleaned


def _error_message(response) -> str:
    """The message of an error answer: SGLang's ``{"error": {"message"}}``, FastAPI's ``{"detail"}``, or text."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500].strip() or "(empty body)"
    if isinstance(body, Mapping):
        error = body.get("error")
        if isinstance(error, Mapping) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)[:500]


def _check_result(action: str, result: Any) -> None:
    """Raise `BackendError` when an SGLang control call reports failure (tuple, dict or object with `success`)."""
    if result is None:
        return
    if isinstance(result, tuple):
        success, message = (result[0], result[1] if len(result) > 1 else "")
    elif isinstance(result, Mapping):
        success, message = result.get("success", True), result.get("message", "")
    else:
        success, message = getattr(result, "success", True), getattr(result, "message", "")
    if not success:
        raise BackendError(f"SGLang {action} failed: {message}")
