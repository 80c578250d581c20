"""dsq: Dynamic Stashing Quantization experiment suite."""

__version__ = "0.1.0"
