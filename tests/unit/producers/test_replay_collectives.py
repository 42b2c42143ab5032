"""Trace replay names and sizes every collective, checked against the raw trace JSON.

The shared HTA traces are read here whole, with plain scans and the host span names read by
eye (`HOST_OP`), not with the replay's rules: for each NCCL kernel, the runtime call that
launched it, the host spans around that call on its thread, and from them the op, the bytes
(elements × element size) and the group size the trace gives. Traces in other conventions
(newer NCCL kernel names, functional collectives, gloo's worker threads, damaged arguments)
are written here as small JSON files, and one is recorded with the installed torch.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perfloop.producers._collectives import (
    ProcessGroups,
    Said,
    collective_op,
    combine,
    dtype_bytes,
    dtype_name,
    said_by_args,
)
from perfloop.producers.replay import replay_trace
from perfloop.schemas.telemetry import COLLECTIVE_OPS
from tests.helpers import ALL_TRACES, load_trace
from tests.unit.producers.test_replay import Collect

# Element sizes of the type names these traces use, from the C++ and ScalarType names.
ITEMSIZE = {
    "float": 4,
    "Float": 4,
    "long": 8,
    "long int": 8,
    "Long": 8,
    "int": 4,
    "Int": 4,
    "signed char": 1,
    "unsigned char": 1,
    "Byte": 1,
}
# The backend spans' names in these traces and the collective each one is.
HOST_OP = {
    "nccl:all_reduce": "all_reduce",
    "nccl:broadcast": "broadcast",
    "nccl:all_to_all": "all_to_all",
    "nccl:_all_gather_base": "all_gather",
    "nccl:_reduce_scatter_base": "reduce_scatter",
}
ARG_OP = {"allreduce": "all_reduce", "broadcast": "broadcast"}


def _trace_path(part: str) -> Path:
    found = [p for p in ALL_TRACES if part in str(p)]
    if not found:
        pytest.skip(f"{part} trace missing")
    return found[0]


def _rows(path: Path, **kw: Any) -> list[dict[str, Any]]:
    pub = Collect()
    replay_trace(path, pub, job_id="test-job", **kw)
    return pub.rows().get("collective", [])


def expected_from_kernels(path: Path) -> list[tuple[str, int, int]]:
    """(op, bytes, group size) of each NCCL kernel launched inside a ProfilerStep.

    A kernel whose launch the trace lost (it began before the capture) counts by its own
    time; its name, ``SendRecv``, says no more than ``other``, and nothing gives its size.
    """
    events = load_trace(path)["traceEvents"]
    steps = [
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if str(e.get("name", "")).startswith("ProfilerStep#")
    ]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    host = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")
        if e["name"].startswith(("nccl:", "c10d::"))
    ]
    out = []
    for k in events:
        if k.get("cat") != "kernel" or "nccl" not in k["name"].lower():
            continue
        launch = launches.get(k["args"]["correlation"])
        if launch is None:
            if any(a <= k["ts"] <= b for a, b in steps):
                assert "SendRecv" in k["name"]
                out.append(("other", 0, 0))
            continue
        t = launch["ts"]
        if not any(a <= t <= b for a, b in steps):
            continue
        around = [
            h
            for h in host
            if (h["pid"], h["tid"]) == (launch["pid"], launch["tid"])
            and h["ts"] <= t <= h["ts"] + h["dur"]
        ]
        args = k["args"]
        if "Collective name" in args:  # newer traces copy the sizes onto the kernel
            op = ARG_OP[args["Collective name"]]
            n = max(args["In msg nelems"], args["Out msg nelems"])
            out.append((op, n * ITEMSIZE[args["dtype"]], args["Group size"]))
            continue
        [backend] = [h for h in around if h["name"].startswith("nccl:")]
        [api] = [h for h in around if h["name"].startswith("c10d::")]
        op = HOST_OP[backend["name"]]
        dims, types = api["args"]["Input Dims"], api["args"]["Input type"]
        if types[0] in ITEMSIZE:  # c10d::_allgather_base_(out, in), alltoall_base_(out, in)
            size = max(math.prod(dims[0]), math.prod(dims[1])) * ITEMSIZE[types[0]]
        else:  # a TensorList whose shapes were not kept: the backend span has the input
            b_dims, b_types = backend["args"]["Input Dims"], backend["args"]["Input type"]
            size = math.prod(b_dims[0]) * ITEMSIZE[b_types[0]]
        # (output, input): an all-gather's output is the group's inputs, a reduce-scatter's
        # input the group's outputs; no other op here gives its group size.
        group = {
            "all_gather": math.prod(dims[0]) // math.prod(dims[1]),
            "reduce_scatter": math.prod(dims[1]) // math.prod(dims[0]),
        }.get(op, 0)
        out.append((op, size, group))
    return out


@pytest.mark.parametrize(
    "part",
    [
        "trace_filter/sampled_rank-0",
        "trace_filter/sampled_rank-1",
        "nccl_parser_config/nccl_data",
        "negative_queue_length_values_check/rank0",
    ],
)
def test_every_nccl_kernel_replays_named_and_sized(part: str) -> None:
    path = _trace_path(part)
    expected = expected_from_kernels(path)
    rows = _rows(path)
    assert expected and len(rows) == len(expected)
    got = [(r["op"], r["size_bytes"], r["group_size"]) for r in rows]
    assert Counter(got) == Counter(expected)
    # Only a kernel whose launch the trace lost, and with it its host spans, stays "other";
    # where the trace gives a group size the row has it, where it gives none 0 (unknown).
    assert sum(r["op"] == "other" for r in rows) == expected.count(("other", 0, 0))
    assert all(r["group_size"] > 0 for r in rows if r["op"] in ("all_gather", "reduce_scatter"))


def test_the_sampled_traces_name_all_three_kinds_of_collective() -> None:
    ops = Counter(
        r["op"] for p in ("sampled_rank-0", "sampled_rank-1") for r in _rows(_trace_path(p))
    )
    assert ops == {"all_to_all": 8, "all_reduce": 8, "all_gather": 4}


def test_host_collectives_leave_out_waits_and_take_sizes_from_the_params() -> None:
    path = _trace_path("ns_resolution_trace")
    events = load_trace(path)["traceEvents"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#")]
    params = [
        e["args"]
        for e in events
        if e["name"] == "record_param_comms"
        and e["args"].get("Collective name") != "wait"
        and any(a <= e["ts"] <= b for a, b in steps)
    ]
    expected = Counter(
        (
            ARG_OP[a["Collective name"]],
            max(a["In msg nelems"], a["Out msg nelems"]) * ITEMSIZE[a["dtype"]],
            a["Group size"],
            str(a["Process Group ID"]),
        )
        for a in params
    )
    rows = _rows(path)
    assert (
        Counter((r["op"], r["size_bytes"], r["group_size"], r["group"]) for r in rows) == expected
    )
    assert {r["dtype"] for r in rows} == {"float32", "int64"}


def test_a_group_size_every_process_group_shares_is_known() -> None:
    path = _trace_path("cpu_only")
    sizes = {pg["pg_size"] for pg in load_trace(path)["distributedInfo"]["pg_config"]}
    rows = _rows(path)
    assert len(sizes) == 1 and rows
    assert {r["group_size"] for r in rows} == sizes


# --- names --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "op"),
    [
        # NCCL kernels, old and new naming, and RCCL's
        (
            "ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)",
            "all_gather",
        ),
        (
            "ncclDevKernel_AllReduce_Sum_bf16_RING_LL128(ncclDevKernelArgsStorage<4096ul>)",
            "all_reduce",
        ),
        ("ncclDevKernel_ReduceScatter_Sum_f32_RING_SIMPLE", "reduce_scatter"),
        ("ncclDevKernel_Broadcast_RING_LL", "broadcast"),
        ("ncclDevKernel_Reduce_Sum_f16_RING_LL", "reduce"),
        ("ncclDevKernel_AlltoAll_RING_SIMPLE", "all_to_all"),
        ("ncclKernel_AllReduce_RING_LL_Sum_rccl_bfloat16", "all_reduce"),
        ("void ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*)", "all_reduce"),
        ("void vllm::cross_device_reduce_1stage<float, 8>(vllm::RankData*)", "all_reduce"),
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "other"),
        ("ncclDevKernel_Generic_4", "other"),
        # backend work spans
        ("gloo:all_gather", "all_gather"),
        ("gloo:recvAnySource", "recv"),
        ("gloo:sparse_all_reduce", "all_reduce"),
        ("nccl:send 0->1", "send"),
        ("nccl:recv 1<-0", "recv"),
        ("nccl:reduce_scatter_tensor_coalesced", "reduce_scatter"),
        ("nccl:all_gather_into_tensor_coalesced", "all_gather"),
        ("mpi:all_reduce", "all_reduce"),
        ("ucc:all_to_all", "all_to_all"),
        ("xccl:allgather", "all_gather"),
        ("nccl:coalesced", "other"),
        # API ops, c10d and functional
        ("c10d::allgather_into_tensor_coalesced_", "all_gather"),
        ("c10d::reduce_scatter_tensor_coalesced_", "reduce_scatter"),
        ("c10d::monitored_barrier_", "barrier"),
        ("c10d::recv_any_source_", "recv"),
        ("c10d::alltoall_", "all_to_all"),
        ("c10d::gather_", "gather"),
        ("c10d::scatter_", "scatter"),
        ("_c10d_functional::all_gather_into_tensor", "all_gather"),
        ("_c10d_functional::all_to_all_single", "all_to_all"),
        ("c10d_functional::reduce_scatter_tensor", "reduce_scatter"),
        # record_param_comms' Collective name
        ("all_to_allv", "all_to_all"),
        ("_broadcast_oop", "broadcast"),
        ("_reduce_oop", "reduce"),
        ("allreduce_coalesced", "all_reduce"),
        ("recv", "recv"),
        ("mystery", "other"),
        ("", "other"),
    ],
)
def test_collective_names_of_every_convention(name: str, op: str) -> None:
    assert collective_op(name) == op


_SPELLINGS = {
    "all_reduce": ["AllReduce", "allreduce", "all_reduce", "allreduce_coalesced"],
    "all_gather": [
        "AllGather",
        "allgather",
        "all_gather",
        "_allgather_base",
        "all_gather_into_tensor",
    ],
    "reduce_scatter": ["ReduceScatter", "reduce_scatter", "_reduce_scatter_base"],
    "all_to_all": ["AlltoAll", "alltoall", "all_to_all", "all_to_allv", "alltoall_base"],
    "broadcast": ["Broadcast", "broadcast", "_broadcast_oop"],
    "barrier": ["barrier", "monitored_barrier"],
    "send": ["send", "isend"],
    "recv": ["recv", "irecv", "recv_any_source"],
}
_WRAPS = [
    "{}",
    "nccl:{}",
    "gloo:{}",
    "c10d::{}_",
    "_c10d_functional::{}",
    "ncclDevKernel_{}_Sum_f32_RING_LL",
]


@settings(max_examples=150, deadline=None)
@given(
    op=st.sampled_from(sorted(_SPELLINGS)),
    pick=st.integers(0, 10),
    wrap=st.sampled_from(_WRAPS),
    args=st.sampled_from(["", "(ncclDevComm*)", " 0->1"]),
)
def test_a_spelling_of_an_op_in_any_wrapping_maps_to_it(
    op: str, pick: int, wrap: str, args: str
) -> None:
    spelling = _SPELLINGS[op][pick % len(_SPELLINGS[op])]
    assert collective_op(wrap.format(spelling) + args) == op


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_maps_to_the_vocabulary(name: str) -> None:
    assert collective_op(name) in COLLECTIVE_OPS


@pytest.mark.parametrize(
    ("raw", "name", "size"),
    [
        ("Float", "float32", 4),
        ("float", "float32", 4),
        ("BFloat16", "bfloat16", 2),
        ("c10::BFloat16", "bfloat16", 2),
        ("__nv_bfloat16", "bfloat16", 2),
        ("f16", "float16", 2),
        ("long int", "int64", 8),
        ("short int", "int16", 2),
        ("unsigned char", "uint8", 1),
        ("Byte", "uint8", 1),
        ("signed char", "int8", 1),
        ("Char", "int8", 1),
        ("c10::complex<float>", "complex64", 8),
        ("Float8_e4m3fn", "float8_e4m3fn", 1),
        ("Qfloat9", "Qfloat9", 0),
        ("TensorList", "", 0),
    ],
)
def test_element_types_of_every_convention(raw: str, name: str, size: int) -> None:
    assert (dtype_name(raw), dtype_bytes(raw)) == (name, size)


# --- traces in other conventions, written here ----------------------------------------------------


def _write(
    tmp_path: Path, events: list[dict[str, Any]], dist: dict[str, Any] | None = None
) -> Path:
    """A trace with one ProfilerStep#7 spanning [0, 1000] µs around ``events``."""
    step = {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#7", "pid": 1, "tid": 1}
    doc = {
        "schemaVersion": 1,
        "distributedInfo": dist or {"backend": "nccl", "rank": 0, "world_size": 8},
        "traceEvents": [{**step, "ts": 0, "dur": 1000, "args": {}}, *events],
    }
    path = tmp_path / "rank0.pt.trace.json"
    path.write_text(json.dumps(doc))
    return path


def _span(name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op", **args: Any) -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "pid": 1,
        "tid": tid,
        "ts": ts,
        "dur": dur,
        "args": args,
    }


def _kernel(name: str, ts: float, dur: float, corr: int | None, **args: Any) -> dict:
    a = {"device": 0, "stream": 7, **({"correlation": corr} if corr is not None else {}), **args}
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "pid": 0,
        "tid": 7,
        "ts": ts,
        "dur": dur,
        "args": a,
    }


def _launch(ts: float, corr: int, tid: int = 1) -> dict:
    return _span("cuLaunchKernelEx", ts, 5, tid, cat="cuda_driver", correlation=corr)


def test_newer_naming_functional_all_gather_around_the_c10d_op(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            _span(
                "_c10d_functional::all_gather_into_tensor",
                100,
                60,
                **{"Input Dims": [[4096], [], []], "Input type": ["c10::BFloat16", "Scalar", ""]},
            ),
            _span(
                "c10d::_allgather_base_",
                110,
                40,
                **{"Input Dims": [[32768], [4096], []], "Input type": ["c10::BFloat16"] * 2 + [""]},
            ),
            _span("nccl:_all_gather_base", 120, 20, cat="user_annotation"),
            _launch(125, 42),
            _kernel(
                "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 300, 50, 42
            ),
        ],
    )
    [row] = _rows(path)
    assert (row["op"], row["size_bytes"], row["group_size"], row["dtype"]) == (
        "all_gather",
        32768 * 2,
        8,
        "bfloat16",
    )
    assert row["duration_ms"] == pytest.approx(0.05) and row["step"] == 7


def test_kernel_arguments_of_newer_kineto_without_host_spans(tmp_path: Path) -> None:
    ranks = "[" + ", ".join(str(r) for r in range(0, 64, 8)) + ", ...]"  # cut short by Kineto
    path = _write(
        tmp_path,
        [
            _kernel(
                "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL",
                200,
                30,
                None,
                **{
                    "Collective name": "_reduce_scatter_base",
                    "In msg nelems": 1024,
                    "Out msg nelems": 128,
                    "dtype": "BFloat16",
                    "Group size": 8,
                    "Process Group Name": "3",
                    "Process Group Ranks": ranks,
                },
            ),
            _kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 400, 10, None),
        ],
        dist={"rank": 0, "world_size": 16, "pg_config": [{"pg_name": "0", "pg_size": 16}]},
    )
    rows = _rows(path)
    got = [(r["op"], r["size_bytes"], r["group"], r["group_size"], r["dtype"]) for r in rows]
    assert got == [
        ("reduce_scatter", 1024 * 2, "3", 8, "bfloat16"),
        # Only its name: op and element type (a reduction names its type); no size recorded;
        # the group size every listed process group shares.
        ("all_reduce", 0, "", 16, "float32"),
    ]


def test_gloo_work_on_its_own_thread_counts_once(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            # The API call enqueues on the main thread; gloo runs the work on a worker thread.
            _span(
                "c10d::allreduce_",
                100,
                15,
                **{"Input Dims": [[[1000]], [], []], "Input type": ["TensorList", "", ""]},
            ),
            _span(
                "gloo:all_reduce",
                120,
                400,
                tid=9,
                cat="user_annotation",
                **{"Input Dims": [[1000]], "Input type": ["float"]},
            ),
            # send: its gloo span outlasts the op and the next call (the peer receives later)
            _span("c10d::send", 600, 20, **{"Input Dims": [[[5]]], "Input type": ["TensorList"]}),
            _span(
                "gloo:send",
                610,
                300,
                cat="user_annotation",
                **{"Input Dims": [[5]], "Input type": ["float"]},
            ),
            _span("c10d::recv_", 630, 20, **{"Input Dims": [[[5]]], "Input type": ["TensorList"]}),
            _span(
                "gloo:recv",
                640,
                200,
                cat="user_annotation",
                **{"Input Dims": [[5]], "Input type": ["float"]},
            ),
            # neither is a collective
            _span("record_param_comms", 700, 5, **{"Collective name": "wait", "Group size": 1}),
            _span("c10d::check_for_nan", 710, 5),
        ],
        dist={
            "backend": "gloo",
            "rank": 0,
            "world_size": 2,
            "pg_config": [{"pg_name": "0", "pg_size": 2}],
        },
    )
    rows = _rows(path)
    got = [(r["op"], r["size_bytes"], r["group_size"], r["duration_ms"]) for r in rows]
    assert got == [("all_reduce", 4000, 2, 0.4), ("send", 20, 2, 0.3), ("recv", 20, 2, 0.2)]


# --- bad and odd input ----------------------------------------------------------------------------

_BAD = [None, -5, "twelve", "12", 1.5, True, float("nan"), 1e30, 2**60, [3], {"n": 1}]


@pytest.mark.parametrize("bad", _BAD, ids=repr)
def test_a_bad_count_or_group_size_is_unknown(bad: Any) -> None:
    args = {"Collective name": "allreduce", "dtype": "Float"}
    said = said_by_args({**args, "In msg nelems": bad, "Out msg nelems": bad, "Group size": bad})
    assert said == Said("all_reduce", dtype="float32")
    row = combine([said], ProcessGroups())
    assert (row.op, row.size_bytes, row.group_size) == ("all_reduce", 0, 0)
    assert said_by_args({"Process Group Ranks": bad}).group_size == (1 if bad == [3] else 0)


@pytest.mark.parametrize(
    ("dtype", "name"), [(None, ""), (7, ""), (["Float"], ""), ("", ""), ("Qfloat9", "Qfloat9")]
)
def test_a_dtype_nobody_knows_is_kept_as_written_and_gives_no_size(dtype: Any, name: str) -> None:
    said = said_by_args({"Collective name": "broadcast", "In msg nelems": 4, "dtype": dtype})
    assert said.dtype == name
    assert combine([said], ProcessGroups()).size_bytes == 0


def test_a_size_past_what_a_row_can_hold_is_unknown() -> None:
    huge = Said("all_gather", 1 << 47, -1, "complex128")
    assert combine([huge], ProcessGroups({}, 1 << 20)).size_bytes == 0
    assert combine([huge], ProcessGroups({}, 2)).size_bytes == (1 << 47) * 16 * 2


@pytest.mark.parametrize(
    ("name", "group"), [("pg-3", "pg-3"), (3, "3"), (-3, ""), (True, ""), ([3], ""), ("  ", "")]
)
def test_a_group_is_named_by_text_or_a_non_negative_id(name: Any, group: str) -> None:
    assert said_by_args({"Process Group Name": name}).group == group


def test_damaged_arguments_replay_with_defaults(tmp_path: Path) -> None:
    """Missing args, negative, fractional and text sizes, a dtype no one knows, odd shapes:
    each row keeps what can be read and gives 0 / "" for the rest; nothing raises."""
    bad_args: list[dict[str, Any]] = [
        {},
        {"Collective name": 7, "In msg nelems": -1, "Out msg nelems": "9", "dtype": "Float"},
        {
            "Collective name": "allgather",
            "In msg nelems": 10,
            "Out msg nelems": 80.0,
            "dtype": "Qfloat9",
            "Group size": -8,
        },
        {
            "Collective name": "broadcast",
            "In msg nelems": 2**60,
            "dtype": None,
            "Group size": 2**40,
        },
        {"Collective name": "send", "Input Dims": [[-1, 3]], "Input type": ["float"]},
        {"Collective name": "recv", "Input Dims": "[[4]]", "Input type": {"x": 1}},
        {"Collective name": "barrier", "Process Group Ranks": "[0, 1, 2"},
    ]
    events = [_span("record_param_comms", 10 + 100 * i, 50, **a) for i, a in enumerate(bad_args)]
    events.append(
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "record_param_comms",
            "ts": 900,
            "dur": -3,
            "pid": [1],
            "tid": {"t": 1},
            "args": "not a dict",
        }
    )
    path = _write(tmp_path, events, dist={"pg_config": "nonsense", "world_size": 2})
    rows = _rows(path)
    got = [(r["op"], r["size_bytes"], r["group_size"], r["dtype"]) for r in rows]
    assert got == [
        ("other", 0, 0, "float32"),  # "Collective name": 7 names nothing, -1 and "9" no count
        ("all_gather", 0, 8, "Qfloat9"),  # no element size: no bytes; 80/10 gives 8 ranks
        ("broadcast", 0, 0, ""),  # 2**60 elements and 2**40 ranks are no plausible values
        ("send", 0, 0, "float32"),  # a negative dimension
        ("recv", 0, 0, ""),
        ("barrier", 0, 0, ""),  # a cut-short rank list gives no size
    ]


def test_a_collective_recorded_here_with_torch_gloo(tmp_path: Path) -> None:
    """A real trace of this torch's c10d ops and gloo work (one rank, no network)."""
    torch = pytest.importorskip("torch")
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("torch without gloo, or a process group already set up")
    from torch.profiler import ProfilerActivity, profile

    path = tmp_path / "gloo.pt.trace.json"
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            dist.all_reduce(torch.ones(1000))
            dist.broadcast(torch.ones(300, dtype=torch.int64), src=0)
            out = torch.empty(64, dtype=torch.bfloat16)
            gather(out, torch.ones(64, dtype=torch.bfloat16))
            dist.barrier()
        prof.export_chrome_trace(str(path))
    finally:
        dist.destroy_process_group()
    events = load_trace(path)["traceEvents"]
    work = [e for e in events if str(e.get("name", "")).startswith("gloo:")]
    rows = _rows(path, whole_trace=True)
    assert len(rows) == len(work) > 0
    by_op = {r["op"]: r for r in rows}
    assert {"all_reduce", "broadcast", "all_gather", "barrier"} <= set(by_op)
    assert (by_op["all_reduce"]["size_bytes"], by_op["all_reduce"]["dtype"]) == (4000, "float32")
    assert (by_op["broadcast"]["size_bytes"], by_op["broadcast"]["dtype"]) == (2400, "int64")
    assert (
        by_op["all_gather"]["size_bytes"] == 64 * 2 and by_op["all_gather"]["dtype"] == "bfloat16"
    )
    assert {r["group_size"] for r in rows} == {1}
