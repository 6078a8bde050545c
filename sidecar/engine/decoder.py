"""A pair's generation on one target context: a Sequence stepped by the StepLoop.

`Decoder` is the engine's face for one request at a time: it holds what a pair adds to a target
(the drafter, the speculation settings, the cost model) and runs each request as an
engine.sequence.Sequence through an engine.step.StepLoop over the target's context. How a round
drafts, verifies and stays lossless is told in engine.sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from sidecar.engine.adaptive import SpeculativeConfig
from sidecar.engine.cost import CostModel
from sidecar.engine.drafters import Drafter
from sidecar.engine.evidence import Evidence
from sidecar.engine.hybrid import HybridDrafter
from sidecar.engine.llama import Context
from sidecar.engine.logprobs import Logprobs
from sidecar.engine.sequence import InvalidToken, Item, PromptTooLong, Request, Result, Sequence
from sidecar.engine.step import StepLoop

# The engine's public face for the runtime: one request at a time, its values and its refusals.
__all__ = ["Decoder", "InvalidToken", "Item", "Logprobs", "PromptTooLong", "Request", "Result"]


class Decoder:
    """Generates from one target Context, optionally with a drafter. Runs on the context's thread."""

    def __init__(
        self,
        target: Context,
        drafter: Drafter | HybridDrafter | None = None,
        config: SpeculativeConfig | None = None,
        cost: CostModel | None = None,
    ) -> None:
        self.target = target
        self.drafter = drafter if drafter is None or isinstance(drafter, HybridDrafter) else HybridDrafter([drafter])
        self.config = config or SpeculativeConfig()
        self.cost = cost or CostModel(self.config.n_max + 1)
        self.evidence = Evidence(self.config.acceptance_prior, self.config.prior_weight)

    def generate(self, req: Request, cancelled: Callable[[], bool] = lambda: False) -> Iterator[Item]:
        """Yield text pieces as they are final, then one Result; with `logprobs`, a Logprobs item
        before the text of the tokens it describes."""
        target = self.target
        yield from StepLoop(target).run(req.prompt, lambda _: Sequence(
            target.weights, target.n_ctx, target.n_batch, req, self.drafter, self.config, self.cost, cancelled,
            self.evidence))
