"""Streaming generation through the real server: the decoupled gpt2 model.

The servers here hold only gpt2, and a small GPT-2 (2 layers, hidden 128,
GPT-2's vocabulary and positions, `config_overrides`): GPT-2 small took 0.68 s
per decoding step of 4 requests on this shared two-core CI machine, which
would put this file far over its two-minute budget. The code path is the same;
the oracle is transformers' own greedy `generate` on the same weights. The
initializer range is 0.2 rather than 0.02: a small random GPT-2 at 0.02 repeats
one token forever, which would let a wrong cache or mask pass.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from conftest import server_config
from test_faults import make_repository

from client.api import ClientError
from client.generate import TokenStream, tokens
from opara_core.serving.generation import small_gpt2
from opara_core.serving.launcher import TritonServer

pytestmark = pytest.mark.server

SMALL = "n_layer=2,n_embd=128,n_head=4,initializer_range=0.2"
SMALL_OVERRIDES = {"n_layer": 2, "n_embd": 128, "n_head": 4, "initializer_range": 0.2}


@functools.lru_cache(maxsize=None)
def oracle_model() -> torch.nn.Module:
    lm = small_gpt2(SMALL_OVERRIDES).lm
    lm.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    lm.generation_config.pad_token_id = 0
    return lm


def oracle(prompt: list[int], max_tokens: int, end_id: int | None = None) -> list[int]:
    """transformers' greedy generate, cut after end_id as the server stops there."""
    with torch.inference_mode():
        out = oracle_model().generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
    generated = out[0, len(prompt) :].tolist()
    if end_id is not None and end_id in generated:
        generated = generated[: generated.index(end_id) + 1]
    return generated


@pytest.fixture(scope="module")
def server(tmp_path_factory, admin_key):
    """gpt2 with iteration-level scheduling, and gpt2_request with the
    request-level baseline; both 4 slots of 128 positions and a queue of 6."""
    root = tmp_path_factory.mktemp("generation")
    # fp32 whatever the shipped config says: the oracle is transformers' fp32 greedy generate, and a
    # half-precision decoder may pick another token where two are nearly tied (its own tests are below)
    parameters = {"config_overrides": SMALL, "max_active": "4", "max_context": "128", "max_queue": "6", "precision": "fp32"}
    repository = make_repository(root / "models", {"gpt2": "gpt2", "gpt2_request": "gpt2"}, parameters)
    with open(repository / "gpt2_request" / "config.pbtxt", "a") as config:
        config.write('parameters { key: "scheduling" value: { string_value: "request" } }\n')
    with TritonServer(server_config(repository, exit_timeout_s=15), root / "server.log") as running:
        yield running


def generate(url: str, prompt: list[int], max_tokens: int, end_id: int | None = None, delay_s: float = 0.0, model: str = "gpt2") -> list[int]:
    time.sleep(delay_s)
    with TokenStream(url) as stream:
        stream.send(model, prompt, max_tokens, end_id)
        return [token for _, token in tokens(stream.events)]


def test_greedy_tokens_equal_transformers_generate_for_a_staggered_mixed_batch(server):
    """Ten requests of different prompt and output lengths, sent at staggered
    times so that they join and leave a running batch of at most 4, one with
    an end id: each gets exactly transformers' greedy tokens."""
    rng = np.random.default_rng(7)
    cases = []
    for i in range(9):  # with the next one, 4 generating and 6 waiting at most: none is refused
        prompt = rng.integers(0, 50257, int(rng.integers(1, 24))).tolist()
        cases.append((prompt, int(rng.integers(1, 20)), None, 0.03 * i))
    prompt, full = [11, 22, 33], oracle([11, 22, 33], 12)
    stop = next(k for k in range(2, 12) if full[k] not in full[:k])
    cases.append((prompt, 12, full[stop], 0.05))  # stops after stop + 1 tokens
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda c: generate(server.grpc_url, *c), cases))
    for (prompt, max_tokens, end_id, _), result in zip(cases, results):
        assert result == oracle(prompt, max_tokens, end_id), (prompt, max_tokens, end_id)
    assert len(results[-1]) == stop + 1


def test_tokens_arrive_one_response_at_a_time(server):
    """Streaming, not one answer at the end: the first token arrives well before the last."""
    with TokenStream(server.grpc_url) as stream:
        stream.send("gpt2", [1, 2, 3], 40)
        times = [when for when, _ in tokens(stream.events)]
    assert len(times) == 40 and len(set(times)) > 1


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "problem"),
    [
        ([1, 50257], 4, "position 1"),
        ([], 4, "empty"),
        ([1, 2], 0, "max_tokens"),
        (list(range(100)), 100, "positions"),
    ],
)
def test_bad_requests_get_a_clear_error(server, prompt, max_tokens, problem):
    with pytest.raises(ClientError) as info:
        generate(server.grpc_url, prompt, max_tokens)
    message = str(info.value)
    assert problem in message and "Traceback" not in message, message


KILLED_CLIENT = """
import sys
from client.generate import TokenStream, tokens
stream = TokenStream(sys.argv[1])
stream.send("gpt2", [1, 2, 3, 4], 100)
next(tokens(stream.events))
print("first token", flush=True)
sys.stdin.read()  # until killed
"""


def test_cancelled_and_disconnected_clients_lose_no_other_request(server):
    """Two clients go away mid-stream, one cancelling its stream, one killed
    (its connection drops), beside three requests that must all be answered
    in full. The server retires both at once, long before their 100 tokens,
    and serves new requests afterwards."""
    import subprocess
    import sys

    from opara_core.serving.launcher import REPO_ROOT

    cases = [([5, 6, 7], 20), ([8, 9], 15), ([10], 20)]
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = [pool.submit(generate, server.grpc_url, prompt, n, None, 0.02) for prompt, n in cases]
        stream = TokenStream(server.grpc_url)
        stream.send("gpt2", [1, 2, 3, 4], 100)
        next(tokens(stream.events))
        stream.close(cancel=True)
        killed = subprocess.Popen(
            [sys.executable, "-c", KILLED_CLIENT, server.grpc_url], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        try:
            assert killed.stdout.readline().strip() == "first token"
        finally:
            killed.kill()
            killed.wait(30)
        results = [f.result() for f in futures]
    for (prompt, n), result in zip(cases, results):
        assert result == oracle(prompt, n)
    assert generate(server.grpc_url, [3, 1, 4], 6) == oracle([3, 1, 4], 6)
    retired = re.findall(r"request \d+ cancelled after (\d+) tokens", server.log_tail(2000))
    assert len(retired) == 2 and all(int(n) < 100 for n in retired), retired


def test_overload_gets_a_clear_error_and_the_others_are_served(server):
    """4 slots and a queue of 6: of 16 long requests sent at once, those past
    the queue are refused with 'overloaded' at once; every accepted one is
    answered in full. Each stream is open before any request is sent, and each
    asks for 64 tokens, so that the first four are still generating when the
    last arrives (16 tokens and a stream opened per request raced: on a busy
    two-core machine the first answers ended before the last request came).
    Not more: at its 67th token prompt [1, 2]'s two best logits are 3e-6 apart,
    which a batch of four rows may order either way; over the first 64 every
    prompt here leads by 3.5e-4 or more."""
    cases = [([i + 1, i + 2], 64) for i in range(16)]
    results: list = [None] * len(cases)
    all_open = threading.Barrier(len(cases))

    def one(i: int) -> None:
        try:
            with TokenStream(server.grpc_url) as stream:
                all_open.wait(60)
                stream.send("gpt2", *cases[i])
                results[i] = [token for _, token in tokens(stream.events)]
        except ClientError as error:
            results[i] = error

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    refused = [r for r in results if isinstance(r, ClientError)]
    assert refused and all("overloaded" in str(r) and "queue limit 6" in str(r) for r in refused)
    served = [(c, r) for c, r in zip(cases, results) if not isinstance(r, ClientError)]
    assert len(served) >= 4 + 6
    for (prompt, n), result in served:
        assert result == oracle(prompt, n)


def test_the_load_generator_keeps_each_error_with_its_own_request(server):
    """The load generator's requests share one channel: 16 long requests at
    once (arrivals 1 ms apart) against 4 slots and a queue of 6. Each outcome
    is either that request's own refusal or all of its tokens; nothing lost."""
    from client.generate import LoadConfig, run_load

    config = LoadConfig(model="gpt2", url=server.grpc_url, rate=1000, requests=16, prompt_len=(2, 4), output_len=(16, 16), vocab=100, timeout_s=60)
    result = run_load(config)
    assert len(result.outcomes) == 16
    served = [o for o in result.outcomes if o.error is None]
    assert len(served) >= 4 + 6 and all(o.tokens == 16 and o.ttft_s <= o.latency_s for o in served)
    assert all("overloaded" in o.error and o.tokens == 0 for o in result.outcomes if o.error is not None)
    assert result.summary()["errors"] == 16 - len(served)


def long_then_short(url: str, model: str) -> tuple[list[tuple[float, int]], list[tuple[float, int]]]:
    """A long request, and a short one sent once the long one's first token is
    in: (time, token) of each."""
    with TokenStream(url) as long, TokenStream(url) as short:
        long.send(model, [1, 2, 3], 60)
        long_events = tokens(long.events)
        long_got = [next(long_events)]
        short.send(model, [4, 5], 3)
        short_got = list(tokens(short.events))
        long_got += list(long_events)
    assert [t for _, t in long_got] == oracle([1, 2, 3], 60)
    assert [t for _, t in short_got] == oracle([4, 5], 3)
    return long_got, short_got


def test_iteration_level_a_late_short_request_joins_and_leaves_before_the_long_one(server):
    long_got, short_got = long_then_short(server.grpc_url, "gpt2")
    assert short_got[-1][0] < long_got[-1][0]


def test_request_level_baseline_makes_a_late_request_wait_for_the_whole_batch(server):
    """The baseline: nobody joins a running batch; the tokens are still exactly the oracle's.
    The short request's first token comes after the long one's 30th of 60: a short
    request that joined would have its first token about when the long one had its
    second. Not the last two: they and the short one's first leave within a step,
    on two streams whose arrival order the client does not fix (fresh-clone CI runs
    read the short one's first 0.17 ms before the long one's last and 0.33 ms before
    its next-to-last)."""
    long_got, short_got = long_then_short(server.grpc_url, "gpt2_request")
    assert short_got[0][0] > long_got[len(long_got) // 2][0]


def test_http_generate_stream_streams_the_same_tokens(server):
    """Triton 2.51's HTTP generate_stream endpoint (server-sent events) works
    with the decoupled model: one event per token, errors as an error event."""
    import json
    import urllib.request

    import urllib.error

    def events(body: dict) -> tuple[int, list[dict]]:
        request = urllib.request.Request(
            f"http://{server.http_url}/v2/models/gpt2/generate_stream", data=json.dumps(body).encode(), method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                status, text = response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            status, text = error.code, error.read().decode()
        return status, [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: ")]

    status, got = events({"input_ids": [1, 2, 3], "max_tokens": 7})
    streamed = [token for e in got for token in np.atleast_1d(e["output_ids"]).tolist()]  # one or more per event
    assert status == 200 and streamed == oracle([1, 2, 3], 7)
    status, refused = events({"input_ids": [1, 2, 3], "max_tokens": 0})
    assert status == 400 and len(refused) == 1 and "max_tokens" in refused[0]["error"]


def test_the_client_cli_streams_tokens_and_runs_a_load(server, tmp_path):
    import json
    import subprocess
    import sys

    from opara_core.serving.launcher import REPO_ROOT

    def cli(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "client", "generate", "--model", "gpt2", "--url", server.grpc_url, *args]
        return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)

    one = cli("--ids", "1,2,3", "--max-tokens", "6")
    assert one.returncode == 0, one.stderr
    assert one.stdout.split("\n")[0].split() == [str(t) for t in oracle([1, 2, 3], 6)]
    load = cli("--rate", "20", "--requests", "8", "--prompt-len", "2,6", "--output-len", "2,6", "--json", str(tmp_path / "load.json"))
    assert load.returncode == 0, load.stderr
    report = json.loads((tmp_path / "load.json").read_text())
    assert report["summary"]["requests"] == 8 and report["summary"]["errors"] == 0
    assert all(r["tokens"] == r["max_tokens"] for r in report["requests"])
    bad = cli("--ids", "1,2", "--max-tokens", "500")
    assert bad.returncode == 1 and bad.stderr.startswith("error:") and "positions" in bad.stderr


def loop_counts(server) -> dict[str, float]:
    """gpt2's opara_generation_*_total counters, as "stage" or "kind" -> value."""
    import urllib.request

    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    counts = {}
    for labels, value in re.findall(r"^opara_generation_(?:seconds|events)_total\{(.*)\} (\S+)$", text, re.M):
        named = dict(re.findall(r'(\w+)="(\w*)"', labels))
        if named["model"] == "gpt2":
            counts[named.get("stage") or named["kind"]] = float(value)
    return counts


def test_the_loop_counts_its_iterations_and_where_their_time_goes(server):
    """One request of 12 tokens: the counters (pushed by a timer) grow by at
    least its prefill, its 11 decoded rows in as many iterations, its 12
    tokens and at least 2 responses (tokens, merged or not, and the final
    one); every stage is there."""
    before = loop_counts(server)
    assert generate(server.grpc_url, [2, 7, 1, 8], 12) == oracle([2, 7, 1, 8], 12)
    deadline = time.monotonic() + 10
    grew = {}
    while time.monotonic() < deadline:
        after = loop_counts(server)
        grew = {name: after[name] - before.get(name, 0.0) for name in after}
        if grew.get("tokens", 0) >= 12 and grew.get("responses", 0) >= 2:
            break
        time.sleep(0.1)  # polling for the pushed counts
    assert grew["tokens"] >= 12 and grew["responses"] >= 2 and grew["prefills"] >= 1 and grew["rows"] >= 11 and grew["iterations"] >= 11, grew
    assert {"prefill", "step", "drain", "respond", "send", "probe"} <= set(after), sorted(after)
    assert grew["step"] > 0 and grew["send"] > 0, grew


# --- the model's parameters (no server) --------------------------------------------------------


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no native bf16: it decodes in fp32")
def test_a_bf16_decoder_is_held_to_its_logits_and_decodes_in_fp32_beyond_its_tolerance():
    from opara_core.serving.generation import GenerationSettings, decoder_in_precision

    lm, cpu = small_gpt2(SMALL_OVERRIDES).lm, torch.device("cpu")
    settings = GenerationSettings(max_active=2, max_context=64)
    decoder, used, accuracy, why = decoder_in_precision(lm, settings, cpu, "bf16", "auto")
    assert used == "bf16" and not why and decoder.keys.dtype == torch.bfloat16
    assert 0 < accuracy.error <= accuracy.tolerance
    assert 0 <= decoder.prefill(0, [5, 6, 7]) < lm.config.vocab_size
    decoder, used, accuracy, why = decoder_in_precision(lm, settings, cpu, "bf16", 1e-9)
    assert used == "fp32" and accuracy is None and why.endswith("decoding in fp32") and decoder.keys.dtype == torch.float32
    assert decoder.prefill(0, [5, 6, 7]) == oracle([5, 6, 7], 1)[0], "fp32 decodes as transformers does"
    assert lm.transformer.wte.weight.dtype == torch.float32


@pytest.mark.gpu
def test_on_a_gpu_a_bf16_decoder_captures_its_graphs_within_tolerance():
    from opara_core.serving.generation import GenerationSettings, decoder_in_precision

    lm, gpu = small_gpt2(SMALL_OVERRIDES).lm, torch.device("cuda")
    decoder, used, accuracy, why = decoder_in_precision(lm, GenerationSettings(max_active=4, max_context=128), gpu, "bf16", "auto")
    assert used == "bf16" and not why and accuracy.error <= accuracy.tolerance
    assert all(bucket.graph is not None for bucket in decoder.buckets) and decoder.keys.dtype == torch.bfloat16
    first = decoder.prefill(0, [5, 6, 7])
    assert 0 <= decoder.step([0], [first], [3])[0] < lm.config.vocab_size


def test_parameters_parse_and_bad_ones_are_named():
    from opara_core.serving.generation import GenerationSettings, graph_buckets, prefill_shapes, step_spans

    settings = GenerationSettings.from_parameters({"scheduling": "request", "max_active": "3", "config_overrides": "n_layer=2,initializer_range=0.2"})
    assert settings.scheduling == "request" and settings.limits().kv_tokens == 3 * settings.max_context
    assert settings.overrides() == {"n_layer": 2, "initializer_range": 0.2}
    assert GenerationSettings().cuda_graphs is True and GenerationSettings.from_parameters({"merge_tokens": "false"}).merge_tokens is False
    for params, problem in (
        ({"max_slots": "3"}, "unknown parameters ['max_slots'] for a generation model; known: admit_every, config_overrides, "),
        ({"buckets": "1,2"}, "unknown parameters ['buckets'] for a generation model"),  # a batch model's
        ({"max_active": "many"}, "parameter max_active is 'many'; allowed: an integer >= 1"),
        ({"max_active": "0"}, "parameter max_active is '0'; allowed: an integer >= 1"),
        ({"scheduling": "orca"}, "parameter scheduling is 'orca'; allowed: iteration, request"),
        ({"config_overrides": "n_layer"}, "expected key=number"),
        ({"sender_threads": "0"}, "parameter sender_threads is '0'; allowed: an integer >= 1"),
        ({"switch_interval_us": "-5"}, "parameter switch_interval_us is '-5'; allowed: an integer >= 0"),
        ({"merge_tokens": "2"}, "parameter merge_tokens is '2'; allowed: true, false"),
        ({"merge_tokens": "0"}, "parameter merge_tokens is '0'; allowed: true, false"),  # one spelling of a boolean
        ({"cuda_graphs": "yes"}, "parameter cuda_graphs is 'yes'; allowed: true, false"),
        ({"admit_every": "0"}, "parameter admit_every is '0'; allowed: an integer >= 1"),
    ):
        with pytest.raises(ValueError, match=re.escape(problem)):
            GenerationSettings.from_parameters(params)
    assert graph_buckets(1) == (1,) and graph_buckets(12) == (1, 2, 4, 8, 12)
    assert prefill_shapes(2, 48) == ((1, 16), (1, 32), (1, 48), (2, 16), (2, 32), (2, 48))
    assert step_spans(512) == (64, 128, 256, 512) and step_spans(100) == (64, 100) and step_spans(40) == (40,)


def test_an_idle_generator_logs_no_statistics_line():
    """Idle, the loop still counts an iteration each time its wait for a request
    times out, and the senders' probing time grows: neither is work worth a line."""
    from opara_core.serving.generation import worked

    before = {"events:iterations": 10, "events:rows": 5, "events:prefills": 1, "events:responses": 6, "events:tokens": 6, "seconds:probe": 0.1}
    idle = {**before, "events:iterations": 30, "seconds:probe": 0.2}
    assert not worked(before, idle)
    for event in ("events:rows", "events:prefills", "events:responses"):
        assert worked(before, {**idle, event: before[event] + 1}), event


# --- the responder's merging, with a response sender that stalls (no server) ---------------------


class StallingSender:
    """A response sender whose first send blocks until released: a transport
    that falls behind, on demand. Records what each response carried."""

    def __init__(self) -> None:
        self.sent: list[tuple[list[int] | None, int]] = []
        self.first = threading.Event()
        self.release = threading.Event()

    def send(self, response=None, flags: int = 0) -> None:
        self.sent.append((response, flags))
        if len(self.sent) == 1:
            self.first.set()
            self.release.wait(10)

    def is_cancelled(self) -> bool:
        return False


class BackendUtils:
    """The parts of triton_python_backend_utils the responder calls."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        @staticmethod
        def from_dlpack(name: str, tensor) -> list[int]:
            return torch.from_dlpack(tensor).tolist()

    @staticmethod
    def InferenceResponse(output_tensors: list, error=None) -> list[int] | None:
        return output_tensors[0] if output_tensors else None


@pytest.mark.parametrize(("merge", "responses"), [(True, [[5], [6, 7, 8]]), (False, [[5], [6], [7], [8]])])
def test_a_stream_whose_sender_is_behind_gets_its_waiting_tokens_in_one_response(merge, responses):
    """Token 5 goes out and its send stalls; tokens 6-8 and the end come
    meanwhile: merged, they go out as one response; unmerged, one each. Either
    way in order, then the final response."""
    from opara_core.planning.iteration import Sequence
    from opara_core.serving.generation import Responder, Stream

    gone = []
    responder = Responder(BackendUtils, 1, gone.append, merge=merge)
    sender = StallingSender()
    try:
        responder.open(Stream(Sequence(0, 3, 4), [1, 2, 3], sender, request=None))
        responder.token(0, 5)
        assert sender.first.wait(10)
        for token in (6, 7, 8):
            responder.token(0, token)
        responder.close(0)
        sender.release.set()
        responder.drain()
    finally:
        responder.stop()
    assert [carried for carried, _ in sender.sent] == [*responses, None]
    assert [flags for _, flags in sender.sent] == [0] * len(responses) + [BackendUtils.TRITONSERVER_RESPONSE_COMPLETE_FINAL]
    assert not gone and responder.stats[0]["tokens"] == 4 and responder.stats[0]["responses"] == len(responses) + 1
