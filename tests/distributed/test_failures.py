"""One rank's failure named on every rank (fxpipe.distributed._failures), gloo ranks on 127.0.0.1.

Each rank writes what it raised (``Type: message``) to ``rank{r}.<what>.txt`` and the parent
checks every rank's line: the failing rank's own error, the others' ``PeerFailedError``
naming it. The parent bounds every spawn (no rank may be left waiting), without timing
anything else.
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_harness import SPAWN_SECONDS, environment, free_port
from dist_models import case


def _read_by_fxpipe(target: torch.Tensor) -> bool:
    """Whether fxpipe is reading loss_fn on fake tensors (fxpipe.checks._loss_fn), not running it."""
    return isinstance(target, torch._subclasses.FakeTensor)


def _record(out: str, rank: int, what: str, e: BaseException) -> None:
    Path(out, f"rank{rank}.{what}.txt").write_text(f"{type(e).__name__}: {e}")


def _read(tmp: Path, world: int, what: str) -> list[str]:
    return [(tmp / f"rank{r}.{what}.txt").read_text() for r in range(world)]


def _run(fn: Any, world: int, args: tuple, tmp: Path, port: int = 0) -> list[int]:
    """``fn(rank, world, port, *args, str(tmp))`` on ``world`` spawned ranks; their exit codes.
    Fails if any rank is still running after ``SPAWN_SECONDS`` (a rank left waiting)."""
    import torch.multiprocessing as mp

    environment()
    ctx = mp.get_context("spawn")
    port = port or free_port()
    procs = [ctx.Process(target=fn, args=(r, world, port, *args, str(tmp))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + SPAWN_SECONDS
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"ranks {alive} still running after {SPAWN_SECONDS} s"
    return [p.exitcode for p in procs]  # type: ignore[misc]


def _three_rank_worker(rank: int, world: int, port: int, out: str) -> None:
    """A bad sample at build and a bad batch at step on rank 0 only (refused on every rank
    before anything is sent; the pipeline still runs), then an error in the last rank's
    ``loss_fn`` in the middle of a step (every rank ends, naming it)."""
    import torch.distributed as dist

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    model, x, y, loss_fn, _ = case("mlp", 2)
    try:  # rank 0's sample has 7 samples: not a multiple of chunks=2
        fpd.pipeline(model, x[:7] if rank == 0 else x, chunks=2, loss_fn=loss_fn, timeout=60)
    except Exception as e:
        _record(out, rank, "build", e)
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=loss_fn, timeout=60)
    try:  # rank 0's batch has 5 samples: not a multiple of chunks=2 (any multiple runs)
        pipe.step(x[:5] if rank == 0 else x, target=y[:5] if rank == 0 else y)
    except Exception as e:
        _record(out, rank, "step", e)
    try:  # rank 1's target has no batch dimension (it checks the target too, though only the last rank uses it)
        pipe.step(x, target=y.sum() if rank == 1 else y)
    except Exception as e:
        _record(out, rank, "target", e)
    Path(out, f"rank{rank}.after.txt").write_text(repr(pipe.step(x, target=y).item()))  # still runs
    pipe.close()

    def failing(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if _read_by_fxpipe(target):  # fails on the real micro-batch, in the middle of the step
            return loss_fn(output, target)
        raise RuntimeError("boom in loss_fn")

    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=failing, timeout=60)
    try:
        pipe.step(x, target=y)
    except BaseException as e:
        _record(out, rank, "midstep", e)
        raise  # ends this process: its peers waiting on it hear of it


def test_every_rank_names_the_failing_rank_and_its_error(tmp_path: Path) -> None:
    codes = _run(_three_rank_worker, 3, (), tmp_path)
    build = _read(tmp_path, 3, "build")
    assert build[0].startswith("BatchShapeError: ") and "[(7, 8)]" in build[0], build[0]
    for line in build[1:]:  # rank 0's own error, in one line, on the others
        assert line.startswith("PeerFailedError: rank 0 could not capture and check its model and sample"), line
        assert "rank 0: BatchShapeError: " in line and "[(7, 8)]" in line, line

    step = _read(tmp_path, 3, "step")
    assert step[0].startswith("BatchShapeError: every tensor input must have the same batch size") \
        and "multiple of chunks=2" in step[0] and "[(5, 8)]" in step[0], step[0]
    for line in step[1:]:
        assert line.startswith("PeerFailedError: rank 0 could not check its batch"), line
        assert "rank 0: BatchShapeError: every tensor input" in line and "[(5, 8)]" in line, line
    target = _read(tmp_path, 3, "target")
    assert target[1].startswith("BatchShapeError: target must be a tensor"), target[1]
    assert all(line.startswith("PeerFailedError: rank 1 could not check its batch") and
               "rank 1: BatchShapeError: target must be a tensor" in line for line in (target[0], target[2])), target
    after = _read(tmp_path, 3, "after")  # refused calls send nothing: the pipeline still runs, on every rank
    model, x, y, loss_fn, _ = case("mlp", 2)
    assert len(set(after)) == 1 and float(after[0]) == pytest.approx(loss_fn(model(x), y).item(), rel=1e-5)

    midstep = _read(tmp_path, 3, "midstep")
    assert midstep[2] == "RuntimeError: boom in loss_fn", midstep[2]
    for line in midstep[:2]:  # rank 1 hears from rank 2's closed connection, rank 0 from rank 1's
        assert line.startswith("PeerFailedError: stopped because another rank failed: rank 2: "), line
        assert line.endswith("rank 2: RuntimeError: boom in loss_fn"), line
    assert all(c != 0 for c in codes), codes


def _differing_arguments_worker(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 asks for other chunks, then another schedule, than rank 0 (as fxpipe.tune run
    on each rank may choose): without the check, gloo aborted rank 1 on a buffer of the wrong
    size, and different schedules waited on each other until ``timeout``."""
    import torch.distributed as dist

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    model, x, y, loss_fn, _ = case("mlp", 2)
    for what, mine in (("chunks", {"chunks": 4 if rank else 2}), ("schedule", {"schedule": "gpipe" if rank else "1f1b"})):
        options = {"chunks": 2, "schedule": "1f1b", **mine}
        try:
            fpd.pipeline(model, x, loss_fn=loss_fn, timeout=60, **options).step(x, target=y)
            Path(out, f"rank{rank}.{what}.txt").write_text("ran")
        except Exception as e:
            _record(out, rank, what, e)
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=loss_fn, timeout=60)  # the same arguments: it runs
    try:  # rank 1 validates while rank 0 trains: gloo aborted rank 1, rank 0 got a raw RuntimeError
        pipe.eval_step(x) if rank else pipe.step(x, target=y)
        Path(out, f"rank{rank}.calls.txt").write_text("ran")
    except Exception as e:
        _record(out, rank, "calls", e)
    # rank 1 given its own shard, as a user attempting data parallelism does: the step trained
    # rank 0's inputs against rank 1's targets (4 ranks: 4.195, neither the shard's nor the global)
    flipped = (x.flip(0), y.flip(0))  # the same values in another order: the same plain sum
    for what, (xs, ys) in (("inputs", (flipped[0], y)), ("targets", (x, flipped[1])), ("both", flipped)):
        try:
            pipe.step(xs if rank else x, target=ys if rank else y)
            Path(out, f"rank{rank}.{what}.txt").write_text("ran")
        except Exception as e:
            _record(out, rank, what, e)
    try:
        pipe.eval_step(x.flip(0) if rank else x)
        Path(out, f"rank{rank}.eval.txt").write_text("ran")
    except Exception as e:
        _record(out, rank, "eval", e)
    Path(out, f"rank{rank}.after.txt").write_text(repr(pipe.step(x, target=y).item()))
    pipe.close()
    # an orderly end: rank 0 holds the tcp:// store, and a rank leaving while the other still
    # talks to it ended in gloo's abort at exit (-6) now and then
    dist.barrier()
    dist.destroy_process_group()


def test_ranks_given_different_chunks_or_schedule_are_refused_on_every_rank(tmp_path: Path) -> None:
    codes = _run(_differing_arguments_worker, 2, (), tmp_path)
    chunks, schedule = _read(tmp_path, 2, "chunks"), _read(tmp_path, 2, "schedule")
    for line in chunks:
        assert line.startswith("DistributedError: the ranks called fxpipe.distributed.pipeline with different "
                               "chunks (chunks: rank 0 2, rank 1 4)"), line
    for line in schedule:
        assert "different schedule (schedule: rank 0 '1f1b', rank 1 'gpipe')" in line, line
    for line in _read(tmp_path, 2, "calls"):
        assert line.startswith("DistributedError: the ranks called different methods of this pipeline (rank 0: "
                               "step(), rank 1: eval_step())"), line
    for what in ("inputs", "targets", "both", "eval"):
        for line in _read(tmp_path, 2, what):
            assert line.startswith("BatchMismatchError: the ranks were given different batches in "), (what, line)
            assert "(rank 0; rank 1 each got another one)" in line, line
    after = _read(tmp_path, 2, "after")
    assert len(set(after)) == 1 and codes == [0, 0], (after, codes)


def _rank0_worker(rank: int, world: int, port: int, store_host: str, out: str) -> None:
    """zbv on 2 ranks puts the last stage, and so ``loss_fn``, on rank 0, which raises in the
    middle of the first step. The store is held by the parent (as torchrun's agent holds it)
    or by rank 0 (``tcp://``)."""
    import torch.distributed as dist

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    if store_host == "parent":
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    model, x, y, loss_fn, options = case("gpt", 4)

    def failing(output: Any, target: torch.Tensor) -> torch.Tensor:
        if _read_by_fxpipe(target):
            return loss_fn(output, target)
        raise ValueError("no loss on rank 0")

    pipe = fpd.pipeline(model, x, chunks=4, loss_fn=failing, schedule="zbv", stages_per_rank=2, timeout=60,
                        **options)
    assert pipe.local == ([0, 3] if rank == 0 else [1, 2])  # the last stage, and loss_fn, on rank 0
    try:
        pipe.step(x, target=y)
    except BaseException as e:
        _record(out, rank, "midstep", e)
        raise


def _run_with_store(world: int, store_host: str, tmp: Path) -> list[int]:
    if store_host != "parent":
        return _run(_rank0_worker, world, (store_host,), tmp)
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
    codes = _run(_rank0_worker, world, (store_host,), tmp, port)
    del store  # held by this process until every rank ended, as torchrun's agent holds it
    return codes


def test_rank_0_failing_mid_step_is_named_when_the_store_outlives_it(tmp_path: Path) -> None:
    """Under torchrun the agent holds the store, so rank 0's line is read after it ended."""
    codes = _run_with_store(2, "parent", tmp_path)
    lines = _read(tmp_path, 2, "midstep")
    assert lines[0] == "ValueError: no loss on rank 0", lines[0]
    assert lines[1].startswith("PeerFailedError: stopped because another rank failed: rank 0: "), lines[1]
    assert lines[1].endswith("rank 0: ValueError: no loss on rank 0"), lines[1]
    assert codes[0] != 0 and codes[1] != 0, codes


@pytest.mark.slow
def test_rank_0_holding_the_store_and_failing_mid_step_is_still_named(tmp_path: Path) -> None:
    """With ``init_method='tcp://'`` the store ends with rank 0's process. Its peer reads the
    line if the store is still up when the connection closes (it was, here), and otherwise
    says the store went with its host: either way a PeerFailedError naming rank 0."""
    codes = _run_with_store(2, "rank0", tmp_path)
    lines = _read(tmp_path, 2, "midstep")
    assert lines[0] == "ValueError: no loss on rank 0", lines[0]
    assert lines[1].startswith("PeerFailedError: "), lines[1]
    read = lines[1].endswith("rank 0: ValueError: no loss on rank 0")
    gone = "cannot be reached: its host ended (rank 0" in lines[1]
    assert read or gone, lines[1]
    assert codes[0] != 0 and codes[1] != 0, codes


def test_a_stage_error_wrapped_by_torch_is_named_by_its_own_line() -> None:
    """torch's PipelineStage re-raises a stage's forward error as a RuntimeError saying only
    "[Stage 0] failed to run forward: args: ..."; the line the other ranks print names the
    stage code's own error and fxpipe's note (the generated line, the model's source)."""
    from fxpipe.distributed._failures import failure_line

    own = IndexError("index out of range in self")
    own.__notes__ = ["in fxpipe stage 0 (Stage0), generated line 21: `embedding = ...`;\n  original source: model.py, line 5"]
    try:
        try:
            raise own
        except IndexError as e:  # the message torch 2.13's stage.py builds
            raise RuntimeError("\n            [Stage 0] failed to run forward:\n            args: ('Tensor(...)',)\n"
                               "            kwargs: {}\n            ") from e
    except RuntimeError as wrapped:
        line = failure_line(0, wrapped)
    assert line == ("rank 0: IndexError: index out of range in self (in fxpipe stage 0 (Stage0), generated line 21: "
                    "`embedding = ...`; original source: model.py, line 5)"), line
    unrelated = RuntimeError("failed to run forward")  # not torch's wrapper: named as it is
    unrelated.__cause__ = ValueError("x")
    assert failure_line(1, unrelated) == "rank 1: RuntimeError: failed to run forward"


def test_the_store_path_in_one_process() -> None:
    """In one process (world size 1): a rank's own error is written as one line and re-raised
    as it was; a transfer error then reads that line (the first written stays) and becomes a
    PeerFailedError naming its rank; a transfer error with no line written is a peer gone silent."""
    import torch.distributed as dist

    from fxpipe.distributed._failures import Failures, failure_line
    from fxpipe.errors import DistributedError, PeerFailedError

    assert failure_line(3, ValueError("a\n  b\n")) == "rank 3: ValueError: a b"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        group = dist.new_group([0])
        failures = Failures(group)
        gone = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
        # nobody failed first: a peer ended without a word (killed, out of memory), said as such (gloo's
        # "Connection closed" came raw before, a trial), and written for the ranks still waiting
        with pytest.raises(PeerFailedError, match="no rank reported an error: a peer process ended") as raw:
            with failures.reported():
                raise gone
        assert raw.value.__cause__ is gone and raw.value.rank is None and "Connection closed" in str(raw.value)
        store = dist.distributed_c10d._get_default_store()
        assert store.get(failures.key).decode().startswith("rank 0: a transfer with another rank failed (rank 0: "
                                                           "RuntimeError: [../gloo")
        store.delete_key(failures.key)
        with pytest.raises(KeyError):
            with failures.reported():
                raise KeyError("bad key")
        with pytest.raises(ZeroDivisionError):  # a later error of its own: the first line stays
            with failures.reported():
                raise ZeroDivisionError("later")
        named = r"^stopped because another rank failed: rank 0: KeyError: 'bad key'$"
        with pytest.raises(PeerFailedError, match=named) as caught:
            with failures.reported():
                raise gone
        assert caught.value.rank == 0 and caught.value.error == "rank 0: KeyError: 'bad key'"
        assert caught.value.__cause__ is gone and isinstance(caught.value, DistributedError)
        again = pickle.loads(pickle.dumps(caught.value))  # as torch.multiprocessing carries it
        assert (str(again), again.rank, again.error) == (str(caught.value), 0, caught.value.error)
        with failures.agreed("check its batch"):  # nothing failed: nothing raised
            pass
        with pytest.raises(ValueError, match="own"):  # the failed rank re-raises its own error
            with failures.agreed("check its batch"):
                raise ValueError("own")
    finally:
        dist.destroy_process_group()


def test_a_step_stopped_midway_leaves_the_pipeline_refusing_further_steps() -> None:
    """An error inside the schedule (here loss_fn, world size 1 in this process) leaves the
    other ranks stopped or waiting elsewhere in the schedule: a further step or eval_step is
    refused with PipelineClosedError naming the first error, never a hang or a partial step."""
    import torch.distributed as dist

    import fxpipe.distributed as fpd
    from fxpipe.errors import PipelineClosedError

    model, x, y, loss_fn, _ = case("mlp", 2)
    calls = [0]

    def failing_once(out: Any, target: torch.Tensor) -> torch.Tensor:
        if _read_by_fxpipe(target):
            return loss_fn(out, target)
        calls[0] += 1
        if calls[0] == 1:
            raise ValueError("boom in loss_fn")
        return loss_fn(out, target)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        pipe = fpd.pipeline(model, x, chunks=2, loss_fn=failing_once, schedule="gpipe", stages_per_rank=2,
                            timeout=60)
        with pytest.raises(ValueError, match="boom in loss_fn"):
            pipe.step(x, target=y)
        for again in (lambda: pipe.step(x, target=y), lambda: pipe.eval_step(x)):
            with pytest.raises(PipelineClosedError, match=r"stopped while the ranks were exchanging values "
                                                          r"\(ValueError: boom in loss_fn\).*Build a new pipeline"):
                again()
        pipe.close()
    finally:
        dist.destroy_process_group()


def _between_steps_worker(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 fails in its own code between two steps (its data loader), uncaught, as a torchrun
    script would: rank 0, waiting in the next step, names it instead of gloo's 'Connection
    closed by peer'."""
    import os
    import sys

    import torch.distributed as dist

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    model, x, y, loss_fn, _ = case("mlp", 2)
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=loss_fn, timeout=60)
    pipe.step(x, target=y)
    if rank == 1:
        try:
            raise ValueError("the data loader broke")
        except ValueError:
            sys.excepthook(*sys.exc_info())  # what Python runs for an exception nothing caught
        os._exit(1)
    try:
        pipe.step(x, target=y)
        Path(out, f"rank{rank}.between.txt").write_text("ran")
    except Exception as e:
        _record(out, rank, "between", e)
    os._exit(0)  # rank 1 is gone: no orderly end of the group


def test_a_rank_failing_between_steps_is_named_by_its_peers(tmp_path: Path) -> None:
    codes = _run(_between_steps_worker, 2, (), tmp_path)
    line = (tmp_path / "rank0.between.txt").read_text()
    assert line.startswith("PeerFailedError: stopped because another rank failed: rank 1: ValueError: the data "
                           "loader broke"), line
    assert codes == [0, 1], codes


def _stepped(rank: int, world: int, port: int, timeout: float) -> tuple:
    """A gloo rank's two-stage MLP pipeline after one step: (pipe, model, x, y, loss_fn)."""
    import torch.distributed as dist

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    model, x, y, loss_fn, _ = case("mlp", 2)
    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=loss_fn, timeout=timeout, progress=False)
    pipe.step(x, target=y)
    return pipe, model, x, y, loss_fn


def _one_rank_calls_worker(rank: int, world: int, port: int, out: str) -> None:
    """Calls that only some ranks make (a rank-guarded branch), and step() left under no_grad:
    each refused on every rank before anything is sent, the pipeline usable afterwards."""
    import torch.distributed as dist

    from fxpipe.distributed import trace

    pipe, _, x, y, _ = _stepped(rank, world, port, 30)
    try:  # gloo aborted the clipping process ("collective mismatch")
        if rank == 0:
            pipe.clip_grad_norm_(0.1)
        else:
            pipe.step(x, target=y)
    except Exception as e:
        _record(out, rank, "clip", e)
    try:  # the recording rank waited out gloo's timeout, then torch's bare RuntimeError
        if rank == 0:
            with trace.record(pipe):
                pipe.step(x, target=y)
        else:
            pipe.step(x, target=y)
    except Exception as e:
        _record(out, rank, "record", e)
    try:  # torch's schedule raised after the step began: the pipeline was lost
        with torch.no_grad():
            pipe.step(x, target=y)
    except Exception as e:
        _record(out, rank, "nograd", e)
    loss = pipe.step(x, target=y)  # still usable
    Path(out, f"rank{rank}.after.txt").write_text(f"{float(loss):.6f}")
    pipe.close()
    dist.destroy_process_group()


def test_calls_some_ranks_skip_or_make_under_no_grad_are_refused_on_every_rank(tmp_path: Path) -> None:
    assert _run(_one_rank_calls_worker, 2, (), tmp_path) == [0, 0]
    for line in _read(tmp_path, 2, "clip"):
        assert line.startswith("DistributedError") and "rank 0: clip_grad_norm_(), rank 1: step()" in line
    for line in _read(tmp_path, 2, "record"):
        assert line.startswith("DistributedError") and "rank 0: trace.record(), rank 1: step()" in line
    for line in _read(tmp_path, 2, "nograd"):
        assert line.startswith("StepError") and "torch.no_grad()" in line and "Nothing was sent" in line
    assert all(float(v) > 0 for v in _read(tmp_path, 2, "after"))


def _build_alone_worker(rank: int, world: int, port: int, out: str) -> None:
    import fxpipe.distributed as fpd

    pipe, model, x, y, loss_fn = _stepped(rank, world, port, 5)
    try:
        if rank == 0:  # the store's bare "wait timeout" on the building rank
            fpd.pipeline(model, x, chunks=2, loss_fn=loss_fn, timeout=5, progress=False)
        else:
            pipe.step(x, target=y)
    except Exception as e:
        _record(out, rank, "build", e)


@pytest.mark.slow
def test_a_build_on_one_rank_alone_is_named_on_every_rank(tmp_path: Path) -> None:
    _run(_build_alone_worker, 2, (), tmp_path)
    building, stepping = _read(tmp_path, 2, "build")
    assert building.startswith("DistributedError") and "did not join this build" in building
    assert stepping.startswith("PeerFailedError") and "rank 0: DistributedError: the other ranks did not join" in stepping


def _late_failure_worker(rank: int, world: int, port: int, out: str) -> None:
    """1F1B, the loss failing on the second micro-batch: the first's backward has run on both
    ranks by then. Each rank records its error and whether every .grad is None again."""
    import torch.distributed as dist

    import fxpipe.distributed as fpd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    model, x, y, loss_fn, _ = case("mlp", 2)
    calls = []

    def failing(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not _read_by_fxpipe(target):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("boom in the second micro-batch's loss")
        return loss_fn(output, target)

    pipe = fpd.pipeline(model, x, chunks=2, loss_fn=failing, schedule="1f1b", timeout=60)
    try:
        pipe.step(x, target=y)
    except BaseException as e:
        _record(out, rank, "late", e)
        Path(out, f"rank{rank}.grads.txt").write_text(repr(all(p.grad is None for p in pipe.parameters())))
        raise


def test_a_step_failing_after_a_backward_leaves_no_partial_gradient(tmp_path: Path) -> None:
    """Eager fails before any backward; a rank keeping the first micro-batch's gradients would
    train its next step off, where the loop skips the bad batch (a trial, one process)."""
    _run(_late_failure_worker, 2, (), tmp_path)
    assert "boom in the second micro-batch's loss" in _read(tmp_path, 2, "late")[1]
    assert _read(tmp_path, 2, "grads") == ["True", "True"]


def _stuck_worker(rank: int, world: int, port: int, out: str) -> None:
    """Rank 1 stuck past the pipeline's timeout: rank 0's step fails naming it; rank 0's next
    step is refused by fxpipe, not by gloo's bare 'Application timeout caused pair closure'."""
    import time

    pipe, _, x, y, _ = _stepped(rank, world, port, 4)
    if rank == 1:
        time.sleep(9)
    try:
        pipe.step(x, target=y)
    except Exception as e:
        _record(out, rank, "stuck", e)
    try:
        pipe.step(x, target=y)
    except Exception as e:
        _record(out, rank, "after", e)


@pytest.mark.slow
def test_the_step_after_a_peer_timed_out_is_refused(tmp_path: Path) -> None:
    _run(_stuck_worker, 2, (), tmp_path)
    assert _read(tmp_path, 2, "stuck")[0].startswith("PeerFailedError"), _read(tmp_path, 2, "stuck")
    after = (tmp_path / "rank0.after.txt").read_text()
    assert after.startswith("PipelineClosedError") and "Build a new pipeline" in after, after
