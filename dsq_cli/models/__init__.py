"""Model construction for GLUE fine-tuning: the registered encoders (fairseq RoBERTa models with
a ``"glue"`` head), their tokenizers, the BERT-to-fairseq weight mapping and fairseq's
checkpoint format. Nothing here trains; ``dsq_cli.train`` builds its models from here."""

from .encoders import (
    ENCODERS,
    Encoder,
    build_encoder,
    check_available,
    quantize_exclude,
    register_encoder,
    roberta_base_download_hint,
)
from .errors import EncoderError
from .fairseq_checkpoint import load_fairseq_checkpoint
from .heads import HEAD_NAME
from .tokenizers import SentenceTokenizer

__all__ = [
    "ENCODERS",
    "HEAD_NAME",
    "Encoder",
    "EncoderError",
    "SentenceTokenizer",
    "build_encoder",
    "check_available",
    "load_fairseq_checkpoint",
    "quantize_exclude",
    "register_encoder",
    "roberta_base_download_hint",
]
