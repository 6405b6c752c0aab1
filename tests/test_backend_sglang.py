"""SGLang backends without SGLang: request/response translation against the shapes SGLang documents (see the
docstring of `agents.sglang_backend`), a real HTTP server on localhost that answers like ``sglang.launch_server``,
and a fake in-process engine. A live test runs when sglang and a CUDA GPU are both present."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from agents.backend import BackendError, GenerationError, SamplingParams
from agents.sglang_backend import (
    SGLangEngineBackend,
    SGLangServerBackend,
    generation_from_sglang,
    sglang_sampling_params,
)


def run(coro, timeout: float = 20):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def fake_generate(input_ids: list[int], sampling: dict) -> dict:
    """What a toy model behind SGLang's native /generate answers: token i is last prompt id + i + 1 (mod 1000),
    with logprob -0.1 * (i + 1); stops after a stop token (kept) or at max_new_tokens."""
    ids, stop = [], set(sampling.get("stop_token_ids") or [])
    finish = {"type": "length", "length": sampling["max_new_tokens"]}
    for i in range(sampling["max_new_tokens"]):
        ids.append((input_ids[-1] + i + 1) % 1000)
        if ids[-1] in stop:
            finish = {"type": "stop", "matched": ids[-1]}
            break
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "id": "req-1", "finish_reason": finish, "prompt_tokens": len(input_ids), "completion_tokens": len(ids),
            "cached_tokens": 0, "e2e_latency": 0.01,
            "output_token_logprobs": [[-0.1 * (i + 1), t, None] for i, t in enumerate(ids)],
        },
    }


class FakeSGLangServer:
    """A localhost HTTP server answering like ``python -m sglang.launch_server``'s native API."""

    def __init__(self, delay_s: float = 0.0, status: int = 200, error: str = "bad request"):
        self.delay_s, self.status, self.error = delay_s, status, error
        self.calls: list[tuple[str, dict | None]] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()

    def generate_calls(self) -> list[dict]:
        return [body for path, body in self.calls if path == "/generate"]

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body):
                data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if isinstance(body, str) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                fake.calls.append((self.path, None))
                self._reply(200, "") if self.path == "/health" else self._reply(404, {"detail": "Not Found"})

            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                fake.calls.append((self.path, body))
                if self.path == "/generate":
                    with fake.lock:
                        fake.in_flight += 1
                        fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                    time.sleep(fake.delay_s)
                    with fake.lock:
                        fake.in_flight -= 1
                    if fake.status != 200:
                        return self._reply(fake.status, {"error": {"message": fake.error}})
                    return self._reply(200, fake_generate(body["input_ids"], body["sampling_params"]))
                if self.path == "/update_weights_from_disk":
                    ok = "missing" not in body["model_path"]
                    message = "Succeeded to update model weights." if ok else "Failed to get weights iterator"
                    return self._reply(200 if ok else 400,
                                       {"success": ok, "message": message, "num_paused_requests": 0})
                if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                    return self._reply(200, "")
                if self.path == "/flush_cache":
                    return self._reply(200, "Cache flushed.\nPlease check backend logs for more details.\n")
                self._reply(404, {"detail": "Not Found"})

        return Handler


@pytest.fixture
def servers():
    made: list[FakeSGLangServer] = []

    def make(**kwargs) -> FakeSGLangServer:
        made.append(FakeSGLangServer(**kwargs))
        return made[-1]

    yield make
    for s in made:
        s.stop()


def dead_url() -> str:
    """A localhost URL where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# ------------------------------------------------------------------------------------------------- translation
def test_sampling_params_are_sent_explicitly():
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=20, max_new_tokens=7, stop_token_ids=(5, 6), seed=3)
    assert sglang_sampling_params(params) == {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20,
                                              "stop_token_ids": [5, 6], "sampling_seed": 3}
    assert "sampling_seed" not in sglang_sampling_params(params, send_seed=False)
    assert sglang_sampling_params(SamplingParams(temperature=0)) == {"max_new_tokens": 512, "temperature": 0,
                                                                     "top_p": 1.0, "top_k": -1}


def test_documented_answer_becomes_a_generation():
    g = generation_from_sglang(fake_generate([1, 2, 9], {"max_new_tokens": 5, "stop_token_ids": [12]}))
    assert g.ids == [10, 11, 12] and g.ids[-1] == 12  # the matched stop token is kept
    assert g.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert g.finish_reason == "stop" and g.meta["finish"] == {"type": "stop", "matched": 12}
    assert g.meta["prompt_tokens"] == 3 and g.meta["completion_tokens"] == 3
    length = generation_from_sglang([fake_generate([1], {"max_new_tokens": 4})])  # a one-element batch answer
    assert length.finish_reason == "length" and len(length.ids) == 4


def test_abort_and_answers_without_output_ids():
    answer = {"text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "Abort before prefill"},
                                        "output_token_logprobs": [[-1.5, 7, None]]}}
    g = generation_from_sglang(answer)
    assert (g.ids, g.logprobs, g.finish_reason) == ([7], [-1.5], "abort")


@pytest.mark.parametrize("answer, message", [
    ({"text": "hi"}, "meta_info"),
    ({"meta_info": {"finish_reason": {"type": "stop"}}}, "return_logprob"),
    ({"output_ids": [1, 3], "meta_info": {"finish_reason": {"type": "stop"},
                                          "output_token_logprobs": [[-1.0, 1, None], [-1.0, 2, None]]}}, "disagree"),
    ({"meta_info": {"finish_reason": {"type": "eos"}, "output_token_logprobs": []}}, "finish_reason"),
    ({"meta_info": {"finish_reason": None, "output_token_logprobs": []}}, "finish_reason"),
    ({"meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": [[None, 3, None]]}}, "entries"),
])
def test_malformed_answers_fail_clearly(answer, message):
    with pytest.raises(GenerationError, match=message):
        generation_from_sglang(answer)


# ------------------------------------------------------------------------------------------------- HTTP servers
def test_generate_posts_the_native_request_and_translates_the_answer(servers):
    server = servers()
    params = SamplingParams(temperature=0.7, max_new_tokens=6, stop_token_ids=(43,), seed=11)

    async def main():
        async with SGLangServerBackend(server.url) as backend:
            return await backend.generate([40, 41, 40], params), await backend.generate([7], params)

    stopped, length = run(main())
    assert server.calls[0] == ("/health", None)  # health check before the first request
    assert server.generate_calls()[0] == {"input_ids": [40, 41, 40], "return_logprob": True,
                                          "sampling_params": sglang_sampling_params(params)}
    assert stopped.ids == [41, 42, 43] and stopped.finish_reason == "stop"
    assert length.ids == [8, 9, 10, 11, 12, 13] and length.finish_reason == "length"
    assert len(length.logprobs) == 6 and stopped.meta["server"] == server.url


def test_requests_spread_over_servers_by_least_in_flight(servers):
    a, b = servers(delay_s=0.2), servers(delay_s=0.2)

    async def main():
        async with SGLangServerBackend([a.url, b.url]) as backend:
            gens = await asyncio.gather(*(backend.generate([i], SamplingParams(max_new_tokens=2)) for i in range(8)))
            return gens, dict(backend.in_flight)

    gens, in_flight_after = run(main())
    assert [g.ids for g in gens] == [[i + 1, i + 2] for i in range(8)]
    assert len(a.generate_calls()) == len(b.generate_calls()) == 4
    assert a.max_in_flight == b.max_in_flight == 4  # concurrent, not one by one
    assert set(in_flight_after.values()) == {0}


def test_unhealthy_server_is_reported_at_start(servers):
    live, dead = servers(), dead_url()

    async def main():
        async with SGLangServerBackend([live.url, dead], connect_timeout_s=2) as backend:
            await backend.generate([1], SamplingParams(max_new_tokens=1))

    with pytest.raises(BackendError, match=f"1 of 2 SGLang server.*{dead}.*launch_server"):
        run(main())
    assert live.generate_calls() == []


def test_unreachable_server_is_skipped_and_requests_retried_elsewhere(servers):
    live, dead = servers(), dead_url()

    async def main():
        async with SGLangServerBackend([dead, live.url], check_health=False, connect_timeout_s=2) as backend:
            return await asyncio.gather(*(backend.generate([i], SamplingParams(max_new_tokens=1)) for i in range(6)))

    gens = run(main())
    assert [g.ids for g in gens] == [[i + 1] for i in range(6)]
    assert all(g.meta["server"] == live.url for g in gens)
    assert len(live.generate_calls()) == 6


def test_no_reachable_server_is_a_clear_error():
    async def main():
        async with SGLangServerBackend([dead_url(), dead_url()], check_health=False, connect_timeout_s=2) as backend:
            await backend.generate([1], SamplingParams(max_new_tokens=1))

    with pytest.raises(GenerationError, match="no SGLang server could take the request.*cannot connect"):
        run(main())


def test_timeout_is_a_clear_error(servers):
    slow = servers(delay_s=3)

    async def main():
        async with SGLangServerBackend(slow.url, timeout_s=0.3) as backend:
            await backend.generate([1], SamplingParams(max_new_tokens=1))

    with pytest.raises(GenerationError, match="timed out after 0.3 s"):  # raised by the timeout, not the answer
        run(main())


def test_error_answer_carries_the_server_message_and_is_not_retried(servers):
    failing = servers(status=400, error="Input length (40000 tokens) exceeds the maximum allowed length")
    other = servers()

    async def main():
        async with SGLangServerBackend([failing.url, other.url], check_health=False) as backend:
            await backend.generate([1], SamplingParams(max_new_tokens=1))

    with pytest.raises(GenerationError, match="HTTP 400: Input length"):
        run(main())
    assert other.generate_calls() == []


def test_overloaded_server_answer_is_retried_on_another(servers):
    overloaded, other = servers(status=503, error="server overloaded"), servers()

    async def main():
        async with SGLangServerBackend([overloaded.url, other.url], check_health=False) as backend:
            return await backend.generate([1], SamplingParams(max_new_tokens=2))

    assert run(main()).ids == [2, 3]
    assert len(overloaded.generate_calls()) == 1 and len(other.generate_calls()) == 1


def test_weight_sync_calls_reach_every_server(servers):
    a, b = servers(), servers()

    async def main():
        async with SGLangServerBackend([a.url, b.url], check_health=False) as backend:
            await backend.update_weights(model_path="/ckpt/step-10")
            await backend.release_memory()
            await backend.resume_memory(tags=["weights"])
            await backend.flush_cache()
            with pytest.raises(BackendError, match="update_weights_from_disk failed on 2 of 2.*Failed to get weights"):
                await backend.update_weights(model_path="/ckpt/missing")
            with pytest.raises(NotImplementedError, match="model_path"):
                await backend.update_weights({"w": torch.zeros(1)})

    run(main())
    for server in (a, b):
        assert server.calls[:4] == [("/update_weights_from_disk", {"model_path": "/ckpt/step-10"}),
                                    ("/release_memory_occupation", {}),
                                    ("/resume_memory_occupation", {"tags": ["weights"]}),
                                    ("/flush_cache", None)]


def test_bad_urls_and_prompts_are_rejected():
    with pytest.raises(ValueError, match="http://"):
        SGLangServerBackend("localhost:30000")
    with pytest.raises(ValueError, match="at least one"):
        SGLangServerBackend([])

    async def main():
        async with SGLangServerBackend("http://127.0.0.1:1", check_health=False) as backend:
            await backend.generate([], SamplingParams())

    with pytest.raises(ValueError, match="empty"):
        run(main())


# ------------------------------------------------------------------------------------------------- engine
class FakeEngine:
    """Has `sglang.Engine.async_generate`'s signature and answers like it (one dict per prompt)."""

    def __init__(self):
        self.calls: list[dict] = []
        self.shut_down = False

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False, **kw):
        self.calls.append(dict(input_ids=input_ids, sampling_params=sampling_params, return_logprob=return_logprob))
        if len(input_ids) > 50:
            raise ValueError("The input (51 tokens) is longer than the model's context length (50 tokens).")
        await asyncio.sleep(0)
        return fake_generate(input_ids, sampling_params)

    def shutdown(self):
        self.shut_down = True


def test_engine_backend_calls_async_generate_with_ids():
    engine = FakeEngine()
    params = SamplingParams(temperature=0, max_new_tokens=3)

    async def main():
        async with SGLangEngineBackend(engine=engine) as backend:
            g = await backend.generate([4, 5], params)
            with pytest.raises(GenerationError, match="context length"):
                await backend.generate(list(range(51)), params)
            return g

    g = run(main())
    assert engine.calls[0] == {"input_ids": [4, 5], "return_logprob": True,
                               "sampling_params": sglang_sampling_params(params)}
    assert (g.ids, g.finish_reason) == ([6, 7, 8], "length")
    assert not engine.shut_down  # an engine passed in belongs to the caller


def test_missing_sglang_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # makes `import sglang` fail even where it is installed
    with pytest.raises(ImportError, match=r'pip install "mt-env\[sglang\]"'):
        SGLangEngineBackend("Qwen/Qwen2.5-0.5B-Instruct")


# ------------------------------------------------------------------------------------------------- live
LIVE = importlib.util.find_spec("sglang") is not None and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not LIVE, reason="live SGLang test: needs the sglang package (pip install \"mt-env[sglang]\") "
                                     "and a CUDA GPU")
def test_live_engine_generates_like_the_hf_model(tmp_path):
    """A real SGLang engine on a tiny random Qwen2 saved to disk: shapes, stop handling, logprobs close to the
    HF model's (bf16 tolerance), weight update from tensors and cache flush."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=512, max_position_embeddings=2048)
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    prompt = [3, 14, 15, 92, 65]

    def hf_logprobs(ids):
        with torch.no_grad():
            logits = model.float()(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
        return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1).tolist()

    async def main():
        backend = SGLangEngineBackend(str(tmp_path), dtype="bfloat16", mem_fraction_static=0.2, random_seed=0,
                                    disable_cuda_graph=True, log_level="error")
        try:
            greedy = await backend.generate(prompt, SamplingParams(temperature=0, max_new_tokens=8))
            k = next((i for i in range(1, 8) if greedy.ids[i] not in greedy.ids[:i]), None)
            stopped = None
            if k is not None:
                stopped = await backend.generate(prompt, SamplingParams(temperature=0, max_new_tokens=8,
                                                                       stop_token_ids=(greedy.ids[k],)))
            new_head = torch.randn_like(model.lm_head.weight) * 0.5
            await backend.update_weights({"lm_head.weight": new_head})
            await backend.flush_cache()
            updated = await backend.generate(prompt, SamplingParams(temperature=0, max_new_tokens=8))
            return greedy, k, stopped, updated, new_head
        finally:
            await backend.close()

    greedy, k, stopped, updated, new_head = asyncio.run(main())
    assert len(greedy.ids) == len(greedy.logprobs) == 8 and greedy.finish_reason == "length"
    assert greedy.logprobs == pytest.approx(hf_logprobs(greedy.ids), abs=0.1)
    if k is not None:
        assert stopped.ids == greedy.ids[:k + 1] and stopped.finish_reason == "stop"
    with torch.no_grad():
        model.lm_head.weight.copy_(new_head)
    assert updated.logprobs == pytest.approx(hf_logprobs(updated.ids), abs=0.1)
