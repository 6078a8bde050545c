"""The step's price, the evidence and the schedule: engine.cost, engine.evidence, engine.schedule.

Pure: the cost model is seeded by hand (t_step[n] = seconds to verify n rows), so each test states
the hardware it pretends to run on: a GPU-like flat curve, or a CPU-like one where rows cost nearly
linearly. The calibration is timed on a fake clock (tests/test_calibration.py times real decodes).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from sidecar.engine import timing
from sidecar.engine.adaptive import expected_tokens
from sidecar.engine.cost import CostModel, Fit, Layout
from sidecar.engine.drafters import Support, match_support
from sidecar.engine.evidence import Evidence
from sidecar.engine.hosttime import HostPrice
from sidecar.engine.schedule import Menu, Option, schedule

pytestmark = pytest.mark.pure

# Seconds to verify 1..9 rows. GPU: one pass costs about the same for any n.
FLAT = [1.0 + 0.02 * i for i in range(9)]
# SmolLM2 on 2 CPU cores: a batch of 4 ~2.4x one token, a batch of 8 ~4.1x.
CPU = [1.0, 1.5, 1.9, 2.4, 2.8, 3.1, 3.5, 3.8, 4.1]
SLACK = 0.03


def cost(t_step: Sequence[float], t_draft: float = 0.0, t_catchup: float = 0.0) -> CostModel:
    model = CostModel(len(t_step))
    model.t_step = [0.0, *t_step]
    model.t_draft, model.t_catchup = t_draft, t_catchup
    model.seed()
    model.fixed = True
    return model


def copy(a: float, k: int = 8) -> np.ndarray:
    """A free source's expected tokens at k = 0..k drafted, every token at acceptance a."""
    return np.array([expected_tokens(a, j) for j in range(k + 1)])


def menus(*options: Option | None, room: int = 8) -> list[Menu]:
    return [Menu(sid, () if o is None else (o,), room) for sid, o in enumerate(options)]


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


# -- the cost model --------------------------------------------------------------------------------


def test_the_seed_is_the_calibrations_line() -> None:
    model = cost(CPU)
    # A pass's fixed cost and a row's, from the curve; one row at one block prices as t_step[1].
    assert model.step(Layout(1, 1)) == pytest.approx(CPU[0], rel=0.1)
    assert model.step(Layout(1, 8)) == pytest.approx(CPU[7], rel=0.1)


def test_the_fit_recovers_a_layouts_price_from_the_decodes() -> None:
    """Decodes priced by known weights (a pass 2 ms, a row 0.3, a prompt row 0.1, attention 0.01
    a row and block, a changed layout 1 ms): the fit finds them from a wrong start."""
    truth = np.array([2.0, 0.3, 0.1, 0.01, 1.0]) * 1e-3
    fit = Fit(("passes", "rows", "prefill", "attention", "changed"), [1e-3] * 5)
    rng = np.random.default_rng(1)
    for _ in range(200):
        layout = Layout(int(rng.integers(1, 5)), int(rng.integers(1, 64)), int(rng.integers(0, 2)) * 256,
                        int(rng.integers(0, 4000)), bool(rng.integers(0, 2)))
        fit.observe(layout.features(), float(truth @ layout.features()))
    assert fit.w == pytest.approx(truth, rel=0.02)


def test_a_feature_the_decodes_do_not_vary_keeps_its_seeds_share() -> None:
    """Plain steps say nothing of a prompt row's price: it keeps the calibration's share of a
    step, at the scale the decodes show (here half the calibrated price)."""
    model = cost(CPU)
    model.fixed = False
    seeded, half = model.device.w[2], 0.5 * model.step(Layout(1, 4, cells=300))
    for _ in range(64):
        model.observe_step(Layout(1, 4, cells=300), half)
    assert model.device.w[2] == pytest.approx(0.5 * seeded, rel=0.05)
    assert model.step(Layout(1, 4, cells=300)) < 0.8 * cost(CPU).step(Layout(1, 4, cells=300))


def test_a_faster_stretch_keeps_the_calibrations_split_of_a_step() -> None:
    """Plain steps at a third of the calibrated price move passes, rows and depth together: the
    fit scales the calibration's split, and does not take the difference off each alike (which
    priced a row at ~0 and drafted long on a CPU)."""
    model = cost(CPU)
    model.fixed = False
    seed = model.device.w.copy()
    rng = np.random.default_rng(0)
    for i in range(60):
        model.observe_step(Layout(1, 1, cells=300 + 3 * i), 0.35 * (1 + 0.03 * rng.standard_normal()))
    passes, rows = model.device.w[:2]
    assert rows / passes == pytest.approx(seed[1] / seed[0], rel=0.25)


def test_a_prompt_chunks_noise_does_not_move_a_rows_price() -> None:
    """Decodes of 1-33 rows deep in a conversation (5% noise) and now and then a 512-token prompt
    chunk (20% noise: its seconds are 100 decodes' worth). The fit weighs each decode by its own
    price, so the chunks' noise does not pull a row's or the depth's price off (unweighted, a row's
    price was up to 50% off and the depth's 100%, across these 20 runs)."""
    truth = np.array([8.0, 6.0, 0.5, 0.15, 0.5]) * 1e-3
    rows_err, depth_err = [], []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        fit = Fit(("passes", "rows", "prefill", "attention", "changed"), truth * rng.uniform(0.5, 1.5, 5))
        for i in range(400):
            if i % 40 == 0:
                layout, noise = Layout(1, 1, 512, 2500 + 10 * i), 0.2
            else:
                r = int(rng.choice([1, 1, 1, 2, 5, 9, 17, 33]))
                layout, noise = Layout(1, r, 0, 2500 + 10 * i, r > 1), 0.05
            fit.observe(layout.features(), float(truth @ layout.features()) * (1 + noise * rng.standard_normal()))
        rows_err.append(abs(fit.w[1] / truth[1] - 1))
        depth_err.append(abs(fit.w[3] / truth[3] - 1))
    assert max(rows_err) < 0.3 and max(depth_err) < 0.6


def test_no_weight_is_negative() -> None:
    fit = Fit(("a", "b"), [1.0, 1.0])
    for x in range(1, 40):
        fit.observe((1.0, float(x)), 5.0 - 0.01 * x)  # more rows "cost less": noise
    assert (fit.w >= 0).all()


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


# -- the evidence ----------------------------------------------------------------------------------


def test_a_class_without_evidence_draws_around_its_prior() -> None:
    ev = Evidence(prior=0.7, weight=0.5)
    draws = [ev.draw("ngram", Support(cls=3, prior=0.9)) for _ in range(4000)]
    assert np.mean(draws) == pytest.approx(0.9, abs=0.02)
    assert np.std(draws) > 0.15  # wide: an unknown class is tried now and then


def test_evidence_narrows_the_draws_and_moves_the_mean() -> None:
    ev = Evidence(prior=0.7, weight=0.5)
    s = Support(cls=1)
    wide = [ev.draw("draft", s) for _ in range(2000)]
    for _ in range(60):
        ev.observe("draft", s, 4, 0)  # every draft broke at its first token
    draws = [ev.draw("draft", s) for _ in range(2000)]
    assert np.mean(draws) < 0.05 and np.std(draws) < np.std(wide) / 3


def test_a_copy_is_learnt_token_by_token_in_the_classes_it_grows_into() -> None:
    ev = Evidence()
    ev.observe("ngram", match_support(4, 64), 12, 12)  # a 4-token match grew to 15 tokens, all held
    assert {k.cls for k in ev.counts} == {2, 3}  # classes of 4-7 and 8-15 tokens
    assert all(rej == 0 for _, rej in ev.counts.values())


def test_a_class_seen_first_starts_from_what_the_class_under_it_has_shown() -> None:
    ev = Evidence(prior=0.5)
    low = Support(cls=1, prior=0.5)
    for _ in range(30):
        ev.observe("suffix", low, 8, 8)
    high = Support(cls=2, prior=0.5, under=(low,))
    assert ev.mean("suffix", high) > 0.9


def test_a_copy_another_request_taught_is_doubted_after_two_failures_in_this_one() -> None:
    """An edit turn copied a file back (class 4 held for 16 tokens, 20 times); the next turn's free
    text breaks twice at that class. Pooled, the pair still believes it near-certain; the request
    believes the pair's evidence as TRUST tokens, and its own two failures in full."""
    pair = Evidence()
    s = Support(cls=4, prior=0.89)
    for _ in range(20):
        pair.request().observe("ngram", s, 16, 16)
    turn = pair.request()
    for _ in range(2):
        turn.observe("ngram", s, 8, 0)
    assert pair.mean("ngram", s) > 0.95
    assert np.median([turn.draw("ngram", s) for _ in range(2000)]) < 0.85


def test_a_requests_own_copy_is_believed_in_full() -> None:
    turn = Evidence(prior=0.5).request()
    s = Support(cls=4)
    for _ in range(10):
        turn.observe("ngram", s, 16, 16)
    assert np.percentile([turn.draw("ngram", s) for _ in range(2000)], 5) > 0.97


def test_draws_are_reproducible() -> None:
    a, b = Evidence(seed=3), Evidence(seed=3)
    s = Support()
    assert [a.draw("d", s) for _ in range(5)] == [b.draw("d", s) for _ in range(5)]


# -- the schedule ----------------------------------------------------------------------------------


def test_alone_a_likely_draft_is_taken_and_an_unlikely_one_is_not() -> None:
    model = cost(FLAT)
    good = schedule(menus(Option(0, copy(0.9))), model, HostPrice(), 0, SLACK, 1.05, 8)
    assert good.choices[0].k >= 4
    bad = schedule(menus(Option(0, copy(0.05))), model, HostPrice(), 0, SLACK, 1.05, 8)
    assert bad.choices == {}


def test_cheap_verification_drafts_longer_than_costly_verification() -> None:
    gpu = schedule(menus(Option(0, copy(0.7))), cost(FLAT), HostPrice(), 0, SLACK, 1.0, 8)
    cpu = schedule(menus(Option(0, copy(0.7))), cost(CPU), HostPrice(), 0, SLACK, 1.0, 8)
    assert gpu.choices[0].k > (cpu.choices[0].k if cpu.choices else 0)


def test_a_draft_that_costs_the_host_more_than_it_saves_is_not_taken() -> None:
    """On a cheap step, a drafted row's host work is what decides: priced as device plus host."""
    model = cost([0.001 + 0.0001 * n for n in range(9)])
    o = Option(0, copy(0.6))
    assert schedule(menus(o), model, HostPrice(), 0, SLACK, 1.05, 8).choices
    host = HostPrice(drafting=0.002, row=0.0005)
    assert not schedule(menus(o), model, host, 0, SLACK, 1.05, 8).choices


def test_no_stream_falls_behind_a_plain_step_for_anothers_draft() -> None:
    """On a CPU a row costs ~0.4 of a step: one stream's copy beside seven plain streams would slow
    them all, though it raises the step's tokens per second. Where its rows cost less than the
    slack (a GPU's padded pass), it is taken."""
    streams = [Option(0, copy(0.99, 32)), *([None] * 7)]
    cpu = schedule(menus(*streams, room=32), cost(CPU), HostPrice(), 0, SLACK, 1.05, 32)
    assert cpu.choices == {}
    cheap = cost([1.0 + 0.0001 * n for n in range(40)])  # a GPU: the pass is the price, rows are cheap
    gpu = schedule(menus(*streams, room=32), cheap, HostPrice(), 0, SLACK, 1.05, 32)
    assert gpu.choices[0].k > 8
    assert gpu.seconds <= gpu.plain / (1 - SLACK)  # the plain streams' step within the slack


def test_streams_that_all_copy_draft_together() -> None:
    streams = [Option(0, copy(0.99, 16)) for _ in range(4)]
    plan = schedule(menus(*streams, room=16), cost(CPU), HostPrice(), 0, SLACK, 1.05, 100)
    assert len(plan.choices) == 4
    assert len({c.k for c in plan.choices.values()}) == 1  # one width: one pass more, not four


def test_streams_that_copy_from_different_sources_draft_together_each_from_its_copy() -> None:
    """Where each stream offers two sources, a joint upgrade takes every stream's likelier one."""
    copying, guessing = copy(0.99, 16), copy(0.3, 16)
    streams = [Menu(sid, (Option(0, guessing), Option(1, copying)) if sid % 2 else
                    (Option(0, copying), Option(1, guessing)), 16) for sid in range(4)]
    plan = schedule(streams, cost(CPU), HostPrice(), 0, SLACK, 1.05, 100)
    assert {sid: c.source for sid, c in plan.choices.items()} == {0: 0, 1: 1, 2: 0, 3: 1}
    assert len({c.k for c in plan.choices.values()}) == 1


def test_drafts_fit_the_batch_budget() -> None:
    streams = [Option(0, copy(0.99, 16)) for _ in range(4)]
    plan = schedule(menus(*streams, room=16), cost(FLAT + [1.2] * 8), HostPrice(), 0, SLACK, 1.0, 20)
    assert sum(c.k for c in plan.choices.values()) <= 20


def test_a_model_drafts_catch_up_is_part_of_its_price() -> None:
    """The same model draft pays with nothing to catch up, and not with 2,000 tokens to prefill
    for a request with 50 tokens left."""
    model = cost(FLAT, t_draft=0.1, t_catchup=0.05)
    fresh = Option(0, copy(0.8), model=True, lag=0, future=50)
    behind = Option(0, copy(0.8), model=True, lag=2000, future=50)
    assert schedule(menus(fresh), model, HostPrice(), 0, SLACK, 1.05, 8).choices
    assert not schedule(menus(behind), model, HostPrice(), 0, SLACK, 1.05, 8).choices


def test_model_drafts_share_their_draft_steps() -> None:
    """Two streams drafting from one draft context pay its per-step cost once: together they
    draft where each alone (beside the other's plain row) would not."""
    model = cost(FLAT, t_draft=0.25)
    model.draft.w[:] = [0.24, 0.01, 0.0]  # a draft step's fixed cost dominates its rows
    o = Option(0, copy(0.75), model=True, future=500)
    pair = schedule(menus(o, o), model, HostPrice(), 0, SLACK, 1.05, 16)
    assert len(pair.choices) == 2


def test_starting_takes_the_margin_staying_on_does_not() -> None:
    model = cost(FLAT)
    o = Option(0, copy(0.12, 1))
    # One drafted row at acceptance 0.12: 1.12 tokens for 1.02 of a step, a gain of ~1.10.
    assert not schedule(menus(o), model, HostPrice(), 0, SLACK, 1.2, 8).choices
    assert schedule(menus(o), model, HostPrice(), 0, SLACK, 1.0, 8).choices


def test_model_drafts_with_menus_of_different_lengths() -> None:
    """A stream near its window's end offers fewer lengths than the others: its model draft's
    catch-up share is priced over every length the step considers (once a broadcast error)."""
    model = cost(FLAT, t_draft=0.1, t_catchup=0.05)
    short = Menu(0, [Option(0, copy(0.9, 3), model=True, lag=10, future=50)], room=3)
    long = Menu(1, [Option(0, copy(0.9, 8), model=True, lag=10, future=50)], room=8)
    plan = schedule([short, long], model, HostPrice(), 0, SLACK, 1.0, 16)
    assert all(c.k <= (3 if sid == 0 else 8) for sid, c in plan.choices.items())


@pytest.mark.parametrize("seed", range(40))
def test_one_streams_early_exit_never_changes_its_plan(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """schedule's `_may_pay` ends a lone stream's step before the matrices where no draft can pay
    its rows at the plain rate; the full search must then find none either (random acceptances,
    prices, host costs and catch-ups, free and model sources)."""
    from sidecar.engine import schedule as sched

    rng = np.random.default_rng(seed)
    curve = list(np.cumsum([1.0, *rng.uniform(0.0, 0.9, 8)]))
    model = cost(curve, t_draft=float(rng.uniform(0, 0.5)), t_catchup=float(rng.uniform(0, 0.2)))
    host = HostPrice(*(float(x) for x in rng.uniform(0, 0.05, 5)))
    options = tuple(Option(i, copy(float(rng.uniform(0, 1)) ** 3, 8), model=bool(rng.integers(2)),
                           lag=int(rng.integers(0, 30)), future=float(rng.uniform(1, 100)))
                    for i in range(int(rng.integers(1, 3))))
    menu = [Menu(0, options, 8)]
    need = float(rng.uniform(1.0, 1.2))
    fast = schedule(menu, model, host, 0, SLACK, need, 8)
    monkeypatch.setattr(sched, "_may_pay", lambda *a: True)
    assert schedule(menu, model, host, 0, SLACK, need, 8).choices == fast.choices
