"""Distillation of MoA drafters (and the EAGLE-style / independent baselines) from a frozen target.

One loop runs the frozen target once per batch (per-layer K/V, input embeddings, TLI input,
last hidden state, logits) and steps one optimizer per drafter, so every drafter sees identical
data and budget. Loss per drafter (response positions only, i.e. positions whose next token is
an assistant token):  ``kl_weight · KL(target ‖ drafter) + smooth-L1(drafter hidden, target
last hidden)`` (+ the same on the TLI input when N > 0, averaged 0.5/0.5 as the reference). The
KL is over the drafter's restricted vocabulary (``draft_vocab_ids``), both distributions
renormalised over it.

Beyond the paper (off by default): ``value_readout_layers`` adds a linear map from the values of
the target's last N layers to the feature head (fitted by ridge regression when it is new, the LSA
path then starting at zero), ``feature_target_weight`` adds a grounding loss (smooth-L1 between
each verified position's feature and the target's final hidden state there), and
``cross_attention_latest_only`` lets the CA read only the freshest feature. The shipped
paper-layout drafter's CA put less than a uniform share of its attention on the freshest feature,
and zeroing every feature hardly changed its top-1 (``moa drafter diagnose``,
``drafter/checkpoints/README.md``).

``system_prompted: drop`` leaves out the conversations that have a system prompt (data written by
``moa regenerate --system-prompt-share``): the paper's no-system-prompt recipe on the same folder.

MoA masks: CA reads features only of visible positions (prompt + every T-th, T ~ U[period_min,
period_max] per sequence); SA uses the staircase mask with a probability falling from 1 to 0
over the first half of training (as the reference code), plain causal afterwards.

``moa train --config drafter/configs/smollm2-135m.yaml [key=value ...]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml

from moa_serve.drafter.baselines import build_baseline
from moa_serve.drafter.checkpoint import DRAFT_VOCAB_KEY, load_drafter, save_drafter
from moa_serve.drafter.config import DrafterConfig
from moa_serve.drafter.moa_model import MoADrafter, TargetParts, init_weights
from moa_serve.drafter.training import masks
from moa_serve.drafter.training.data import (
    batches,
    build_examples,
    load_conversations,
    loader,
    stop_token_ids,
    top_vocab,
    vocab_coverage,
)
from moa_serve.model.target import TargetArch, TargetModel
from moa_serve.model_files import load_state_dict, load_tokenizer, read_config, resolve_model_path

DEFAULTS = dict(
    target="HuggingFaceTB/SmolLM2-135M-Instruct",
    data_dir="../shared/data/train",
    data_files=None,
    per_file=1500,
    max_len=256,
    drafters=["moa", "eagle", "independent"],
    target_layer_inference=0,
    draft_vocab_size=8192,
    independent_layers=2,
    batch_size=8,
    grad_accum=2,
    max_steps=1000,
    max_time_min=0.0,
    max_tokens=0,
    lr=1e-3,
    min_lr_ratio=0.1,
    warmup_steps=20,
    weight_decay=0.0,
    betas=[0.9, 0.95],
    grad_clip=1.0,
    kl_weight=0.1,
    period_min=6,
    period_max=14,
    staircase=True,
    eagle_noise=0.1,
    feature_target_weight=0.0,
    value_readout_layers=0,
    cross_attention_latest_only=False,
    amp="float32",
    target_dtype="bfloat16",
    max_prompt=0,
    device="cpu",
    threads=2,
    seed=0,
    out_dir="runs/drafters",
    export_dir="runs/drafters/export",
    export_prefix="drafter",
    save_every_min=5.0,
    save_every_steps=0,
    compile=False,
    loader_workers=0,
    log_every=5,
    init_seed=0,
    init_from=None,
    system_prompted="keep",
)


def load_config(path: str | None, overrides: list[str] = ()) -> dict:
    cfg = dict(DEFAULTS)
    if path:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
        unknown = set(loaded) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"unknown training config keys: {sorted(unknown)}")
        cfg.update(loaded)
    for o in overrides:
        key, sep, value = o.lstrip("-").partition("=")
        key = key.replace("-", "_")
        if not sep or key not in DEFAULTS:
            raise ValueError(f"override {o!r}: expected key=value with key in {sorted(DEFAULTS)}")
        cfg[key] = _number_or_value(yaml.safe_load(value))
    return cfg


def _number_or_value(value):
    """A YAML value, with what YAML 1.1 reads as text but is a number (``3e-5``) as a float."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value


def _lr_factor(cfg, step: int, progress: float) -> float:
    if step < cfg["warmup_steps"]:
        return (step + 1) / cfg["warmup_steps"]
    m = cfg["min_lr_ratio"]
    return m + (1 - m) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp_min(1)


class Trainer:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.device = torch.device(cfg["device"])
        if self.device.type == "cpu" and cfg["threads"]:
            torch.set_num_threads(int(cfg["threads"]))
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(cfg["seed"])
        self.amp = None if cfg["amp"] in (None, "float32", "none") else getattr(torch, cfg["amp"])
        path = resolve_model_path(cfg["target"])
        hf = read_config(path)
        state = load_state_dict(path)
        self.target32 = TargetModel.from_state_dict(hf, state, torch.float32, self.device)
        self.target32.requires_grad_(False)
        tdt = getattr(torch, cfg["target_dtype"])
        self.target = (
            TargetModel.from_state_dict(hf, state, tdt, self.device) if tdt != torch.float32 else self.target32
        )
        self.arch: TargetArch = self.target32.arch
        self.tok = load_tokenizer(path)
        self.tli = int(cfg["target_layer_inference"])
        self.parts = TargetParts(self.target32, self.tli)

        if cfg["system_prompted"] not in ("keep", "drop"):
            raise ValueError(f"system_prompted: keep or drop, got {cfg['system_prompted']!r}")
        convs = load_conversations(cfg["data_dir"], cfg["per_file"], cfg["seed"], cfg["data_files"])
        if cfg["system_prompted"] == "drop":  # the paper's recipe on data regenerated with --system-prompt-share
            convs = [c for c in convs if c[0]["role"] != "system"]
        if not convs:
            raise ValueError(
                f"data_dir {cfg['data_dir']!r}: no conversations in *.jsonl files (for the "
                "self-distilled recipe run `moa regenerate --out ../runs/selfdistill` first)"
            )
        self.examples = build_examples(self.tok, convs, cfg["max_len"], max_prompt=cfg["max_prompt"])
        vsize = int(cfg["draft_vocab_size"])
        stops = stop_token_ids(self.tok, self.arch.vocab_size)
        # warm start: the drafters (and their draft vocabulary) of an earlier run's exported checkpoints
        self.init = self._warm_start_states(cfg) if cfg.get("init_from") else {}
        if self.init:
            vocab = next(iter(self.init.values()))[1].get(DRAFT_VOCAB_KEY)
            self.vocab = vocab.long() if vocab is not None else None
            self.vocab_coverage = vocab_coverage(self.examples, self.vocab) if vocab is not None else 1.0
        elif vsize and vsize < self.arch.vocab_size:
            self.vocab, self.vocab_coverage = top_vocab(self.examples, vsize, stops)
        else:
            self.vocab, self.vocab_coverage = None, 1.0
        self.vocab_dev = self.vocab.to(self.device) if self.vocab is not None else None
        w = self.target32.lm_head.weight
        self.head_w = (w[self.vocab_dev] if self.vocab is not None else w).detach()

        self.models: dict[str, torch.nn.Module] = {}
        self.cfgs: dict[str, DrafterConfig] = {}
        for kind in cfg["drafters"]:
            dcfg = DrafterConfig(
                target=self.arch,
                target_name_or_path=str(cfg["target"]),
                target_layer_inference=self.tli if kind == "moa" else 0,
                draft_vocab_size=len(self.vocab) if self.vocab is not None else 0,
                kind=kind,
                num_layers=int(cfg["independent_layers"]) if kind == "independent" else 0,
                value_readout_layers=int(cfg["value_readout_layers"]) if kind == "moa" else 0,
                cross_attention_latest_only=bool(cfg["cross_attention_latest_only"]) if kind == "moa" else False,
            )
            m = MoADrafter(dcfg) if kind == "moa" else build_baseline(dcfg)
            init_weights(m, seed=cfg["init_seed"])
            if kind in self.init:
                state = {k: v for k, v in self.init[kind][1].items() if k != DRAFT_VOCAB_KEY}
                m.load_flat_state_dict(state, new_readout=True) if kind == "moa" else m.load_state_dict(state)
            started_from = self.init[kind][0] if kind in self.init else None
            if dcfg.value_readout_layers and not (started_from and started_from.value_readout_layers):
                self._fit_value_readout(m)  # a new readout (init_from's, when it has one, is kept)
            self.models[kind] = m.to(self.device).train()
            self.cfgs[kind] = dcfg
        self.opts = {
            k: torch.optim.AdamW(
                m.parameters(),
                lr=cfg["lr"],
                betas=tuple(cfg["betas"]),
                weight_decay=cfg["weight_decay"],
                fused=self.device.type == "cuda",  # one kernel for all parameters on a GPU
            )
            for k, m in self.models.items()
        }
        self.forwards = self._forwards(bool(cfg["compile"]))
        self.step = 0
        self.batches_done = 0  # the data position: batches of the deterministic stream consumed
        self.elapsed = 0.0
        self.tokens_seen = 0
        self.history: list[dict] = []
        self.out = Path(cfg["out_dir"])
        self.rng = random.Random(cfg["seed"])

    def _forwards(self, compiled: bool) -> dict:
        """The drafters' training forward passes, each through ``torch.compile`` when ``compiled``
        (shapes vary with the batch's length: compiled for dynamic shapes)."""
        fns = {}
        for kind, m in self.models.items():
            if kind == "moa":
                fns[kind] = {"feature": m.feature_head, "draft": m.draft_head.forward_parallel}
            else:
                fns[kind] = {"draft": m.forward_parallel}
        if compiled:
            fns = {k: {n: torch.compile(f, dynamic=True) for n, f in v.items()} for k, v in fns.items()}
        return fns

    @torch.no_grad()
    def _fit_value_readout(self, m: MoADrafter, batches_: int = 24, ridge: float = 1.0) -> None:
        """Starts a new ``value_readout`` as the ridge regression of the target's final hidden state
        on the values it reads, over a few training batches, and the LSA path (``Ekv2E``) at zero:
        the features carry the target's state from step 0, and the LSA learns what the readout
        misses. (The shipped paper-layout LSA's features were many times the hidden state's norm and
        did not help the drafter predict; continuing them beside the readout kept that noise.)"""
        head = m.feature_head
        head.Ekv2E.weight.zero_()
        head.Ekv2E.bias.zero_()
        xs, hs = [], []
        stream = batches(self.examples, self.cfg["batch_size"], self.cfg["seed"] + 7919)
        for _ in range(batches_):
            tokens, _, valid = next(stream)
            t = self.target.forward_train(tokens.to(self.device), valid.to(self.device), 0, self.vocab_dev)
            xs.append(head.readout_values(t["per_layer_kv"][valid].float()))
            hs.append(t["hidden"][valid].float())
        x, h = torch.cat(xs), torch.cat(hs)
        x1 = torch.cat([x, torch.ones(len(x), 1, device=x.device)], 1)
        w = torch.linalg.solve(x1.T @ x1 + ridge * torch.eye(x1.shape[1], device=x.device), x1.T @ h)
        head.value_readout.weight.copy_(w[:-1].T)
        head.value_readout.bias.copy_(w[-1])
        fit = F.cosine_similarity(x1 @ w, h, dim=-1).mean().item()
        print(
            json.dumps({"event": "value_readout_fit", "positions": len(x), "feature_hidden_cos": round(fit, 4)}),
            flush=True,
        )

    def _warm_start_states(self, cfg: dict) -> dict[str, tuple[DrafterConfig, dict]]:
        """``init_from``: the folder of exported checkpoints (``<export_prefix>-<kind>``) to start
        from, so that training continues the shipped drafters on more data instead of
        starting over. Their draft vocabulary is kept (the LM head rows they learned)."""
        out = {}
        for kind in cfg["drafters"]:
            path = Path(cfg["init_from"]) / f"{cfg['export_prefix']}-{kind}"
            dcfg, state = load_drafter(str(path))
            if dcfg.kind != kind or dcfg.target_layer_inference != (self.tli if kind == "moa" else 0):
                raise ValueError(
                    f"init_from {path}: a {dcfg.kind} drafter with TLI {dcfg.target_layer_inference}, "
                    f"not the {kind} drafter this config trains"
                )
            if kind == "moa" and dcfg.value_readout_layers not in (0, int(cfg["value_readout_layers"])):
                raise ValueError(
                    f"init_from {path}: its value readout reads {dcfg.value_readout_layers} layers; set "
                    f"value_readout_layers={dcfg.value_readout_layers} (this config: "
                    f"{cfg['value_readout_layers']})"
                )
            out[kind] = (dcfg, state)
        vocabs = [st.get(DRAFT_VOCAB_KEY) for _, st in out.values()]
        if any(v is None for v in vocabs) != all(v is None for v in vocabs) or any(
            v is not None and not torch.equal(v, vocabs[0]) for v in vocabs
        ):
            raise ValueError(f"init_from {cfg['init_from']}: the drafters' draft vocabularies differ")
        return out

    # ------------------------------------------------------------------ state
    def state_path(self) -> Path:
        return self.out / "train_state.pt"

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / "train_state.pt.tmp"
        torch.save(
            {
                "step": self.step,
                "elapsed": self.elapsed,
                "tokens_seen": self.tokens_seen,
                "batches_done": self.batches_done,
                "vocab": self.vocab,
                "models": {k: m.state_dict() for k, m in self.models.items()},
                "opts": {k: o.state_dict() for k, o in self.opts.items()},
                "history": self.history,
                "rng": self.rng.getstate(),
                "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None,
                "config": self.cfg,
            },
            tmp,
        )
        os.replace(tmp, self.state_path())
        self.export()

    def resume(self) -> bool:
        p = self.state_path()
        if not p.is_file():
            return False
        st = torch.load(p, map_location=self.device, weights_only=False)
        saved = st.get("vocab", self.vocab)
        if (saved is None) != (self.vocab is None) or (saved is not None and not torch.equal(saved.cpu(), self.vocab)):
            raise ValueError(
                f"{p}: its drafters' draft vocabulary is not the one this run's data gives (the data "
                "changed); resume on the same data, or start over with --no-resume"
            )
        for k, m in self.models.items():
            m.load_state_dict(st["models"][k])
            self.opts[k].load_state_dict(st["opts"][k])
        self.step, self.elapsed, self.tokens_seen = st["step"], st["elapsed"], st["tokens_seen"]
        # a state without a data position: each step consumed grad_accum batches
        self.batches_done = st.get("batches_done", st["step"] * self.cfg["grad_accum"])
        self.history = st["history"]
        self.rng.setstate(st["rng"])
        torch.set_rng_state(st["torch_rng"].cpu())
        if st.get("cuda_rng") is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state_all([r.cpu() for r in st["cuda_rng"]])
        return True

    def export(self, export_dir: str | Path | None = None) -> dict[str, Path]:
        """Writes each drafter as a checkpoint folder (config.json + model.safetensors + draft vocab),
        its weights in bfloat16: half the bytes of float32, and what a float32 CPU drafter reads
        through the packed bf16 kernels unchanged (the training state keeps float32)."""
        out = {}
        for kind, m in self.models.items():
            state = m.flat_state_dict() if kind == "moa" else dict(m.state_dict())
            if self.vocab is not None:
                state[DRAFT_VOCAB_KEY] = self.vocab
            d = Path(export_dir or self.cfg["export_dir"]) / f"{self.cfg['export_prefix']}-{kind}"
            save_drafter(d, self.cfgs[kind], state, dtype=torch.bfloat16)
            (d / "training.json").write_text(json.dumps(self.summary(kind), indent=2) + "\n")
            out[kind] = d
        return out

    def summary(self, kind: str) -> dict:
        recent = [h[kind] for h in self.history[-20:] if kind in h]
        avg = {k: round(sum(r[k] for r in recent) / len(recent), 4) for k in recent[0]} if recent else {}
        return {
            "kind": kind,
            "steps": self.step,
            "wall_time_s": round(self.elapsed, 1),
            "tokens_seen": self.tokens_seen,
            "final_losses_last20": avg,
            "draft_vocab_size": len(self.vocab) if self.vocab is not None else 0,
            "draft_vocab_coverage": round(self.vocab_coverage, 4),
            "num_examples": len(self.examples),
            "config": self.cfg,
        }

    # ------------------------------------------------------------------ one batch
    def progress(self) -> float:
        p = self.step / max(1, self.cfg["max_steps"])
        if self.cfg["max_time_min"]:
            p = max(p, self.elapsed / (60 * self.cfg["max_time_min"]))
        if self.cfg["max_tokens"]:
            p = max(p, self.tokens_seen / self.cfg["max_tokens"])
        return min(1.0, p)

    def micro_step(self, tokens, resp, valid, scale: float) -> dict:
        cfg, dev = self.cfg, self.device
        tokens, resp, valid = (x.to(dev, non_blocking=True) for x in (tokens, resp, valid))
        b, s = tokens.shape
        with torch.no_grad():
            t = self.target.forward_train(tokens, valid, self.tli, self.vocab_dev)
            t = {k: v.float() for k, v in t.items()}
            p_log = F.log_softmax(t["logits"], -1)
        loss_mask = torch.zeros_like(resp, dtype=torch.float32)
        loss_mask[:, :-1] = (resp[:, 1:] & valid[:, 1:]).float()
        positions = torch.arange(s, device=dev)[None].expand(b, s)
        causal = masks.causal_mask(b, s, dev)
        stats = {}
        ac = torch.autocast(dev.type, dtype=self.amp) if self.amp else torch.autocast(dev.type, enabled=False)

        def losses(pred, logits, extra=None):
            q_log = F.log_softmax(logits.float(), -1)
            kl = _masked_mean((p_log.exp() * (p_log - q_log)).sum(-1), loss_mask)
            feat = _masked_mean(F.smooth_l1_loss(pred.float(), t["hidden"], reduction="none").mean(-1), loss_mask)
            if extra is not None:
                feat = 0.5 * feat + 0.5 * extra
            acc = _masked_mean((logits.argmax(-1) == t["logits"].argmax(-1)).float(), loss_mask)
            return cfg["kl_weight"] * kl + feat, {"kl": kl.detach(), "feat": feat.detach(), "acc": acc}

        for kind in self.models:
            fwd = self.forwards[kind]
            with ac:
                if kind == "moa":
                    period = torch.randint(cfg["period_min"], cfg["period_max"] + 1, (b,), device=dev)
                    visible = masks.every_t_visible(~resp, period) | ~valid
                    visible[:, 0] = True
                    use_stair = (
                        (torch.rand(b, device=dev) < masks.staircase_probability(self.progress()))
                        if cfg["staircase"]
                        else torch.zeros(b, dtype=torch.bool, device=dev)
                    )
                    sa = masks.self_mask(visible, use_stair)
                    ca = (
                        masks.latest_cross_mask(visible)
                        if cfg["cross_attention_latest_only"]
                        else masks.bounded_cross_mask(visible)
                    )
                    sel = visible & valid
                    fv = fwd["feature"](t["per_layer_kv"][sel])
                    grounding = None
                    if cfg["feature_target_weight"]:
                        # the feature of a verified position should carry the target's final hidden
                        # state there (what EAGLE-style reads directly); without this the LSA is
                        # trained only through the CA, and the drafters it gave predicted no better
                        # from a fresh feature than from one 5 tokens old
                        grounding = F.smooth_l1_loss(fv.float(), t["hidden"][sel])
                    feats = torch.zeros(b, s, fv.shape[-1], dtype=fv.dtype, device=dev)
                    feats = feats.index_put((sel,), fv)
                    hidden, ca_out = fwd["draft"](
                        self.parts,
                        tokens,
                        feats,
                        positions,
                        sa,
                        ca,
                        t["tli_input"] if self.tli else None,
                        ~visible if self.tli else None,
                    )
                    extra = None
                    if self.tli:
                        extra = _masked_mean(
                            F.smooth_l1_loss(ca_out.float(), t["tli_input"], reduction="none").mean(-1), loss_mask
                        )
                    logits = hidden @ self.head_w.T.to(hidden.dtype)
                    loss, st = losses(hidden, logits, extra)
                    if grounding is not None:
                        loss = loss + cfg["feature_target_weight"] * grounding
                        st["ground"] = grounding.detach()
                elif kind == "eagle":
                    prev = torch.zeros_like(t["hidden"])
                    prev[:, 1:] = t["hidden"][:, :-1]
                    if cfg["eagle_noise"]:
                        prev = prev + (torch.rand_like(prev) * 2 - 1) * cfg["eagle_noise"]
                    pred = fwd["draft"](self.parts, tokens, prev, positions, causal)
                    logits = pred @ self.head_w.T.to(pred.dtype)
                    loss, st = losses(pred, logits)
                else:
                    pred = fwd["draft"](self.parts, tokens, positions, causal)
                    logits = pred @ self.head_w.T.to(pred.dtype)
                    loss, st = losses(pred, logits)
            (loss * scale).backward()
            st["loss"] = loss.detach()
            stats[kind] = st
        return stats  # tensors on the device, read once per step (one synchronisation)

    def train(
        self,
        progress_bar: bool = True,
        until_tokens: int = 0,
        until_step: int = 0,
        deadline: float = 0.0,
    ) -> dict[str, Path]:
        """Trains until ``max_steps`` / ``max_time_min`` / ``max_tokens`` (which also set the
        schedule), or earlier at ``until_tokens`` tokens, step ``until_step`` or the
        ``time.monotonic()`` ``deadline`` (a stop that leaves the schedule as it is: a later call
        goes on from there). Saves the training state at the end and every ``save_every_steps``
        steps / ``save_every_min`` minutes, then exports."""
        from tqdm import tqdm

        cfg = self.cfg
        cuda = self.device.type == "cuda"
        workers = int(cfg["loader_workers"])
        stream = loader(self.examples, cfg["batch_size"], cfg["seed"], self.batches_done, workers, pin_memory=cuda)
        budget = 60 * cfg["max_time_min"] if cfg["max_time_min"] else float("inf")
        by_tokens = bool(cfg["max_tokens"])  # the bar counts tokens toward max_tokens, else steps
        bar = tqdm(
            total=cfg["max_tokens"] if by_tokens else cfg["max_steps"],
            initial=self.tokens_seen if by_tokens else self.step,
            disable=not progress_bar,
            mininterval=10,
            dynamic_ncols=True,
            file=sys.stderr,
            unit="tok" if by_tokens else "step",
            unit_scale=by_tokens,
        )
        last_save = time.perf_counter()
        print(
            json.dumps(
                {
                    "event": "start",
                    "examples": len(self.examples),
                    "vocab_coverage": self.vocab_coverage,
                    "step": self.step,
                    "tokens_seen": self.tokens_seen,
                    "params": {k: sum(p.numel() for p in m.parameters()) for k, m in self.models.items()},
                }
            ),
            flush=True,
        )

        def more() -> bool:
            return (
                self.step < cfg["max_steps"]
                and self.elapsed < budget
                and not (cfg["max_tokens"] and self.tokens_seen >= cfg["max_tokens"])
                and not (until_tokens and self.tokens_seen >= until_tokens)
                and not (until_step and self.step >= until_step)
                and not (deadline and time.monotonic() >= deadline)
            )

        while more():
            t0 = time.perf_counter()
            factor = _lr_factor(cfg, self.step, self.progress())
            for o in self.opts.values():
                for g in o.param_groups:
                    g["lr"] = cfg["lr"] * factor
            acc: dict[str, dict] = {}
            ntok = 0
            for _ in range(cfg["grad_accum"]):
                tokens, resp, valid = next(stream)
                self.batches_done += 1
                ntok += int(valid.sum())
                st = self.micro_step(tokens, resp, valid, 1.0 / cfg["grad_accum"])
                for k, v in st.items():
                    for kk, vv in v.items():
                        acc.setdefault(k, {}).setdefault(kk, 0.0)
                        acc[k][kk] = acc[k][kk] + vv / cfg["grad_accum"]
            for k, m in self.models.items():
                acc[k]["gnorm"] = torch.nn.utils.clip_grad_norm_(m.parameters(), cfg["grad_clip"])
                self.opts[k].step()
                self.opts[k].zero_grad(set_to_none=True)
            # the step's statistics in one read from the device
            names = [(k, kk) for k, v in acc.items() for kk in v]
            values = torch.stack([torch.as_tensor(acc[k][kk], dtype=torch.float32).to(self.device) for k, kk in names])
            for (k, kk), v in zip(names, values.tolist()):
                acc[k][kk] = v
            dt = time.perf_counter() - t0
            self.elapsed += dt
            self.step += 1
            self.tokens_seen += ntok
            rec = {
                "step": self.step,
                "elapsed": round(self.elapsed, 1),
                "lr": cfg["lr"] * factor,
                "tokens_seen": self.tokens_seen,
                "tok_s": round(ntok / dt, 1),
                **{k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in acc.items()},
            }
            self.history.append(rec)
            eta = min((cfg["max_steps"] - self.step) * dt, budget - self.elapsed)
            if cfg["max_tokens"]:
                eta = min(eta, (cfg["max_tokens"] - self.tokens_seen) / max(ntok, 1) * dt)
            bar.update(ntok if by_tokens else 1)
            bar.set_postfix_str(
                " ".join(f"{k}:loss={v['loss']:.3f},kl={v['kl']:.2f},acc={v['acc']:.2f}" for k, v in acc.items())
                + f" tokens={self.tokens_seen / 1e6:.2f}M tok/s={ntok / dt:.0f} eta={eta / 60:.1f}m"
            )
            if self.step % cfg["log_every"] == 0 or self.step == 1:
                print(json.dumps({**rec, "eta_min": round(eta / 60, 1)}), flush=True)
            due_steps = cfg["save_every_steps"] and self.step % cfg["save_every_steps"] == 0
            if due_steps or time.perf_counter() - last_save > 60 * cfg["save_every_min"]:
                self.save()
                last_save = time.perf_counter()
        bar.close()
        self.save()
        print(
            json.dumps({"event": "done", "step": self.step, "elapsed": self.elapsed, "tokens_seen": self.tokens_seen}),
            flush=True,
        )
        return self.export()


def run(cfg: dict, resume: bool = True, progress_bar: bool = True) -> dict[str, Path]:
    tr = Trainer(cfg)
    if resume and tr.resume():
        print(json.dumps({"event": "resumed", "step": tr.step, "elapsed": tr.elapsed}), flush=True)
    return tr.train(progress_bar)


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides)
    if args.resume and args.no_resume:
        raise SystemExit("moa train: --resume and --no-resume are exclusive")
    if args.resume and not (Path(cfg["out_dir"]) / "train_state.pt").is_file():
        raise SystemExit(f"moa train --resume: no training state in out_dir {cfg['out_dir']}")
    out = run(cfg, resume=not args.no_resume)
    for kind, d in out.items():
        print(f"{kind}: {d}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("train", help="distil MoA (+ EAGLE-style and independent baseline) drafters from a target")
    p.add_argument("--config", default=None, help="YAML file of hyper-parameters (drafter/configs/*.yaml)")
    p.add_argument("--no-resume", action="store_true", help="start over even if out_dir has a training state")
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on from out_dir's training state, and fail if there is none (without either flag: "
        "go on from it if there is one)",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides of the config (e.g. max_steps=200 lr=5e-4)")
    p.set_defaults(func=cmd_train)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moa train")
    sub = ap.add_subparsers(dest="cmd")
    register(sub)
    args = ap.parse_args(["train", *(argv if argv is not None else sys.argv[1:])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
