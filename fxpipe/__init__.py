"""fxpipe: automatic GPipe pipeline parallelism for any nn.Module."""

__version__ = "0.1.0"
