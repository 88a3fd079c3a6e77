"""Test drafters for speculative decoding (engine/spec/drafter.py's contract), built from reference outputs.

- `OracleDrafter(refs)`: proposes the target's own greedy continuation (the reference whose prefix the query's
  tokens are): every draft is accepted.
- `WrongDrafter(refs)`: proposes a token different from the reference's at every position: nothing is accepted.
- `RejectAtDrafter(refs, k)`: correct up to position j, then wrong, with j cycling 0, 1, …, k (k: all correct), so
  a run sees a rejection at every draft position.
Queries that match no reference get no drafts (they run plain).
"""

from __future__ import annotations

from engine.spec.drafter import Draft, Drafter


class OracleDrafter(Drafter):
    def __init__(self, refs: list[list[int]], vocab: int = 1 << 30):
        self.refs = [list(r) for r in refs]
        self.vocab = vocab
        self.observed: dict[str, int] = {}  # req id -> next position expected by `observe`'s contract
        self.proposals = 0

    def _continuation(self, tokens, n: int) -> list[int] | None:
        for ref in self.refs:
            if len(ref) > len(tokens) and ref[: len(tokens)] == list(tokens):
                return ref[len(tokens): len(tokens) + n]
        return None

    def wrong_from(self, draft: list[int]) -> int:
        return len(draft) + 1  # every position is right

    def propose(self, queries):
        out = []
        for q in queries:
            draft = self._continuation(q.token_ids, q.num_tokens)
            if draft is None:
                out.append(Draft(()))
                continue
            bad = self.wrong_from(draft)
            self.proposals += 1
            out.append(Draft(tuple(t if i < bad else (t + 1) % self.vocab for i, t in enumerate(draft))))
        return out

    def observe(self, req_id, start, token_ids, hidden):
        assert hidden is None  # no taps
        self.observed[req_id] = start + len(token_ids)

    def rollback(self, req_id, num_tokens):
        self.observed[req_id] = min(self.observed.get(req_id, 0), num_tokens)

    def release(self, req_id):
        self.observed.pop(req_id, None)


class WrongDrafter(OracleDrafter):
    def wrong_from(self, draft):
        return 0


class RejectAtDrafter(OracleDrafter):
    def __init__(self, refs, k: int, vocab: int = 1 << 30):
        super().__init__(refs, vocab)
        self.k = k

    def wrong_from(self, draft):
        return self.proposals % (self.k + 1)
