"""Evaluation tools as clients of the served API: lm-evaluation-harness (``lm-eval``) and the
official ``openai`` client against ``serve run`` of the shipped ``local-cpu.yaml`` with
stories260k as the target (float32, ``highest``), served twice in one cluster: with prompt-lookup
speculation at ``/`` and without a drafter at ``/plain``.

* a loglikelihood multiple-choice task through ``local-completions`` (echo + logprobs on token-id
  prompts) and a generate_until task through ``local-chat-completions``, defined from local data
  (``tests/fixtures/lm_eval``; no hub): per-item results the same with speculation on and off,
  the loglikelihoods those of the target computed in this process;
* the ``openai`` client's ``logprobs`` fields parse, streamed and not, and are the same with
  speculation on and off."""

from __future__ import annotations

import copy
import time

import httpx
import pytest
import yaml

from moa_serve.protocol import VerifyRequest
from moa_serve.verifier.torch.runner import TorchTargetRunner
from tests.conftest import REPO
from tests.support.chat_model import with_chat_template
from tests.support.ray_harness import serve_run

FIXTURES = REPO / "tests" / "fixtures" / "lm_eval"
CONFIG = REPO / "deployments" / "configs" / "local-cpu.yaml"
TOL = 1e-5


@pytest.fixture(scope="module")
def stories_chat(tmp_path_factory, stories_path):
    """stories260k with a chat template (the chat route needs one)."""
    return with_chat_template(stories_path, tmp_path_factory.mktemp("stories-chat"))


def served_config(target, out):
    """``local-cpu.yaml`` over ``target`` in float32 products, as two applications: prompt lookup
    drafting every round (no governor) at ``/``, no drafter at ``/plain``."""
    cfg = yaml.safe_load(CONFIG.read_text())
    spec = cfg["applications"][0]
    args = spec["args"]
    args.update(
        target=str(target),
        model_name="stories",
        drafter="lookup",
        client_drafter=None,
        dtype="float32",
        matmul_precision="highest",
        kv_cache_dtype="auto",
        max_model_len=512,
    )
    args["router"].update(speculation_governor=False, max_sessions_per_round=8, multi_step_max_sessions=8)
    args["verifier_pool"].update(max_sessions=8, torch_threads=1, ray_actor_options={"num_cpus": 0.5})
    plain = copy.deepcopy(spec)
    plain.update(name="plain", route_prefix="/plain")
    plain["args"]["drafter"] = None
    cfg["applications"] = [spec, plain]
    path = out / "lm-eval.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory, stories_chat):
    out = tmp_path_factory.mktemp("lm-eval-serve")
    with serve_run(served_config(stories_chat, out), out) as url:
        with httpx.Client(timeout=5) as c:
            for _ in range(120):
                if c.get(url + "/plain/readyz").status_code == 200:
                    break
                time.sleep(0.5)
        yield {"spec": url, "plain": url + "/plain"}


def lm_eval_run(url: str, chat: bool, tokenizer: str, monkeypatch, tmp_path) -> dict:
    monkeypatch.chdir(REPO)  # the tasks' data paths are relative to the repository
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    common = {"model": "stories", "num_concurrent": 1, "max_retries": 1}
    if chat:
        model, task = "local-chat-completions", "stories_continue"
        args = {**common, "base_url": url + "/v1/chat/completions", "tokenizer_backend": None}
    else:
        model, task = "local-completions", "stories_choice"
        args = {
            **common,
            "base_url": url + "/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": tokenizer,
            "tokenized_requests": True,
        }
    return simple_evaluate(
        model=model,
        model_args=args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(FIXTURES), include_defaults=False),
        log_samples=True,
        apply_chat_template=chat,
        random_seed=0,
        numpy_random_seed=0,
        torch_random_seed=0,
        fewshot_random_seed=0,
    )


def test_lm_eval_loglikelihoods_equal_the_target_and_do_not_depend_on_speculation(
    served, stories_chat, monkeypatch, tmp_path
):
    runs = {k: lm_eval_run(u, False, str(stories_chat), monkeypatch, tmp_path) for k, u in served.items()}
    samples = {k: r["samples"]["stories_choice"] for k, r in runs.items()}
    assert len(samples["spec"]) == len(samples["plain"]) == 4
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    lm = LocalCompletionsAPI(
        model="stories", base_url="http://127.0.0.1:1", tokenizer_backend="huggingface", tokenizer=str(stories_chat)
    )
    runner = TorchTargetRunner(str(stories_chat), "float32", max_sessions=2, max_model_len=512)
    for s, p in zip(samples["spec"], samples["plain"]):
        assert s["doc_id"] == p["doc_id"] and s["acc"] == p["acc"]
        for (ctx, cont), (ll_s, greedy_s), (ll_p, greedy_p) in zip(
            (a for a in s["arguments"]), (r[0] for r in s["resps"]), (r[0] for r in p["resps"])
        ):
            assert abs(ll_s - ll_p) <= TOL and greedy_s == greedy_p
            ctx_ids, cont_ids = lm._encode_pair(ctx, cont)
            (r,) = runner.verify(
                [VerifyRequest("ref", ctx_ids + cont_ids, want_features=False, logprobs=0, score_from=len(ctx_ids))]
            )
            runner.release("ref")
            assert abs(ll_s - sum(x.logprob for x in r.scores)) <= TOL
    results = {k: r["results"]["stories_choice"]["acc,none"] for k, r in runs.items()}
    print(f"stories_choice acc: {results}")  # docs/benchmarks.md#lm-eval
    assert results["spec"] == results["plain"]


def test_lm_eval_generations_do_not_depend_on_speculation(served, stories_chat, monkeypatch, tmp_path):
    runs = {k: lm_eval_run(u, True, str(stories_chat), monkeypatch, tmp_path) for k, u in served.items()}
    spec, plain = (runs[k]["samples"]["stories_continue"] for k in ("spec", "plain"))
    assert len(spec) == 3
    print(
        "stories_continue exact_match:",
        {k: r["results"]["stories_continue"]["exact_match,none"] for k, r in runs.items()},
    )
    assert [s["resps"] for s in spec] == [p["resps"] for p in plain]
    assert all(s["resps"][0][0] for s in spec)  # something was generated


def test_openai_client_logprobs_parse_and_do_not_depend_on_speculation(served):
    openai = pytest.importorskip("openai")
    got = {}
    for k, url in served.items():
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        messages = [{"role": "user", "content": "The dog ran to the park. The dog ran to the"}]
        ask = dict(
            model="stories",
            messages=messages,
            max_tokens=12,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            extra_body={"ignore_eos": True},
        )
        chat = client.chat.completions.create(**ask)
        content = chat.choices[0].logprobs.content
        assert len(content) == 12 and all(len(c.top_logprobs) == 3 and c.bytes is not None for c in content)
        assert all(c.top_logprobs[0].logprob == c.logprob for c in content)  # greedy: the most likely token
        streamed = [
            c
            for ch in client.chat.completions.create(**ask, stream=True)
            if ch.choices and ch.choices[0].logprobs
            for c in ch.choices[0].logprobs.content
        ]
        # (the repeated prompt is in the prefix cache: its last token alone is fed, in a forward of
        # another size, which rounds float32's last bits differently)
        assert [c.token for c in streamed] == [c.token for c in content]
        assert all(abs(a.logprob - b.logprob) <= TOL for a, b in zip(streamed, content))
        comp = client.completions.create(
            model="stories", prompt="Once upon a time, there was a", max_tokens=0, echo=True, logprobs=2
        )
        lp = comp.choices[0].logprobs
        assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
        assert len(lp.tokens) == len(lp.text_offset) == len(lp.top_logprobs) and comp.usage.completion_tokens == 0
        copied = client.completions.create(  # a text that repeats itself: prompt lookup drafts it
            model="stories",
            prompt="The cat sat on the mat. The cat sat on the mat. The cat sat on the",
            max_tokens=16,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        got[k] = [c.logprob for c in content] + lp.token_logprobs[1:] + copied.choices[0].logprobs.token_logprobs
    assert len(got["spec"]) == len(got["plain"])
    for a, b in zip(got["spec"], got["plain"]):
        assert abs(a - b) <= TOL
    stats = httpx.get(served["spec"] + "/v1/stats", timeout=10).json()
    assert stats["gateway"]["accepted"] > 0  # speculation was on: lookup drafts were verified and kept
