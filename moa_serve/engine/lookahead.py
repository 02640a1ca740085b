"""Lookahead: verify calls pipelined across rounds.

A round without drafts whose successor can be predicted sends the next round's verify call
before its own returns: each session continues from the committed length the current call is
predicted to leave (the replica holds those tokens: it computed them), no tokens sent, no
features. So the verifier is never idle while the Router commits and streams. A session the
prediction misses (a stop token before the end of the call, an abort) costs a discarded row and
resends its tokens whole next round."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Hashable

from moa_serve.engine.events import Tracked
from moa_serve.engine.pool_calls import PoolCalls, resend_whole
from moa_serve.engine.round_stats import ServiceStats
from moa_serve.engine.session import Session
from moa_serve.protocol import VerifyRequest, VerifyResult

log = logging.getLogger(__name__)


@dataclass
class Ahead:
    """A verify call sent before the previous one came back: it continues each of its sessions
    from ``bases`` (the committed length the previous call was predicted to leave) and asks for
    ``asked`` tokens each."""

    task: asyncio.Future
    bases: dict[str, int]
    asked: dict[str, int]


class Lookahead:
    def __init__(self, calls: PoolCalls, stats: ServiceStats, enabled: bool, decode_steps: int):
        self.calls, self.stats = calls, stats
        self.enabled, self.decode_steps = enabled, decode_steps
        self._ahead: dict[Hashable, Ahead] = {}

    def take(self, g: Hashable) -> Ahead | None:
        """The call sent ahead for group ``g``'s next round, if any."""
        return self._ahead.pop(g, None)

    def possible(self, batch: list[Tracked], drafting: bool, drafts: dict, want: bool | set[str], queued: bool) -> bool:
        """A round whose successor can be predicted: no drafts now and none next (``drafting``:
        whether the next round could draft), no features, no remote client, no prompt still
        prefilling or unknown to the verifier, nobody queued (they would wait one more call)."""
        return (
            self.enabled
            and not drafting
            and not drafts
            and not queued
            and (want is False or (isinstance(want, set) and not want))
            and not any(
                t.remote or t.session.prefilling or t.session.verifier_base == 0 or t.session.finished for t in batch
            )
        )

    def send(self, g: Hashable, sessions: list[Session], bases: dict[str, int]) -> None:
        reqs, asked = lookahead_requests(sessions, bases, self.decode_steps)
        if not reqs:
            return
        self.stats.lookahead_calls += 1
        self._ahead[g] = Ahead(self.calls.verify_ahead(g, reqs), {r.session_id: r.base for r in reqs}, asked)

    def drop(self, g: Hashable, active: list[Tracked]) -> None:
        """Cancels the call sent ahead: what it did on the replica is unknown, so its sessions
        resend their tokens whole."""
        ahead = self._ahead.pop(g, None)
        if ahead is not None:
            ahead.task.cancel()
            for t in active:
                if t.session.id in ahead.bases:
                    t.session.verifier_base = 0

    async def results(
        self, g: Hashable, live: list[Tracked], ahead: Ahead, active: list[Tracked]
    ) -> tuple[dict[str, Session], dict[str, VerifyResult]] | None:
        """The results of the call sent ahead for the sessions that hold exactly what it assumed
        (by id: session, result); the others (a stop token before the end of the previous call)
        resend whole. None when the call failed (its sessions resync)."""
        try:
            replies = await ahead.task
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.stats.lookahead_failures += 1
            log.warning("lookahead verify call failed (%s: %s); its sessions resync", type(exc).__name__, exc)
            self.drop(g, active)
            resend_whole([t.session for t in live])
            return None
        by_id = {t.session.id: t.session for t in live if len(t.session.tokens) == ahead.bases[t.session.id]}
        for t in live:
            if t.session.id not in by_id:  # mispredicted: the replica holds tokens this session does not
                t.session.verifier_base = 0
        results = {r.session_id: r for r in replies if r.session_id in by_id}
        self.stats.lookahead_discarded += len(replies) - len(results)
        return by_id, results

    async def stop(self) -> None:
        tasks = [a.task for a in self._ahead.values()]
        self._ahead.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def lookahead_requests(
    sessions: list[Session], bases: dict[str, int], decode_steps: int
) -> tuple[list[VerifyRequest], dict[str, int]]:
    """A draft-free verify call sent before the previous one returned: each session continues from
    ``bases[id]``, the committed length that call is predicted to leave (the replica holds those
    tokens: it returned them), no tokens sent, no features. Sessions with no room left are not in
    it. Returns the requests and the tokens each asks for (the next prediction)."""
    reqs, asked = [], {}
    for s in sessions:
        steps, room = s.step_budget(bases[s.id], decode_steps)
        if room <= 0:
            continue
        asked[s.id] = steps
        reqs.append(
            VerifyRequest(
                s.id,
                [],
                [],
                None,
                s.sampling,
                False,
                base=bases[s.id],
                decode_steps=steps,
                max_tokens=room if steps > 1 else 0,
                stop_token_ids=tuple(sorted(s.stop_token_ids)),
                grammar=s.grammar,
                grammar_start=s.grammar_start,
                logprobs=s.logprobs,
            )
        )
    return reqs, asked
