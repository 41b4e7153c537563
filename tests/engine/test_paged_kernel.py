"""The compiled paged-attention kernel (engine/runner/csrc/paged_attention.cpp) against attention computed
the plain way (each sequence's blocks gathered, softmax over masked scores, in float64), and its loader.

Shapes cover what the kernel specialises on and what it does not: head dims 64 and 128 (unrolled) and 16, 80
(generic); multi-head and grouped-query; blocks of 4 and 16, partly filled last blocks; decodes and causal
chunks that continue a prompt; few sequences (one KV head per work item) and many (whole sequences per item);
float32, bfloat16 and float16 caches; a query that is a strided view, as the model hands it over.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from kvgate.engine.runner.kernels import SOURCE, KernelLoader, UntrustedCache, build_name, cache_dir, load_cached


@pytest.fixture(scope="module")
def kernel():
    loader = KernelLoader("wait", torch.device("cpu"))
    assert loader.paged_attention is not None, loader.status
    return loader.paged_attention


def reference(query, kv, tables, query_start, start_pos, scale):
    """float64 attention of each query row over keys 0 .. its position, read through the block table."""
    num_heads, block_size, num_kv_heads = query.shape[1], kv.shape[2], kv.shape[3]
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s in range(tables.shape[0]):
        for row in range(int(query_start[s]), int(query_start[s + 1])):
            pos = int(start_pos[s]) + row - int(query_start[s])
            blocks = tables[s, : pos // block_size + 1]
            keys = kv[0][blocks].reshape(-1, num_kv_heads, kv.shape[4])[: pos + 1].double()
            values = kv[1][blocks].reshape(-1, num_kv_heads, kv.shape[4])[: pos + 1].double()
            for h in range(num_heads):
                scores = keys[:, h // group] @ query[row, h].double() * scale
                out[row, h] = torch.softmax(scores, 0) @ values[:, h // group]
    return out


def make_case(seed, *, seqs, new_tokens, start, heads, kv_heads, head_dim, block_size, dtype, strided=False):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = -(-(start + new_tokens) // block_size) + 1  # one spare block: the kernel must not read it
    num_blocks = seqs * max_blocks + 3
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: seqs * max_blocks].view(seqs, max_blocks).contiguous()
    rows = seqs * new_tokens
    if strided:  # the query as a slice of a wider tensor, like the model's fused q/k rotary output
        query = torch.randn(rows, heads + kv_heads, head_dim, generator=gen)[:, :heads]
    else:
        query = torch.randn(rows, heads, head_dim, generator=gen)
    query_start = torch.arange(seqs + 1, dtype=torch.int64) * new_tokens
    start_pos = torch.tensor([start + 3 * s for s in range(seqs)], dtype=torch.int64)  # lengths differ
    start_pos = torch.minimum(start_pos, torch.tensor((max_blocks - 1) * block_size - new_tokens))
    return query, kv, tables, query_start, start_pos


CASES = {
    "decode, 16 seqs, smollm2 shapes": dict(seqs=16, new_tokens=1, start=40, heads=9, kv_heads=3, head_dim=64,
                                            block_size=16),
    "decode, 1 seq, head dim 128": dict(seqs=1, new_tokens=1, start=70, heads=8, kv_heads=2, head_dim=128,
                                        block_size=16),
    "decode, mha, head dim 16": dict(seqs=5, new_tokens=1, start=9, heads=4, kv_heads=4, head_dim=16, block_size=4),
    "decode, generic head dim 80": dict(seqs=6, new_tokens=1, start=33, heads=6, kv_heads=1, head_dim=80,
                                        block_size=16),
    "first token of a prompt": dict(seqs=3, new_tokens=1, start=0, heads=4, kv_heads=2, head_dim=64, block_size=4),
    "chunks continuing prompts": dict(seqs=2, new_tokens=7, start=13, heads=4, kv_heads=2, head_dim=64,
                                      block_size=4),
    "many chunks, whole-sequence items": dict(seqs=9, new_tokens=5, start=20, heads=6, kv_heads=3, head_dim=64,
                                              block_size=16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_attention_over_gathered_blocks(kernel, case: str, dtype: torch.dtype) -> None:
    query, kv, tables, query_start, start_pos = make_case(1, dtype=dtype, **CASES[case])
    scale = query.shape[-1] ** -0.5
    out = torch.full(query.shape, float("nan"))

    kernel(out, query, kv, tables, query_start, start_pos, scale, 1)

    torch.testing.assert_close(out.double(), reference(query, kv, tables, query_start, start_pos, scale),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tile_rows", [1, 3, 16])
def test_tiles_of_query_rows_give_the_same_answer(kernel, tile_rows: int) -> None:
    query, kv, tables, query_start, start_pos = make_case(2, **CASES["chunks continuing prompts"],
                                                          dtype=torch.float32)
    out = torch.empty(query.shape)
    kernel(out, query, kv, tables, query_start, start_pos, 0.125, tile_rows)
    torch.testing.assert_close(out.double(), reference(query, kv, tables, query_start, start_pos, 0.125),
                               atol=1e-5, rtol=1e-5)


def test_a_strided_query_view_is_read_without_a_copy(kernel) -> None:
    query, kv, tables, query_start, start_pos = make_case(3, **CASES["decode, 16 seqs, smollm2 shapes"],
                                                          dtype=torch.float32, strided=True)
    assert not query.is_contiguous()
    out = torch.empty(query.shape)
    kernel(out, query, kv, tables, query_start, start_pos, 0.125, 1)
    torch.testing.assert_close(out.double(), reference(query, kv, tables, query_start, start_pos, 0.125),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 3])
def test_the_answer_does_not_depend_on_the_thread_count(kernel, threads: int) -> None:
    query, kv, tables, query_start, start_pos = make_case(4, **CASES["decode, 16 seqs, smollm2 shapes"],
                                                          dtype=torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = torch.empty(query.shape)
        kernel(out, query, kv, tables, query_start, start_pos, 0.125, 1)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out.double(), reference(query, kv, tables, query_start, start_pos, 0.125),
                               atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_refused_with_what_is_wrong(kernel) -> None:
    query, kv, tables, query_start, start_pos = make_case(5, **CASES["decode, mha, head dim 16"],
                                                          dtype=torch.float32)
    out = torch.empty(query.shape)
    with pytest.raises(RuntimeError, match="block table too short"):
        kernel(out, query, kv, tables[:, :1], query_start, start_pos, 0.25, 1)
    with pytest.raises(RuntimeError, match="query must be float32"):
        kernel(out, query.half(), kv, tables, query_start, start_pos, 0.25, 1)
    with pytest.raises(RuntimeError, match="query_start must be int64"):
        kernel(out, query, kv, tables, query_start[:-1], start_pos, 0.25, 1)
    with pytest.raises(RuntimeError, match="kv must be contiguous"):
        kernel(out, query, kv.transpose(1, 2), tables, query_start, start_pos, 0.25, 1)
    wild = tables.clone()
    wild[0, 0] = kv.shape[1]  # one past the last block: refused, never read
    with pytest.raises(RuntimeError, match=f"block id {kv.shape[1]} outside the cache"):
        kernel(out, query, kv, wild, query_start, start_pos, 0.25, 1)
    wild[0, 0] = -1
    with pytest.raises(RuntimeError, match="block id -1 outside the cache"):
        kernel(out, query, kv, wild, query_start, start_pos, 0.25, 1)


# ------------------------------------------------------------------------------------------ the loader


def test_the_cache_is_keyed_by_source_torch_and_instruction_set() -> None:
    names = {build_name(b"a", "2.13.0", "AVX512"), build_name(b"b", "2.13.0", "AVX512"),
             build_name(b"a", "2.14.0", "AVX512"), build_name(b"a", "2.13.0", "AVX2")}
    assert len(names) == 4
    assert build_name(b"a", "2.13.0", "AVX2") == build_name(b"a", "2.13.0", "AVX2")


def test_cache_dir_follows_the_environment(tmp_path: Path) -> None:
    assert cache_dir({"KVGATE_KERNEL_DIR": str(tmp_path / "k")}) == tmp_path / "k"
    assert cache_dir({"KVGATE_CACHE_DIR": str(tmp_path)}) == tmp_path / "kernels"
    assert cache_dir({}) == Path.home() / ".cache" / "kvgate" / "kernels"


def test_off_and_non_cpu_devices_use_no_kernel() -> None:
    assert KernelLoader("off", torch.device("cpu")).paged_attention is None
    assert KernelLoader("auto", torch.device("cuda")).status == "off"  # constructing a device needs no GPU
    with pytest.raises(ValueError, match="attention_kernel must be one of auto, wait, off"):
        KernelLoader("fast", torch.device("cpu"))


def test_a_cached_build_that_does_not_load_is_built_again(tmp_path: Path) -> None:
    env = {"KVGATE_KERNEL_DIR": str(tmp_path)}
    name = build_name(SOURCE.read_bytes(), torch.__version__, torch.backends.cpu.get_cpu_capability())
    (tmp_path / f"{name}.so").write_bytes(b"not a shared library")

    loader = KernelLoader("wait", torch.device("cpu"), env=env)

    assert loader.status == "ready" and loader.paged_attention is not None


def test_a_cached_build_others_may_write_is_not_loaded(tmp_path: Path) -> None:
    name = build_name(SOURCE.read_bytes(), torch.__version__, torch.backends.cpu.get_cpu_capability())
    path = tmp_path / f"{name}.so"
    path.write_bytes(b"anything")
    path.chmod(0o666)
    with pytest.raises(UntrustedCache, match="writable by others"):
        load_cached(tmp_path, name)


def test_without_a_compiler_the_kernel_is_unavailable_and_says_why(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    loader = KernelLoader("wait", torch.device("cpu"), env={"KVGATE_KERNEL_DIR": str(tmp_path)})
    assert loader.paged_attention is None
    assert loader.status == "unavailable: no C++ compiler (no-such-compiler) on PATH; install g++ " \
                            "(Debian: build-essential)"


def test_auto_builds_in_the_background_and_later_loads_the_cached_build(tmp_path: Path) -> None:
    env = {"KVGATE_KERNEL_DIR": str(tmp_path)}
    building = KernelLoader("auto", torch.device("cpu"), env=env)
    assert building.status == "building" and building.paged_attention is None  # returned before the build
    deadline = time.monotonic() + 180
    while building.status == "building" and time.monotonic() < deadline:
        time.sleep(0.5)
    assert building.status == "ready" and building.paged_attention is not None
    assert not any(path.name.startswith("build-") for path in tmp_path.iterdir())  # the work folder went

    started = time.perf_counter()
    cached = KernelLoader("auto", torch.device("cpu"), env=env)
    assert cached.status == "ready" and time.perf_counter() - started < 1.0


def test_the_builder_cli_builds_another_instruction_set_without_loading_it(tmp_path: Path, monkeypatch,
                                                                           capsys) -> None:
    import shutil
    import sys

    from kvgate.engine.runner.kernels import main

    this = torch.backends.cpu.get_cpu_capability()
    other = "AVX2" if this != "AVX2" else "AVX512"
    mine = build_name(SOURCE.read_bytes(), torch.__version__, this)
    shutil.copy2(cache_dir(__import__("os").environ) / f"{mine}.so", tmp_path / f"{mine}.so")  # the session's build
    monkeypatch.setenv("KVGATE_KERNEL_DIR", str(tmp_path))

    assert main(["--isa", other]) == 0

    theirs = build_name(SOURCE.read_bytes(), torch.__version__, other)
    assert (tmp_path / f"{theirs}.so").is_file() and theirs not in sys.modules
    assert f"paged-attention kernel for {other}: {tmp_path / theirs}.so" in capsys.readouterr().out
