"""router.membership: which replicas the gateway tracks, and how long it keeps a member that left the list."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgate.registry.loader import load_registry
from kvgate.registry.schema import Backend
from kvgate.registry.snapshot import Snapshot
from kvgate.router.membership import (DEFAULT_BLOCK_SIZE_TOKENS, ModelKnobs, ReplicaSource, Standing, Unlisted,
                                      Upsert, drop_reason, judge_unlisted, member_sources, model_knobs,
                                      public_url, static_sources, upsert)
from kvgate.state.base import MemberRecord
from kvgate.state.base import ReplicaState as MemberState

READY, STARTING, DRAINING = MemberState.READY, MemberState.STARTING, MemberState.DRAINING


def source(url: str = "http://a:1", *, model: str = "m", backend: Backend = Backend.VLLM, grpc: str | None = None,
           state: MemberState | None = READY) -> ReplicaSource:
    return ReplicaSource("r-1", model, url, backend, grpc, state)


@pytest.mark.parametrize(("current", "wanted", "change"), [
    (None, source(), Upsert.ADD),
    (source(), source(), Upsert.KEEP),
    (source(state=STARTING), source(state=READY), Upsert.STATE),  # readers and index are kept
    (source("http://a:1"), source("http://a:2"), Upsert.REPLACE),  # restarted on a new port
    (source(), source(backend=Backend.KVGATE, grpc="a:9"), Upsert.REPLACE),  # now streams its state
    (source(grpc="a:9"), source(grpc="a:10"), Upsert.REPLACE),
    (source(model="m"), source(model="n"), Upsert.REPLACE),  # another model's index counts in other chunks
    (source(), ReplicaSource("r-1", "m", "http://a:1", Backend.VLLM, None, READY, "KEY"), Upsert.KEEP),  # key: not compared
])
def test_a_replica_is_re_created_only_when_its_readers_or_model_change(current: ReplicaSource | None,
                                                                      wanted: ReplicaSource, change: Upsert) -> None:
    assert upsert(current, wanted) is change


def test_a_member_with_a_grpc_target_is_a_kvgate_engine_and_one_without_is_scraped() -> None:
    records = [MemberRecord("e", "m", "http://e:1", grpc_target="e:2", state=READY),
               MemberRecord("v", "m", "http://v:1", state=STARTING)]
    assert member_sources(records) == [ReplicaSource("e", "m", "http://e:1", Backend.KVGATE, "e:2", READY),
                                       ReplicaSource("v", "m", "http://v:1", Backend.VLLM, None, STARTING)]


def test_a_member_whose_url_ends_in_a_slash_is_kept_not_rebuilt_at_every_poll() -> None:
    # Rebuilding it would restart its load readers and empty its prefix index at every membership poll.
    [listed] = member_sources([MemberRecord("v", "m", "http://v:1/", state=READY)])
    assert listed.url == "http://v:1"
    assert upsert(listed, member_sources([MemberRecord("v", "m", "http://v:1/", state=READY)])[0]) is Upsert.KEEP


def registry(tmp_path: Path) -> Snapshot:
    (tmp_path / "models.yaml").write_text(
        "apiVersion: kvgate/v1\nkind: Model\nmetadata: {name: m}\nspec:\n  source: builtin:tiny-llama\n"
        "  engine: {block_size_tokens: 32, max_loaded_adapters: 3}\n"
        "  routing:\n    prefix_chunk_chars: 128\n"
        "    static_replicas: [{url: 'http://s:1/', backend: sglang, api_key_env: S_KEY}]\n")
    return load_registry(tmp_path)


def test_static_replicas_are_keyed_by_an_opaque_id_with_no_membership_state(tmp_path: Path) -> None:
    assert static_sources(registry(tmp_path)) == {
        "m-static-0": ReplicaSource("m-static-0", "m", "http://s:1", Backend.SGLANG, None, None, "S_KEY")}


def test_a_static_replicas_id_is_its_place_in_its_models_list_and_hides_its_url(tmp_path: Path) -> None:
    (tmp_path / "models.yaml").write_text("".join(
        f"apiVersion: kvgate/v1\nkind: Model\nmetadata: {{name: {name}}}\nspec:\n  source: builtin:tiny-llama\n"
        f"  routing: {{static_replicas: [{urls}]}}\n---\n" for name, urls in (
            ("a", "{url: 'http://u:s3cret@10.0.0.5:8000'}, {url: 'http://10.0.0.6:8000'}, "
                  "{url: 'http://10.0.0.6:8000'}"),
            ("b", "{url: 'http://10.0.0.6:8000'}"))))
    sources = static_sources(load_registry(tmp_path))
    # The same URL twice in one model is tracked once; one server in front of two models is one replica of each.
    assert {rid: (s.model, s.url) for rid, s in sources.items()} == {
        "a-static-0": ("a", "http://u:s3cret@10.0.0.5:8000"), "a-static-1": ("a", "http://10.0.0.6:8000"),
        "b-static-0": ("b", "http://10.0.0.6:8000")}


@pytest.mark.parametrize(("url", "shown"), [
    ("http://u:s3cret@10.0.0.5:8000/v1?api_key=k#f", "http://10.0.0.5:8000/v1"),
    ("https://:tok@h", "https://h"),
    ("http://u:a/b?c#d@h:1/x", "http://h:1/x"),  # a password with "/", "?" and "#" unencoded: dropped whole
    ("http://10.0.0.5:8000", "http://10.0.0.5:8000"),
    ("u:p@h:1", "h:1"),
])
def test_a_public_url_has_no_user_part_query_or_fragment(url: str, shown: str) -> None:
    assert public_url(url) == shown


def test_a_replica_takes_its_models_knobs_or_the_defaults_for_an_undeclared_model(tmp_path: Path) -> None:
    snapshot = registry(tmp_path)
    assert model_knobs(snapshot, "m", 256) == ModelKnobs(32, 3, 128, holds_places=True)  # fair queuing: the default
    assert model_knobs(snapshot, "gone", 256) == ModelKnobs(DEFAULT_BLOCK_SIZE_TOKENS, 0, 256)
    assert model_knobs(None, "m", 64) == ModelKnobs(DEFAULT_BLOCK_SIZE_TOKENS, 0, 64)


def standing(state: MemberState = READY, *, draining: bool = False, failed_checks: int = 0,
             since: float | None = None) -> Standing:
    return Standing(state, draining, failed_checks, since)


GRACE_S = 600.0


@pytest.mark.parametrize(("member", "now", "verdict"), [
    (standing(), 100.0, Unlisted.START_GRACE),  # READY and serving when it left: kept
    (standing(STARTING), 100.0, Unlisted.DROP),  # never served
    (standing(DRAINING, draining=True), 100.0, Unlisted.DROP),  # taken out on purpose
    (standing(draining=True), 100.0, Unlisted.DROP),  # its own stream says it drains
    (standing(failed_checks=2), 100.0, Unlisted.START_GRACE),  # two slow checks are not gone
    (standing(failed_checks=3), 100.0, Unlisted.DROP),  # three in a row are
    (standing(since=100.0), 699.0, Unlisted.KEEP),  # left at t=100: kept 599 s later
    (standing(since=100.0), 700.0, Unlisted.DROP),  # 600 s later: grace over
    (standing(failed_checks=3, since=100.0), 101.0, Unlisted.DROP),  # stopped answering within its grace
    (standing(draining=True, since=100.0), 101.0, Unlisted.DROP),
])
def test_a_member_that_left_the_list_is_kept_while_serving_for_member_grace_s(member: Standing, now: float,
                                                                           verdict: Unlisted) -> None:
    assert judge_unlisted(member, now, GRACE_S) is verdict


def test_with_no_grace_a_member_that_left_the_list_is_dropped_at_once() -> None:
    assert judge_unlisted(standing(), 100.0, 0.0) is Unlisted.DROP


@pytest.mark.parametrize(("member", "gone"), [
    (standing(failed_checks=3, since=100.0), True),
    (standing(failed_checks=2, since=100.0), False),
    (standing(failed_checks=5), False),  # listed: a failing replica the autoscaler still lists stays tracked
])
def test_an_unlisted_member_is_gone_after_three_failed_checks_in_a_row(member: Standing, gone: bool) -> None:
    assert member.gone is gone


@pytest.mark.parametrize(("member", "why"), [
    (standing(since=100.0), "grace over"),
    (standing(DRAINING, draining=True, since=100.0), "draining"),
    (standing(failed_checks=3, since=100.0), "3 failed health checks in a row"),
])
def test_the_log_says_why_an_unlisted_member_was_dropped(member: Standing, why: str) -> None:
    assert drop_reason(member) == why
