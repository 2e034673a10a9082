"""The vLLM AR service's torch-free tokenizer (kvrelay.ar_service.vllm_tokenizer) gives exactly the
ids vLLM's own tokenizer gives, for every tokenizer shape the tests build, over many prompts; and
where it cannot, the service falls back to transformers' AutoTokenizer and says why.

vLLM's tokenizer is loaded here the way its engine loads it (`vllm.tokenizers.get_tokenizer` on
the model directory, config.json included: transformers picks the class from it), described as the
engine process describes it, and compared with BackendTokenizer and with AutoTokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="engine: vllm needs vLLM (scripts/setup.sh --vllm)")

from kvrelay.ar_service.vllm_engine import VllmTokenizer, describe_engine_tokenizer, service_tokenizer  # noqa: E402
from kvrelay.ar_service.vllm_tokenizer import (  # noqa: E402
    PROBE_TEXTS,
    BackendTokenizer,
    EngineTokenizer,
    torch_free_problem,
)
from tests.vllm.checkpoint import build_tokenizer  # noqa: E402

pytestmark = pytest.mark.slow

CORPUS = (
    "the quick brown fox jumps over the lazy dog. a red circle on a blue square; "
    "héllo wörld naïve café 日本語 テキスト 中文 한국어 Здравствуй мир 🦊🔥 "
    "def f(x): return x ** 2  # 1234567890 3.14159\n\tindented line\r\n"
) * 20
# Pieces the random prompts are made of: words, whitespace runs, unicode, and text that looks like
# the special tokens of the tokenizers below (or of other families).
PIECES = (
    "fox", "the", " ", "  ", "\n", "\t", "\r\n", ".", ",", "é", "日本", "🦊", "👩‍👩‍👧", "\u200b", "\x00",
    "<s>", "</s>", "<unk>", "<pad>", "[CLS]", "[SEP]", "[MASK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|begin_of_text|>", "▁", "Ġ", "##ing", "12", "3.5", "don't", "FOX", "ﬁ", "Å", "Å",
)  # fmt: skip


def _prompts() -> list[str]:
    rng = random.Random(7)
    randoms = ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30))) for _ in range(300)]
    return [*PROBE_TEXTS, *randoms, CORPUS, CORPUS * 20]  # the last: ~170k characters


PROMPTS = _prompts()


def _config(directory: Path, model_type: str) -> None:
    """config.json of a `model_type` checkpoint: transformers (and vLLM through it) picks the
    tokenizer class from it, e.g. Qwen2Tokenizer for qwen2, which rebuilds the pre-tokenizer."""
    import transformers

    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[model_type]
    cls(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(str(directory))


def _bpe(
    directory: Path, *, tokenizer_config: dict[str, Any] | None = None, truncation: bool = False
) -> None:
    """A byte-level BPE with merges trained on CORPUS (so pre-tokenization changes the ids), <s>/</s>
    specials added by a template; `tokenizer_config` entries are merged into tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS], trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    if truncation:
        tok.enable_truncation(max_length=8)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(
        str(directory)
    )
    if tokenizer_config:
        path = directory / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **tokenizer_config}))


def _wordpiece(directory: Path) -> None:
    """A BERT-like WordPiece: lowercasing and accent-stripping normalizer, [CLS] $A [SEP]."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, strip_accents=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tok.train_from_iterator([CORPUS], trainers.WordPieceTrainer(vocab_size=300, special_tokens=specials))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
    ).save_pretrained(str(directory))


# name -> (writer, model_type of config.json)
TOKENIZERS = {
    # The one tests/vllm's checkpoints carry (one token per byte), under both families it is built for.
    "tests-byte-level-llama": (build_tokenizer, "llama"),
    "tests-byte-level-qwen2": (build_tokenizer, "qwen2"),
    "bpe-llama": (_bpe, "llama"),
    "bpe-qwen2": (_bpe, "qwen2"),  # transformers uses Qwen2Tokenizer: its own pre-tokenizer regex
    "bpe-add-bos-eos": (lambda d: _bpe(d, tokenizer_config={"add_bos_token": True, "add_eos_token": True}), "llama"),
    "bpe-no-bos": (lambda d: _bpe(d, tokenizer_config={"add_bos_token": False}), "llama"),
    "bpe-split-special": (lambda d: _bpe(d, tokenizer_config={"split_special_tokens": True}), "llama"),
    "bpe-json-truncation": (lambda d: _bpe(d, truncation=True), "llama"),
    "wordpiece": (_wordpiece, "llama"),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    writer, model_type = TOKENIZERS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    writer(directory)
    _config(directory, model_type)
    return directory


def test_the_service_tokenizer_gives_vllms_ids_without_transformers(model_dir: Path) -> None:
    from transformers import AutoTokenizer
    from vllm.tokenizers import get_tokenizer

    vllm_tok = get_tokenizer(str(model_dir))
    engine = describe_engine_tokenizer(vllm_tok)
    assert torch_free_problem(engine) is None, engine.reason
    ours = BackendTokenizer(engine)
    auto = AutoTokenizer.from_pretrained(str(model_dir))
    assert (ours.vocab_size, ours.bos_id, ours.eos_id) == (len(auto), auto.bos_token_id, auto.eos_token_id)
    for text in PROMPTS:
        expected = list(vllm_tok.encode(text, add_special_tokens=True))
        assert ours.encode(text) == expected, text[:80]
        assert auto.encode(text, add_special_tokens=True) == expected, text[:80]
    # Every shape above is a real case: special tokens added, text longer than a truncation.
    long_ids = ours.encode(CORPUS * 20)
    assert len(long_ids) > 1000


def test_the_tokenizers_differ_where_the_service_must_follow_transformers(tmp_path: Path) -> None:
    """The cases above are not all one tokenizer: tokenizer.json alone (kvrelay's HfTokenizer)
    gives other ids than vLLM for the Qwen2 class (its own pre-tokenizer), split_special_tokens and
    a tokenizer.json that truncates, so the service must run the backend vLLM built, as vLLM runs it."""
    from vllm.tokenizers import get_tokenizer

    from kvrelay.models.tokenizer import HfTokenizer

    differs = []
    for name in ("bpe-qwen2", "bpe-add-bos-eos", "bpe-split-special", "bpe-json-truncation"):
        writer, model_type = TOKENIZERS[name]
        (tmp_path / name).mkdir()
        writer(tmp_path / name)
        _config(tmp_path / name, model_type)
        vllm_tok, plain = get_tokenizer(str(tmp_path / name)), HfTokenizer(tmp_path / name)
        if any(plain.encode(t) != list(vllm_tok.encode(t, add_special_tokens=True)) for t in PROMPTS):
            differs.append(name)
    # transformers 5 ignores add_bos_token/add_eos_token for a TokenizersBackend whose
    # tokenizer.json has a post-processor: that one is the same.
    assert differs == ["bpe-qwen2", "bpe-split-special", "bpe-json-truncation"]


def test_a_tokenizer_with_its_own_encode_path_is_not_run_without_transformers(tmp_path: Path) -> None:
    from transformers import TokenizersBackend

    build_tokenizer(tmp_path)

    class Custom(TokenizersBackend):  # type: ignore[misc]
        def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
            return [1, *super().encode(text, *args, **kwargs)]

    engine = describe_engine_tokenizer(Custom.from_pretrained(str(tmp_path)))
    assert engine.backend_json is None
    assert engine.reason.endswith("Custom defines encode (its own encode path)"), engine.reason
    assert torch_free_problem(engine) == engine.reason
    # Not a transformers tokenizer at all (vLLM's Mistral tokenizer, a fastokens shim).
    other = describe_engine_tokenizer(_FakeTokenizer())
    assert (
        other.reason
        == "vLLM's tokenizer is _FakeTokenizer (not a transformers TokenizersBackend with a Rust backend)"
    )


class _FakeTokenizer:
    bos_token_id = 1
    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1, *text.encode()]

    def __len__(self) -> int:
        return 259


def test_the_service_falls_back_to_transformers_when_a_probe_differs(tmp_path: Path) -> None:
    from vllm.tokenizers import get_tokenizer

    build_tokenizer(tmp_path)
    engine = describe_engine_tokenizer(get_tokenizer(str(tmp_path)))
    assert isinstance(service_tokenizer(engine, str(tmp_path)), BackendTokenizer)
    # vLLM's ids for one probe differ from the backend's (a tokenizer whose Python side changes them).
    probes = list(engine.probe_ids)
    probes[4] = (*probes[4], 7)
    wrong = EngineTokenizer(
        **{**{f: getattr(engine, f) for f in EngineTokenizer.__slots__}, "probe_ids": tuple(probes)}
    )
    problem = torch_free_problem(wrong)
    assert problem is not None and problem.startswith(
        f"{engine.class_name}'s Rust backend gives other ids than vLLM for "
    ), problem
    fallback = service_tokenizer(wrong, str(tmp_path))
    assert isinstance(fallback, VllmTokenizer)
    assert fallback.encode(PROBE_TEXTS[4]) == list(engine.probe_ids[4])


def test_an_engine_without_a_tokenizer_leaves_the_service_on_transformers(tmp_path: Path) -> None:
    """vllm_args.skip_tokenizer_init: vLLM loads no tokenizer and get_tokenizer raises; the engine
    describes that (the service's start must not fail on it) and the service falls back."""
    from types import SimpleNamespace

    from kvrelay.ar_service.vllm_engine import VllmRankHandler
    from kvrelay.ar_service.vllm_tokenizer import DescribeTokenizer

    def no_tokenizer() -> None:
        raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")  # vLLM's words

    handler = object.__new__(VllmRankHandler)
    handler.engine = SimpleNamespace(get_tokenizer=no_tokenizer)
    described = handler.handle(DescribeTokenizer())
    assert described.backend_json is None and described.probe_ids == ()
    assert (
        described.reason == "vLLM has no tokenizer (Tokenizer not available when `skip_tokenizer_init=True`)"
    )
    build_tokenizer(tmp_path)
    assert isinstance(service_tokenizer(described, str(tmp_path)), VllmTokenizer)
