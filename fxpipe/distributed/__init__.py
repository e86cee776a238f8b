"""``fxpipe.distributed``: the automatic plan run by one process per stage (or several stages
per process), with torch.distributed.pipelining doing the sending and the scheduling.

::

    import fxpipe.distributed as fpd
    pipe = fpd.pipeline(model, sample, chunks=4, loss_fn=F.cross_entropy)   # on every rank
    loss = pipe.step(x, target=y)          # every rank; the mini-batch loss on every rank
    opt = torch.optim.AdamW(pipe.parameters())                               # this rank's

See docs/guide.md, "Several processes", for what is exact and what is not supported yet.
"""

from ._build import DEFAULT_TIMEOUT, SCHEDULES, pipeline
from ._pipe import DistributedPipeline

__all__ = ["pipeline", "DistributedPipeline", "SCHEDULES", "DEFAULT_TIMEOUT"]
