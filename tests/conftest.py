"""Shared pytest set-up: options, markers, the seed, and the helpers' folder on sys.path.

Tests live in folders that mirror the package (tests/capture/, tests/plan/, ...); the shared
helpers (exact.py, zoo.py, hf_families.py, ...) stay in tests/, importable from every folder.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ci_budget  # noqa: E402 - from the folder just put on the path


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked slow and those over CI's time budget (the full local run)")
    parser.addoption("--record-durations", default=None, metavar="PATH",
                     help="write each test's measured seconds to PATH (tests/durations.json: CI's budget)")


def pytest_configure(config):
    path = config.getoption("--record-durations")
    if path:
        config.pluginmanager.register(ci_budget.Recorder(path), "fxpipe-durations")


def pytest_collection_modifyitems(config, items):
    skip_cuda = pytest.mark.skip(reason="needs a CUDA device")
    skip_slow = pytest.mark.skip(reason="marked slow: run with --runslow")
    run_slow = config.getoption("--runslow") or bool(config.getoption("-m"))
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
    if not run_slow:  # CI: what is over its budget, as if marked slow (tests/ci_budget.py)
        over = ci_budget.skip_marker()
        for item in ci_budget.over_budget(items):
            if "slow" not in item.keywords:
                item.add_marker(over)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
