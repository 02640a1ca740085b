"""How often would proactive drafting (drafting the next round while the current one is being
verified, as SpecEdge does) pay in client-server mode? For each round of Spec-Bench's 13
questions: the device drafts k, guesses the outcome 'all k accepted, then the drafter's (k+1)-th
token', and would have the next round's drafts ready iff the committed tokens equal
drafts + [guess]. Prints the hit rate (docs/client-server.md).

    MOA_MODEL_DIR=../shared/models python tools/bench/proactive_hits.py drafter/checkpoints/smollm2-135m-instruct-moa 2
"""

import json
import sys

from moa_serve.commands.bench import DEFAULT_QUESTIONS, load_questions
from moa_serve.drafter.training.data import prompt_ids
from moa_serve.engine.local import SpeculativeEngine
from moa_serve.protocol import DraftRequest

target = "HuggingFaceTB/SmolLM2-135M-Instruct"
drafter, K = sys.argv[1], int(sys.argv[2])
eng = SpeculativeEngine.load(target, drafter, "float32", max_sessions=1)
inner = eng.proposer


class Guessing:
    def __init__(self, p):
        self.p, self.held, self.pending, self.hits, self.rounds, self.full = p, {}, {}, 0, 0, 0

    def __getattr__(self, n):
        return getattr(self.p, n)

    def propose(self, reqs):
        asked = []
        for r in reqs:
            toks = self.held.get(r.session_id, [])[: r.base] + list(r.tokens)
            self.held[r.session_id] = toks
            pend = self.pending.pop(r.session_id, None)
            if pend is not None:
                start, drafts, guess = pend
                new = toks[start:]
                self.rounds += 1
                self.full += new[: len(drafts)] == drafts
                self.hits += new == drafts + [guess]
            asked.append(
                DraftRequest(
                    r.session_id,
                    r.tokens,
                    r.num_drafts + 1 if r.num_drafts else 0,
                    r.feature_start,
                    r.features,
                    r.sampling,
                    r.base,
                )
            )
        out = self.p.propose(asked)
        for r, res in zip(reqs, out):
            if r.num_drafts and len(res.drafts) == r.num_drafts + 1 and not res.resync:
                self.pending[r.session_id] = (len(self.held[r.session_id]), res.drafts[:-1], res.drafts[-1])
                res.drafts = res.drafts[:-1]
                if res.probs is not None:
                    res.probs = res.probs[:-1]
        return out


g = Guessing(inner)
eng.proposer = g
qs = load_questions(DEFAULT_QUESTIONS, per_category=1)
for q in qs:
    ids = prompt_ids(eng.tokenizer, [{"role": "user", "content": q["turns"][0]}])
    eng.generate([ids], 64, num_speculative_tokens=K)
print(
    json.dumps(
        {
            "drafter": drafter,
            "k": K,
            "rounds": g.rounds,
            "all_accepted": round(g.full / g.rounds, 3),
            "hit": round(g.hits / g.rounds, 3),
        }
    )
)
