"""The adaptive draft length: the expected-tokens formula, the cost model, and the fallback logic.

CostModel is built by hand (t_step[n] = seconds to verify n rows), so each test states the hardware
it pretends to run on: a GPU-like flat curve, or a CPU-like one where rows cost nearly linearly.
A plan here has one source (tests/test_hybrid.py has several).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from sidecar.engine import adaptive, timing
from sidecar.engine.adaptive import DEPTH_MAX, KV_BLOCK, CostModel, SpeculativeConfig, Step, expected_tokens
from sidecar.engine.drafters import Support
from sidecar.engine.llama import Context, ContextParams, Weights
from sidecar.engine.planner import RETRY_TOKENS, Plan
from sidecar.engine.rounds import PLAIN, Key, Round, Source

pytestmark = pytest.mark.model

INF = math.inf
# Seconds to verify 1..9 rows. GPU: one pass costs about the same for any n.
FLAT = [1.0 + 0.02 * i for i in range(9)]
# SmolLM2 on 2 CPU cores (module docstring): a batch of 4 ~2.4x one token, a batch of 8 ~4.1x.
CPU = [1.0, 1.5, 1.9, 2.4, 2.8, 3.1, 3.5, 3.8, 4.1]
# Every row costs a full step: no k can beat plain decoding.
LINEAR = [float(n) for n in range(1, 10)]


def cost(t_step: Sequence[float], t_draft: float = 0.0) -> CostModel:
    model = CostModel(len(t_step))
    model.t_step = [0.0, *t_step]
    model.t_draft = t_draft
    return model


def plan(t_step: Sequence[float], num_predict: int = -1, draft_has_cost: bool = False,
         t_draft: float = 0.0, **config: float) -> Plan:
    """A plan over one source; a costly one is past its exploratory probe (see the test of it)."""
    c = cost(t_step, t_draft)
    c.explored.add("draft")
    return Plan.start(SpeculativeConfig(**config), c, [Source(has_cost=draft_has_cost)],  # type: ignore[arg-type]
                      num_predict)


# -- expected tokens -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "k", "expected"),
    [
        (0.8, 4, 3.3616),  # the paper's table: alpha 0.8, gamma 4 -> 3.36
        (0.6, 2, 1.96),
        (0.9, 8, 6.12579511),
        (0.5, 1, 1.5),
        (0.7, 0, 1.0),  # no draft: the target's own token
        (0.0, 5, 1.0),  # every draft rejected: still the correction token
        (1.0, 5, 6.0),  # every draft accepted, plus the bonus token
    ],
)
def test_expected_tokens_values(a: float, k: int, expected: float) -> None:
    assert expected_tokens(a, k) == pytest.approx(expected, rel=1e-8)


def test_expected_tokens_grows_with_k_and_acceptance() -> None:
    for a in (0.1, 0.5, 0.9):
        values = [expected_tokens(a, k) for k in range(10)]
        assert values == sorted(values)
        assert values[-1] < 1 / (1 - a)  # bounded by the geometric series
    assert expected_tokens(0.4, 4) < expected_tokens(0.6, 4) < expected_tokens(0.99, 4) < 5


# -- cost model ------------------------------------------------------------------------------------


def test_observe_step_seeds_then_smooths() -> None:
    model = CostModel(4)
    model.observe_step(2, 1.0)
    assert model.t_step[2] == 1.0
    model.observe_step(2, 2.0)
    assert model.t_step[2] == pytest.approx(1.2)
    model.observe_step(9, 5.0)  # larger than the table: ignored
    assert len(model.t_step) == 5


def test_observe_draft_is_per_token() -> None:
    model = CostModel(4)
    model.observe_draft(4, 0.2)
    assert model.t_draft == pytest.approx(0.05)
    model.observe_draft(0, 9.0)  # nothing drafted: nothing learnt
    assert model.t_draft == pytest.approx(0.05)


def test_verify_curve_is_relative_to_one_row() -> None:
    assert cost([0.5, 1.0, 2.0]).verify_curve() == [1.0, 2.0, 4.0]


class FakeContext:
    """Just enough of engine.llama.Context for calibrate(), on a fake clock."""

    def __init__(self, clock: list[float], seconds: dict[int, list[float]]) -> None:
        self.clock = clock
        self.seconds = seconds  # per batch size, successive timings (the last one repeats)
        self.tokens: list[int] = []
        self.n_ctx = 4096

    def __len__(self) -> int:
        return len(self.tokens)

    def clear(self) -> None:
        self.tokens = []

    def prefill(self, tokens: Sequence[int]) -> None:
        self.tokens += list(tokens)

    def truncate(self, n: int) -> None:
        self.tokens = self.tokens[:n]

    def decode(self, tokens: Sequence[int]) -> None:
        times = self.seconds[len(tokens)]
        self.clock[0] += times.pop(0) if len(times) > 1 else times[0]
        self.tokens += list(tokens)


def test_calibrate_keeps_the_fastest_run_and_flattens_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Minimum over repetitions per size; a bigger batch is never recorded as cheaper; cache emptied."""
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    seconds = {
        1: [9.0, 1.0, 5.0, 1.0],  # warm-up, then a burst of load in one repetition
        2: [1.5, 1.4, 1.6],
        3: [1.3],  # noise: "faster" than 2 rows
    }
    ctx = FakeContext(clock, seconds)
    model = CostModel(3)
    model.calibrate(ctx, reps=3)  # type: ignore[arg-type]
    assert model.t_step[0] == 0.0
    assert model.t_step[1:] == pytest.approx([1.0, 1.4, 1.4])
    assert model.t_switch == 0.0  # a step after a batch costs what any step does
    assert len(ctx) == 0


class GraphContext(FakeContext):
    """A GPU's clock: one-token steps in a row replay a captured graph (1 s each); the two steps
    after a batch run without it while it is rebuilt (3 s each); a batch costs 3.5 s."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__(clock, {})
        self.singles = 0

    def decode(self, tokens: Sequence[int]) -> None:
        if len(tokens) == 1:
            self.clock[0] += 1.0 if self.singles >= 2 else 3.0
            self.singles += 1
        else:
            self.clock[0] += 3.5
            self.singles = 0
        self.tokens += list(tokens)


def test_calibrate_times_steady_steps_and_what_a_batch_costs_them(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    model = CostModel(4)
    model.calibrate(GraphContext(clock), reps=2)  # type: ignore[arg-type]
    assert model.t_step[1:] == pytest.approx([1.0, 3.5, 3.5, 3.5])  # plain decoding is steps in a row
    assert model.t_switch == pytest.approx(2 * (3.0 - 1.0))


class ShapeContext(GraphContext):
    """A GPU's clock, with batches too: a batch of the previous decode's shape replays its graph
    (1 + 0.1 s a row); any other batch costs 3.5 s."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__(clock)
        self.last = 0

    def decode(self, tokens: Sequence[int]) -> None:
        if len(tokens) > 1:
            self.clock[0] += 1.0 + 0.1 * len(tokens) if len(tokens) == self.last else 3.5
            self.singles = 0
            self.tokens += list(tokens)
        else:
            super().decode(tokens)
        self.last = len(tokens)


def test_calibrate_times_a_batch_of_the_previous_shape_where_that_is_cheaper(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    gpu = CostModel(4)
    gpu.calibrate(ShapeContext(clock), reps=2)  # type: ignore[arg-type]
    assert gpu.t_step[1:] == pytest.approx([1.0, 3.5, 3.5, 3.5])
    assert gpu.t_same[1:] == pytest.approx([1.0, 1.2, 1.3, 1.4])
    cpu = CostModel(4)
    cpu.calibrate(GraphContext(clock), reps=2)  # type: ignore[arg-type]
    assert cpu.t_same == []  # no cheaper: the planner never pads


def test_observe_step_keeps_same_shape_decodes_apart() -> None:
    model = cost([1.0, 3.5, 3.5])
    model.t_same = [0.0, 1.0, 1.5, 1.6]
    model.observe_step(3, 2.6, same=True)
    assert (model.t_same[3], model.t_step[3]) == (pytest.approx(1.8), 3.5)
    model.observe_step(3, 4.5)
    assert model.t_step[3] == pytest.approx(3.7)
    cpu = cost([1.0, 1.5, 1.9])
    cpu.observe_step(3, 2.9, same=True)  # nothing measured apart: one table
    assert cpu.t_step[3] == pytest.approx(2.1) and cpu.t_same == []


def test_on_a_gpu_starting_a_batch_must_repay_the_graph_it_interrupts() -> None:
    """A draft expected to yield 4.3 tokens for a 3.5-step batch pays while batches run anyway
    (after the prompt's prefill, or another batch), not once plain steps are at full speed again."""
    p = plan([1.0] + [3.5] * 8)
    p.cost.t_switch = 4.0
    p.sources[0].support = lambda: Support(cls=1, prior=0.8)
    assert p.decide(0, INF, 100).k == 8  # right after the prompt: the graph is cold anyway
    for produced in (1, 2):
        p.record(PLAIN, drafted=0, accepted=0, draft_seconds=0.0, verify_seconds=1.0, produced=produced)
    assert p.decide(2, INF, 100).k == 0


# -- draft length ----------------------------------------------------------------------------------


def test_short_num_predict_runs_target_only() -> None:
    p = plan(FLAT, num_predict=8)
    assert not p.enabled
    assert p.fallback is not None and "short output" in p.fallback
    assert all(p.decide(i, 8 - i, 100).k == 0 for i in range(8))


@pytest.mark.parametrize("num_predict", [-1, 16, 500])
def test_long_or_unlimited_output_speculates(num_predict: int) -> None:
    p = plan(FLAT, num_predict=num_predict)
    assert p.enabled and p.fallback is None
    assert p.decide(0, INF if num_predict < 0 else num_predict, 100).k > 0


def test_cheap_verification_drafts_longer_than_costly_verification() -> None:
    """GPU-like flat curve: the longest draft allowed; CPU-like curve: a short one, but still one."""
    k_gpu = plan(FLAT).decide(0, INF, 100).k
    k_cpu = plan(CPU).decide(0, INF, 100).k
    assert k_gpu == 8
    assert 1 <= k_cpu < k_gpu


def test_draft_cost_shortens_the_draft() -> None:
    free = plan(CPU).decide(0, INF, 100).k
    paid = plan(CPU, draft_has_cost=True, t_draft=0.3).decide(0, INF, 100).k
    assert paid < free


@pytest.mark.parametrize(
    ("remaining", "room", "n_max", "cap"),
    [(INF, 100, 8, 8), (4, 100, 8, 3), (INF, 2, 8, 2), (INF, 100, 3, 3), (1, 100, 8, 0)],
)
def test_draft_length_respects_its_caps(remaining: float, room: int, n_max: int, cap: int) -> None:
    """At most n_max, one less than the tokens still wanted, the room left in the context."""
    assert plan(FLAT, n_max=n_max).decide(0, remaining, room).k == cap


def test_draft_length_never_exceeds_the_measured_table() -> None:
    assert plan(FLAT[:4], n_max=16).decide(0, INF, 100).k == 3  # t_step has rows 1..4


def test_costly_verification_without_evidence_falls_back() -> None:
    """When verifying k+1 rows costs k+1 steps, no draft pays even at the prior acceptance."""
    for p in (plan(LINEAR), plan(LINEAR, draft_has_cost=True, t_draft=0.1)):
        assert p.decide(0, INF, 100).k == 0
        assert p.fallback == "verification too costly on this hardware"


FOUR = Round(k=4, rows=5)


def _record_rejections(p: Plan, rounds: int, t_step: Sequence[float], rnd: Round = FOUR) -> None:
    # Verification timings equal to the model's, so the cost model does not move.
    for _ in range(rounds):
        p.record(rnd, drafted=4, accepted=0, draft_seconds=0.0, verify_seconds=t_step[4], produced=0)


def test_low_acceptance_on_costly_hardware_backs_off_then_probes_again() -> None:
    """After rejected drafts on a CPU-like curve the plan stops drafting, but probes after
    probe_interval plain steps, then after twice as many, in full. The probe budget is lifted here;
    a later test covers it."""
    p = plan(CPU, draft_has_cost=True, probe_interval=4, fallback_rounds=1000, probe_budget=1.0)
    rnd = p.decide(0, INF, 100)
    assert rnd.k > 0
    _record_rejections(p, 5, CPU, rnd)
    assert p.acceptance(rnd) == pytest.approx(0.35 / 5.5)  # (0 + 0.7 x 0.5) / (5 + 0.5)
    ks = [p.decide(i, INF, 100).k for i in range(12)]
    assert ks == [0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 8]
    assert p.fallback == "draft does not pay: acceptance 0.06"


def test_acceptance_evidence_brings_drafting_back() -> None:
    p = plan(CPU, probe_interval=4, fallback_rounds=1000)
    _record_rejections(p, 5, CPU)
    assert p.decide(0, INF, 100).k == 0
    for _ in range(20):
        p.record(Round(k=4, rows=5), drafted=4, accepted=4, draft_seconds=0.0, verify_seconds=CPU[4], produced=0)
    assert p.acceptance(Round()) > 0.9
    assert p.decide(0, INF, 100).k > 1


def test_record_switches_off_when_slower_than_plain_decoding() -> None:
    """Realised throughput of a costly draft below margin x plain rate: off for probe_interval tokens.

    Here the model's estimate is wrong (drafting takes 2.5 steps a round that it did not expect), so
    realised throughput is what switches it off; after the back-off it drafts again."""
    p = plan(FLAT, draft_has_cost=True)  # fallback_rounds 8, margin 0.97, probe_interval 32
    for i in range(7):
        p.record(Round(k=4, rows=5), drafted=4, accepted=2, draft_seconds=2.5, verify_seconds=FLAT[4], produced=i + 1)
        assert p.fallback is None
    p.record(Round(k=4, rows=5), drafted=4, accepted=2, draft_seconds=2.5, verify_seconds=FLAT[4], produced=8)
    assert p.fallback is not None and p.fallback.startswith("slower than target-only")
    assert "at acceptance 0.50" in p.fallback
    assert [p.decide(n, INF, 100).k for n in (8, 20, 39)] == [0, 0, 0]
    p.cost.t_draft = 0.0  # the slow rounds were a burst of load: drafting is as cheap as it was
    assert p.decide(40, INF, 100).k > 0


def test_a_free_source_is_not_switched_off_by_realised_throughput() -> None:
    """Rounds of a free draft that lose are its class's evidence, not a verdict on the drafter: a
    long match still drafts right after short ones failed."""
    p = classed(plan(CPU), key=1, prior=0.5)
    rnd = Round(k=4, rows=5, support=p.sources[0].support())
    for i in range(16):
        p.record(rnd, drafted=4, accepted=0, draft_seconds=0.0, verify_seconds=CPU[4], produced=i + 1)
    assert p.fallback is None
    assert classed(p, key=5, prior=0.95).decide(16, INF, 100).k > 0


def test_starting_to_draft_takes_a_margin_but_staying_on_does_not() -> None:
    """At a predicted speed-up of 1.02 a plan that is off stays off, and one that drafts goes on."""
    # a = 0.7, k = 1: E = 1.7 tokens for 1.667 steps, a predicted 1.02x; longer drafts do worse.
    curve = [1.0, 1.667, 2.6, 3.5, 4.4, 5.3, 6.2, 7.1, 8.0]
    p = plan(curve, draft_has_cost=True, min_gain=1.05)
    assert p.decide(0, INF, 100).k == 0
    p = plan(curve, draft_has_cost=True, min_gain=1.0)
    assert p.decide(0, INF, 100).k == 1
    p.config = SpeculativeConfig(min_gain=1.05)
    assert p.decide(1, INF, 100).k == 1


def test_in_a_shared_step_staying_on_takes_the_margin_too() -> None:
    """Beside three plain rows a copy that holds 96% of the time is priced at 1.03x the step's plain
    rate: it drafts where `min_gain` is 1.0, and at 1.05 a plan that drafted it last round stops.
    Alone, staying on needs only to beat plain (the test above); in a shared step a price is about
    10% off per decode (bench/replay_prices.py), and the other streams pay for a coin toss."""
    shared = Step(0, ((1, 1), (2, 1), (3, 1)), 3.0)
    p = Plan.start(SpeculativeConfig(min_gain=1.0), cost(CPU), [Source()], -1)  # type: ignore[list-item]
    p._evidence[Key("draft", 0)] = [0.96e6, 0.04e6]
    assert p.decide(0, INF, 100, shared).k == 8
    p.config = SpeculativeConfig(min_gain=1.05)
    assert p.decide(9, INF, 100, shared).k == 0


def test_record_keeps_speculation_when_it_pays() -> None:
    p = plan(FLAT)
    for i in range(16):
        p.record(Round(k=4, rows=5), drafted=4, accepted=3, draft_seconds=0.01, verify_seconds=FLAT[4], produced=4 * i)
    assert p.fallback is None
    assert p.decide(64, INF, 100).k > 0


def test_evidence_carries_over_to_the_next_request() -> None:
    """A pair's acceptance outlives a request: a draft that never agrees is probed late next time,
    and one that always agrees drafts from the first round."""
    bad = plan(CPU, draft_has_cost=True, t_draft=0.3)
    for _ in range(10):
        bad.record(Round(k=4, rows=5), drafted=4, accepted=0, draft_seconds=1.2, verify_seconds=CPU[4], produced=0)
    nxt = Plan.start(bad.config, bad.cost, [Source(has_cost=True)], -1)
    assert [nxt.decide(i, INF, 100).k for i in range(bad.config.probe_interval * 2)] == [0] * 64
    good = plan(FLAT, draft_has_cost=True, t_draft=0.01)
    for _ in range(10):
        good.record(Round(k=8, rows=9), drafted=8, accepted=8, draft_seconds=0.08, verify_seconds=FLAT[8], produced=0)
    assert Plan.start(good.config, good.cost, [Source(has_cost=True)], -1).decide(0, INF, 100).k == 8


def test_a_costly_probe_waits_until_the_budget_covers_it() -> None:
    """Probing a model draft that does not pay means prefilling what it missed, then drafting: it
    waits for enough target-only steps that the probe stays within probe_budget of them."""
    lag = 1000
    p = plan(LINEAR, draft_has_cost=True, t_draft=0.3, probe_interval=4, probe_budget=0.05)
    p.cost.t_catchup = 0.02
    p.sources[0].lag = lambda: lag
    # probe = 1000 x 0.02 + 8 x 0.3 + (9 - 1) = 30.4 steps; 5% of the idle time: 608 idle steps.
    rounds = [p.decide(i, INF, 100) for i in range(608)]
    ks = [rnd.k for rnd in rounds]
    assert ks.index(8) == 607 and sum(ks) == 8
    p.record(rounds[607], drafted=8, accepted=0, draft_seconds=2.4 + 20, verify_seconds=9.0, produced=608,
             step_seconds=2.4, caught_up=1000)
    lag = 0  # a caught-up draft: 10.4 steps, so 208 idle steps
    ks = [p.decide(i, INF, 100).k for i in range(300)]
    assert ks.index(8) == 207


def test_the_probe_budget_counts_the_pairs_earlier_requests() -> None:
    """The same 30.4-step probe (1,000 tokens to catch up) within 5% of the target-only time: no
    request of 200 tokens affords it alone, but the pair's plain steps add up across requests, so
    the fourth request (608 steps in all) probes."""
    c = cost(LINEAR, 0.3)
    c.t_catchup = 0.02
    c.explored.add("draft")
    config = SpeculativeConfig(probe_interval=4, probe_budget=0.05)
    probed = []
    for request in range(4):
        p = Plan.start(config, c, [Source(has_cost=True, lag=lambda: 1000)], -1)
        ks = [p.decide(i, INF, 100).k for i in range(200)]
        probed.append(8 in ks)
        if 8 in ks:
            assert request * 200 + ks.index(8) + 1 == 608
    assert probed == [False, False, False, True]


def test_in_a_shared_step_a_plain_step_counts_its_share_of_the_probe_budget() -> None:
    """The budget is wall time: four sequences stepping together add one step to it, not four (a
    probe's catch-up holds up the whole step)."""
    c = cost(LINEAR, 0.3)
    c.explored.add("draft")
    p = Plan.start(SpeculativeConfig(), c, [Source(has_cost=True, lag=lambda: 1000)], -1)
    shared = Step(0, ((1, 1), (2, 1), (3, 1)), 3.0)
    for i in range(8):
        assert p.decide(i, INF, 100, shared).k == 0
    assert c.unprobed == 2.0


def _disturbed(anchored: bool) -> tuple[CostModel, Plan]:
    """A pair that learnt good evidence of its model draft at load's prices (CPU curve, 0.3-step
    draft), then drafted through a disturbance that made its draft and its wide rows 100x dearer;
    plain steps since brought the one-row step back (the hybrid of the README's libgomp run)."""
    c = cost(CPU, 0.3)
    c.t_catchup = 0.02
    if anchored:
        c.anchor()
    c.explored.add("draft")
    c.evidence[Key("draft", 0)] = [64.0, 0.0]
    c.t_step[2:] = [t * 100 for t in c.t_step[2:]]
    c.t_draft, c.t_catchup = c.t_draft * 100, c.t_catchup * 100
    return c, Plan.start(SpeculativeConfig(), c, [Source(has_cost=True, lag=lambda: 20)], -1)


def test_a_disturbance_does_not_price_a_model_draft_out_for_good() -> None:
    """Priced at the disturbance's prices, the model never drafts again and a probe never fits its
    budget (the old behaviour, unanchored). Priced at the load's prices at today's one-row step,
    a probe comes within the budget's steps (5.5 steps of probe at 3%: 184), and once it shows the
    draft costing what it did at load, the learnt prices restart from the load's and it drafts."""
    _, stale = _disturbed(anchored=False)
    assert all(stale.decide(i, INF, 100).k == 0 for i in range(2000))
    c, p = _disturbed(anchored=True)
    rounds = [p.decide(i, INF, 100) for i in range(400)]
    probe = next(i for i, r in enumerate(rounds) if r.k)
    assert rounds[probe].probe and 184 <= probe + 1 < 400
    p.record(rounds[probe], drafted=8, accepted=8, draft_seconds=2.4 + 0.4, verify_seconds=4.1,
             produced=probe + 1, step_seconds=2.4, caught_up=20)
    assert c.t_draft == pytest.approx(0.3) and c.t_step[9] == pytest.approx(4.1)
    assert p.decide(probe + 10, INF, 100).k > 0


def test_a_probe_in_a_shared_step_restarts_nothing() -> None:
    """Drafts made together share their time out (drafters.propose_together), so a probe's share in
    a shared step says nothing of what a lone draft costs: only a lone probe restarts the prices."""
    c, p = _disturbed(anchored=True)
    probe = next(r for r in (p.decide(i, INF, 100) for i in range(400)) if r.k)
    p.record(probe, drafted=8, accepted=8, draft_seconds=0.8, verify_seconds=4.1, produced=300,
             step_seconds=0.8, observe=False, plain_seconds=4.0)
    assert c.t_step[9] == pytest.approx(410.0)


def test_a_probe_at_the_learnt_price_keeps_what_was_learnt() -> None:
    """A probe whose draft costs what the learnt price says changes nothing but its own average:
    the learnt curve is not the load's, and only a disturbance's prices are thrown away."""
    c = cost(CPU, 0.3)
    c.anchor()
    c.t_step[5] = 3.5  # learnt: five rows deep into requests cost more than at load
    c.recover(0.25)
    assert c.t_step[5] == 3.5 and c.t_draft == 0.3


def test_a_model_with_no_evidence_is_probed_once_at_its_first_chance() -> None:
    """Judged by the prior alone a model draft on a CPU never pays (0.7 acceptance, 0.3-step draft
    steps), and one that agrees far better would never show it: the first round it could draft
    probes it, once per pair, whatever the budget; after that the budget rules."""
    c = cost(CPU, 0.3)
    c.t_catchup = 0.02
    first = Plan.start(SpeculativeConfig(), c, [Source(has_cost=True, lag=lambda: 500)], -1)
    rnd = first.decide(0, INF, 100)
    assert rnd.probe and rnd.k == 8
    first.record(rnd, drafted=0, accepted=0, draft_seconds=0.0, verify_seconds=1.0, produced=0)  # it offered nothing
    assert [first.decide(i, INF, 100).k for i in range(1, 40)] == [0] * 39  # no second free probe
    again = Plan.start(SpeculativeConfig(), c, [Source(has_cost=True, lag=lambda: 500)], -1)
    assert again.decide(0, INF, 100).k == 0


def test_a_model_draft_starts_only_if_the_gain_repays_its_catch_up() -> None:
    """Drafting would pay per round (2.2x, saving 0.54 steps a token), but the draft must first
    prefill 1000 missed tokens (20 steps): worth it for 512 more tokens, not for 20."""
    p = plan(FLAT, draft_has_cost=True, t_draft=0.05)
    p.cost.t_catchup = 0.02
    p.sources[0].lag = lambda: 1000
    assert p.decide(0, 20, 100).k == 0
    assert p.decide(0, INF, 100).k > 0
    p.sources[0].lag = lambda: 1000  # once drafting, the catch-up is sunk: it does not stop it
    assert p.decide(1, 20, 100).k > 0


def test_a_free_drafter_is_never_probed() -> None:
    """An n-gram's support classes carry priors, so a class expected to lose is not paid for."""
    p = plan(LINEAR, probe_interval=4, probe_budget=1.0)
    assert [p.decide(i, INF, 100).k for i in range(300)] == [0] * 300


# -- support classes (drafters.Support) ------------------------------------------------------------


def classed(p: Plan, key: int, prior: float | None = None) -> Plan:
    p.sources[0].support = lambda: Support(cls=key, prior=prior)
    return p


def test_acceptance_is_kept_per_support_class() -> None:
    """Rejections of drafts continuing short matches do not hold back those continuing long ones."""
    p = classed(plan(CPU, fallback_rounds=1000), key=1, prior=0.5)
    rnd = p.decide(0, INF, 100)
    _record_rejections(p, 5, CPU, rnd)
    assert p.acceptance(rnd) == pytest.approx(0.25 / 5.5)  # (0 + 0.5 x 0.5) / (5 + 0.5)
    assert p.decide(0, INF, 100).k == 0
    classed(p, key=5, prior=0.95)
    rnd = p.decide(0, INF, 100)
    assert rnd.k > 0
    assert p.acceptance(rnd) == pytest.approx(0.95)


def test_a_class_without_evidence_starts_from_its_prior() -> None:
    """A likely class drafts on its prior alone; an unlikely one waits, on costly verification."""
    assert classed(plan(CPU), key=4, prior=0.9).decide(0, INF, 100).k > 0
    assert classed(plan(CPU), key=1, prior=0.3).decide(0, INF, 100).k == 0


def test_a_class_judged_not_to_pay_is_retried_in_time() -> None:
    """Evidence fades with every request. A class that lost ten drafts in one request is tried
    again in the next at its prior, but one success there does not outweigh those rejections;
    sixty requests later it does."""
    first = classed(plan(CPU, fallback_rounds=1000), key=4, prior=0.9)
    _record_rejections(first, 10, CPU, first.decide(0, INF, 100))
    later = [classed(Plan.start(first.config, first.cost, [Source()], -1), key=4, prior=0.9) for _ in range(60)]
    for p in (later[0], later[-1]):
        assert p.decide(0, INF, 100).k > 0
        p.record(Round(k=1, rows=2, support=Support(cls=4, prior=0.9)), drafted=1, accepted=1,
                 draft_seconds=0.0, verify_seconds=CPU[1], produced=0)
    assert later[0].decide(2, INF, 100).k == 0
    assert later[-1].decide(2, INF, 100).k > 0


def test_a_classed_drafter_that_drafted_reports_no_fallback() -> None:
    """Skipping one class of draft is not switching speculation off."""
    p = classed(plan(CPU, fallback_rounds=1000), key=5, prior=0.95)
    rnd = p.decide(0, INF, 100)
    assert rnd.k > 0
    p.record(rnd, drafted=4, accepted=4, draft_seconds=0.0, verify_seconds=CPU[4], produced=5)
    classed(p, key=1, prior=0.3)
    assert p.decide(5, INF, 100).k == 0
    assert p.fallback is None


def test_nothing_to_propose_is_a_plain_step() -> None:
    p = plan(FLAT)
    p.sources[0].support = lambda: Support(ready=False)
    assert p.decide(0, INF, 100).k == 0


def test_class_evidence_carries_over_to_the_next_request() -> None:
    """A free class the pair's earlier requests found poor is tried once more in a new request, at
    its prior (acceptance depends on the request: code's short matches break, a summary's hold),
    drafting a few tokens; one rejection of its own then buries it, with the pair's evidence behind it. A class the pair
    found good starts from that evidence."""
    first = classed(plan(CPU, fallback_rounds=1000), key=2, prior=0.9)
    _record_rejections(first, 10, CPU, first.decide(0, INF, 100))
    for _ in range(10):
        classed(first, key=5, prior=0.5)
        first.record(Round(k=4, rows=5, support=Support(cls=5, prior=0.5)), drafted=4, accepted=4,
                     draft_seconds=0.0, verify_seconds=CPU[4], produced=0)
    assert set(first.cost.evidence) == {Key("draft", 2), Key("draft", 5)}
    second = classed(Plan.start(first.config, first.cost, [Source()], -1), key=2, prior=0.9)
    rnd = second.decide(0, INF, 100)
    assert rnd.retry and 0 < rnd.k <= RETRY_TOKENS and second.acceptance(rnd) == pytest.approx(0.9)
    second.record(rnd, drafted=rnd.k, accepted=0, draft_seconds=0.0, verify_seconds=CPU[rnd.k], produced=0)
    assert second.decide(1, INF, 100).k == 0
    assert second.acceptance(Round(support=rnd.support)) < 0.1  # priced on the evidence again
    assert classed(second, key=5, prior=0.5).decide(1, INF, 100).k > 0


def test_only_a_retry_is_priced_above_the_evidence() -> None:
    """A draft whose first class the evidence prices well is priced on the evidence all along it: a
    class further along that earlier requests found poor keeps the draft short, though this request
    has not drafted it. Only a retry (a first class untried here and priced below its prior, where
    no draft pays on the evidence) takes the priors, and for at most RETRY_TOKENS tokens."""
    c = cost(CPU)
    c.evidence[Key("draft", 4)] = [100.0, 0.0]
    c.evidence[Key("draft", 5)] = [0.0, 10.0]
    p = Plan.start(SpeculativeConfig(), c, [Source()], -1)
    p.sources[0].support = lambda: Support(cls=4, prior=0.9, along=lambda j: Support(cls=4 if j < 3 else 5, prior=0.9))
    assert p.decide(0, INF, 100).k == 3
    p.sources[0].support = lambda: Support(cls=5, prior=0.9, along=lambda j: Support(cls=5, prior=0.9))
    rnd = p.decide(0, INF, 100)
    assert rnd.retry and rnd.k == RETRY_TOKENS
    # A first class a little below its prior whose draft pays on the evidence is no retry: it drafts
    # in full, as it would have without retries.
    c.evidence[Key("draft", 3)] = [3.0, 1.0]
    p = Plan.start(SpeculativeConfig(), c, [Source()], -1)
    p.sources[0].support = lambda: Support(cls=3, prior=0.8, along=lambda j: Support(cls=3 if j < 1 else 4, prior=0.8))
    rnd = p.decide(0, INF, 100)
    assert not rnd.retry and rnd.k > RETRY_TOKENS


def test_calibrate_draft_measures_step_and_catchup(tiny: Path) -> None:
    w = Weights(tiny, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=256, n_threads=1))
    try:
        model = CostModel(2)
        # Without a budget it measures for real, whatever the machine's load.
        assert model.calibrate_draft(ctx)
        # Prefilling is batched, so on a quiet machine a token of catch-up costs less than a
        # one-token step; not asserted: on the busy CI machine a 6 ms prefill was preempted in
        # all three repetitions and the 60 us steps were not (catch-up 1.6 steps a token).
        assert model.t_catchup > 0.0 and model.t_draft > 0.0
        assert not model.provisional
        assert len(ctx) == 0
    finally:
        ctx.close()
        w.close()


def test_calibration_fits_a_small_context(tiny: Path) -> None:
    w = Weights(tiny, n_gpu_layers=0)
    ctx = Context(w, ContextParams(n_ctx=24, n_threads=1))
    try:
        model = CostModel(9)
        model.calibrate(ctx)  # 9 rows and three steps after them leave room for a 12-token prefix
        model.calibrate_draft(ctx)
        assert all(t > 0 for t in model.t_step[1:]) and model.t_draft > 0 and model.t_catchup > 0
        assert len(ctx) == 0
    finally:
        ctx.close()
        w.close()


def test_record_counters() -> None:
    p = plan(FLAT)
    for _ in range(2):  # the first plain steps after a batch (the prompt's) are t_switch's to pay
        p.record(PLAIN, drafted=0, accepted=0, draft_seconds=0.0, verify_seconds=5.0, produced=1)
    assert p.cost.t_step[1] == 1.0
    p.record(PLAIN, drafted=0, accepted=0, draft_seconds=0.0, verify_seconds=2.0, produced=1)  # a plain step
    assert p.tally.rounds == 0 and p.tally.draft_tokens == 0
    assert p.cost.t_step[1] == pytest.approx(1.0 + 0.2 * (2.0 - 1.0))
    p.record(Round(k=3, rows=4), drafted=3, accepted=2, draft_seconds=0.0, verify_seconds=FLAT[3], produced=4)
    p.record(Round(k=5, rows=6), drafted=5, accepted=5, draft_seconds=0.0, verify_seconds=FLAT[5], produced=10)
    assert (p.tally.rounds, p.tally.draft_tokens, p.tally.accepted_tokens) == (2, 8, 7)
    assert p.tally.accepted_per_pos == [2, 2, 1, 1, 1]
    # 7 accepted, 1 round with a rejection, prior 0.7 x weight 0.5
    assert p.acceptance(Round()) == pytest.approx((7 + 0.35) / (7 + 1 + 0.5))


# -- the classes a draft grows into (Support.along) -------------------------------------------


def test_a_drafts_later_tokens_are_priced_at_the_classes_it_grows_into() -> None:
    """A copy that holds becomes a longer match: with its first token at 0.8 and the rest at 0.99,
    a long draft pays where one priced at 0.8 throughout would stay short."""
    flat = classed(plan(CPU), key=1, prior=0.8)
    assert flat.decide(0, INF, 100).k == 2
    longer = Support(cls=6, prior=0.99)
    grows = plan(CPU)
    grows.sources[0].support = lambda: Support(cls=1, prior=0.8, along=lambda j: Support(cls=1, prior=0.8)
                                               if j == 0 else longer)
    rnd = grows.decide(0, INF, 100)
    assert rnd.k == 8
    grows.record(rnd, drafted=8, accepted=3, draft_seconds=0.0, verify_seconds=CPU[8], produced=0)
    # each token to its own class
    assert grows.cost.evidence == {Key("draft", 1): [1.0, 0.0], Key("draft", 6): [2.0, 1.0]}


def test_a_class_seen_first_starts_from_what_the_class_under_it_has_shown() -> None:
    """A class with no evidence of its own is no worse than the classes under it (Support.under): a
    copy that has held for a hundred tokens of a shorter match class is not priced back at the longer
    class's static prior when it grows into it. Its own evidence still rules once it has some."""
    c = cost(CPU)
    c.evidence[Key("draft", 4)] = [100.0, 0.0]
    p = Plan.start(SpeculativeConfig(), c, [Source()], -1)
    alone = Support(cls=5, prior=0.5)
    p.sources[0].support = lambda: alone
    assert p.decide(0, INF, 100).k == 0
    above = Support(cls=5, prior=0.5, under=(Support(cls=4, prior=0.9), Support(cls=3, prior=0.8)))
    p.sources[0].support = lambda: above
    rnd = p.decide(0, INF, 100)
    assert rnd.k == 8  # all the table has
    assert p.acceptance(rnd) == pytest.approx(p.acceptance(Round(support=Support(cls=4, prior=0.9))))
    _record_rejections(p, 10, CPU, rnd)
    assert p.acceptance(rnd) < 0.05 and p.decide(0, INF, 100).k == 0


# -- batch shapes (CostModel.t_same) -------------------------------------------------------------

# An H200 with CUDA graphs (README, "On a GPU"), in ms: any batch after another shape costs about
# 3.4, the same shape again far less.
GPU_STEP = [1.33, 3.40, 3.40, 3.39, 3.42, 3.45, 3.47, 3.49, 3.50]
GPU_SAME = [1.33, 1.38, 1.50, 1.64, 1.70, 1.76, 1.82, 1.86, 1.90]


def gpu_plan() -> Plan:
    p = plan(GPU_STEP, n_max=8)
    p.cost.t_same = [0.0, *GPU_SAME]
    return p


def test_inside_a_stretch_a_draft_keeps_the_stretchs_shape() -> None:
    """After a batch of 9 rows, 9 rows again cost 1.9 ms and any other batch 3.4: a free source then
    drafts all 8 tokens whatever its class (the decoder pads a shorter proposal), and a model, whose
    every token costs a step of its own, drafts a few and pads them to the shape."""
    p = classed(gpu_plan(), key=5, prior=0.97)
    rnd = p.decide(0, INF, 100)
    assert rnd.k == 8 and rnd.rows == 9
    p.record(rnd, drafted=8, accepted=8, draft_seconds=0.0, verify_seconds=3.5, produced=9)
    classed(p, key=1, prior=0.6)
    rnd = p.decide(9, INF, 100)
    assert rnd.k == 8 and rnd.rows == 9
    model = gpu_plan()
    model.sources[0].has_cost = True
    model.cost.t_draft = 0.2
    model.record(Round(k=8, rows=9), drafted=8, accepted=3, draft_seconds=1.6, verify_seconds=3.5, produced=4)
    rnd = model.decide(4, INF, 100)
    k = rnd.k
    assert 1 < k < 8 and rnd.rows == 9  # padded: 9 rows replayed cost less than k + 1 rows rebuilt
    rnd = model.decide(4, INF, 5)
    assert rnd.k < k and rnd.rows < 9  # no room to pad in the window


def test_a_stretch_starts_at_the_shape_its_rounds_do_best_at() -> None:
    """Out of a stretch every batch costs 3.4-3.5 ms, so the first round's own rate barely depends
    on k; the shape is chosen by what the stretch's later rounds cost at it."""
    p = classed(gpu_plan(), key=3, prior=0.9)
    for i in range(3):
        p.record(PLAIN, drafted=0, accepted=0, draft_seconds=0.0, verify_seconds=1.33, produced=i)
    rnd = p.decide(3, INF, 100)
    k = rnd.k
    assert rnd.rows == k + 1
    e = [expected_tokens(0.9, j) for j in range(9)]
    assert k == max(range(1, 9), key=lambda j: e[j] / GPU_SAME[j])


def test_on_a_cpu_a_draft_is_never_padded() -> None:
    p = classed(plan(CPU), key=5, prior=0.97)
    rnd = p.decide(0, INF, 100)
    assert rnd.k > 2
    p.record(rnd, drafted=rnd.rows - 1, accepted=rnd.rows - 1, draft_seconds=0.0, verify_seconds=CPU[rnd.rows - 1],
             produced=9)
    classed(p, key=1, prior=0.8)
    rnd = p.decide(9, INF, 100)
    k = rnd.k
    assert k and rnd.rows == k + 1


def test_a_provisional_curve_follows_its_one_row_step_as_a_level() -> None:
    """Loaded on a busy machine, the prior curve was scaled to a slow step: once plain steps run
    fast again, the batch sizes not decoded since move with them, so a likely draft pays again."""
    model = CostModel(8)
    model._prior(0.2, 9)  # a load that measured a 0.2 s step on a busy machine
    p = Plan.start(SpeculativeConfig(), model, [Source(support=lambda: Support(cls=4, prior=0.9))], -1)
    for produced in range(12):  # quiet now: 0.04 s steps
        p.record(PLAIN, drafted=0, accepted=0, draft_seconds=0.0, verify_seconds=0.04, produced=produced)
    assert model.t_step[1] == pytest.approx(0.04, rel=0.01)
    assert model.verify_curve() == pytest.approx([1.0, *(0.6 * n + 0.4 for n in range(2, 10))])
    assert p.decide(12, INF, 100).k > 0
    model.observe_step(3, 0.1)  # a batch decoded since keeps its own price
    three, four = model.t_step[3], model.t_step[4]
    model.observe_step(1, 0.02)
    assert model.t_step[3] == three and model.t_step[4] == pytest.approx(four * model.t_step[1] / 0.04, rel=0.02)


def test_a_measured_curve_does_not_move_with_one_row_steps() -> None:
    model = cost(CPU)
    model.observe_step(1, 0.5)
    assert model.t_step[1:] == [pytest.approx(0.9), *CPU[1:]]


def test_a_rows_price_follows_the_curve_it_is_priced_by() -> None:
    """What n rows add to a shared step is cached per step, and forgotten when a decode moves the
    curve: a round priced after the move sees the new price."""
    model = cost(CPU)
    shared = Step(0, ((1, 1), (2, 1)), 2.0)
    before = model.added(3, shared)
    assert before == model.batch(((1, 1), (2, 1), (0, 3))) - model.batch(((1, 1), (2, 1)))
    model.observe_step(3, 10.0)
    assert model.added(3, shared) == model.batch(((1, 1), (2, 1), (0, 3))) - model.batch(((1, 1), (2, 1)))
    assert model.added(3, shared) != before


@pytest.mark.parametrize("a", [0.0005, 0.05, 0.3, 0.7, 0.95, 0.999])
@pytest.mark.parametrize("curve", [FLAT, CPU])
def test_the_search_stops_where_rows_add_no_tokens_without_missing_the_best(a: float, curve: list[float]) -> None:
    """The planner stops weighing longer drafts once a row adds under MIN_HOLD expected tokens;
    the length it picks is the one a search over every length picks."""
    p = plan(curve, n_max=8)
    key = Key("draft", 0)
    p._evidence[key] = [a * 1e6, (1 - a) * 1e6]  # acceptance a, beyond any prior
    got = p._best(0, Support(), 8, 0)
    t = p.cost.t_step
    need = p.config.min_gain / t[1]
    rates = {k: expected_tokens(a, k) / t[k + 1] for k in range(1, 9)}
    best = max((k for k in rates if rates[k] > need), key=lambda k: rates[k], default=0)
    assert got[0] == best


def _deep(one_block: float = 1.0, block2: float = 1.1, block3: float = 1.2) -> CostModel:
    """A CPU curve timed at one block, then one-row steps at 2 and 3 blocks of cache."""
    c = cost(CPU)
    c.t_step[1] = one_block
    c.anchor()
    for _ in range(20):
        c.observe_step(1, block2, cells=300)  # 301 cells: two blocks
        c.observe_step(1, block3, cells=600)
    return c


def test_a_pass_is_priced_at_the_depth_it_attends_over() -> None:
    """One-row steps 10% dearer per block of cache give the slope; the curve stays at one block and
    every pass is priced at the depth it runs at, so a wide pass deep in a request is not priced as
    on an empty cache while its one-row step is priced as it is now."""
    c = _deep()
    assert c.depth == pytest.approx(0.1)
    assert c.t_step[1] == pytest.approx(1.0)  # kept at one block
    assert c.added(1, Step(cells=600)) == pytest.approx(1.2)
    assert c.added(9) == pytest.approx(4.1)
    assert c.added(9, Step(cells=900)) == pytest.approx(4.1 * 1.3)  # 909 cells: four blocks
    assert c.batch([(0, 9), (1, 1)], cells=900) == pytest.approx(c.batch([(0, 9), (1, 1)]) * 1.3)


@pytest.mark.parametrize("rows", [[(0, 1), (1, 1), (2, 1), (3, 1)], [(0, 9), (1, 1)], [(0, 65), (1, 65), (2, 65),
                                                                                   (3, 65), (5, 2)]])
def test_a_cached_price_is_the_price_at_every_depth(rows: list[tuple[int, int]]) -> None:
    """CostModel.batch keeps a layout's price for the steps of a KV block: every depth, across the
    block edges and past a pass wider than a block, prices as a model that remembers nothing."""
    c, fresh = _deep(), _deep()
    for cells in range(3 * KV_BLOCK):
        fresh._repriced()
        assert c.batch(rows, cells) == fresh.batch(rows, cells), cells


def test_a_wide_pass_seen_deep_is_learnt_at_one_block() -> None:
    """A pass that cost what its depth says leaves the curve as it was; one that cost 10% more moves
    the one-block price by the moving average's share of 10%."""
    c = _deep()
    c.observe_step(9, 4.1 * 1.3, cells=900)
    assert c.t_step[9] == pytest.approx(4.1)
    c.observe_step(9, 4.1 * 1.3 * 1.1, cells=900)
    assert c.t_step[9] == pytest.approx(4.1 * (1 + 0.2 * 0.1))


def test_the_depth_slope_is_held_to_its_range() -> None:
    """Deeper steps that ran faster (the machine sped up) price nothing below one block's; a busy
    spell that slowed them tenfold prices a block at DEPTH_MAX, not at ten."""
    assert _deep(block2=0.9, block3=0.95).depth == 0.0
    assert _deep(block2=10.0, block3=10.0).depth == DEPTH_MAX
    unseen = cost(CPU)
    unseen.observe_step(1, 2.0, cells=600)  # no step at one block yet: no slope
    assert unseen.depth == 0.0


def test_a_pass_over_several_streams_is_priced_as_shared_decodes_showed() -> None:
    """Four sequences' plain rows took 3.1 one-row steps where the curve says 2.4 for four rows:
    such passes cost more from then on; a lone sequence's draft pass does not."""
    model = cost(CPU)
    four = ((0, 1), (1, 1), (2, 1), (3, 1))
    assert model.batch(four) == pytest.approx(2.4)
    for _ in range(30):
        model.observe_shared(four, 3.1)
    assert model.shared == pytest.approx(3.1 / 2.4, rel=0.01)
    assert model.batch(four) == pytest.approx(3.1, rel=0.01)
    # Rows 5, 1, 1, 1: a pass of 4 over four streams, then one of 4 rows on sequence 0 alone.
    assert model.batch(((0, 5), (1, 1), (2, 1), (3, 1))) == pytest.approx(3.1 + 2.4, rel=0.01)
    model.observe_shared(four, 100.0)  # one decode a busy machine slowed moves it within bounds
    assert model.shared <= adaptive.SHARED_MAX


def test_a_drafts_own_pass_beside_others_is_priced_as_shared_decodes_showed() -> None:
    """Once the shared passes' factor is known, a decode that also has a pass of one stream (a
    draft's rows past the others') teaches what such a pass costs beside them; alone, a
    sequence's rows are still priced by the curve (its own rounds correct that)."""
    model = cost(CPU)
    four = ((0, 1), (1, 1), (2, 1), (3, 1))
    drafting = ((0, 5), (1, 1), (2, 1), (3, 1))  # a pass of 4 over four streams, one of 4 rows
    for _ in range(30):
        model.observe_shared(four, 3.0)
    for _ in range(30):
        model.observe_shared(drafting, 3.0 + 2 * 2.4)
    assert model.shared == pytest.approx(3.0 / 2.4, rel=0.01)
    assert model.beside == pytest.approx(2.0, rel=0.01)
    assert model.batch(drafting) == pytest.approx(3.0 + 4.8, rel=0.01)
    assert model.added(4) == pytest.approx(2.4)  # alone: the curve


def test_a_lone_pass_priced_high_comes_back_while_nothing_drafts() -> None:
    """Eight streams: a copy that holds pays its rows where a pass of one stream beside the others
    costs what the curve says. One slow decode of a draft taught `beside` a price that priced every
    draft out, and with no draft nothing taught it otherwise: n-gram at N = 8 stopped drafting for
    good. Plain shared steps bring it back toward the curve, and the copy goes again."""
    model = cost(CPU)
    model.shared = 1.4
    p = Plan.start(SpeculativeConfig(), model, [Source()], -1)  # type: ignore[list-item]
    p._evidence[Key("draft", 0)] = [1e6, 0.0]  # a copy that always holds
    eight = Step(0, tuple((s, 1) for s in range(1, 8)), 7.0)
    assert p._best(0, Support(), 8, 0, eight)[0] > 0
    # One decode of a copy whose own pass took three times the curve (a busy spell) moves it a step.
    model.observe_shared(((0, 9), *eight.rows), 3.8 * 1.4 + 3 * 3.8)
    assert model.beside == pytest.approx(1.4)
    assert p._best(0, Support(), 8, 0, eight)[0] == 0
    plain = tuple((s, 1) for s in range(8))
    for _ in range(25):
        model.observe_shared(plain, 3.8 * 1.4)  # plain steps at the price they have: `shared` holds
    assert model.shared == pytest.approx(1.4)
    assert 1.0 < model.beside < 1.25
    assert p._best(0, Support(), 8, 0, eight)[0] > 0


def test_a_row_that_merges_two_passes_is_charged_nothing_not_less() -> None:
    """Sequence 1's stream sits between 0's and 2's: its row joins them into one pass, so by price
    it adds less than nothing (a pass of one stream beside others costs `beside` times the curve).
    Its share of the decode is then zero, never below, and a token of the step costs the decode's
    seconds over its plain rows."""
    model = cost(CPU)
    model.beside = 2.0
    gap = Step(1, ((0, 1), (2, 1), (3, 1)), 3.0)
    assert model.added(1, gap) < 0  # one pass of 4 rows (2.4) against 1 row beside (2.0) + 2 rows (1.5)
    mine, plain_row, per_token = model.shares(1, gap, 2.4)
    assert (mine, plain_row) == (0.0, 0.0)
    assert per_token == pytest.approx(2.4 / 4)
    mine, plain_row, _ = model.shares(5, gap, 3.0)
    assert mine >= 0.0 and plain_row == 0.0


def test_in_a_shared_step_a_costly_draft_is_judged_against_that_steps_plain_rate() -> None:
    """Rounds that make 3 tokens for 1.7 s of drafting and verify share beat a lone one-row step
    (1 s a token), but in a batch whose plain steps make a token every 0.35 s (a plain row adds
    0.3 s) they lose: there the draft is switched off; judged alone, it is not."""
    alone = plan(CPU, draft_has_cost=True)  # fallback_rounds 8, margin 0.97
    batched = plan(CPU, draft_has_cost=True)
    for i in range(8):
        alone.record(FOUR, drafted=4, accepted=2, draft_seconds=0.5, verify_seconds=1.2, produced=3 * i + 3)
        batched.record(FOUR, drafted=4, accepted=2, draft_seconds=0.5, verify_seconds=1.2, produced=3 * i + 3,
                       observe=False, plain_seconds=0.3 + 2 * 0.35)
    assert alone.fallback is None
    assert batched.fallback == "slower than target-only: 1.8 vs 3.0 tok/s at acceptance 0.50"
