"""Streaming trace reading and the classification helpers of trace replay (`_kineto`)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import numpy as np
import pytest

from perfloop.producers._kineto import (
    EVENTS_PREFIX,
    TraceError,
    collective_op,
    dtype_bytes,
    is_launch,
    iter_events,
    iter_trace,
    kernel_class,
    phase_of,
    union_us,
)

EVENTS = [
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 1.5, "dur": 2.0},
    {"ph": "X", "cat": "kernel", "name": "k", "ts": 3.25, "dur": 1.0, "args": {"x": [{"a": 1}]}},
]


def _write(path: Path, text: str | bytes, *, gz: bool = False) -> Path:
    data = text.encode() if isinstance(text, str) else text
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _trace(**meta: object) -> str:
    """A Kineto-shaped document: metadata first, events, then trailing keys."""
    head = {k: v for k, v in meta.items() if not k.startswith("tail_")}
    tail = {k[5:]: v for k, v in meta.items() if k.startswith("tail_")}
    doc = json.dumps({**head, "traceEvents": EVENTS, **tail}, indent=1)
    return doc


@pytest.mark.parametrize("gz", [False, True])
def test_events_stream_and_metadata_before_and_after_them(tmp_path: Path, gz: bool) -> None:
    text = _trace(
        schemaVersion=1,
        distributedInfo={"rank": 3, "world_size": 8},
        unrelated={"big": list(range(100))},
        tail_traceName="t.json",
        tail_baseTimeNanoseconds=1_700_000_000_000_000_000,
    )
    path = _write(tmp_path / ("t.json.gz" if gz else "t.json"), text, gz=gz)
    meta: dict[str, object] = {}
    events = list(iter_trace(path, meta))
    assert events == EVENTS
    assert meta["distributedInfo"] == {"rank": 3, "world_size": 8}
    assert meta["baseTimeNanoseconds"] == 1_700_000_000_000_000_000
    assert meta["traceName"] == "t.json"
    assert "unrelated" not in meta  # skipped, never built
    assert list(iter_events(path, str(meta[EVENTS_PREFIX]))) == EVENTS


def test_trailing_metadata_larger_than_the_tail_window_is_still_read(tmp_path: Path) -> None:
    long_name = "x" * 100_000  # pushes the events' end out of the 64 KiB tail
    text = _trace(tail_traceName=long_name, tail_baseTimeNanoseconds=42)
    meta: dict[str, object] = {}
    assert list(iter_trace(_write(tmp_path / "t.json", text), meta)) == EVENTS
    assert meta["baseTimeNanoseconds"] == 42
    assert meta["traceName"] == long_name


def test_a_closing_bracket_inside_the_last_event_is_not_the_end_of_the_list(
    tmp_path: Path,
) -> None:
    # The last event's args end with "}]" followed by more text: only the real end of the
    # list leaves a complete object after it.
    text = _trace(tail_displayTimeUnit="ns", tail_baseTimeNanoseconds=7)
    meta: dict[str, object] = {}
    list(iter_trace(_write(tmp_path / "t.json", text), meta))
    assert meta["displayTimeUnit"] == "ns"
    assert meta["baseTimeNanoseconds"] == 7


def test_the_bare_array_form_of_the_chrome_format(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.json", json.dumps(EVENTS))
    meta: dict[str, object] = {}
    assert list(iter_trace(path, meta)) == EVENTS
    assert meta[EVENTS_PREFIX] == "item"


def test_an_empty_event_list_as_the_last_key(tmp_path: Path) -> None:
    meta: dict[str, object] = {}
    path = _write(tmp_path / "e.json", '{"baseTimeNanoseconds": 5, "traceEvents": []}')
    assert list(iter_trace(path, meta)) == []
    assert meta["baseTimeNanoseconds"] == 5


@pytest.mark.parametrize(
    ("content", "gz", "reason"),
    [
        ("this is not json", False, "not valid JSON"),
        ('{"traceEvents": [{"ph": "X", "ts": 1}, ', False, "not valid JSON"),
        ('{"schemaVersion": 1}', False, "no 'traceEvents' list"),
        ('{"traceEvents": {"a": 1}}', False, "'traceEvents' is not a list"),
        ("42", False, "not an object"),
        ("", False, "empty file"),
        (b"\x1f\x8b\x08\x00garbage-that-is-not-deflate", False, "gzip"),
    ],
)
def test_unreadable_traces_give_one_line_naming_the_file(
    tmp_path: Path, content: str | bytes, gz: bool, reason: str
) -> None:
    path = _write(tmp_path / "bad.json", content, gz=gz)
    with pytest.raises(TraceError) as e:
        list(iter_trace(path, {}))
    msg = str(e.value)
    assert str(path) in msg and reason in msg
    assert "\n" not in msg


def test_a_truncated_gzip_stream(tmp_path: Path) -> None:
    whole = gzip.compress(_trace(schemaVersion=1).encode() * 1)
    path = _write(tmp_path / "cut.json.gz", whole[: len(whole) // 2])
    with pytest.raises(TraceError, match=r"cut\.json\.gz: (truncated|not valid JSON)"):
        list(iter_trace(path, {}))


def test_a_missing_file() -> None:
    with pytest.raises(TraceError, match=r"nope\.json: cannot read"):
        list(iter_trace(Path("/nonexistent/nope.json"), {}))


@pytest.mark.parametrize(
    ("name", "cat", "cls"),
    [
        ("volta_sgemm_64x64_nt", "kernel", "gemm"),
        (
            "void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>",
            "kernel",
            "gemm",
        ),
        ("Cijk_Ailk_Bjlk_SB_Bias_AS_SAV_UserArgs_MT64x16x16", "kernel", "gemm"),
        ("void fbgemm_gpu::permute_2D_lengths_kernel<int>(int)", "kernel", "other"),
        ("sm80_xmma_wgrad_implicit_gemm_indexed_tf32f32_tf32f32_f32_nhwckrsc", "kernel", "conv"),
        ("void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>", "kernel", "conv"),
        (
            "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>",
            "kernel",
            "attention",
        ),
        ("fmha_cutlassF_f16_aligned_64x64_rf_sm80", "kernel", "attention"),
        ("void cudnn::bn_fw_tr_1C11_singleread<float, 512, true, 1, 2, 0>", "kernel", "norm"),
        ("void at::native::vectorized_layer_norm_kernel<float, float>", "kernel", "norm"),
        (
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>",
            "kernel",
            "reduction",
        ),
        ("void at::native::cunn_SoftMaxForward<4, float>", "kernel", "reduction"),
        ("void permute_pooled_embs_kernel<float>(float const*)", "kernel", "other"),
        (
            "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor>",
            "kernel",
            "elementwise",
        ),
        ("triton_poi_fused_add_0", "kernel", "elementwise"),
        ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "kernel", "comm"),
        ("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", "memcpy"),
        ("Memset (Device)", "gpu_memset", "memset"),
        ("Memcpy DtoD", "memcpy", "memcpy"),  # the capitalised categories of old Kineto
        ("something_new", "kernel", "other"),
    ],
)
def test_kernel_class(name: str, cat: str, cls: str) -> None:
    assert kernel_class(name, cat) == cls


@pytest.mark.parametrize(
    ("name", "phase"),
    [
        ("ProfilerStep#3", None),
        ("## forward ##", "forward"),
        ("forward", "forward"),
        ("## backward ##", "backward"),
        ("autograd::engine::evaluate_function: AddmmBackward0", "backward"),
        ("## optimizer ##", "optimizer"),
        ("Optimizer.zero_grad#AdamW.zero_grad", "optimizer"),
        ("## zero_grad ##", "optimizer"),
        ("## data_load ##", "data_wait"),
        ("enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__", "data_wait"),
        ("nccl:all_reduce", "comm"),
        ("c10d::allreduce_", "comm"),
        ("record_param_comms", "comm"),
        ("## checkpoint ##", "checkpoint"),
        ("## encoder fp8 None ##", None),
        ("aten::linear", None),
    ],
)
def test_phase_of(name: str, phase: str | None) -> None:
    assert phase_of(name) == phase


@pytest.mark.parametrize(
    ("name", "op"),
    [
        ("allreduce", "all_reduce"),
        ("all_reduce", "all_reduce"),
        ("_allgather_base", "all_gather"),
        ("allgather_into_tensor_coalesced", "all_gather"),
        ("reduce_scatter_tensor", "reduce_scatter"),
        ("nccl:_reduce_scatter_base", "reduce_scatter"),
        ("gloo:all_reduce", "all_reduce"),
        ("all_to_all", "all_to_all"),
        ("ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclDevComm*)", "broadcast"),
        ("ncclDevKernel_Reduce_Sum_f32_RING_LL", "reduce"),
        ("nccl:send", "send"),
        ("nccl:recv", "recv"),
        ("barrier", "barrier"),
        ("ncclKernel_SendRecv_RING_SIMPLE_Sum_int8_t", "other"),
        ("mystery", "other"),
    ],
)
def test_collective_op(name: str, op: str) -> None:
    assert collective_op(name) == op


def test_dtype_bytes() -> None:
    assert [dtype_bytes(d) for d in ("Float", "Double", "Half", "BFloat16", "Long")] == [
        4,
        8,
        2,
        2,
        8,
    ]
    assert [dtype_bytes(d) for d in ("unsigned char", "Bool", "c10::Half", "int", "?")] == [
        1,
        1,
        2,
        4,
        0,
    ]


def test_is_launch() -> None:
    launches = ["cudaLaunchKernel", "cuLaunchKernel", "cudaMemcpyAsync", "cudaMemsetAsync"]
    launches += ["hipLaunchKernel", "hipMemcpyWithStream", "cudaGraphLaunch"]
    assert all(is_launch(n) for n in launches)
    others = ["cudaEventQuery", "cudaStreamSynchronize", "cudaFree", "cudaEventRecord"]
    assert not any(is_launch(n) for n in others)


def test_union_matches_a_unit_grid() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(0, 12)
        iv = [(a, a + rng.randint(0, 15)) for a in (rng.randint(0, 60) for _ in range(n))]
        grid = np.zeros(100, dtype=bool)
        for a, b in iv:
            grid[a:b] = True
        starts = np.array([a for a, _ in iv], dtype=float)
        ends = np.array([b for _, b in iv], dtype=float)
        assert union_us(starts, ends) == grid.sum()
