"""The built-in demo model: a seeded random "tiny" Llama plus a BPE tokenizer trained locally.

Its weights are random, so its text is meaningless; it exists so that every part of pdserve
(scheduler, KV transfer, HTTP API) runs real token generation with nothing downloaded. It is
written in Hugging Face format and served through the same loader as any real checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    processors,
    trainers,
)

logger = logging.getLogger(__name__)

DEMO_VERSION = "2"  # 2: the chat template renders tools, tool calls and tool results
_MARKER = ".pdserve-demo-model"
BOS, EOS, IM_START, IM_END = "<s>", "</s>", "<|im_start|>", "<|im_end|>"
# ChatML with Hermes-style tools (as Qwen 2.5 renders them): the tool list in a system turn,
# calls as <tool_call> JSON in assistant turns, results as <tool_response> in user turns.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n\\nYou may call one or more functions. '"
    " + 'Function signatures are within <tools></tools>:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each call, return a JSON object within <tool_call></tool_call>:'"
    ' + \'\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\''
    " + '\\n</tool_call><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>'"
    " + '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\\n' + message['content'] }}"
    "{% for call in message['tool_calls'] %}"
    "{{ '<tool_call>\\n{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": '"
    " + (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# The thinking variant (DemoShape.thinking): as Qwen3 does, enable_thinking false closes an
# empty block in the prompt; otherwise the model opens <think> itself.
THINK_TAGS = ("<think>", "</think>")
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}{% endif %}",
)


@dataclass(frozen=True)
class DemoShape:
    """The issue's "tiny" Llama shape; the vocabulary comes from the trained tokenizer."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    max_position_embeddings: int = 4096
    target_vocab_size: int = 4096
    seed: int = 0
    max_corpus_bytes: int = 2_000_000
    # A Qwen3-architecture thinking model: <think> / </think> as single (non-special) tokens,
    # a template with enable_thinking, Q/K head norms.
    thinking: bool = False


def default_demo_dir() -> Path:
    """Where the demo model is cached when no model directory is given."""
    return Path.home() / ".cache" / "pdserve" / "demo-model"


def _corpus(max_bytes: int) -> list[str]:
    # Python's own standard library: present wherever pdserve runs, and real-looking text.
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    if not texts:
        raise RuntimeError(f"no training text found under {stdlib}")
    return texts


def train_tokenizer(shape: DemoShape) -> Tokenizer:
    """Byte-level BPE (GPT-2 style) with BOS/EOS and ChatML special tokens; BOS prepended."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=shape.target_vocab_size,
        special_tokens=[BOS, EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(shape.max_corpus_bytes), trainer)
    if shape.thinking:  # as in Qwen3's tokenizer: added tokens, kept in decoded text
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in THINK_TAGS])
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def _random_weights(shape: DemoShape, vocab: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(shape.seed)
    h, inter, d = shape.hidden_size, shape.intermediate_size, shape.head_dim

    def normal(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": normal(vocab, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            f"{p}self_attn.q_proj.weight": normal(shape.num_heads * d, h),
            f"{p}self_attn.k_proj.weight": normal(shape.num_kv_heads * d, h),
            f"{p}self_attn.v_proj.weight": normal(shape.num_kv_heads * d, h),
            f"{p}self_attn.o_proj.weight": normal(h, shape.num_heads * d),
            f"{p}mlp.gate_proj.weight": normal(inter, h),
            f"{p}mlp.up_proj.weight": normal(inter, h),
            f"{p}mlp.down_proj.weight": normal(h, inter),
            f"{p}input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            f"{p}post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
        if shape.thinking:  # Qwen3's per-head RMSNorm of queries and keys
            tensors[f"{p}self_attn.q_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
            tensors[f"{p}self_attn.k_norm.weight"] = torch.ones(d, dtype=torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    tensors["lm_head.weight"] = normal(vocab, h)
    return tensors


def _hf_config(shape: DemoShape, vocab: int, bos: int, eos: list[int]) -> dict[str, object]:
    arch, model_type = (
        ("Qwen3ForCausalLM", "qwen3") if shape.thinking else ("LlamaForCausalLM", "llama")
    )
    return {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos[0],
        "torch_dtype": "bfloat16",
    }


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_demo_model(path: str | Path, shape: DemoShape | None = None) -> Path:
    """Write the demo checkpoint into ``path`` (created; existing files overwritten)."""
    shape = shape or DemoShape()
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(shape)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    bos, eos = tok.token_to_id(BOS), [tok.token_to_id(EOS), tok.token_to_id(IM_END)]
    tok.save(str(root / "tokenizer.json"))
    save_file(_random_weights(shape, vocab), str(root / "model.safetensors"), {"format": "pt"})
    _write_json(root / "config.json", _hf_config(shape, vocab, bos, eos))
    _write_json(root / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos})
    _write_json(
        root / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": IM_END,
            "pad_token": EOS,
            "chat_template": THINKING_CHAT_TEMPLATE if shape.thinking else CHAT_TEMPLATE,
            "model_max_length": shape.max_position_embeddings,
            "clean_up_tokenization_spaces": False,
        },
    )
    (root / _MARKER).write_text(DEMO_VERSION, encoding="utf-8")
    logger.info("demo model written to %s (vocab %d)", root, vocab)
    return root


def is_demo_model(path: str | Path) -> bool:
    marker = Path(path) / _MARKER
    return marker.is_file() and marker.read_text(encoding="utf-8") == DEMO_VERSION


def ensure_demo_model(path: str | Path | None = None) -> Path:
    """Return ``path`` (default :func:`default_demo_dir`), writing the demo model if needed.

    Built in a temporary sibling and renamed into place, so concurrent callers never see a
    half-written directory.
    """
    root = Path(path) if path is not None else default_demo_dir()
    if is_demo_model(root):
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        write_demo_model(tmp)
        if root.exists() and not is_demo_model(root):
            shutil.rmtree(root)  # stale or partial earlier version
        try:
            os.rename(tmp, root)
        except OSError:
            if not is_demo_model(root):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def main(argv: list[str] | None = None) -> int:
    """``pdserve make-demo-model DIR``: write the demo checkpoint into DIR."""
    parser = argparse.ArgumentParser(prog="pdserve make-demo-model", description=__doc__)
    parser.add_argument("dir", nargs="?", default=None, help=f"default: {default_demo_dir()}")
    parser.add_argument("--seed", type=int, default=0, help="weight seed")
    args = parser.parse_args(argv)
    target = Path(args.dir) if args.dir else default_demo_dir()
    write_demo_model(target, DemoShape(seed=args.seed))
    print(target)
    return 0
