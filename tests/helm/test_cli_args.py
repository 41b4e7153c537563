"""Every kvgate container the chart renders runs arguments that kvgate's own argument parser accepts,
parsed the way `kvgate` parses them (kvgate.cli, then the subcommand's parser), so the chart cannot
drift from the CLI. Redis is the one container that does not run kvgate."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging

import pytest

from kvgate import cli
from kvgate.autoscaler.metrics_server import METRICS_TOKEN_ENV, metrics_access
from kvgate.router.operator_access import plan_access
from tests.helm.chart import FULLNAME, VALUE_SETS, containers, manifests, with_registry


class Refused(Exception):
    """The parser refused the arguments; the message is argparse's."""


def parse_kvgate(args: list[str]) -> argparse.Namespace:
    """`kvgate ARGS` parsed exactly as kvgate.cli.main does: the front door, then a forwarded
    subcommand's own parser. Raises Refused with argparse's message instead of exiting."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parsed, rest = cli.build_parser().parse_known_args(args)
            if parsed.command in cli.FORWARDED:
                module = importlib.import_module(cli.FORWARDED[parsed.command][0])
                return module.build_parser().parse_args(rest)
            if rest:
                raise Refused(f"unrecognized arguments: {' '.join(rest)}")
            return parsed
    except SystemExit:
        raise Refused(stderr.getvalue().strip()) from None


def kvgate_containers(values: dict) -> list[tuple[str, dict]]:
    found = []
    for obj in manifests(with_registry(values)):
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for _, container in containers(obj):
            if container.get("command") == ["kvgate"]:
                found.append((f"{obj['metadata']['name']}/{container['name']}", container))
            else:
                assert container["name"] == "redis" and container["command"] == ["redis-server"]
    return found


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_container_parses_with_the_kvgate_parser(value_set: str) -> None:
    found = kvgate_containers(VALUE_SETS[value_set])
    assert len(found) == 4  # gateway and autoscaler, each with its validate-registry init container
    for where, container in found:
        try:
            parse_kvgate(container["args"])
        except Refused as exc:
            pytest.fail(f"{where}: kvgate refuses {container['args']}: {exc}")


def test_the_parsed_arguments_are_the_ones_the_chart_means() -> None:
    parsed = {where.removeprefix(f"{FULLNAME}-"): parse_kvgate(c["args"])
              for where, c in kvgate_containers(VALUE_SETS["tuned"])}
    gateway = parsed["gateway/gateway"]
    assert (gateway.host, gateway.port, gateway.drain_timeout_s, gateway.member_grace_s) == ("0.0.0.0", 8080, 120.0, 300.0)
    assert gateway.registry == "/etc/kvgate/registry" and gateway.key_prefix == "kvgate:prod:"
    autoscaler = parsed["autoscaler/autoscaler"]
    assert (autoscaler.cluster, autoscaler.interval_s, autoscaler.lease_ttl_s) == ("prod", 2.0, 20.0)
    assert autoscaler.engine_pod_template == "/etc/kvgate/engine/pod-template.yaml"
    assert autoscaler.holder == "$(POD_NAME)" and autoscaler.log_level == "DEBUG"
    assert (autoscaler.metrics_host, autoscaler.metrics_port) == ("0.0.0.0", 9090)
    assert parsed["gateway/validate-registry"].sources == ["/etc/kvgate/registry"]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_the_gateway_would_start_on_its_address_with_tokens_from_its_environment(value_set: str) -> None:
    """`kvgate router` refuses to start beyond loopback without an admin token: the chart's gateway, on 0.0.0.0,
    gets one (and a metrics token) from Secrets in its environment, so it starts guarded and without a warning."""
    [(_, gateway)] = [(w, c) for w, c in kvgate_containers(VALUE_SETS[value_set]) if w.endswith("gateway/gateway")]
    args = parse_kvgate(gateway["args"])
    environ = {e["name"]: "from-a-secret" for e in gateway["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    plan = plan_access(args.host, flag_token=args.admin_token, environ=environ, insecure_open=args.insecure_open_admin)
    assert plan.refusal is None and plan.admin_token and plan.metrics_token
    assert not args.admin_token and not args.insecure_open_admin  # no token in `ps`, nothing left open
    assert all(level < logging.WARNING for level, _ in plan.notices)
    refused = plan_access(args.host, flag_token=None, environ={}, insecure_open=False)
    assert refused.refusal  # the check can fail: without the Secrets it would not start


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_the_autoscaler_would_serve_its_metrics_guarded_by_the_token_from_its_environment(value_set: str) -> None:
    """`kvgate autoscaler` refuses to serve /metrics beyond loopback without a metrics token: the chart's, on 0.0.0.0,
    gets the gateways' metrics token from its Secret, so it starts guarded and without a warning."""
    [(_, autoscaler)] = [(w, c) for w, c in kvgate_containers(VALUE_SETS[value_set])
                         if w.endswith("autoscaler/autoscaler")]
    args = parse_kvgate(autoscaler["args"])
    environ = {e["name"]: "from-a-secret" for e in autoscaler["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    access = metrics_access(args.metrics_host, environ.get(METRICS_TOKEN_ENV), args.insecure_open_metrics)
    assert args.metrics_port and access.refusal is None and access.token == "from-a-secret"
    assert not args.insecure_open_metrics
    assert metrics_access(args.metrics_host, None, False).refusal  # without the Secret it would not start


def test_an_argument_the_cli_does_not_know_is_caught() -> None:
    """The check above can fail: a flag kvgate router does not have is refused by name."""
    [(_, gateway)] = [(w, c) for w, c in kvgate_containers({"gateway": {"extraArgs": ["--workers", "4"]}})
                      if w.endswith("gateway/gateway")]
    with pytest.raises(Refused, match="unrecognized arguments: --workers 4"):
        parse_kvgate(gateway["args"])
