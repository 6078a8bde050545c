"""Several drafters behind one: each round drafts from the source the schedule expects most of.

A pair may draft from the request's own text (n-gram), from earlier requests' outputs (the suffix
cache) and from a draft model. Which one pays changes from round to round: a long verbatim match is
near-certain and costs nothing, a model draft costs its steps but guesses text never seen before.
So the choice is not a fixed precedence but the schedule's (engine.schedule), which prices every
source by its own support class and cost: each sequence offers every ready source's draft in its
menu (Sequence.menu), and proposes from the one the step picks. Where a long match is near-certain
the free source's expected gain is the larger, and the model's draft pass is skipped, the outcome
of llama.cpp's rule (PR #22397: the draftless source first) reached by pricing.

Each source's classes are its own: evidence is keyed by (source name, class) (evidence.Key), and
the names of a hybrid's sources differ, so two sources' classes never mix. The decoder holds a
lone drafter as a one-source hybrid.

A model source's KV cache needs nothing here: ModelDrafter reuses the prefix it shares with the
context and prefills what it missed, however many rounds it sat out; the schedule prices that
catch-up (the `lag` its look reports). A sequence looks at every source each round with
`propose(i, context, 0)`, which drafts nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.engine.drafters import Drafter, Learner, Proposal
from sidecar.engine.grammar import Grammar
from sidecar.engine.sampling import Sampler


class HybridDrafter:
    """Drafters that take turns; the hybrid starts, shifts and finishes them all together."""

    def __init__(self, sources: Sequence[Drafter]) -> None:
        names = [s.name for s in sources]
        if not names:
            raise ValueError("a hybrid drafter needs at least one source")
        if len(set(names)) < len(names):
            raise ValueError(f"each source of a hybrid drafter needs its own name, not {names}")
        if sum(s.has_cost for s in sources) > 1:
            # The cost model times one draft model's steps and catch-up (CostModel.t_draft).
            raise ValueError("a hybrid drafter takes at most one draft model")
        self.sources = list(sources)
        self.name = "+".join(names)
        self.has_cost = any(s.has_cost for s in sources)
        self._seen: Sequence[int] | None = None

    def begin(self, sampler: Sampler, seen: Sequence[int] | None = None) -> None:
        """Start a request. `seen`, when given, is everything the request has seen, growing with
        its output: its whole conversation, also what the window cut or a context shift left out.
        Sources that cost no model pass (n-gram, suffix) look up in it instead of the window they
        are handed: a file or a tool call the conversation already holds is their best draft,
        wherever it sits. Its end is the window's end, so their drafts continue the same tokens.
        A draft model reads the window, which is what its own cache holds."""
        self._seen = seen
        for s in self.sources:
            s.begin(sampler)
            if seen is not None and not s.has_cost:
                # Index the conversation now, at admission, not in the request's first menu: at
                # 6k tokens the n-gram index is ~15 ms of dictionary inserts, which the host's fit
                # (engine.hosttime) took for the price of that step's draft.
                s.propose(seen, 0)

    def _context(self, source: Drafter, context: Sequence[int]) -> Sequence[int]:
        return context if self._seen is None or source.has_cost else self._seen

    def propose(self, source: int, context: Sequence[int], max_tokens: int, grammar: Grammar | None) -> Proposal:
        s = self.sources[source]
        return s.propose(self._context(s, context), max_tokens, grammar)

    def shift(self, context: Sequence[int], keep: int, discard: int) -> None:
        for s in self.sources:
            s.shift(context, keep, discard)

    def finish(self, prompt: Sequence[int], output: Sequence[int], done_reason: str) -> None:
        """Hand a finished request to the sources that learn from it (drafters.Learner)."""
        for s in self.sources:
            if isinstance(s, Learner):
                s.finish(prompt, output, done_reason)

