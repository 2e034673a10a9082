"""A tiny random Llama or Qwen2 checkpoint built at test time with transformers + tokenizers.

Shaped like the `small` preset's AR (4 layers, hidden 256, 8 heads, 4 kv heads, head_dim 32,
fp32) so that the `small` DiT can attend over its KV, and with head_dim 32 because vLLM's CPU
attention supports no smaller head size. The tokenizer is byte-level BPE without merges (one token
per byte) plus `<s>`/`</s>`, with a post-processor that adds `<s>`: vLLM, transformers and
kvrelay's `HfTokenizer` all read the same tokenizer.json and agree on the ids. Nothing is
downloaded.
"""

from __future__ import annotations

from pathlib import Path

NUM_LAYERS = 4
HIDDEN = 256
NUM_HEADS = 8
NUM_KV_HEADS = 4
HEAD_DIM = 32
MLP = 768
MAX_TOKENS = 1024


def build_tokenizer(directory: Path) -> int:
    """Write tokenizer.json + tokenizer_config.json to `directory`; return the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    vocab["<s>"] = len(vocab)
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    bos = vocab["<s>"]
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(directory))
    return len(vocab)


def build_checkpoint(directory: str | Path, *, arch: str = "llama", seed: int = 0) -> Path:
    """A random `arch` ("llama" | "qwen2") checkpoint (safetensors, fp32) plus its tokenizer."""
    import torch
    import transformers

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    vocab = build_tokenizer(path)
    common = dict(
        vocab_size=vocab,
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_TOKENS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=vocab - 2,
        eos_token_id=vocab - 1,
        torch_dtype="float32",
    )
    if arch == "llama":
        config = transformers.LlamaConfig(**common)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        config = transformers.Qwen2Config(**common)
        model_cls = transformers.Qwen2ForCausalLM
    else:
        raise ValueError(f"arch must be llama or qwen2, got {arch!r}")
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    # The default init (std 0.02) gives near-zero activations; a larger spread makes the KV
    # comparisons meaningful.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return path
