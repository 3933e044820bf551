"""How faithfully pdserve's default numerics follow a float32 reference on a real checkpoint.

Greedy tokens of a fixed prompt set (chat questions through the model's chat template, and raw
completions), ``--num-tokens`` each with EOS ignored, from transformers in float32 (the
reference), transformers in the checkpoint's bf16, and pdserve as served (its default dtype),
all on the same weights and the same prompt token ids. Reported per engine: the mean number of
leading tokens equal to the reference's, and how many whole answers are equal.

Run: ``python bench/fidelity.py --model DIR [--pdserve-dtype auto] [--json out.json]``
(``DIR``: a Hugging Face directory; a ``.gguf`` file where pdserve reads GGUF, the reference
then dequantizes it through transformers' GGUF loader). ``--llamacpp`` (a ``.gguf`` model):
llama.cpp's ``llama-server`` (bench/llamacpp_ref.py) answers the same prompt ids too, greedy
(temperature 0), EOS ignored, so its agreement with the same reference stands beside pdserve's.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/x.py` from anywhere

CHAT_QUESTIONS = (
    "What is the capital of France?",
    "What is the largest planet in our solar system?",
    "Who wrote the play Romeo and Juliet?",
    "What is the boiling point of water at sea level in Celsius?",
    "How many continents are there on Earth?",
    "What gas do plants absorb from the air?",
    "What is the chemical symbol for gold?",
    "Which ocean is the largest?",
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Explain what a computer program is in one sentence.",
    "What should I pack for a weekend trip to the mountains?",
)
COMPLETIONS = (
    "The quick brown fox",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "def fibonacci(n):\n    ",
    "The history of the Roman Empire begins",
    "Water is made of two elements:",
    "In mathematics, a prime number is",
    "The best way to learn a new language is",
    "Paris is the capital of",
    "import numpy as np\n\n",
    "The sun rises in the east and",
    "My favourite book is",
)
# The factual chat questions (the first eight): their float32 answers are what a user checks.
NUM_FACTUAL = 8


@dataclass
class EngineScore:
    engine: str
    mean_agreeing_tokens: float
    whole_answers_equal: int
    num_prompts: int
    factual_first_tokens_equal: int  # factual questions whose answer starts as float32's does


def prompt_ids(model: str, gguf_file: str | None) -> list[list[int]]:
    """Token ids of every prompt, from transformers' tokenizer (and chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model, gguf_file=gguf_file)
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
        for q in CHAT_QUESTIONS
    ]
    # transformers 5 returns a BatchEncoding, 4 a list of ids
    chats = [list(c["input_ids"]) if hasattr(c, "keys") else list(c) for c in chats]
    raw = [tok(text, add_special_tokens=False)["input_ids"] for text in COMPLETIONS]
    return chats + raw


def load_hf(model: str, gguf_file: str | None, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, gguf_file=gguf_file, dtype=dtype)
    lm.generation_config.eos_token_id = None  # EOS ignored, as pdserve's ignore_eos
    return lm


def greedy(lm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = lm.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                            min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
            out.append(y[0, len(ids) :].tolist())
    return out


def hf_greedy(
    model: str, gguf_file: str | None, dtype: torch.dtype, prompts: list[list[int]], n: int
) -> list[list[int]]:
    return greedy(load_hf(model, gguf_file, dtype), prompts, n)


def pdserve_greedy(
    model_path: str, dtype: str, prompts: list[list[int]], n: int
) -> list[list[int]]:
    from pdserve.llm import LLM
    from pdserve.model_runner import ModelRunner, RunnerConfig
    from pdserve.sampling_params import SamplingParams

    runner = ModelRunner(RunnerConfig(model_path, dtype=dtype))
    with LLM(runner) as llm:
        results = llm.generate(
            prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        )
    return [r.token_ids for r in results]


LLAMACPP_REQUEST_TIMEOUT_S = 120.0


async def llamacpp_greedy(gguf: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """llama-server's greedy continuation of each prompt (token ids in, token ids out)."""
    from bench import llamacpp_ref
    from bench.cluster import free_port

    tree = await asyncio.to_thread(llamacpp_ref.ensure_build)
    out = []
    timeout = aiohttp.ClientTimeout(total=LLAMACPP_REQUEST_TIMEOUT_S)
    async with (
        llamacpp_ref.LlamaServer(tree.server, gguf, free_port(), num_slots=1) as server,
        aiohttp.ClientSession(timeout=timeout) as session,
    ):
        for ids in prompts:
            body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "ignore_eos": True,
                    "cache_prompt": False, "return_tokens": True}  # fmt: skip
            async with session.post(f"{server.url}/completion", json=body) as resp:
                resp.raise_for_status()
                out.append(list((await resp.json())["tokens"])[:n])
    return out


def leading_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def score(engine: str, got: list[list[int]], ref: list[list[int]]) -> EngineScore:
    agree = [leading_agreement(g, r) for g, r in zip(got, ref, strict=True)]
    factual = sum(g[:1] == r[:1] for g, r in zip(got[:NUM_FACTUAL], ref[:NUM_FACTUAL], strict=True))
    return EngineScore(
        engine, statistics.mean(agree), sum(g == r for g, r in zip(got, ref, strict=True)),
        len(ref), factual,
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a Hugging Face directory or a .gguf file")
    ap.add_argument("--num-tokens", type=int, default=32)
    ap.add_argument("--pdserve-dtype", default="auto")
    ap.add_argument("--skip-hf-bf16", action="store_true")
    ap.add_argument(
        "--llamacpp", action="store_true", help="llama-server on the same .gguf file too"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    path = Path(args.model)
    hf_dir, gguf = (str(path.parent), path.name) if path.suffix == ".gguf" else (str(path), None)
    prompts = prompt_ids(hf_dir, gguf)
    n = args.num_tokens
    ref = hf_greedy(hf_dir, gguf, torch.float32, prompts, n)
    scores = [score("transformers float32 (reference)", ref, ref)]
    if not args.skip_hf_bf16:
        scores.append(score("transformers bfloat16",
                            hf_greedy(hf_dir, gguf, torch.bfloat16, prompts, n), ref))  # fmt: skip
    ours = pdserve_greedy(str(path), args.pdserve_dtype, prompts, n)
    scores.append(score(f"pdserve colocated (--dtype {args.pdserve_dtype})", ours, ref))
    if args.llamacpp:
        if gguf is None:
            ap.error("--llamacpp needs a .gguf --model")
        theirs = asyncio.run(llamacpp_greedy(path, prompts, n))
        scores.append(score("llama.cpp llama-server (same file)", theirs, ref))
    print(f"{'engine':<40} {'agreeing tokens':>16} {'equal answers':>14} {'factual 1st':>12}")
    for s in scores:
        print(f"{s.engine:<40} {s.mean_agreeing_tokens:>12.1f}/{n:<3} "
              f"{s.whole_answers_equal:>9}/{s.num_prompts:<4} "
              f"{s.factual_first_tokens_equal:>8}/{NUM_FACTUAL}")  # fmt: skip
    if args.json:
        report: dict[str, Any] = {"model": str(path), "num_tokens": n,
                                  "scores": [asdict(s) for s in scores]}  # fmt: skip
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
