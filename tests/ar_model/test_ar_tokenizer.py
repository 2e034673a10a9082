"""The byte tokenizer built in, and the optional Hugging Face tokenizer's clear failure modes."""

from __future__ import annotations

import importlib.util

import pytest

from kvrelay.models.presets import BOS_ID, get_preset
from kvrelay.models.tokenizer import ByteTokenizer, HfTokenizer, load_tokenizer


def test_byte_tokenizer_round_trips_utf8():
    tok = load_tokenizer()
    text = "un renard roux — 赤い狐 🦊"
    ids = tok.encode(text)
    assert ids[0] == BOS_ID and len(ids) == 1 + len(text.encode("utf-8"))
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.vocab_size == get_preset("small").ar.vocab


def test_byte_tokenizer_is_stable():
    assert ByteTokenizer().encode("AB") == [BOS_ID, 65, 66]


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is not None, reason="tokenizers is installed")
def test_hf_tokenizer_without_the_package_says_what_to_install(tmp_path):
    with pytest.raises(ImportError, match="pip install tokenizers"):
        HfTokenizer(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="tokenizers not installed")
def test_hf_tokenizer_directory_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HfTokenizer(tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="tokenizers not installed")
def test_hf_tokenizer_directory_encodes_and_decodes(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(["a red fox in the snow", "a blue fox on the ice"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(tmp_path / "tokenizer.json"))

    hf = load_tokenizer(tmp_path)
    ids = hf.encode("a red fox")
    assert hf.bos_id == 1 and ids[0] == 1 and len(ids) > 1
    assert hf.decode(ids).replace(" ", "").replace("Ġ", "") == "aredfox"
    assert hf.vocab_size <= 300


@pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None, reason="tokenizers not installed")
def test_a_checkpoint_directory_with_a_tokenizer_uses_it(tmp_path):
    """`model: {path: DIR}` without `tokenizer:` reads DIR's tokenizer.json, as vLLM does: byte
    ids fed to a model trained on another vocabulary would prefill noise. Without one (a
    checkpoint written by save_checkpoint for the byte vocabulary) it stays the byte tokenizer."""
    from tokenizers import Tokenizer, models

    from kvrelay.config import ModelConfig

    def build_tokenizer(directory):
        Tokenizer(models.WordLevel({"<unk>": 0, "fox": 1}, unk_token="<unk>")).save(str(directory / "tokenizer.json"))

    assert isinstance(load_tokenizer(None, model=ModelConfig(path=str(tmp_path))), ByteTokenizer)
    build_tokenizer(tmp_path)
    assert isinstance(load_tokenizer(None, model=ModelConfig(path=str(tmp_path))), HfTokenizer)
    # An explicit tokenizer still wins.
    other = tmp_path / "other"
    other.mkdir()
    build_tokenizer(other)
    assert isinstance(load_tokenizer(str(other), model=ModelConfig(path=str(tmp_path))), HfTokenizer)
