"""dsq_cli: the Dynamic Stashing Quantization experiment suite (the `dsq` command), built on the
`dsq` library."""

__version__ = "0.1.0"
