"""Generate over gRPC: one server with a tiny random-weight Llama (it only generates) and MiniLM (it cannot).

Streams equal transformers' greedy tokens and their text; seeds reproduce; stop strings, max_tokens and
EOS end streams with the right finish reason; a cancelled or expired stream gives its KV blocks back at
once (ListModels' kv_cache); bad input is INVALID_ARGUMENT with a message.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from tests.helpers.client import RPC_TIMEOUT_S, inference_stub
from tests.helpers.inprocess import in_process_server
from tests.helpers.models import build_tiny_generator
from tests.helpers.processes import named_worker_pid, wait_for

GEN, EMBEDDER = "tiny-llama", "minilm"
PROMPT = "The quick brown fox jumps over the lazy dog"
# transformers' greedy output includes this many tokens before the token the model's EOS is set to.
EOS_AT = 5


def _pb():
    from embedserv.v1 import embedserv_pb2 as pb

    return pb


def _reference(model_dir, prompt: str, max_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids, transformers' greedy new ids) with EOS switched off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), attn_implementation="eager").float().eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=None,
        )
    return ids[0].tolist(), out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def generator_dir(tmp_path_factory):
    """The tiny Llama, with its EOS set to the greedy output's token at EOS_AT (first occurrence there)."""
    model_dir = build_tiny_generator(tmp_path_factory.mktemp("e2e-generate"), "llama", seed=5)
    prompt_ids, greedy = _reference(model_dir, PROMPT, 40)
    eos = next(t for i, t in enumerate(greedy) if i >= EOS_AT and t not in greedy[:i])
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text())
    config["eos_token_id"] = eos
    path.write_text(json.dumps(config))
    return model_dir, prompt_ids, greedy, eos


@pytest.fixture(scope="module")
def served(generator_dir, bundled_dir):
    """(stub, server handle). In this process, but with worker processes: the last test kills one."""
    args = [
        "--dtype",
        "float32",
        "--model",
        str(generator_dir[0]),
        "--served-model-name",
        GEN,
        "--model",
        str(bundled_dir),
        "--served-model-name",
        EMBEDDER,
    ]
    with in_process_server(args, worker_processes=True) as (target, proc):
        with grpc.insecure_channel(target) as channel:
            yield inference_stub(channel), proc


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def _generate(stub, **fields):
    pb = _pb()
    return list(stub.Generate(pb.GenerateRequest(model=GEN, prompt=PROMPT, **fields), timeout=RPC_TIMEOUT_S))


def _ids(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def _text(responses) -> str:
    return "".join(r.text for r in responses)


def _kv_cache(stub):
    pb = _pb()
    models = {m.name: m for m in stub.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT_S).models}
    return models[GEN].kv_cache


def test_greedy_stream_equals_transformers(server, generator_dir):
    from transformers import AutoTokenizer

    pb = _pb()
    model_dir, prompt_ids, greedy, _ = generator_dir
    responses = _generate(server, max_tokens=30, ignore_eos=True)
    assert _ids(responses) == greedy[:30]
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    last = responses[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt_ids), 30)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    full = tokenizer.decode(prompt_ids + greedy[:30], skip_special_tokens=True)
    prompt_text = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    assert full.startswith(prompt_text)
    assert _text(responses) == full[len(prompt_text) :]


def test_eos_ends_the_stream_unless_ignored(server, generator_dir):
    pb = _pb()
    _, _, greedy, eos = generator_dir
    responses = _generate(server, max_tokens=30)
    until = greedy.index(eos) + 1
    assert _ids(responses) == greedy[:until]
    assert responses[-1].finish_reason == pb.FINISH_REASON_EOS
    assert responses[-1].usage.completion_tokens == until
    assert _generate(server, max_tokens=30, ignore_eos=True)[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_stop_string_ends_the_text_just_before_it(server):
    pb = _pb()
    text = _text(_generate(server, max_tokens=30, ignore_eos=True))
    words = text.split()
    stop = words[len(words) // 2]
    responses = _generate(server, max_tokens=30, ignore_eos=True, stop=["never appears", stop])
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP
    assert _text(responses) == text[: text.index(stop)]
    assert len(_ids(responses)) < 30


def test_seeded_sampling_is_reproducible(server):
    sampled = dict(max_tokens=20, ignore_eos=True, temperature=1.0, top_p=0.95, top_k=200)
    first = _ids(_generate(server, seed=7, **sampled))
    assert _ids(_generate(server, seed=7, **sampled)) == first
    assert _ids(_generate(server, seed=8, **sampled)) != first


def test_cancelled_stream_frees_its_blocks(server):
    pb = _pb()
    assert _kv_cache(server).used_blocks == 0
    call = server.Generate(
        pb.GenerateRequest(model=GEN, prompt=PROMPT * 3, max_tokens=400, ignore_eos=True), timeout=RPC_TIMEOUT_S
    )
    for _ in range(3):
        next(call)
    assert _kv_cache(server).used_blocks > 0
    call.cancel()
    _wait_for_free_blocks(server)


def test_expired_deadline_frees_blocks(server):
    pb = _pb()
    request = pb.GenerateRequest(model=GEN, prompt=PROMPT * 3, max_tokens=400, ignore_eos=True)
    with pytest.raises(grpc.RpcError) as err:
        list(server.Generate(request, timeout=0.3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_for_free_blocks(server)


def _wait_for_free_blocks(stub, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while _kv_cache(stub).used_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _kv_cache(stub).used_blocks == 0


def test_list_models_reports_generation(server):
    pb = _pb()
    models = {m.name: m for m in server.ListModels(pb.ListModelsRequest(), timeout=RPC_TIMEOUT_S).models}
    assert list(models[GEN].tasks) == [pb.TASK_GENERATE]
    assert models[GEN].kv_cache.block_size == 16 and models[GEN].kv_cache.total_blocks > 0
    assert not models[EMBEDDER].HasField("kv_cache")


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(max_tokens=0), "max_tokens must be at least 1"),
        (dict(temperature=-0.5), "temperature must be 0"),
        (dict(top_p=1.5), "top_p must be in (0, 1]"),
        (dict(top_p=-0.1), "top_p must be in (0, 1]"),
        (dict(max_tokens=600), "more than the model's context of 512 tokens"),
        (dict(stop=[""]), "stop strings must not be empty"),
        (dict(model=EMBEDDER), "cannot serve Generate; it serves: embed, embed_multi_vector, rerank"),
    ],
)
def test_bad_generate_requests_are_invalid_argument(server, fields, message):
    pb = _pb()
    request = dict(model=GEN, prompt=PROMPT, max_tokens=5) | fields
    with pytest.raises(grpc.RpcError) as err:
        list(server.Generate(pb.GenerateRequest(**request), timeout=RPC_TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_unknown_model_is_not_found(server):
    pb = _pb()
    with pytest.raises(grpc.RpcError) as err:
        list(server.Generate(pb.GenerateRequest(model="nope", prompt=PROMPT, max_tokens=5), timeout=RPC_TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def _generator_worker(proc) -> int | None:
    return named_worker_pid(proc.pid, proc.log_path, f"{GEN}/0")


def test_a_stream_whose_worker_dies_ends_unavailable_and_the_model_comes_back(served, generator_dir):
    """Runs last: it kills the generator's worker. The stream fails UNAVAILABLE (its KV cache is gone), a
    new worker replaces the old one, and Generate then answers as before."""
    stub, proc = served
    pb = _pb()
    victim = _generator_worker(proc)
    assert victim is not None
    request = pb.GenerateRequest(model=GEN, prompt=PROMPT, max_tokens=480, ignore_eos=True)
    stream = stub.Generate(request, timeout=RPC_TIMEOUT_S)
    next(stream)
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    wait_for(lambda: _generator_worker(proc) not in (None, victim), 30, what="a replacement worker")
    deadline = time.monotonic() + 60
    while True:
        try:
            responses = _generate(stub, max_tokens=6, ignore_eos=True)
            break
        except grpc.RpcError as again:
            # UNAVAILABLE until the replacement has loaded the model.
            assert again.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, again.details()
            time.sleep(0.2)
    assert _ids(responses) == generator_dir[2][:6]
    # Concurrent streams on the new process: its running batch (step deltas) started empty.
    with ThreadPoolExecutor(4) as pool:
        streams = list(pool.map(lambda _: _ids(_generate(stub, max_tokens=30, ignore_eos=True)), range(4)))
    assert streams == [generator_dir[2][:30]] * 4
