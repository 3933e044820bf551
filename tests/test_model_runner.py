"""ModelRunner: batching, paging, prefix reuse, sampling contract, statelessness."""

from __future__ import annotations

import copy
import dataclasses
import threading
import types
from pathlib import Path

import pytest
import torch

from pdserve.engine.protocol import TokenLogprob
from pdserve.kernels import triton as triton_kernels
from pdserve.kernels.paged_attention import load_kernel
from pdserve.model.checkpoint import load_model_config
from pdserve.model.config import ModelDirError
from pdserve.model_runner import ModelRunner, RunnerConfig
from pdserve.sampling_params import SamplingParams
from pdserve.sequence import Sequence
from tests.model.checkpoints import convert_checkpoint, load_reference, write_checkpoint

PAGE_SIZE = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def runners() -> dict[str, ModelRunner]:
    return {}  # one runner per device, built on first use


@pytest.fixture
def runner(runners: dict[str, ModelRunner], checkpoint: Path, device: str) -> ModelRunner:
    if device not in runners:
        runners[device] = ModelRunner(
            RunnerConfig(
                str(checkpoint), dtype="float32", page_size=PAGE_SIZE, num_pages=128, device=device
            )
        )
    return runners[device]


class PageBook:
    """Hands out disjoint page ranges for test sequences."""

    def __init__(self) -> None:
        self.next_page = 0

    def seq(
        self, seq_id: str, prompt: list[int], sampling: SamplingParams | None = None
    ) -> Sequence:
        pages = list(range(self.next_page, self.next_page + 12))
        self.next_page = (self.next_page + 12) % 120
        return Sequence(
            seq_id, list(prompt), len(prompt), sampling or SamplingParams(temperature=0), pages
        )


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 320, (length,), generator=gen).tolist()


def _run(runner: ModelRunner, seqs: list[Sequence], num_steps: int) -> list[list[int]]:
    """Prefill then decode all ``seqs`` together, applying tokens like the scheduler does."""
    out = runner.prefill(seqs)
    for _ in range(num_steps):
        for s, tok in zip(seqs, out.token_ids, strict=True):
            s.num_cached_tokens = s.num_tokens
            s.token_ids.append(tok)
        out = runner.decode(seqs)
    return [s.generated_ids + [tok] for s, tok in zip(seqs, out.token_ids, strict=True)]


def test_mixed_length_batch_gives_same_greedy_tokens_as_each_prompt_alone(
    runner: ModelRunner,
) -> None:
    book = PageBook()
    prompts = [_prompt(n, seed=n) for n in (1, 3, 4, 5, 9, 17)]
    together = _run(runner, [book.seq(f"b{i}", p) for i, p in enumerate(prompts)], 10)
    alone = [_run(runner, [book.seq(f"a{i}", p)], 10)[0] for i, p in enumerate(prompts)]
    assert together == alone


@pytest.mark.parametrize("length", [1, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1])
def test_prompts_at_page_boundaries_match_transformers(
    runner: ModelRunner, checkpoint: Path, length: int
) -> None:
    reference = load_reference(checkpoint)
    seq = PageBook().seq("p", _prompt(length, seed=100 + length))
    logits = [runner.prefill_logits([seq])[0]]
    for _ in range(2 * PAGE_SIZE):  # decode across two more page boundaries
        seq.num_cached_tokens = seq.num_tokens
        seq.token_ids.append(int(logits[-1].argmax()))
        logits.append(runner.decode_logits([seq])[0])
    with torch.no_grad():
        ref = reference(torch.tensor([seq.token_ids])).logits[0, length - 1 :]
    # The reference runs on the CPU: compare there (assert_close rejects tensors on two devices).
    torch.testing.assert_close(torch.stack(logits).cpu(), ref, atol=2e-4, rtol=1e-4)


def test_prefill_after_cached_prefix_equals_full_prefill(runner: ModelRunner) -> None:
    prompt = _prompt(14, seed=7)
    full = PageBook().seq("full", prompt)
    expected = runner.prefill_logits([full])
    # Same pages: first write the 6-token prefix, then prefill the rest on top of it.
    prefix = Sequence("pre", prompt[:6], 6, page_ids=full.page_ids)
    runner.prefill_logits([prefix])
    rest = Sequence("rest", list(prompt), 14, page_ids=full.page_ids, num_cached_tokens=6)
    other = PageBook().seq("other", _prompt(5, seed=8))
    other.page_ids = [p + 60 for p in other.page_ids]
    got = runner.prefill_logits([other, rest])
    torch.testing.assert_close(got[1:], expected, atol=2e-4, rtol=1e-4)


def _backend_runner(checkpoint: Path, backend: str) -> ModelRunner:
    """A float32 CPU runner on ``backend``; skipped only where that backend cannot run here
    (the C++ kernel did not build; Triton's interpreter is off), asked as the factory asks it:
    any error while building the runner fails the test."""
    head_dim = load_model_config(checkpoint).head_dim
    runs_here = {
        "torch": True,
        "cpp": load_kernel(torch.float32, head_dim) is not None,
        "triton": triton_kernels.is_available(torch.device("cpu")),
    }
    if not runs_here[backend]:
        pytest.skip(f"the {backend} attention backend does not run here")
    return ModelRunner(
        RunnerConfig(str(checkpoint), dtype="float32", page_size=PAGE_SIZE, num_pages=64,
                     attention_backend=backend)
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_decode_rows_in_a_prefill_batch_get_their_decode_logits(
    checkpoint: Path, backend: str
) -> None:
    """One-token rows over a cached context in an extend batch (a prefix-cache hit one token
    short of the prompt's end) get what a decode step gives them, in each backend."""
    runner = _backend_runner(checkpoint, backend)
    book = PageBook()
    rows = [book.seq(f"d{i}", _prompt(5 + 4 * i, seed=20 + i)) for i in range(2)]
    for row in rows:
        row.token_ids.append(int(runner.prefill_logits([row])[0].argmax()))
        row.num_cached_tokens = row.num_tokens - 1
    expected = runner.decode_logits(rows)
    long = _prompt(11, seed=30)
    chunk = Sequence("chunk", long[:8], 8, page_ids=book.seq("c", long).page_ids)
    got = runner.prefill_logits([chunk, *rows])
    torch.testing.assert_close(got[1:], expected, atol=2e-4, rtol=1e-4)


def test_float32_activations_over_a_bf16_cache_run_on_the_triton_backend(checkpoint: Path) -> None:
    """``--dtype float32 --kv-cache-dtype bfloat16`` (accepted on CUDA): the Triton backend
    stores the K/V rounded and attends them as the torch backend does (issue 31: it crashed)."""
    if not triton_kernels.is_available(torch.device("cpu")):
        pytest.skip("Triton's interpreter is off")
    logits = {}
    for backend in ("torch", "triton"):
        runner = ModelRunner(
            RunnerConfig(str(checkpoint), dtype="float32", kv_cache_dtype="bfloat16",
                         page_size=PAGE_SIZE, num_pages=64, attention_backend=backend)
        )  # fmt: skip
        assert runner.kv_pool.storage.dtype == torch.bfloat16
        row = PageBook().seq("r", _prompt(9, seed=50))
        first = runner.prefill_logits([row])
        row.token_ids.append(int(first[0].argmax()))
        row.num_cached_tokens = row.num_tokens - 1
        logits[backend] = torch.cat([first, runner.decode_logits([row])])
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_a_mixed_step_samples_what_a_prefill_and_a_decode_step_sample_apart(
    checkpoint: Path, backend: str
) -> None:
    """ModelRunner.mixed (chunked prefill): decode rows after a prompt chunk, in one forward,
    get the decode step's tokens and logprobs, and the chunk its prefill's."""
    runner = _backend_runner(checkpoint, backend)
    book = PageBook()
    greedy = SamplingParams(temperature=0, logprobs=True)
    rows = [book.seq(f"d{i}", _prompt(5 + 4 * i, seed=40 + i), greedy) for i in range(3)]
    for row, tok in zip(rows, runner.prefill(rows).token_ids, strict=True):
        row.token_ids.append(tok)
        row.num_cached_tokens = row.num_tokens - 1
    long = _prompt(11, seed=50)
    pages = book.seq("c", long).page_ids
    whole = runner.prefill([Sequence("w", long, 11, greedy, pages)])
    runner.prefill([Sequence("c", long[:6], 6, greedy, pages)])  # the first chunk
    apart = runner.decode(rows)
    mixed = runner.mixed([Sequence("c", long, 11, greedy, pages, 6)], rows)
    assert mixed.token_ids == whole.token_ids + apart.token_ids
    assert mixed.logprobs is not None and apart.logprobs is not None
    got = [lp.logprob for lp in mixed.logprobs if lp is not None]
    want = [lp.logprob for lp in (whole.logprobs or []) + apart.logprobs if lp is not None]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=2e-4, rtol=1e-4)


def test_prefill_and_decode_do_not_mutate_sequences(runner: ModelRunner) -> None:
    seq = PageBook().seq("m", _prompt(6, seed=3), SamplingParams(temperature=0.7, seed=1))
    before = copy.deepcopy(seq)
    runner.prefill([seq])
    seq.num_cached_tokens = seq.num_tokens - 1
    before.num_cached_tokens = seq.num_cached_tokens
    runner.decode([seq])
    assert (seq.token_ids, seq.page_ids, seq.num_cached_tokens) == (
        before.token_ids, before.page_ids, before.num_cached_tokens,
    )  # fmt: skip


def test_fixed_seed_reproduces_whatever_the_batch(runner: ModelRunner) -> None:
    book = PageBook()
    sampling = SamplingParams(temperature=1.5, top_p=0.95, seed=1234)
    prompt = _prompt(7, seed=11)
    alone = _run(runner, [book.seq("a", prompt, sampling)], 12)[0]
    again = _run(runner, [book.seq("b", prompt, sampling)], 12)[0]
    noise = [
        book.seq(f"n{i}", _prompt(3 + i, seed=i), SamplingParams(temperature=1.0)) for i in range(3)
    ]
    in_batch = _run(runner, [noise[0], book.seq("c", prompt, sampling), *noise[1:]], 12)[1]
    other_seed = _run(runner, [book.seq("d", prompt, SamplingParams(temperature=1.5, seed=99))], 12)
    assert alone == again == in_batch
    assert other_seed[0] != alone


def test_top_k_one_and_temperature_zero_equal_greedy(runner: ModelRunner) -> None:
    book = PageBook()
    prompt = _prompt(9, seed=21)
    greedy = _run(runner, [book.seq("g", prompt, SamplingParams(temperature=0.0))], 8)
    top_k_1 = _run(
        runner, [book.seq("k", prompt, SamplingParams(temperature=2.0, top_k=1, seed=5))], 8
    )
    assert top_k_1 == greedy


def test_logprobs_are_aligned_with_inputs_and_only_for_requesting_seqs(runner: ModelRunner) -> None:
    book = PageBook()
    asking = book.seq(
        "lp", _prompt(5, seed=1), SamplingParams(temperature=0, logprobs=True, top_logprobs=3)
    )
    silent = book.seq("no", _prompt(6, seed=2))
    out = runner.prefill([silent, asking])
    assert out.logprobs is not None and out.logprobs[0] is None
    lp = out.logprobs[1]
    assert isinstance(lp, TokenLogprob) and lp.token_id == out.token_ids[1]
    expected = runner.prefill_logits([asking])[0].log_softmax(-1)
    top = expected.topk(3)
    assert [t for t, _ in lp.top] == top.indices.tolist()
    assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert lp.logprob == pytest.approx(top.values[0].item(), abs=1e-4)  # greedy picks the top


def test_batch_without_logprob_requests_returns_none(runner: ModelRunner) -> None:
    out = runner.prefill([PageBook().seq("x", _prompt(4, seed=4))])
    assert out.logprobs is None and len(out.token_ids) == 1


def test_too_few_pages_is_rejected(runner: ModelRunner) -> None:
    seq = Sequence("short", _prompt(9, seed=5), 9, SamplingParams(), page_ids=[0, 1])
    with pytest.raises(ValueError, match="pages"):
        runner.prefill([seq])


def test_stats_count_calls_and_tokens(checkpoint: Path) -> None:
    runner = ModelRunner(
        RunnerConfig(str(checkpoint), dtype="float32", page_size=PAGE_SIZE, num_pages=32)
    )
    _run(runner, [PageBook().seq("s", _prompt(6, seed=6))], 3)
    st = runner.stats
    assert (st.num_prefill_calls, st.num_prefill_tokens, st.num_decode_steps) == (1, 6, 3)


def test_kv_pool_is_sized_from_bytes_and_never_reallocated(checkpoint: Path) -> None:
    runner = ModelRunner(
        RunnerConfig(str(checkpoint), dtype="float32", page_size=PAGE_SIZE, kv_cache_bytes=1 << 20)
    )
    assert runner.kv_config.num_pages == (1 << 20) // runner.kv_config.page_bytes
    address = runner.kv_pool.base_address
    _run(runner, [PageBook().seq("s", _prompt(6, seed=6))], 2)
    assert runner.kv_pool.base_address == address
    assert runner.max_model_len == 256  # the checkpoint's max_position_embeddings


def test_decode_thread_calibration_keeps_its_choice_and_tokens_do_not_depend_on_threads(
    checkpoint: Path,
) -> None:
    runner = ModelRunner(
        RunnerConfig(str(checkpoint), dtype="float32", page_size=PAGE_SIZE, num_pages=128,
                     num_threads=2)
    )  # fmt: skip
    book = PageBook()
    scratch = [book.seq(f"c{i}", [7] * 20) for i in range(4)]
    choice = runner.calibrate_decode_threads(scratch)
    assert set(choice.step_s) == {1, 2} and all(s > 0 for s in choice.step_s.values())
    assert runner.decode_threads == choice.threads
    assert runner.prefill_threads == 2

    def greedy_tokens(decode_threads: int) -> list[list[int]]:
        runner.decode_threads = decode_threads
        seqs = [book.seq(f"t{decode_threads}-{i}", _prompt(9 + 5 * i, i)) for i in range(3)]
        out = runner.prefill(seqs).token_ids
        for _ in range(6):
            for s, token in zip(seqs, out, strict=True):
                s.num_cached_tokens = s.num_tokens
                s.token_ids.append(token)
            out = runner.decode(seqs).token_ids
        return [s.generated_ids for s in seqs]

    assert greedy_tokens(1) == greedy_tokens(2)


def test_a_float32_checkpoint_runs_in_float32_by_default(
    checkpoint: Path, runner: ModelRunner
) -> None:
    auto = ModelRunner(RunnerConfig(str(checkpoint), page_size=PAGE_SIZE, num_pages=32))
    assert auto.config.dtype == "auto"
    assert auto.dtype == auto.kv_pool.kv.dtype == auto.model.weights.embed.dtype == torch.float32
    prompt = [1, 5, 9, 2, 7]
    seqs = [Sequence("a", list(prompt), len(prompt), SamplingParams(), [0, 1])]
    logits = auto.prefill_logits(seqs)
    seqs = [Sequence("b", list(prompt), len(prompt), SamplingParams(), [0, 1])]
    assert torch.equal(logits, runner.prefill_logits(seqs))  # same as an explicit float32 run


@pytest.mark.parametrize(
    ("stored", "declared", "expected"),
    [
        (torch.bfloat16, "bfloat16", torch.bfloat16),
        (torch.float16, "float16", torch.bfloat16),  # CPU: no fast float16
        (torch.bfloat16, None, torch.bfloat16),  # no declaration: the stored dtype
        (torch.float32, None, torch.float32),
    ],
)
def test_auto_follows_the_checkpoint(
    checkpoint: Path, tmp_path: Path, stored: torch.dtype, declared: str | None,
    expected: torch.dtype,
) -> None:  # fmt: skip
    converted = convert_checkpoint(checkpoint, tmp_path / "c", stored, declared)
    auto = ModelRunner(RunnerConfig(str(converted), page_size=PAGE_SIZE, num_pages=8))
    assert auto.dtype == expected


def test_a_quantized_checkpoint_is_refused_before_any_weight_loads(
    checkpoint: Path, tmp_path: Path
) -> None:
    quant = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    fp8 = convert_checkpoint(checkpoint, tmp_path / "q", torch.float32, "float32",
                             quantization_config=quant)  # fmt: skip
    with pytest.raises(ModelDirError, match="quantized .*'fp8'"):
        ModelRunner(RunnerConfig(str(fp8), num_pages=8))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_cuda_runner_without_a_gpu_is_refused_naming_the_field(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"RunnerConfig\.device='cuda:0': CUDA is not available"):
        ModelRunner(RunnerConfig(str(checkpoint), device="cuda:0"))


def test_cpu_pool_defaults_to_512_mib_and_an_explicit_page_count_wins(checkpoint: Path) -> None:
    cfg = RunnerConfig(str(checkpoint), dtype="float32", page_size=PAGE_SIZE)
    default = ModelRunner(cfg)
    assert default.kv_config.num_pages == (512 << 20) // default.kv_config.page_bytes
    assert default.kv_sizing is None  # sized from memory on CUDA only
    explicit = ModelRunner(dataclasses.replace(cfg, num_pages=10, kv_cache_bytes=1 << 30))
    assert explicit.kv_config.num_pages == 10


class FakeCudaMemory:
    """torch.cuda's memory readings for a runner taking its CUDA sizing path on CPU tensors:
    the weights count 1 GiB, the warm-up peaks 256 MiB above its base, libraries take 128 MiB."""

    TOTAL = 4 << 30

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.allocated = 0
        self.other = 0
        self.warm_ups = 0
        cuda = torch.cuda
        for name in ("init", "synchronize", "reset_peak_memory_stats", "empty_cache"):
            monkeypatch.setattr(cuda, name, lambda *a, **k: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda *a: self.allocated)
        monkeypatch.setattr(cuda, "memory_reserved", lambda *a: self.allocated)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda *a: self.allocated + (256 << 20))
        monkeypatch.setattr(cuda, "mem_get_info", lambda *a: (self.free, self.TOTAL))
        uuid = types.SimpleNamespace(uuid=f"fake-{id(self)}")  # names the sizing lock's file
        monkeypatch.setattr(cuda, "get_device_properties", lambda *a: uuid)

    @property
    def free(self) -> int:
        return self.TOTAL - self.allocated - self.other


def test_the_cuda_sizing_path_fills_the_share_and_serves_the_same_tokens(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pdserve.model_runner as model_runner  # noqa: PLC0415

    # A prefill worker's config: it decodes nothing, so no graph memory is held back either.
    cfg = RunnerConfig(str(checkpoint), dtype="float32", page_size=PAGE_SIZE, max_num_seqs=4,
                       max_prefill_tokens=64, gpu_memory_utilization=0.5,
                       runs_decode_steps=False)  # fmt: skip
    reference = ModelRunner(dataclasses.replace(cfg, num_pages=128))
    fake = FakeCudaMemory(monkeypatch)
    monkeypatch.setattr(model_runner, "is_cpu", lambda device: False)  # take the CUDA branches
    loaded = model_runner.load_model_weights

    def load_weights(*args: object, **kwargs: object) -> object:
        fake.allocated += 1 << 30
        return loaded(*args, **kwargs)

    def warm_up(self: ModelRunner) -> None:
        fake.warm_ups += 1
        fake.other = 128 << 20
        original_warm_up(self)

    original_warm_up = ModelRunner._warm_up_largest_step
    monkeypatch.setattr(model_runner, "load_model_weights", load_weights)
    monkeypatch.setattr(ModelRunner, "_warm_up_largest_step", warm_up)
    # The warm-up pool's bytes are counted as allocated once it exists.
    pool_cls = model_runner.KVPagePool

    def pool(config, device="cpu", hugepages=True, storage=None):  # noqa: ANN001, ANN202
        fake.allocated += (config.num_pages + 1) * config.page_bytes  # + the scratch page
        return pool_cls(config, device, hugepages, storage)

    monkeypatch.setattr(model_runner, "KVPagePool", pool)
    sized = ModelRunner(cfg)
    monkeypatch.undo()

    expected = ((2 << 30) - (1 << 30) - (256 << 20) - (128 << 20)) // sized.kv_config.page_bytes
    assert fake.warm_ups == 1
    assert sized.kv_sizing is not None and sized.kv_sizing.num_pages == expected
    assert sized.kv_sizing.graph_reserve_bytes == 0 and sized.graph_runner is None
    assert sized.kv_config.num_pages == expected == sized.kv_pool.kv.shape[0]
    assert sized.max_model_len == min(256, expected * PAGE_SIZE)
    prompt = _prompt(7, seed=3)
    book = PageBook()
    assert _run(sized, [book.seq("s", prompt)], 6) == _run(reference, [book.seq("r", prompt)], 6)


def test_every_step_binds_the_runners_device_on_the_thread_that_runs_it(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA's current device is per thread: the engine's step thread is not the one that built
    the runner, and on cuda:1 its launches would otherwise land on device 0."""
    import pdserve.model_runner as model_runner  # noqa: PLC0415

    bound: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(
        model_runner, "bind_device", lambda d: bound.append((threading.current_thread().name, d))
    )
    seq = PageBook().seq("t", _prompt(5, seed=4))

    def steps() -> None:
        runner.prefill([seq])
        seq.num_cached_tokens = seq.num_tokens
        seq.token_ids.append(1)
        runner.decode([seq])

    worker = threading.Thread(target=steps, name="step-thread")
    worker.start()
    worker.join(60)
    assert bound == [("step-thread", runner.device)] * 2
