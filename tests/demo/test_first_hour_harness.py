"""docs/first-hour.md's OpenAI-style agent harness (``agent.py``, verbatim) through a real
``trajstore proxy`` process on each backend: what the store folds and a trainer reads is what
the engine answered the harness, call by call."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import proxy_process

import trajstore
from trajstore.demo._agent import _serving
from trajstore.demo._engine import make_engine, render_chat, respond
from trajstore.reader import SampleReader

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "docs",
                   "first-hour.md")
TOOL_OUTPUTS = ["ls: main.py tests/", "tests: 3 passed"]


def _agent_script() -> str:
    page = open(DOC).read()
    return textwrap.dedent(next(text for kind, text in re.findall(r"```(bash|python)\n(.*?)```", page, re.S)
                                if kind == "python" and "X-Trajstore-Trajectory" in text))


def _what_the_engine_answered(script: str) -> tuple[list[int], list[int], list[float]]:
    """The harness's conversation replayed on the (deterministic) engine: the first prompt's ids,
    and the token ids and logprobs of every answer, in order."""
    messages = ast.literal_eval(re.search(r"^messages = (\[.*?\])$", script, re.M | re.S).group(1))
    assert re.findall(r'for tool_output in (\[.*?\]):', script) == [repr(TOOL_OUTPUTS).replace("'", '"')]
    first_prompt = render_chat(messages)
    ids: list[int] = []
    logprobs: list[float] = []
    for tool_output in TOOL_OUTPUTS:
        answer = respond({"model": "any", "messages": messages, "max_tokens": 6, "return_token_ids": True,
                          "logprobs": True}, chat=True)
        choice = answer["choices"][0]
        ids += choice["token_ids"]
        logprobs += [c["logprob"] for c in choice["logprobs"]["content"]]
        messages += [{"role": "assistant", "content": choice["message"]["content"]},
                     {"role": "tool", "content": tool_output}]
    return first_prompt, ids, logprobs


def test_the_first_hour_harness_is_read_back_as_the_engine_answered_it(store_url, tmp_path):
    script = _agent_script()
    payload = str(tmp_path / "payload")
    with _serving(make_engine(), "engine") as engine, \
            proxy_process("--store", store_url, "--payload", payload, "proxy", "--upstream", engine,
                          "--insecure-no-auth") as proxy:
        port = proxy.rsplit(":", 1)[1]
        agent = tmp_path / "agent.py"
        agent.write_text(script.replace("8701", port))
        run = subprocess.run([sys.executable, str(agent)], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert run.stdout.splitlines() == ["recorded as seq 0", "recorded as seq 1"]
    with trajstore.connect(store_url, payload=payload) as store:
        assert store.materialize().num_samples_after == 1
    (s,) = next(iter(SampleReader(store_url, batch_size=1, payload=payload)))
    prompt, answers, logprobs = _what_the_engine_answered(script)
    generated = s.loss_mask.astype(bool)
    assert s.trajectory_id == "my-episode" and s.reward == 1.0
    assert s.prompt_ids.tolist() == prompt
    assert s.response_ids[generated].tolist() == answers
    assert np.allclose(s.rollout_logprobs[generated], logprobs) and s.logprobs_mask[generated].all()
    # between the answers: the tool's output as the next prompt rendered it, out of the loss
    observation = s.response_ids[~generated].tolist()
    assert observation[-1] == render_chat([{"role": "tool", "content": TOOL_OUTPUTS[0]}])[-1]
    assert (s.token_model_versions[~generated] == -1).all()
