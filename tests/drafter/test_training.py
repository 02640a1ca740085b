"""Drafter distillation: masks, a few training steps, checkpoint round trip + resume, and the
baseline proposers' losslessness."""

import gzip
import json
from pathlib import Path

import pytest
import torch

from moa_serve.drafter.checkpoint import DRAFT_VOCAB_KEY, load_drafter
from moa_serve.drafter.training import masks
from tests.conftest import SHARED

DATA = SHARED / "data" / "train"


def chat(*turns: str) -> list[dict]:
    """A conversation of these turns, the user's and the assistant's by turns, the user's first."""
    return [{"role": ("user", "assistant")[i % 2], "content": t} for i, t in enumerate(turns)]


def write_toy_data(tmp_path, convs: list[list[dict]]) -> Path:
    """A data folder holding the conversations as one toy.jsonl, one {"messages": ...} a line."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "toy.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return data


def _tiny_cfg(tmp_path, stories_path, **kw):
    from moa_serve.drafter.training.train import load_config

    cfg = load_config(None, [])
    cfg.update(
        target=str(stories_path),
        data_dir=str(DATA),
        data_files=["alpaca_5k", "gsm8k_train"],
        per_file=24,
        max_len=48,
        max_prompt=16,
        draft_vocab_size=256,
        batch_size=4,
        grad_accum=1,
        max_steps=3,
        lr=3e-3,
        warmup_steps=1,
        amp="float32",
        target_dtype="float32",
        threads=2,
        out_dir=str(tmp_path / "state"),
        export_dir=str(tmp_path / "export"),
        export_prefix="tiny",
        save_every_min=100,
        log_every=1000,
    )
    cfg.update(kw)
    return cfg


# ---------------------------------------------------------------------------------------- masks
def test_bounded_cross_mask_semantics():
    visible = torch.zeros(2, 10, dtype=torch.bool)
    visible[0, :3] = True
    visible[0, 7] = True
    visible[1, :1] = True
    m = masks.bounded_cross_mask(visible)
    assert m.shape == (2, 1, 10, 10)
    start = masks.last_visible(visible)
    assert start[0].tolist() == [0, 1, 2, 2, 2, 2, 2, 7, 7, 7]
    for b in range(2):
        for i in range(10):
            assert m[b, 0, i].nonzero().flatten().tolist() == list(range(int(start[b, i]) + 1))
    # never a feature of a position after the query
    assert not (m[0, 0] & ~torch.ones(10, 10, dtype=torch.bool).tril()).any()
    assert not m[0, 0, :7, 3:7].any()  # before the cut at 7, positions 3..6 are unverified


def test_latest_cross_mask_reads_only_the_last_visible_position():
    visible = torch.tensor([[True, True, False, False, True, False]])
    m = masks.latest_cross_mask(visible)[0, 0]
    expected = torch.zeros(6, 6, dtype=torch.bool)
    for i, start in enumerate([0, 1, 1, 1, 4, 4]):
        expected[i, start] = True
    assert torch.equal(m, expected)
    assert (m <= masks.bounded_cross_mask(visible)[0, 0]).all()  # a subset of the bounded mask


def test_every_t_visible_and_staircase():
    is_prompt = torch.zeros(1, 20, dtype=torch.bool)
    is_prompt[0, :4] = True
    vis = masks.every_t_visible(is_prompt, torch.tensor([6]))
    assert vis[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 6, 12, 18]
    st = masks.staircase_self_mask(vis)[0, 0]
    assert st[8].nonzero().flatten().tolist() == [7, 8]  # after the last visible position (6) up to itself
    assert st[6].nonzero().flatten().tolist() == [6]
    sm = masks.self_mask(vis, torch.tensor([False]))
    assert torch.equal(sm[0, 0], torch.ones(20, 20, dtype=torch.bool).tril())
    # the reference's schedule: staircase at the start, gone by half of training
    assert masks.staircase_probability(0.0) == 1.0
    assert masks.staircase_probability(0.25) == pytest.approx(0.5)
    assert masks.staircase_probability(0.5) == 0.0 == masks.staircase_probability(0.9)


def test_forward_train_matches_cache_layout(stories_path):
    from moa_serve.model.target import TargetModel
    from moa_serve.model_files import load_state_dict, read_config

    tm = TargetModel.from_state_dict(read_config(stories_path), load_state_dict(stories_path), torch.float32)
    toks = torch.randint(1, 500, (1, 12), generator=torch.Generator().manual_seed(0))
    out = tm.forward_train(toks)
    cache = tm.new_cache(1, 32)
    slot = cache.allocate()
    from moa_serve.model.kv_cache import PackedBatch

    h = tm.forward_packed(toks[0], PackedBatch(cache, [slot], [0], [12]))[None]
    assert torch.allclose(out["hidden"], h, atol=1e-5)
    assert torch.allclose(
        out["per_layer_kv"][0], cache.per_layer_kv_at(torch.full((12,), slot), torch.arange(12)), atol=1e-5
    )
    assert torch.allclose(out["logits"], tm.lm_head(h), atol=1e-4)


# ---------------------------------------------------------------------------------------- training
@pytest.mark.slow
def test_training_reduces_loss_and_resumes(tmp_path, stories_path):
    from moa_serve.drafter.training.train import Trainer

    cfg = _tiny_cfg(tmp_path, stories_path, max_steps=25)
    tr = Trainer(cfg)
    tr.train(progress_bar=False)
    first = [h["moa"]["loss"] for h in tr.history[:5]]
    last = [h["moa"]["loss"] for h in tr.history[-5:]]
    assert sum(last) < sum(first), (first, last)
    for kind in ("eagle", "independent"):
        assert sum(h[kind]["loss"] for h in tr.history[-5:]) < sum(h[kind]["loss"] for h in tr.history[:5])

    # checkpoint round trip: exported folders load, carry the draft vocabulary, no target weights
    for kind in ("moa", "eagle", "independent"):
        dcfg, state = load_drafter(str(tmp_path / "export" / f"tiny-{kind}"))
        assert dcfg.kind == kind and DRAFT_VOCAB_KEY in state
        assert not any(k.startswith(("model.", "lm_head", "embed_tokens")) for k in state)
        assert json.loads((tmp_path / "export" / f"tiny-{kind}" / "training.json").read_text())["steps"] == 25

    # resume: a new trainer picks up step, weights and optimizer state
    tr2 = Trainer({**cfg, "max_steps": 27})
    assert tr2.resume() and tr2.step == 25
    for a, b in zip(tr.models["moa"].parameters(), tr2.models["moa"].parameters()):
        assert torch.equal(a, b)
    tr2.train(progress_bar=False)
    assert tr2.step == 27


@pytest.fixture(scope="module")
def trained_baselines(tmp_path_factory, stories_path):
    from moa_serve.drafter.training.train import Trainer

    tmp = tmp_path_factory.mktemp("baselines")
    tr = Trainer(_tiny_cfg(tmp, stories_path, max_steps=2))
    tr.train(progress_bar=False)
    return tmp / "export"


@pytest.mark.parametrize("kind", ["eagle", "independent", "moa"])
def test_baseline_proposers_keep_greedy_output(trained_baselines, stories_path, kind):
    from moa_serve.engine.in_process import SpeculativeEngine

    prompts = [[1, 400, 50, 61, 300], [1, 20, 21, 22, 23, 24, 25, 26]]
    plain = SpeculativeEngine.load(str(stories_path), None, "float32", max_sessions=2, max_model_len=128)
    spec = SpeculativeEngine.load(
        str(stories_path), str(trained_baselines / f"tiny-{kind}"), "float32", max_sessions=2, max_model_len=128
    )
    want = [r.token_ids for r in plain.generate(prompts, 30, ignore_eos=True)]
    got = spec.generate(prompts, 30, num_speculative_tokens=4, ignore_eos=True)
    assert [r.token_ids for r in got] == want
    assert all(r.rounds <= 30 for r in got)


def test_eagle_incremental_drafting_equals_parallel_pass(trained_baselines, stories_path):
    """The EAGLE proposer's cached drafting (verified positions read the target's hidden states,
    drafted ones the drafter's own prediction) equals a teacher-forced pass built the same way,
    also after a rollback round."""
    from moa_serve.drafter.baselines import EagleProposer
    from moa_serve.drafter.moa_model import TargetParts
    from moa_serve.model.target import TargetModel
    from moa_serve.model_files import load_state_dict, read_config
    from moa_serve.protocol import DraftRequest

    tm = TargetModel.from_state_dict(read_config(stories_path), load_state_dict(stories_path), torch.float32)
    prop = EagleProposer.load(str(trained_baselines / "tiny-eagle"), target_model=tm, max_sessions=2, max_model_len=64)
    committed = list(range(40, 60))
    hidden = tm.forward_train(torch.tensor([committed]))["hidden"][0]
    n = len(committed) - 1
    (r1,) = prop.propose([DraftRequest("x", committed[:10], 2, 0, hidden[:9])])  # an earlier round
    # this round sends only the tokens committed since (a delta on the replica's 10)
    (res,) = prop.propose([DraftRequest("x", committed[10:], 3, 9, hidden[9:n], base=10)])
    parts = TargetParts(tm, 0)
    w = prop.lm_head_weight
    vocab = prop.draft_vocab
    seq = list(committed)
    prev = torch.cat([torch.zeros(1, hidden.shape[1]), hidden[:n]])  # f_{i-1} at i
    want = []
    with torch.no_grad():
        for _ in range(3):
            s = len(seq)
            mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None]
            out = prop.model.forward_parallel(parts, torch.tensor([seq]), prev[None], torch.arange(s)[None], mask)[0]
            tok = int(vocab[int((out[-1] @ w.T).argmax())])
            want.append(tok)
            seq.append(tok)
            prev = torch.cat([prev, out[-1:]])
    assert res.drafts == want


# ---------------------------------------------------------------------------------------- self-distillation data
def test_regenerate_writes_target_replies_and_matching_originals(tmp_path, stories_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moa_serve.drafter.training.data import prompt_ids
    from moa_serve.measure.regenerate_replies import regenerate

    convs = [
        [
            {"role": "user", "content": f"Tell me a story about a {w}."},
            {"role": "assistant", "content": f"Once upon a time there was a {w}."},
        ]
        for w in ("cat", "dog", "bird", "frog", "tree")
    ]
    convs[2] += [{"role": "user", "content": "And then?"}, {"role": "assistant", "content": "The end."}]
    data = write_toy_data(tmp_path, convs)

    out = regenerate(
        str(stories_path), str(data), str(tmp_path / "out"), per_file=5, max_new_tokens=12, batch=2, dtype="float32"
    )
    regen = [json.loads(line)["messages"] for line in (out / "self" / "regenerated.jsonl").read_text().splitlines()]
    orig = [json.loads(line)["messages"] for line in (out / "original" / "original.jsonl").read_text().splitlines()]
    assert len(regen) == len(orig) == 5
    tok = AutoTokenizer.from_pretrained(stories_path)
    hf = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    for r, o in zip(regen, orig):
        assert len(o) == 2 and o[0] == r[0] and o in [c[:2] for c in convs]  # first turn, dataset reply kept
        assert [m["role"] for m in r] == ["user", "assistant"]
        ids = prompt_ids(tok, r[:1])
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=tok.eos_token_id)
        assert r[1]["content"] == tok.decode(ref[0, len(ids) :], skip_special_tokens=True)


def test_regenerate_all_turns_answers_each_turn_in_the_context_of_its_own_replies(tmp_path, stories_path):
    """--all-turns: turn t is answered after the target's own replies to turns < t (not the
    dataset's); the control arm keeps the dataset's replies to the same turns; pack/unpack keeps
    them all."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moa_serve.drafter.training.data import load_conversations, prompt_ids
    from moa_serve.measure.regenerate_replies import pack, regenerate, unpack

    convs = [
        chat(
            "Tell me a story about a cat.",
            "Dataset reply one.",
            "And then?",
            "Dataset reply two.",
            "How did it end?",
            "Dataset reply three.",
        ),
        chat("Tell me a story about a dog.", "Dataset reply."),
    ]
    data = write_toy_data(tmp_path, convs)
    out = regenerate(
        str(stories_path),
        str(data),
        str(tmp_path / "out"),
        per_file=2,
        max_new_tokens=6,
        batch=2,
        dtype="float32",
        all_turns=True,
    )
    regen = {c[0]["content"]: c for c in load_conversations(out / "self")}
    orig = {c[0]["content"]: c for c in load_conversations(out / "original")}
    assert orig == {c[0]["content"]: c for c in convs}
    long = regen["Tell me a story about a cat."]
    assert [m["role"] for m in long] == ["user", "assistant"] * 3
    assert [m["content"] for m in long[0::2]] == [m["content"] for m in convs[0][0::2]]
    tok = AutoTokenizer.from_pretrained(stories_path)
    hf = AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32).eval()
    for t in (1, 3, 5):  # each reply: greedy after the target's own earlier replies
        ids = prompt_ids(tok, long[:t])
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=tok.eos_token_id)
        assert long[t]["content"] == tok.decode(ref[0, len(ids) :], skip_special_tokens=True)
    assert not any("Dataset" in m["content"] for m in long[1::2])
    packed = tmp_path / "pack.jsonl.gz"
    assert pack(str(out), str(packed)) == 2
    again = unpack(str(packed), str(data), str(tmp_path / "again"))
    for part in ("self", "original"):
        assert sorted(json.dumps(c) for c in load_conversations(again / part)) == sorted(
            json.dumps(c) for c in load_conversations(out / part)
        )


def test_system_prompt_share_picks_a_stable_share_and_round_trips_through_a_pack(tmp_path):
    """The serving-matched variant: the chat template's default system prompt (SmolLM2's), given to
    a hash-chosen share of conversations; a pack keeps it, and training windows start with it."""
    from transformers import AutoTokenizer

    from moa_serve.drafter.training.data import default_system_prompt, encode_turns, load_conversations, render_segments
    from moa_serve.measure.regenerate_replies import gets_system_prompt, pack, unpack
    from tests.conftest import SMOLLM

    tok = AutoTokenizer.from_pretrained(SMOLLM)
    system = default_system_prompt(tok)
    assert system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    served = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    rendered = [
        t
        for ids, _ in render_segments(
            tok, [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}], True
        )
        for t in ids
    ]
    assert list(served if isinstance(served, list) else served["input_ids"]) == rendered  # exactly as served
    msgs = [{"role": "user", "content": f"prompt {i}"} for i in range(2000)]
    picked = [gets_system_prompt(m, 0.5) for m in msgs]
    assert 0.45 < sum(picked) / len(picked) < 0.55
    assert picked == [gets_system_prompt(m, 0.5) for m in msgs]  # stable
    assert all(gets_system_prompt(m, 0.7) for m, p in zip(msgs, picked) if p)  # a larger share holds it
    assert not any(gets_system_prompt(m, 0.0) for m in msgs) and all(gets_system_prompt(m, 1.0) for m in msgs)

    convs = [chat("Q1", "A1", "Q2", "A2"), chat("Solo", "Dataset")]
    data = write_toy_data(tmp_path, convs)
    out = tmp_path / "out"
    (out / "self").mkdir(parents=True)
    sys_msg = {"role": "system", "content": system}
    written = [
        [
            sys_msg,
            convs[0][0],
            {"role": "assistant", "content": "mine 1"},
            convs[0][2],
            {"role": "assistant", "content": "mine 2"},
        ],
        [convs[1][0], {"role": "assistant", "content": "mine"}],
    ]
    (out / "self" / "regenerated.jsonl").write_text(
        "".join(
            json.dumps({"messages": c, "source": {"file": "toy.jsonl", "row": i}}) + "\n" for i, c in enumerate(written)
        )
    )
    assert pack(str(out), str(tmp_path / "p.gz")) == 2
    again = unpack(str(tmp_path / "p.gz"), str(data), str(tmp_path / "again"))
    assert sorted(map(json.dumps, load_conversations(again / "self"))) == sorted(map(json.dumps, written))
    assert sorted(map(json.dumps, load_conversations(again / "original"))) == sorted(
        map(json.dumps, [[sys_msg] + convs[0], convs[1]])
    )
    windows = encode_turns(tok, written[0], max_len=512)
    sys_ids = [t for ids, _ in render_segments(tok, [sys_msg]) for t in ids]
    assert len(windows) == 2 and all(ids[: len(sys_ids)] == sys_ids for ids, _ in windows)


def test_encode_turns_gives_each_reply_its_own_window():
    """A multi-turn conversation: one window per assistant turn, only that turn's reply (and its
    end token) marked; a single-turn conversation: exactly encode_conversation's window."""
    from transformers import AutoTokenizer

    from moa_serve.drafter.training.data import build_examples, encode_conversation, encode_turns
    from tests.conftest import SMOLLM

    tok = AutoTokenizer.from_pretrained(SMOLLM)
    conv = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
        {"role": "assistant", "content": "Green, like grass."},
    ]
    assert encode_turns(tok, conv[:2], 64, 8) == [encode_conversation(tok, conv[:2], 64, 8)]
    (ids1, r1), (ids2, r2) = encode_turns(tok, conv, 512)
    marked = lambda ids, r: tok.decode([t for t, m in zip(ids, r) if m])  # noqa: E731
    assert marked(ids1, r1) == "Blue.<|im_end|>" and marked(ids2, r2) == "Green, like grass.<|im_end|>"
    assert ids2[: len(ids1)] == ids1  # the second window holds the first turn as context
    ((c2, m2),) = encode_turns(tok, conv, 512, max_prompt=4)[1:]
    assert m2.index(True) == 4 and marked(c2, m2) == "Green, like grass.<|im_end|>"
    assert len(build_examples(tok, [conv], 512, min_response=1)) == 2


def test_regenerate_goes_on_where_an_earlier_run_stopped(tmp_path, stories_path):
    """--limit answers part of the sample; the next run answers only the prompts not yet answered,
    into a new shard; a third run has nothing left to do."""
    from moa_serve.drafter.training.data import load_conversations
    from moa_serve.measure.regenerate_replies import regenerate

    convs = [
        [
            {"role": "user", "content": f"Tell me a story about a {w} (prompt {i})."},
            {"role": "assistant", "content": f"Dataset reply {i} about a {w}."},
        ]
        for i, w in enumerate(("cat", "dog", "bird", "frog", "tree", "fox", "owl"))
    ]
    data = write_toy_data(tmp_path, convs)
    out = tmp_path / "out"
    kw = dict(per_file=7, max_new_tokens=4, batch=2, dtype="float32")
    regenerate(str(stories_path), str(data), str(out), limit=3, **kw)
    regenerate(str(stories_path), str(data), str(out), **kw)
    regenerate(str(stories_path), str(data), str(out), **kw)  # nothing left: no new shard
    shards = sorted(p.name for p in (out / "self").glob("*.jsonl"))
    assert shards == ["regenerated-001.jsonl", "regenerated.jsonl"]
    firsts = [len((out / "self" / n).read_text().splitlines()) for n in ("regenerated.jsonl", "regenerated-001.jsonl")]
    assert firsts == [3, 4]
    got = sorted(c[0]["content"] for c in load_conversations(out / "self"))
    assert got == sorted(c[0]["content"] for c in convs)  # every prompt once
    orig = sorted(json.dumps(c) for c in load_conversations(out / "original"))
    assert orig == sorted(json.dumps(c) for c in convs)

    # pack: sources + replies only (no corpus text); unpack rebuilds the same data from the corpus
    from moa_serve.measure.regenerate_replies import pack, unpack

    packed = tmp_path / "pack.jsonl.gz"
    assert pack(str(out), str(packed)) == 7
    raw = gzip.decompress(packed.read_bytes()).decode()
    assert not any(m["content"] in raw for c in convs for m in c)  # the corpus's text stays in the corpus
    again = unpack(str(packed), str(data), str(tmp_path / "again"))
    for part in ("self", "original"):
        assert sorted(json.dumps(c) for c in load_conversations(again / part)) == sorted(
            json.dumps(c) for c in load_conversations(out / part)
        )
    # a later run goes on from unpacked data: nothing left to answer
    regenerate(str(stories_path), str(data), str(again), **kw)
    assert len(list((again / "self").glob("*.jsonl"))) == 1
    # a corpus that changed under the pack is refused, naming the row
    (data / "toy.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in reversed(convs)))
    with pytest.raises(ValueError, match="row .* of toy.jsonl no longer holds"):
        unpack(str(packed), str(data), str(tmp_path / "changed"))


def test_training_warm_starts_from_exported_checkpoints(tmp_path, stories_path):
    """init_from: a new run starts from an earlier run's exported drafters (weights and draft
    vocabulary), not from scratch; a folder of the wrong kind is refused."""
    from moa_serve.drafter.training.train import Trainer

    first = Trainer(_tiny_cfg(tmp_path / "a", stories_path, max_steps=3))
    first.train(progress_bar=False)
    cfg = _tiny_cfg(
        tmp_path / "b", stories_path, max_steps=1, init_from=str(tmp_path / "a" / "export"), draft_vocab_size=64, seed=3
    )
    warm = Trainer(cfg)
    assert torch.equal(warm.vocab, first.vocab)  # kept, though this config asks for another size
    for kind in ("moa", "eagle", "independent"):
        for a, b in zip(first.models[kind].state_dict().values(), warm.models[kind].state_dict().values()):
            assert torch.allclose(a.float(), b.float(), atol=1e-2)  # bf16 checkpoint
    cold = Trainer({**cfg, "init_from": None})
    assert not torch.equal(next(cold.models["moa"].parameters()), next(warm.models["moa"].parameters()))
    warm.train(progress_bar=False)
    assert warm.step == 1
    with pytest.raises(ValueError, match="not the eagle drafter"):
        (tmp_path / "mixed").mkdir()
        import shutil

        shutil.copytree(tmp_path / "a" / "export" / "tiny-moa", tmp_path / "mixed" / "tiny-moa")
        shutil.copytree(tmp_path / "a" / "export" / "tiny-independent", tmp_path / "mixed" / "tiny-eagle")
        Trainer({**cfg, "init_from": str(tmp_path / "mixed"), "drafters": ["moa", "eagle"]})


def test_training_without_data_names_the_data_dir(tmp_path, stories_path):
    from moa_serve.drafter.training.train import Trainer

    with pytest.raises(ValueError, match="data_dir .*no conversations"):
        Trainer(_tiny_cfg(tmp_path, stories_path, data_dir=str(tmp_path / "missing"), data_files=None))


def test_system_prompted_drop_trains_on_the_conversations_without_one(tmp_path, stories_path):
    """system_prompted: drop keeps only the conversations without a system prompt (the paper's
    recipe on data regenerated with --system-prompt-share); keep trains on all; anything else is
    refused, naming the key."""
    from moa_serve.drafter.training.train import Trainer

    sys_msg = {"role": "system", "content": "You are a storyteller."}
    convs = [
        [
            {"role": "user", "content": f"Tell me a story about a {w}."},
            {"role": "assistant", "content": f"Once upon a time there was a little {w} who liked to play."},
        ]
        for w in ("cat", "dog", "bird", "frog", "tree", "fox")
    ]
    convs = [([sys_msg] if i % 3 == 0 else []) + c for i, c in enumerate(convs)]
    data = write_toy_data(tmp_path, convs)
    kw = dict(data_dir=str(data), data_files=None, per_file=0, drafters=["eagle"], max_len=64)
    assert len(Trainer(_tiny_cfg(tmp_path, stories_path, **kw)).examples) == 6
    assert len(Trainer(_tiny_cfg(tmp_path, stories_path, system_prompted="drop", **kw)).examples) == 4
    with pytest.raises(ValueError, match="system_prompted"):
        Trainer(_tiny_cfg(tmp_path, stories_path, system_prompted="some", **kw))


def test_value_readout_starts_from_the_targets_state_and_round_trips(tmp_path, stories_path):
    """value_readout_layers: a paper-layout drafter continued with the readout gets a linear map
    from the target's last layers' *values* (fitted, LSA path zeroed), so its features start close
    to the target's final hidden state; they then ignore every key and the earlier layers; the
    exported checkpoint keeps the readout and serves through the proposer; a checkpoint with a
    readout does not load into a config without one."""
    import torch.nn.functional as F

    from moa_serve.drafter.moa_model import MoADrafter
    from moa_serve.drafter.registry import load_feature_source
    from moa_serve.drafter.training.data import batches
    from moa_serve.drafter.training.train import Trainer

    paper = Trainer(_tiny_cfg(tmp_path / "a", stories_path, drafters=["moa"], max_steps=3))
    paper.train(progress_bar=False)
    cfg = _tiny_cfg(
        tmp_path / "b",
        stories_path,
        drafters=["moa"],
        max_steps=2,
        value_readout_layers=2,
        feature_target_weight=1.0,
        init_from=str(tmp_path / "a" / "export"),
    )
    tr = Trainer(cfg)
    head = tr.models["moa"].feature_head
    assert head.readout_layers == 2 and not head.Ekv2E.weight.any()

    tokens, _, valid = next(batches(tr.examples, 4, 11))
    with torch.no_grad():
        t = tr.target.forward_train(tokens, valid, 0, tr.vocab_dev)
        kv, hidden = t["per_layer_kv"][valid].float(), t["hidden"][valid].float()
        cos_readout = F.cosine_similarity(head(kv), hidden, dim=-1).mean()
        cos_paper = F.cosine_similarity(paper.models["moa"].feature_head(kv), hidden, dim=-1).mean()
        assert cos_readout > 0.5 and cos_readout > cos_paper + 0.2, (cos_readout, cos_paper)
        # only the values of the last two layers reach the feature (the LSA path is zero here)
        nl, kvh = kv.shape[1], tr.arch.num_kv_heads
        changed = kv.clone().reshape(len(kv), nl, kvh, 2, -1)
        changed[:, :, :, 0] += 3.0  # every key
        changed[:, : nl - 2] -= 2.0  # earlier layers, keys and values
        assert torch.allclose(head(changed.reshape_as(kv)), head(kv), atol=1e-5)
        changed[:, nl - 1, 0, 1] += 1.0  # a value of the last layer
        assert not torch.allclose(head(changed.reshape_as(kv)), head(kv), atol=1e-3)

    tr.train(progress_bar=False)
    assert "ground" in tr.history[-1]["moa"]
    dcfg, state = load_drafter(str(tmp_path / "b" / "export" / "tiny-moa"))
    assert dcfg.value_readout_layers == 2 and "value_readout.weight" in state
    served = load_feature_source(str(tmp_path / "b" / "export" / "tiny-moa"))  # what the verifier runs
    with torch.no_grad():
        assert torch.allclose(served(kv), tr.models["moa"].feature_head(kv), atol=0.05, rtol=0.05)  # bf16 copy
    with pytest.raises(ValueError, match="no place for"):
        MoADrafter(paper.cfgs["moa"]).load_flat_state_dict({k: v for k, v in state.items() if k != DRAFT_VOCAB_KEY})


def test_diagnose_reports_distances_and_the_cas_use_of_features(tmp_path, stories_path):
    """moa drafter diagnose: top-1 by distance for MoA, d = 1 for EAGLE-style; a latest-only drafter
    puts all of its CA mass on the freshest feature, a paper-layout one spreads it."""
    from moa_serve.drafter.training.diagnose import diagnose
    from moa_serve.drafter.training.train import Trainer

    tr = Trainer(_tiny_cfg(tmp_path / "a", stories_path, drafters=["moa", "eagle"], max_steps=2))
    tr.train(progress_bar=False)
    latest = Trainer(
        _tiny_cfg(tmp_path / "b", stories_path, drafters=["moa"], max_steps=1, cross_attention_latest_only=True)
    )
    latest.train(progress_bar=False)
    data = tmp_path / "data"
    data.mkdir()
    rows = [json.loads(line) for line in (DATA / "alpaca_5k.jsonl").read_text().splitlines()[:12]]
    (data / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = diagnose(
        str(stories_path),
        [
            str(tmp_path / "a" / "export" / "tiny-moa"),
            str(tmp_path / "a" / "export" / "tiny-eagle"),
            str(tmp_path / "b" / "export" / "tiny-moa"),
        ],
        str(data),
        batches_=2,
        batch_size=4,
        period=4,
        max_len=48,
        max_prompt=16,
        progress=False,
    )
    paper, eagle, fresh = out
    assert len(paper["top1_by_distance"]) == 4 and paper["positions"] > 0
    assert all(0 <= x <= 1 for x in paper["top1_by_distance"] + [paper["top1_features_zeroed"]])
    assert 0 < paper["ca_mass_on_freshest"] < 0.99 and paper["ca_mass_if_uniform"] < 1
    assert fresh["ca_mass_on_freshest"] == pytest.approx(1.0)
    assert eagle["kind"] == "eagle" and 0 <= eagle["top1_d1"] <= 1


def test_shrink_vocab_keeps_the_most_frequent_draft_tokens_and_the_output(
    trained_baselines, stories_path, tmp_path, capsys
):
    """``moa drafter shrink-vocab``: the same weights, the draft vocabulary cut to the most frequent
    reply tokens of the given data (stop tokens kept), and speculative greedy output unchanged."""
    from moa_serve.cli import main
    from moa_serve.drafter.training.data import build_examples, load_conversations, response_counts, stop_token_ids
    from moa_serve.engine.in_process import SpeculativeEngine
    from moa_serve.model_files import load_tokenizer

    data = tmp_path / "data"
    data.mkdir()
    rows = (DATA / "alpaca_5k.jsonl").read_text().splitlines()[:40]
    (data / "a.jsonl").write_text("\n".join(rows) + "\n")
    src, small = trained_baselines / "tiny-moa", tmp_path / "small"
    assert (
        main(
            ["drafter", "shrink-vocab", "--drafter", str(src), "--size", "64", "--data", str(data), "--out", str(small)]
        )
        == 0
    )
    cfg, before = load_drafter(str(src))
    cfg_small, after = load_drafter(str(small))
    old, new = before[DRAFT_VOCAB_KEY].tolist(), after[DRAFT_VOCAB_KEY].tolist()
    assert len(old) > 64 and len(new) == 64 == cfg_small.draft_vocab_size
    assert set(new) <= set(old) and new == sorted(new)
    assert all(torch.equal(before[k], after[k]) for k in before if k != DRAFT_VOCAB_KEY)
    tok = load_tokenizer(stories_path)
    counts = response_counts(build_examples(tok, load_conversations(data), 256))
    stops = set(stop_token_ids(tok, cfg.target.vocab_size)) & set(old)
    assert stops <= set(new)
    dropped = set(old) - set(new)
    assert min(counts[t] for t in set(new) - stops) >= max(counts[t] for t in dropped)
    report = json.loads((small / "training.json").read_text())["draft_vocab_shrunk"]
    assert (
        report["size"] == 64 and report["size_before"] == len(old) and report["coverage"] <= report["coverage_before"]
    )

    prompts = [[1, 400, 50, 61, 300], [1, 20, 21, 22, 23, 24, 25, 26]]
    plain = SpeculativeEngine.load(str(stories_path), None, "float32", max_sessions=2, max_model_len=128)
    spec = SpeculativeEngine.load(str(stories_path), str(small), "float32", max_sessions=2, max_model_len=128)
    want = [r.token_ids for r in plain.generate(prompts, 30, ignore_eos=True)]
    assert [r.token_ids for r in spec.generate(prompts, 30, num_speculative_tokens=4, ignore_eos=True)] == want
    capsys.readouterr()
    assert (
        main(
            [
                "drafter",
                "shrink-vocab",
                "--drafter",
                str(src),
                "--size",
                str(len(old)),
                "--data",
                str(data),
                "--out",
                str(tmp_path / "x"),
            ]
        )
        != 0
    )
    assert "--size must be in" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_resumed_training_gives_the_losses_of_an_uninterrupted_run(tmp_path, stories_path):
    """A run stopped after a saved step and resumed in a fresh trainer continues with the same
    batches, random draws (masks' T, staircase, EAGLE noise), optimizer and schedule state: its
    next losses and final weights equal those of a run that was never stopped."""
    from moa_serve.drafter.training.train import Trainer

    kw = dict(drafters=["moa", "eagle"], max_steps=6, save_every_steps=2, period_min=5, period_max=15)
    whole = Trainer(_tiny_cfg(tmp_path / "whole", stories_path, **kw))
    whole.train(progress_bar=False)

    cfg = _tiny_cfg(tmp_path / "parts", stories_path, **kw)
    first = Trainer(cfg)
    first.train(progress_bar=False, until_step=3)
    assert first.step == 3 and first.batches_done == 3
    second = Trainer(cfg)
    assert second.resume() and second.step == 3
    second.train(progress_bar=False)

    def losses(tr):
        return [(h["step"], h["moa"]["loss"], h["eagle"]["loss"]) for h in tr.history]

    assert losses(second) == losses(whole)
    assert second.tokens_seen == whole.tokens_seen
    for kind in ("moa", "eagle"):
        for a, b in zip(whole.models[kind].parameters(), second.models[kind].parameters()):
            assert torch.equal(a, b)
    # data that gives another draft vocabulary cannot go on from this state
    with pytest.raises(ValueError, match="draft vocabulary"):
        Trainer({**cfg, "draft_vocab_size": 128}).resume()


def test_batch_loader_keeps_the_stream_order_for_any_number_of_workers(tmp_path, stories_path):
    from moa_serve.drafter.training.data import batches, loader
    from moa_serve.drafter.training.train import Trainer

    examples = Trainer(_tiny_cfg(tmp_path, stories_path, drafters=["eagle"])).examples
    want = [next(s) for s in [batches(examples, 4, 5, start=3)] for _ in range(6)]
    for workers in (0, 2):
        got = loader(examples, 4, 5, start=3, workers=workers, pin_memory=False)
        for w in want:
            assert all(torch.equal(a, b) for a, b in zip(w, next(got)))


def test_regenerate_time_boxed_over_the_whole_corpus_goes_on_chunk_by_chunk(tmp_path, stories_path):
    """--per-file 0 samples every conversation; --max-minutes stops after the chunk in which the
    time ran out (a chunk is 4 x --batch conversations), and the next run answers the rest."""
    from moa_serve.drafter.training.data import load_conversations
    from moa_serve.measure.regenerate_replies import regenerate

    data = tmp_path / "data"
    data.mkdir()
    for name, n in (("a", 4), ("b", 3)):
        rows = [{"messages": [{"role": "user", "content": f"Story {name}{i}."}]} for i in range(n)]
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    kw = dict(per_file=0, max_new_tokens=3, batch=1, dtype="float32")
    regenerate(str(stories_path), str(data), str(out), max_minutes=1e-9, **kw)
    assert len(load_conversations(out / "self")) == 4
    regenerate(str(stories_path), str(data), str(out), **kw)
    got = sorted(c[0]["content"] for c in load_conversations(out / "self"))
    assert got == sorted(f"Story {n}{i}." for n, k in (("a", 4), ("b", 3)) for i in range(k))
