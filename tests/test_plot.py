"""memory_plan.png and its one-line summary: one GiB axis for the step, legends off the data, the
head drawn at its phase's size, the peak line at the estimate's peak, the line's numbers the
estimate's."""

from __future__ import annotations

import re

import matplotlib.pyplot as plt
import pytest
from matplotlib.transforms import Bbox

from trainer.cli import check
from trainer.preflight.plot import draw_plan
from trainer.preflight.scenario import Evaluator, Scenario
from trainer.preflight.timeline import picture_line, timeline

GIB = 2 ** 30
TINY = ["model.dropout=0", "checkpointing.profile_repeats=1", "data.seq_len=128",
        "train.micro_batch_size=8"]


@pytest.fixture(scope="module")
def outcome():
    """A budget plan (some blocks recompute, some keep all: two colours, a budget line)."""
    cfg, layout = check([*TINY, "checkpointing=budget"], {"WORLD_SIZE": "1"})
    return Evaluator(400.0).evaluate(Scenario(cfg, layout, 1))


@pytest.fixture
def drawn(outcome):
    fig, labels = draw_plan(outcome, capacity=int(1.5 * outcome.estimate.peak.total))
    fig.canvas.draw()
    yield fig, labels
    plt.close(fig)


def artist(ax, gid: str):
    [found] = [a for a in ax.get_children() if a.get_gid() == gid]
    return found


def test_the_step_has_one_gib_axis_and_the_blocks_their_own(drawn) -> None:
    fig, _ = drawn
    # Two panels and no twin axis: a twinx would be a third Axes in the figure.
    assert len(fig.axes) == 2
    steps, blocks = fig.axes
    assert steps.get_ylabel() == "memory per rank (GiB)"
    assert blocks.get_ylabel() == "saved per block (MiB)"  # the tiny model's blocks: MiB


def test_the_legends_cover_no_data(drawn) -> None:
    fig, _ = drawn
    renderer = fig.canvas.get_renderer()
    legends = [ax.get_legend() for ax in fig.axes]
    assert all(legend is not None for legend in legends)
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)
        for ax in fig.axes:  # the data area of both panels, and everything drawn on them
            assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()
            for a in ax.patches + ax.lines + ax.texts:
                extent = a.get_window_extent(renderer)
                if a.get_clip_on():  # what is drawn of it: a line above the scale is not
                    extent = Bbox.intersection(extent, ax.bbox)
                assert extent is None or not box.overlaps(extent), a


def test_the_head_is_drawn_at_its_phase_and_the_peak_at_the_estimate(drawn, outcome) -> None:
    fig, labels = drawn
    est = outcome.estimate
    head_phase = est.phases[len(est.block_saved)]
    assert head_phase.name.startswith("the head")
    values, edges, baseline = artist(fig.axes[0], "head").get_data()
    spike = [i for i, (v, b) in enumerate(zip(values, baseline)) if v > b]
    assert len(spike) == 1  # one segment: the head's phase, between forward and backward
    assert values[spike[0]] == pytest.approx(head_phase.total / GIB, rel=1e-12)
    outline = artist(fig.axes[0], "total").get_data().values
    assert outline[spike[0]] == pytest.approx(head_phase.total / GIB, rel=1e-12)
    # The step's outline reaches the predicted peak and never exceeds it.
    assert max(outline) == pytest.approx(est.peak.total / GIB, rel=1e-12)
    peak = artist(fig.axes[0], "peak").get_ydata()
    assert list(peak) == pytest.approx([est.peak.total / GIB] * 2, rel=1e-12)
    assert any(label.startswith("the head (output layer, loss): +") for label in labels)


def test_the_backward_is_the_estimate_s_phases_in_time_order(outcome) -> None:
    est, t = outcome.estimate, timeline(outcome)
    n = len(est.block_saved)
    stages = [s.stage for s in t.segments]
    assert stages == ["forward"] * (n + 1) + ["head"] + ["backward"] * (n + 1) + ["optimizer"]
    back = [s.total for s in t.segments if s.stage == "backward"]
    assert back == [p.total for p in reversed(est.phases[:n])] + [est.phases[n + 1].total]
    assert t.segments[-1].total == est.phases[-1].total
    # Through the forward the activations only grow, by each block's saved bytes.
    forward = [s.activations for s in t.segments if s.stage == "forward"]
    assert [b - a for a, b in zip(forward, forward[1:])] == list(est.block_saved)


def _gib(text: str) -> tuple[float, float]:
    """The number and half its last digit (the printing's rounding)."""
    decimals = len(text.split(".")[1])
    return float(text), 0.5 * 10 ** -decimals


LINE = re.compile(r"memory per rank: floor (\S+) GiB, activations up to \+(\S+) GiB by the last "
                  r"block's forward, head \+(\S+) GiB, peak (\S+) GiB during (.+?)"
                  r"(?: \(device (\S+) GiB: (fits|does NOT fit), (\S+) GiB (free|over)\))?$")


@pytest.mark.parametrize("capacity_of_peak", [None, 1.5, 0.5])
def test_the_console_line_says_the_estimate_s_numbers(outcome, capacity_of_peak) -> None:
    est, profile = outcome.estimate, outcome.profile
    capacity = None if capacity_of_peak is None else int(capacity_of_peak * est.peak.total)
    match = LINE.match(picture_line(outcome, capacity))
    assert match, picture_line(outcome, capacity)
    head = est.phases[len(est.block_saved)]
    expected = [head.params + head.grads + head.optimizer + head.unsharded,
                profile.before_blocks_bytes + sum(est.block_saved),
                profile.head.saved_bytes + profile.head.extra_bytes, est.peak.total]
    for text, value in zip(match.groups()[:4], expected):
        number, rounding = _gib(text)
        assert number == pytest.approx(value / GIB, abs=rounding), (text, value)
    assert match.group(5) == est.peak.name
    if capacity is None:
        assert match.group(6) is None
        return
    fits = est.peak.total <= capacity
    assert match.group(7) == ("fits" if fits else "does NOT fit")
    assert match.group(9) == ("free" if fits else "over")
    for text, value in ((match.group(6), capacity), (match.group(8),
                                                      abs(capacity - est.peak.total))):
        number, rounding = _gib(text)
        assert number == pytest.approx(value / GIB, abs=rounding)
