"""A quantized GGUF in memory once: the embedding table looked up packed, the projections
views of the mapped file until packed, no parse kept by a process that serves nothing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import quantize

from pdserve.model.checkpoint import check_model_config, load_model_config
from pdserve.model.gguf import file as gguf_file
from pdserve.model.gguf.reader import FastGGUFReader
from pdserve.model.quantized import QuantizedTensor, stack_runs
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sequence import Sequence
from tests.model.gguf.conftest import demo_gguf
from tests.model.gguf.test_weights import MIXED
from tests.model.gguf.writer import write_sentencepiece_vocab_gguf

LOOKUP_TYPES = ("Q8_0", "Q5_0", "Q4_1", "Q4_0")  # those gguf can quantize (K-quants: a real file)


@pytest.mark.parametrize("qtype", LOOKUP_TYPES)
def test_looked_up_rows_have_the_bits_of_the_full_dequantization(qtype: str) -> None:
    rows = np.random.default_rng(0).standard_normal((50, 256)).astype(np.float32)
    table = QuantizedTensor(qtype, (50, 256), quantize(rows, GGMLQuantizationType[qtype]))
    ids = torch.tensor([[3, 3, 49], [0, 17, 3]])  # repeats and any shape
    looked_up = table.dequantize_rows(ids, torch.float32)
    assert looked_up.shape == (2, 3, 256)
    assert torch.equal(looked_up, table.dequantize(torch.float32)[ids])


def test_a_real_k_quant_table_looks_rows_up_as_its_full_dequantization() -> None:
    from tests.real_models import QWEN_05B, real_model

    reader = FastGGUFReader(real_model(QWEN_05B))  # (gguf's own takes seconds on its vocabulary)
    smallest = {}  # the 0.5B's smallest Q6_K and Q4_K matrices, rows looked up as a table
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in ("Q4_K", "Q6_K") and (
            kind not in smallest or t.n_bytes < smallest[kind].n_bytes
        ):
            smallest[kind] = t
    assert set(smallest) == {"Q4_K", "Q6_K"}
    for t in smallest.values():
        n, k = (int(d) for d in reversed(t.shape))
        table = QuantizedTensor(t.tensor_type.name, (n, k), t.data.reshape(n, -1))
        ids = torch.tensor([0, n - 1, 7, 7])
        full = table.dequantize(torch.float32)[ids]
        assert torch.equal(table.dequantize_rows(ids, torch.float32), full), t.name


def _prefill_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    return runner.prefill_logits([Sequence("s", list(prompt), len(prompt), page_ids=[0, 1, 2])])


@pytest.mark.parametrize("tie", [False, True])
def test_a_packed_embedding_gives_the_logits_of_a_dense_float32_table(
    tie: bool, demo_dir: Path, tmp_path: Path
) -> None:
    path = demo_gguf(demo_dir, tmp_path, "Q4_1", tie=tie)
    runner = ModelRunner(RunnerConfig(str(path), page_size=4, num_pages=16))
    weights = runner.model.weights
    assert isinstance(weights.embed, QuantizedTensor)  # no dense copy of the table
    assert (weights.lm_head is weights.embed) == tie  # a tied head runs the packed matmul
    prompt = [5, 1, 9, 9, 300, 2, 7]
    packed = _prefill_logits(runner, prompt)
    weights.embed = weights.embed.dequantize(torch.float32)  # today's dense table, in its place
    assert torch.equal(packed, _prefill_logits(runner, prompt))


def _maps_the_file(data: np.ndarray, path: Path) -> bool:
    mapped = isinstance(data, np.memmap) and not data.flags.owndata
    return mapped and Path(str(data.filename)) == path


def test_quantized_weights_are_views_of_the_mapped_file_not_copies(
    demo_dir: Path, tmp_path: Path
) -> None:
    path = demo_gguf(demo_dir, tmp_path, "Q4_1", types=MIXED).resolve()
    runner = ModelRunner(RunnerConfig(str(path), page_size=4, num_pages=16))
    weights = runner.model.weights
    layer = weights.layers[0]
    assert _maps_the_file(weights.embed.data, path)  # type: ignore[union-attr]
    assert _maps_the_file(layer.o_proj.data, path)  # type: ignore[union-attr]
    v = layer.qkv[2]  # type: ignore[index]  # (q and k are reordered rows: Llama's copies)
    assert v.type_name == "Q8_0" and _maps_the_file(v.data, path)
    # No parse stays cached once the model is built (its mapping lives on in the views).
    assert gguf_file._open.cache_info().currsize == 0


def test_a_fused_projection_packs_one_matrix_per_run_of_a_type() -> None:
    def part(kind: str, n: int) -> QuantizedTensor:
        data = quantize(np.ones((n, 32), np.float32), GGMLQuantizationType[kind])
        return QuantizedTensor(kind, (n, 32), data)

    parts = [part("Q4_1", 16), part("Q4_1", 32), part("Q8_0", 16), part("Q4_1", 16)]
    runs = stack_runs(parts)
    assert [(r.type_name, r.shape[0]) for r in runs] == [("Q4_1", 48), ("Q8_0", 16), ("Q4_1", 16)]
    assert np.array_equal(runs[0].data, np.concatenate([parts[0].data, parts[1].data]))
    assert runs[1] is parts[2]


def test_the_launcher_s_config_check_keeps_no_parse_of_the_file(demo_f32_gguf: Path) -> None:
    gguf_file.forget_parsed_files()
    load_model_config(demo_f32_gguf)
    assert gguf_file._open.cache_info().currsize == 1  # a worker's loaders share one parse
    assert check_model_config(demo_f32_gguf).hidden_size == 256
    assert gguf_file._open.cache_info().currsize == 0


def _values(reader: GGUFReader) -> dict[str, object]:
    arrays = getattr(reader, "arrays", {})
    return {k: arrays[k] if k in arrays else f.contents() for k, f in reader.fields.items()}


def test_the_fast_reader_reads_every_value_and_tensor_gguf_s_reader_reads(
    demo_dir: Path, tmp_path: Path
) -> None:
    from tests.real_models import SMOLLM2, real_model

    files = [
        demo_gguf(demo_dir, tmp_path, "Q4_1", types=MIXED),  # byte-level BPE: merges, types
        write_sentencepiece_vocab_gguf(tmp_path / "sp.gguf", "a small text " * 50),  # scores
        real_model(SMOLLM2),
    ]
    array_keys: set[str] = set()
    for path in files:
        stock, fast = GGUFReader(path), FastGGUFReader(path)
        array_keys |= set(fast.arrays)
        assert _values(fast) == _values(stock)
        assert list(fast.fields) == list(stock.fields)
        assert fast.data_offset == stock.data_offset
        for a, b in zip(stock.tensors, fast.tensors, strict=True):
            assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
    wanted = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.scores"}
    assert wanted <= array_keys  # strings, and numbers, read the fast way


def test_a_file_cut_inside_its_vocabulary_is_refused_as_unreadable(
    demo_f32_gguf: Path, tmp_path: Path
) -> None:
    from pdserve.model.config import ModelDirError

    raw = demo_f32_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(raw[: raw.index(b"tokenizer.ggml.merges") + 200])  # mid-array
    with pytest.raises(ModelDirError, match="not a readable GGUF file"):
        load_model_config(cut)
