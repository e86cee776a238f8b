"""Which tests CI runs: everything, less what costs more than CI's budget allows.

CI is a fresh clone on 2 cores and must finish in 8 minutes, setup included; the whole suite
takes about 35 minutes on such a machine. So a test whose measured time (``durations.json``:
seconds of its setup and of its call, from a full ``--runslow`` run) is over
:data:`SLOW_SECONDS` counts as slow, as if marked ``@pytest.mark.slow``: skipped unless
``--runslow``. A module-scoped fixture that costs that much (a set of gloo ranks started once
for a whole file) makes every test using it slow, since whichever runs first pays for it.

:data:`CORE` keeps one test of each thing a silent error would hide in, whatever it costs, in
CI: exactness on ranks under every schedule, a failing rank named everywhere, the data-parallel
mesh (ddp and fsdp, a tied weight, eval_step and new lengths), a model's own ``labels=`` loss
on ranks, awkward cuts, tied weights and a length per step in one process. Their time is counted in
the budget. A test not in ``durations.json`` (new, or measured under 0.3 s) runs in CI;
``tools/test --runslow --record-durations tests/durations.json`` measures every test again.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

import pytest

#: seconds (setup + call, on the reference run) over which a test is left to --runslow
SLOW_SECONDS = 0.5

#: node ids, or prefixes of them, that CI runs whatever they cost
CORE = (
    "tests/distributed/test_distributed.py::test_exact_against_eager_on_two_ranks",
    "tests/distributed/test_failures.py::test_every_rank_names_the_failing_rank_and_its_error",
    "tests/distributed/test_dp_accumulation.py::test_accumulated_gradients_survive_eval_step_and_a_new_length",
    "tests/distributed/test_distributed_labels.py::test_the_models_own_labels_loss_is_weighed_as_in_one_process",
    "tests/distributed/test_dp_loss_weights.py::test_replicas_of_other_shapes_are_weighed_exactly_or_refused[ddp]",
    "tests/test_pipeline.py::test_awkward_cuts_keep_every_gradient[never-cut0]",
    "tests/test_step.py::test_step_with_tied_weights[1f1b]",
    "tests/test_any_length.py::test_training_on_a_length_per_step_and_a_smaller_last_batch_is_eagers[gpipe]",
    "tests/test_pipeline_hf.py::test_gpt2_lm_matches_eager_with_tied_weights[3-always]",
    "tests/test_pipeline_hf.py::test_export_capture_takes_another_sequence_length_and_refuses_what_its_guards_exclude",
    "tests/distributed/test_schedules.py::test_each_layer_runs_once_per_micro_batch_and_once_per_recomputation[1f1b]",
    "tests/checks/test_running_totals.py::test_a_capacity_counted_over_the_batch_is_refused_naming_the_line[False]",
)

_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
_SHARED = ("module", "package", "session")


def measured() -> dict[str, list[float]]:
    """node id -> [setup seconds, call seconds] of the reference run."""
    with open(_FILE) as f:
        return json.load(f)


def _core(nodeid: str) -> bool:
    return nodeid.startswith(CORE)


def _shared_fixtures(item: Any) -> set[tuple[str, str]]:
    """(where it is defined, name) of each module- or session-scoped fixture of the tests'
    own that ``item`` uses (pytest's, such as ``tmp_path_factory`` under ``tmp_path``, cost
    nothing worth counting and are shared by everything)."""
    info = getattr(item, "_fixtureinfo", None)
    found = set()
    for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
        if defs and defs[-1].scope in _SHARED and str(defs[-1].baseid).startswith("tests"):
            found.add((str(defs[-1].baseid), name))
    return found


def over_budget(items: Iterable[Any]) -> list[Any]:
    """The items CI leaves to ``--runslow`` (see the module docstring)."""
    items = list(items)
    seconds = measured()
    heavy: set[tuple[str, str]] = set()
    for item in items:
        setup, _ = seconds.get(item.nodeid, (0.0, 0.0))
        if setup > SLOW_SECONDS and not _core(item.nodeid):
            heavy |= _shared_fixtures(item)
    slow = []
    for item in items:
        if _core(item.nodeid):
            continue
        if sum(seconds.get(item.nodeid, (0.0, 0.0))) > SLOW_SECONDS or _shared_fixtures(item) & heavy:
            slow.append(item)
    return slow


class Recorder:
    """``--record-durations PATH``: each test's setup and call seconds, written at the end."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seconds: dict[str, list[float]] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        entry = self.seconds.setdefault(report.nodeid, [0.0, 0.0])
        entry[0 if report.when == "setup" else 1] += report.duration

    def pytest_sessionfinish(self, session: Any) -> None:
        kept = {k: [round(s, 2), round(c, 2)] for k, (s, c) in sorted(self.seconds.items()) if s + c >= 0.3}
        lines = [f"  {json.dumps(k)}: [{s}, {c}]" for k, (s, c) in kept.items()]
        with open(self.path, "w") as f:
            f.write("{\n" + ",\n".join(lines) + "\n}\n")


def skip_marker() -> Any:
    return pytest.mark.skip(reason=f"over CI's budget (measured over {SLOW_SECONDS} s, tests/durations.json): "
                                   "run with --runslow")
