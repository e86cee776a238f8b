"""The runtime underneath GPipe: schedule, micro-batches, checkpointing, workers, BatchNorm."""

import copy
import gc
import threading
import weakref

import pytest
import torch
from torch import nn

from fxpipe import GPipe, is_checkpointing, is_recomputing
from fxpipe.runtime import microbatch
from fxpipe.runtime.microbatch import Batch
from fxpipe.runtime.pipeline import clock_cycles


# -- clock cycles ------------------------------------------------------------------------

@pytest.mark.parametrize("m,n", [(1, 1), (3, 3), (4, 2), (2, 5), (8, 4)])
def test_clock_cycles_cover_every_task_once_in_dependency_order(m, n):
    seen = {}
    for k, schedule in enumerate(clock_cycles(m, n)):
        for i, j in schedule:
            assert i + j == k
            seen[(i, j)] = k
    assert sorted(seen) == [(i, j) for i in range(m) for j in range(n)]
    for (i, j), k in seen.items():
        if j:
            assert seen[(i, j - 1)] < k  # a micro-batch reaches partition j after j-1
        if i:
            assert seen[(i - 1, j)] < k  # a partition takes micro-batches in order


def test_clock_cycles_example():
    assert list(clock_cycles(3, 3)) == [
        [(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1), (0, 2)], [(2, 1), (1, 2)], [(2, 2)],
    ]


# -- micro-batches -----------------------------------------------------------------------

def test_scatter_like_torch_chunk():
    x = torch.arange(10)
    parts = microbatch.scatter(x, 4)
    assert [b.value.tolist() for b in parts] == [t.tolist() for t in x.chunk(4)]
    torch.testing.assert_close(microbatch.gather(parts), x)
    assert len(microbatch.scatter(torch.zeros(3, 2), 8)) == 3  # fewer samples than chunks


def test_scatter_tuple_rejects_mismatched_batch_sizes():
    with pytest.raises(ValueError, match=r"input\[0\] has 4, input\[1\] has 5"):
        microbatch.scatter((torch.zeros(4), torch.zeros(5)), 2)


def test_scatter_tree_pytrees():
    args = (torch.arange(6).view(6, 1), {"mask": torch.ones(6), "scale": 2.0})
    kwargs = {"flag": True, "none": None, "t": torch.tensor(3.0)}
    micro, spec = microbatch.scatter_tree(args, kwargs, 4)
    assert len(micro) == 3  # chunk size 2
    for leaves in micro:
        a, k = torch.utils._pytree.tree_unflatten(leaves, spec)
        assert a[0].shape == (2, 1) and a[1]["mask"].shape == (2,)
        assert a[1]["scale"] == 2.0 and k["flag"] is True and k["none"] is None
        assert k["t"].item() == 3.0  # 0-dim tensors go to every micro-batch
    outs = [[m[0] * 2, "label", m[1]] for m in micro]
    gathered = microbatch.gather_tree(outs)
    torch.testing.assert_close(gathered[0], args[0] * 2)
    assert gathered[1] == "label"


def test_scatter_tree_names_mismatched_leaves():
    with pytest.raises(ValueError) as info:
        microbatch.scatter_tree((torch.zeros(4, 2),), {"mask": torch.zeros(3)}, 2)
    assert "[0][0] has 4" in str(info.value) and "['mask'] has 3" in str(info.value)


def test_gather_tree_refuses_scalars():
    with pytest.raises(ValueError, match="0-dim tensor"):
        microbatch.gather_tree([[torch.tensor(1.0)], [torch.tensor(2.0)]], names=["loss"])


def test_batch_call_spread():
    b = Batch((torch.ones(2), 3))
    assert b.call(lambda x, k: (x * k, k), spread=True).values[1] == 3
    assert b.anchor() == 0
    assert Batch((1, torch.zeros(2, dtype=torch.long))).anchor() is None


# -- checkpointing -----------------------------------------------------------------------

def dropout_model():
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 8))


@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_dropout_bit_exact_between_checkpoint_modes(chunks):
    results = {}
    for mode in ["always", "except_last", "never"]:
        torch.manual_seed(0)
        model = dropout_model()
        pipe = GPipe(model, [2, 1, 2], devices=["cpu"] * 3, chunks=chunks, checkpoint=mode)
        torch.manual_seed(1234)
        x = torch.randn(9, 8)
        out = pipe(x)
        out.sum().backward()
        results[mode] = (out.detach(), [p.grad.clone() for p in model.parameters()])
    ref_out, ref_grads = results["never"]
    for mode in ["always", "except_last"]:
        out, grads = results[mode]
        assert torch.equal(out, ref_out), mode
        for g, r in zip(grads, ref_grads):
            assert torch.equal(g, r), mode


class Probe(nn.Module):
    def __init__(self):
        super().__init__()
        self.events = []

    def forward(self, x):
        self.events.append((is_checkpointing(), is_recomputing()))
        return x * 1.0


def test_is_checkpointing_and_is_recomputing():
    probe = Probe()
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), probe), [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="except_last")
    pipe(torch.randn(4, 2)).sum().backward()
    # micro-batch 0 checkpointed then recomputed, micro-batch 1 plain.
    assert sorted(probe.events) == sorted([(True, False), (False, False), (False, True)])
    assert not is_checkpointing() and not is_recomputing()


def test_no_checkpointing_in_eval_or_no_grad():
    probe = Probe()
    pipe = GPipe(nn.Sequential(nn.Linear(2, 2), probe), [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="always")
    with torch.no_grad():
        pipe(torch.randn(4, 2))
    pipe.eval()
    pipe(torch.randn(4, 2))
    assert probe.events == [(False, False)] * 4


# -- backward order ----------------------------------------------------------------------

class Recorder(nn.Module):
    def __init__(self, log, name):
        super().__init__()
        self.log, self.name = log, name
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        mb = int(x[0, 0].item() // 1000)  # the micro-batch id travels in the data
        if y.requires_grad:  # not in the activation-free checkpoint pass
            y.register_hook(lambda g, mb=mb: self.log.append((self.name, mb)))
        return y * 0 + x  # keep the id in the data


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_backward_visits_micro_batches_in_reverse_order(checkpoint):
    log = []
    model = nn.Sequential(Recorder(log, "a"), Recorder(log, "b"))
    pipe = GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=4, checkpoint=checkpoint)
    x = torch.zeros(4, 4)
    for i in range(4):
        x[i] = 1000 * i
    pipe(x).sum().backward()
    for name in "ab":
        order = [mb for n, mb in log if n == name]
        assert order == [3, 2, 1, 0], (name, log)


# -- exceptions and workers --------------------------------------------------------------

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


# -- deferred BatchNorm ------------------------------------------------------------------

def bn_models():
    # Each BatchNorm sees the same input in the pipeline and in the full-batch model
    # (normalisation itself uses micro-batch statistics, so a BN after a BN would not).
    yield nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 5))
    yield nn.Sequential(nn.Flatten(), nn.Linear(48, 5), nn.BatchNorm1d(5, momentum=None), nn.Linear(5, 5))
    yield nn.Sequential(nn.Conv3d(3, 2, 1), nn.BatchNorm3d(2, momentum=0.3), nn.Flatten())


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_deferred_batch_norm_matches_full_batch(chunks, checkpoint):
    for model in bn_models():
        ref = copy.deepcopy(model)
        pipe = GPipe(model, [2, len(model) - 2], devices=["cpu"] * 2, chunks=chunks,
                     checkpoint=checkpoint, deferred_batch_norm=True)
        for step in range(3):
            x = torch.randn(12, 3, 4, 4) + step
            if isinstance(model[0], nn.Conv3d):
                x = x.unsqueeze(-1)
            pipe(x).sum().backward()
            ref(x)
        for (name, a), b in zip(ref.named_buffers(), model.buffers()):
            torch.testing.assert_close(b, a, msg=lambda m: f"{name}: {m}")
        assert list(model.state_dict()) == list(ref.state_dict())  # keys unchanged


def test_deferred_batch_norm_eval_uses_running_stats():
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    ref = copy.deepcopy(model)
    pipe = GPipe(model, [1, 1], devices=["cpu"] * 2, chunks=2, deferred_batch_norm=True)
    x = torch.randn(6, 3)
    pipe(x)
    ref(x)
    pipe.eval()
    ref.eval()
    torch.testing.assert_close(pipe(x), ref(x))


# -- CUDA only ---------------------------------------------------------------------------

@pytest.mark.cuda
def test_cuda_streams_and_copies_between_devices():
    n = min(torch.cuda.device_count(), 2)
    devices = [f"cuda:{i % torch.cuda.device_count()}" for i in range(2)]
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    ref = copy.deepcopy(model).cuda()
    pipe = GPipe(model, [2, 1], devices=devices, chunks=4)
    x = torch.randn(16, 8, device=devices[0])
    out = pipe(x)
    out.sum().backward()
    r = ref(x.to(ref[0].weight.device))
    r.sum().backward()
    torch.testing.assert_close(out, r.to(out.device))
    assert out.device == torch.device(devices[-1])
    assert len(pipe._runtime._copy_streams[0]) == 4
    assert all(isinstance(s, torch.cuda.Stream) for s in pipe._runtime._copy_streams[0])
    del n


@pytest.mark.cuda
def test_cuda_record_stream_keeps_memory_alive():
    from fxpipe.runtime.stream import new_stream, record_stream, use_stream

    device = torch.device("cuda")
    stream = new_stream(device)
    with use_stream(stream):
        x = torch.ones(1 << 20, device=device)
    record_stream(x, torch.cuda.current_stream(device))
    ptr = x.data_ptr()
    del x
    y = torch.empty(1 << 20, device=device)
    # The block is still in use on the other stream, so it was not handed out again.
    assert y.data_ptr() != ptr or torch.cuda.current_stream(device).query()
