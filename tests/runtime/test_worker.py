"""runtime/_worker.py: persistent worker threads (inline on CPU), exceptions forwarded with
their type and traceback, no leaks and no hang at exit."""

import gc
import threading
import weakref

import pytest
import torch
from torch import nn

from fxpipe import GPipe


class Boom(Exception):
    pass


class Explode(nn.Module):
    def __init__(self, exc):
        super().__init__()
        self.exc = exc
        self.armed = True

    def forward(self, x):
        if self.armed:
            raise self.exc("kaboom")
        return x


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt, SystemExit, RuntimeError])
def test_exception_propagates_with_type_and_pipeline_stays_usable(exc, threads):
    explode, counter = Explode(exc), Counter()
    pipe = GPipe(nn.Sequential(nn.Linear(3, 3), explode, counter), [1, 1, 1], devices=["cpu"] * 3, chunks=4)
    pipe._runtime.threads = threads
    with pytest.raises(exc, match="kaboom") as info:
        pipe(torch.randn(8, 3))
    # The traceback reaches the raising frame inside the worker.
    assert any(frame.name == "forward" for frame in info.traceback)
    # Partition 1 fails at tick 1, so later ticks never start: partition 2 never ran.
    assert counter.calls == 0
    explode.armed = False
    out = pipe(torch.randn(8, 3))
    assert out.shape == (8, 3) and counter.calls == 4


def fxpipe_threads():
    return [t for t in threading.enumerate() if t.name.startswith("fxpipe-worker")]


def threaded(pipe):
    """Forces worker threads on a CPU pipeline (CPU-only pipelines run tasks inline)."""
    pipe._runtime.threads = True
    return pipe


def test_cpu_pipelines_run_inline_without_threads():
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], devices=["cpu"] * 2, chunks=2)
    pipe(torch.randn(4, 2)).sum().backward()
    assert pipe._runtime.workers.inline and pipe._runtime.workers.threads == []


def test_worker_threads_follow_the_callers_thread_count():
    seen = []

    class Spy(nn.Module):
        def forward(self, x):
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            return x

    pipe = threaded(GPipe(nn.Sequential(nn.Linear(2, 2), Spy()), [1, 1], devices=["cpu"] * 2, chunks=2))
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe(torch.randn(4, 2))
    finally:
        torch.set_num_threads(old)
    assert seen and all(name.startswith("fxpipe-worker") and n == 1 for name, n in seen)


def test_workers_are_persistent_and_one_per_device():
    pipe = threaded(GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], devices=["cpu"] * 2, chunks=2))
    pipe(torch.randn(4, 2))
    workers = list(pipe._runtime.workers.threads)
    assert len(workers) == 1  # both partitions live on the one CPU device
    assert all(t.is_alive() and t in fxpipe_threads() for t in workers)
    pipe(torch.randn(4, 2)).sum().backward()
    assert pipe._runtime.workers.threads == workers  # the same threads serve every call


def test_no_thread_leak_when_pipelines_are_dropped():
    gc.collect()
    before = len(fxpipe_threads())
    for _ in range(30):
        pipe = threaded(GPipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [1, 1], devices=["cpu"] * 2, chunks=2))
        pipe(torch.randn(4, 2)).sum().backward()
        ref = weakref.ref(pipe)
        del pipe
    gc.collect()
    assert ref() is None
    for t in fxpipe_threads()[before:]:
        t.join(timeout=5)
    assert len(fxpipe_threads()) <= before


def test_no_hang_at_interpreter_exit(tmp_path):
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(
        "import torch, fxpipe\n"
        "from torch import nn\n"
        "ps = [fxpipe.GPipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [1, 1], devices=['cpu'] * 2, chunks=2)\n"
        "      for _ in range(24)]\n"
        "for p in ps:\n"
        "    p._runtime.threads = True\n"
        "    p(torch.randn(4, 2)).sum().backward()\n"
        "print('done')\n"
    )
    for _ in range(3):  # an abort at exit was intermittent before workers stopped using atexit
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "done"
