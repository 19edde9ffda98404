"""The OpenAI generation bodies turn into the SamplingParams the engine runs: every field we accept travels."""

from __future__ import annotations

from embedserv.server.http.openai_generate import ChatBody, CompletionBody
from embedserv.types import SamplingParams


def test_completion_body_keeps_ignore_eos():
    # vLLM's extension; benchmarks send it to both servers, and dropping it ends streams at EOS.
    body = CompletionBody(prompt="x", max_tokens=12, temperature=0, ignore_eos=True)
    assert body.sampling(12) == SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert CompletionBody(prompt="x").sampling(16).ignore_eos is False


def test_chat_body_keeps_sampling_fields():
    body = ChatBody(messages=[{"role": "user", "content": "hi"}], temperature=0.5, top_p=0.9, top_k=3, seed=7,
                    stop="END", ignore_eos=True)  # fmt: skip
    assert body.sampling(8) == SamplingParams(
        max_tokens=8, temperature=0.5, top_p=0.9, top_k=3, seed=7, stop=("END",), ignore_eos=True
    )
