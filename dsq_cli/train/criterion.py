"""Translation's loss with the output layer in chunks: fairseq's label-smoothed cross-entropy,
the decoder's output projection and its log-softmax taken ``train.loss_chunk_tokens`` tokens at
a time (`dsq.engine.chunked_output`), so that no step holds the whole batch's logits.

Registered with fairseq as ``dsq_chunked_label_smoothed_cross_entropy``; the trainer chooses it
when ``train.loss_chunk_tokens`` is positive. Training steps take the chunked path; validation,
which keeps no gradient, computes fairseq's own. The loss, its NLL and the gradients are
fairseq's up to float32 summation order; a format with one scale per tensor at q3 (``fixed16``)
scales each chunk's gradient on its own (docs/training.md, "Memory").
"""

from __future__ import annotations

import torch
from fairseq import utils
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
    label_smoothed_nll_loss,
)

from dsq.engine.chunked_output import chunked_output_loss

NAME = "dsq_chunked_label_smoothed_cross_entropy"


@register_criterion(NAME, dataclass=LabelSmoothedCrossEntropyCriterionConfig)
class ChunkedLabelSmoothedCrossEntropy(LabelSmoothedCrossEntropyCriterion):
    """fairseq's criterion with the output layer in chunks of `chunk_tokens` (set by the
    trainer after building it) while training."""

    chunk_tokens: int = 0

    def forward(self, model, sample, reduce=True):
        if not (self.chunk_tokens and reduce and model.training and torch.is_grad_enabled()):
            return super().forward(model, sample, reduce)
        if self.ignore_prefix_size or self.report_accuracy:
            raise ValueError("the chunked loss takes neither ignore_prefix_size nor accuracy")
        features, extra = model(**sample["net_input"], features_only=True)
        target = model.get_targets(sample, (features, extra)).reshape(-1)
        decoder = model.decoder

        def loss_fn(logits, chunk_target):
            lprobs = utils.log_softmax(logits, dim=-1)  # as model.get_normalized_probs
            return label_smoothed_nll_loss(
                lprobs, chunk_target, self.eps, ignore_index=self.padding_idx, reduce=True
            )

        loss, nll_loss = chunked_output_loss(
            features.reshape(-1, features.shape[-1]),
            decoder.output_layer,
            loss_fn,
            target,
            list(decoder.output_projection.parameters()),
            self.chunk_tokens,
        )
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        return loss, sample_size, logging_output
