"""The replica-state protocol: committed stubs are current, and they work over a real gRPC channel.

The stubs in kvgate/v1 are generated from proto/ and committed, so that installing kvgate needs no
protoc. These tests catch a .proto edited without `make proto`, and prove the generated client and
server talk to each other over a loopback socket.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from kvgate import protogen
from kvgate.v1 import replica_pb2, replica_pb2_grpc

COMMITTED_STUBS = [
    Path("kvgate/v1/replica_pb2.py"),
    Path("kvgate/v1/replica_pb2.pyi"),
    Path("kvgate/v1/replica_pb2_grpc.py"),
]


def make_state(seq: int, **overrides: object) -> replica_pb2.ReplicaState:
    fields: dict[str, object] = {
        "replica_id": "tiny-llama-0",
        "model": "tiny-llama",
        "seq": seq,
        "wall_time_unix_ns": 1_700_000_000_000_000_000 + seq * 50_000_000,  # one snapshot per 50 ms
        "process_start_unix_ns": 1_699_999_000_000_000_000,
        "num_requests_waiting": 2,
        "num_requests_running": 8,
        "num_kv_blocks_free": 300,
        "num_kv_blocks_total": 1024,
        "block_size_tokens": 16,
        "adapters_loaded": ["sql-lora", "chat-lora"],
        "prefix_cache_queried_tokens_total": 12_000,
        "prefix_cache_hit_tokens_total": 9_000,
        "draining": False,
    }
    fields.update(overrides)
    return replica_pb2.ReplicaState(**fields)


# --- the committed stubs are current ---------------------------------------------------------------


def test_generation_lists_exactly_the_committed_stubs(tmp_path: Path) -> None:
    assert protogen.generate(tmp_path) == COMMITTED_STUBS


def test_regenerating_gives_byte_identical_stubs(tmp_path: Path) -> None:
    for relative in protogen.generate(tmp_path):
        fresh = (tmp_path / relative).read_bytes()
        committed = (protogen.REPO_ROOT / relative).read_bytes()
        assert fresh == committed, f"{relative} is stale: run `make proto`"


def test_generated_grpc_module_imports_messages_from_the_kvgate_package() -> None:
    source = (protogen.REPO_ROOT / "kvgate/v1/replica_pb2_grpc.py").read_text()
    assert "from kvgate.v1 import replica_pb2 as" in source


def test_check_passes_on_the_committed_tree(capsys: pytest.CaptureFixture[str]) -> None:
    assert protogen.main(["--check"]) == 0
    assert "current" in capsys.readouterr().out


def _copy_of_committed_tree(root: Path) -> Path:
    for relative in COMMITTED_STUBS:
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(protogen.REPO_ROOT / relative, root / relative)
    return root


def test_check_fails_and_names_an_edited_stub(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy_of_committed_tree(tmp_path)
    with (root / "kvgate/v1/replica_pb2.pyi").open("a") as stub:
        stub.write("# edited by hand\n")

    assert protogen.main(["--check", "--out", str(root)]) == 1

    err = capsys.readouterr().err
    assert "kvgate/v1/replica_pb2.pyi" in err
    assert "kvgate/v1/replica_pb2.py\n" not in err
    assert "make proto" in err


def test_check_names_missing_and_orphaned_stubs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _copy_of_committed_tree(tmp_path)
    (root / "kvgate/v1/replica_pb2_grpc.py").unlink()
    (root / "kvgate/v1/gone_pb2.py").write_text("# its .proto was deleted\n")

    assert protogen.main(["--check", "--out", str(root)]) == 1

    err = capsys.readouterr().err
    assert "kvgate/v1/replica_pb2_grpc.py" in err
    assert "kvgate/v1/gone_pb2.py" in err


def test_missing_grpcio_tools_is_one_clear_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A None entry in sys.modules makes `import grpc_tools` raise ImportError.
    monkeypatch.setitem(sys.modules, "grpc_tools", None)

    assert protogen.main(["--out", str(tmp_path)]) == 2

    err = capsys.readouterr().err
    assert "pip install -e '.[test]'" in err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


# --- a real round trip over gRPC -------------------------------------------------------------------


class FakeReplica(replica_pb2_grpc.ReplicaServicer):
    """Serves canned snapshots and records the requests it got."""

    def __init__(self) -> None:
        self.watch_requests: list[replica_pb2.WatchStateRequest] = []

    async def GetState(
        self, request: replica_pb2.GetStateRequest, context: grpc.aio.ServicerContext
    ) -> replica_pb2.ReplicaState:
        return make_state(seq=7)

    async def WatchState(
        self, request: replica_pb2.WatchStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[replica_pb2.ReplicaState]:
        self.watch_requests.append(request)
        for seq in (1, 2, 3):
            yield make_state(seq=seq, num_requests_waiting=seq, draining=seq == 3)


@pytest.fixture
async def replica() -> AsyncIterator[tuple[FakeReplica, replica_pb2_grpc.ReplicaStub]]:
    servicer = FakeReplica()
    server = grpc.aio.server()
    replica_pb2_grpc.add_ReplicaServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")  # 0: the OS picks a free port
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, replica_pb2_grpc.ReplicaStub(channel)
    finally:
        await channel.close()
        await server.stop(grace=None)


async def test_get_state_returns_the_replica_snapshot(replica) -> None:
    _, stub = replica

    state = await stub.GetState(replica_pb2.GetStateRequest(), timeout=5)

    assert state == make_state(seq=7)
    assert state.replica_id == "tiny-llama-0"
    assert state.model == "tiny-llama"
    assert list(state.adapters_loaded) == ["sql-lora", "chat-lora"]
    assert (state.num_kv_blocks_free, state.num_kv_blocks_total, state.block_size_tokens) == (300, 1024, 16)
    assert (state.prefix_cache_queried_tokens_total, state.prefix_cache_hit_tokens_total) == (12_000, 9_000)


async def test_watch_state_streams_snapshots_in_sequence_order(replica) -> None:
    servicer, stub = replica
    request = replica_pb2.WatchStateRequest(include_kv_events=True, min_interval_ms=100)

    states = [state async for state in stub.WatchState(request, timeout=5)]

    assert [state.seq for state in states] == [1, 2, 3]
    assert [state.num_requests_waiting for state in states] == [1, 2, 3]
    assert [state.draining for state in states] == [False, False, True]
    assert servicer.watch_requests == [request]


# --- serialization ---------------------------------------------------------------------------------


def test_state_with_kv_events_survives_serialization() -> None:
    state = make_state(
        seq=42,
        kv_events=[
            replica_pb2.KvBlockEvent(all_cleared=replica_pb2.KvBlocksAllCleared()),
            replica_pb2.KvBlockEvent(
                stored=replica_pb2.KvBlocksStored(
                    block_hashes=[0xDEADBEEF, 2**64 - 1],  # the full uint64 range survives
                    adapter="sql-lora",
                    block_size_tokens=16,
                )
            ),
            replica_pb2.KvBlockEvent(
                stored=replica_pb2.KvBlocksStored(
                    block_hashes=[7], parent_block_hash=2**64 - 1, adapter="sql-lora", block_size_tokens=16
                )
            ),
            replica_pb2.KvBlockEvent(removed=replica_pb2.KvBlocksRemoved(block_hashes=[0xDEADBEEF])),
        ],
    )

    decoded = replica_pb2.ReplicaState.FromString(state.SerializeToString())

    assert decoded == state
    kinds = [event.WhichOneof("event") for event in decoded.kv_events]
    assert kinds == ["all_cleared", "stored", "stored", "removed"]
    first_stored, chained_stored = decoded.kv_events[1].stored, decoded.kv_events[2].stored
    assert list(first_stored.block_hashes) == [0xDEADBEEF, 2**64 - 1]
    assert not first_stored.HasField("parent_block_hash")  # starts the prompt: no parent, not parent 0
    assert chained_stored.HasField("parent_block_hash")
    assert chained_stored.parent_block_hash == 2**64 - 1
    assert list(decoded.kv_events[3].removed.block_hashes) == [0xDEADBEEF]
