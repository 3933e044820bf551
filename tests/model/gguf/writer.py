"""Small GGUF files written from a Hugging Face checkpoint with gguf's own writer and quantizers,
laid out as llama.cpp's converter lays them out (names, metadata keys, Llama's Q/K row order)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quant_shape_to_byte_shape, quantize
from safetensors.torch import load_file

_ARCH = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
} | {f"self_attn.{n}_proj.{kind}": f"attn_{n}.{kind}" for n in "qkv" for kind in ("weight", "bias")}


def _permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's two rotary halves interleaved (rows, then any columns)."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, 2, rows // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _gguf_name(name: str) -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = name.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{index}.{_LAYER_NAMES[rest]}"


def _add_tokenizer(writer: GGUFWriter, hf_dir: Path, eos_ids: list[int | None]) -> None:
    tok = json.loads((hf_dir / "tokenizer.json").read_text(encoding="utf-8"))
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    special = set()
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        if added.get("special"):
            special.add(added["id"])
    tokens = [""] * len(vocab)
    for text, token_id in vocab.items():
        tokens[token_id] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.CONTROL if i in special else TokenType.NORMAL for i in range(len(tokens))]
    )
    writer.add_token_merges(merges)
    bos = tok_cfg.get("bos_token")
    if bos is not None:
        writer.add_bos_token_id(vocab[bos])
        # A post-processor prepending BOS is what llama.cpp's add_bos_token means.
        writer.add_add_bos_token(bos in json.dumps(tok.get("post_processor") or {}))
    eos_ids = [i for i in eos_ids if i is not None] or [vocab[tok_cfg["eos_token"]]]
    writer.add_eos_token_id(eos_ids[0])
    if len(eos_ids) > 1:
        writer.add_eot_token_id(eos_ids[1])
    if tok_cfg.get("chat_template"):
        writer.add_chat_template(tok_cfg["chat_template"])


def write_gguf(
    hf_dir: Path,
    out: Path,
    qtype: GGMLQuantizationType,
    tie: bool = False,
    types: dict[str, GGMLQuantizationType] | None = None,
) -> Path:
    """``hf_dir``'s model as one GGUF file: matrices stored as ``qtype`` (per-name overrides in
    ``types``, keyed by the GGUF name's suffix such as ``attn_v.weight``), norms and biases F32.
    ``tie``: leave out ``output.weight`` (the LM head reads the embedding table)."""
    hf = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    arch = _ARCH[hf["architectures"][0]]
    heads, kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    writer = GGUFWriter(str(out), arch)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(hf.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(hf["rms_norm_eps"]))
    writer.add_vocab_size(hf["vocab_size"])
    eos = hf.get("eos_token_id")
    gen = hf_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text(encoding="utf-8")).get("eos_token_id", eos)
    _add_tokenizer(writer, hf_dir, eos if isinstance(eos, list) else [eos])
    tensors = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        tensors |= load_file(str(path))
    if tie or hf.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    for name, tensor in tensors.items():
        gguf_name = _gguf_name(name)
        data = tensor.to(torch.float32).numpy()
        if arch == "llama" and ".attn_q." in gguf_name:
            data = _permute(data, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            data = _permute(data, kv_heads)
        kind = GGMLQuantizationType.F32
        if data.ndim == 2:
            suffix = gguf_name.split(".", 2)[-1] if gguf_name.startswith("blk.") else gguf_name
            kind = (types or {}).get(suffix, qtype)
        writer.add_tensor(gguf_name, _encode(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _encode(data: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    if kind == GGMLQuantizationType.F32:
        return np.ascontiguousarray(data)
    if kind == GGMLQuantizationType.F16:
        return data.astype(np.float16)
    try:
        return quantize(data, kind)
    except NotImplementedError:
        # A type gguf cannot quantize (Q2_K, IQ4_XS, ...): blocks of zeros of its size, for
        # files that must be refused before any value is read.
        return np.zeros(quant_shape_to_byte_shape(data.shape, kind), dtype=np.uint8)


def write_sentencepiece_vocab_gguf(out: Path, text: str, vocab_size: int = 800) -> Path:
    """A GGUF holding only a Llama-2-style sentencepiece vocabulary (``tokenizer.ggml.model``
    "llama": byte-fallback tokens, scores instead of merges), trained with ``tokenizers`` on
    ``text``: each merged piece scores minus its merge rank, as sentencepiece BPE models do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    specials = ["<unk>", "<s>", "</s>", *byte_tokens]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, show_progress=False, special_tokens=specials
    )
    tok.train_from_iterator([text], trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    rank = {"".join(m if isinstance(m, list) else m.split(" ")): i
            for i, m in enumerate(model["merges"])}  # fmt: skip
    tokens = sorted(vocab, key=vocab.__getitem__)
    kinds = {"<unk>": TokenType.UNKNOWN, "<s>": TokenType.CONTROL, "</s>": TokenType.CONTROL}
    kinds |= dict.fromkeys(byte_tokens, TokenType.BYTE)
    writer = GGUFWriter(str(out), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([-float(rank.get(t, len(rank))) for t in tokens])
    writer.add_token_types([kinds.get(t, TokenType.NORMAL) for t in tokens])
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
