"""Cloud-init user data for an EC2 node that boots straight into one `kvgate engine` replica.

A pure function of the claim's `ReplicaSpec` and a few settings: no I/O, no boto3. The output is a
`#cloud-config` document (YAML) that

1. writes `/usr/local/bin/kvgate-engine` (a bash script that execs `kvgate engine` with the arguments
   of `base.engine_args`, shell-quoted), a systemd unit `kvgate-engine.service` that runs it, and
   `/usr/local/bin/kvgate-register`;
2. gets kvgate from where the pool's `aws.install` says (`install_step`): already on the image, a wheel
   URL, or a package index that serves it (kvgate is not on PyPI: never a bare `pip install kvgate`),
   and starts the unit;
3. runs `kvgate-register`, which waits for the engine's `/health` and then *registers the replica* by
   tagging its own instance `kvgate:replica-state=ready` (or `failed` after the boot deadline) through
   the instance metadata service (IMDSv2) and the AWS CLI. The provider's `list_replicas()` reads that
   tag, so the autoscaler learns readiness without reaching into the VPC. It needs an instance profile
   allowing `ec2:CreateTags` on the instance itself; without one the tag stays unset and the replica is
   reported STARTING until the router's own health checks take over.

The systemd unit stops the engine with SIGTERM and gives it `drain_timeout_s` (+5 s) before SIGKILL,
so an EC2 terminate (an ACPI shutdown) drains in-flight requests.
"""

from __future__ import annotations

import shlex
from string import Template

from kvgate.providers.base import ReplicaSpec, engine_args
from kvgate.registry.schema import KvgateInstall

ENGINE_PORT = 8000  # the OpenAI API of the replica
ENGINE_GRPC_PORT = 50051  # its ReplicaState stream
READY_TAG = "kvgate:replica-state"

# Readable on purpose: this is what an operator reads in /var/lib/cloud/instance/user-data.txt when a
# node misbehaves. `$$` is a literal `$` for string.Template; `${name}` is filled in by render_user_data.
_TEMPLATE = Template("""\
#cloud-config
# kvgate node for claim ${claim_id} (pool ${pool}, cluster ${cluster}): one `kvgate engine` replica.
write_files:
  - path: /usr/local/bin/kvgate-engine
    permissions: "0755"
    content: |
      #!/bin/bash
      # The replica: exec'd by kvgate-engine.service, so SIGTERM from systemd reaches the engine.
      export KVGATE_CACHE_DIR=/var/cache/kvgate
      exec ${kvgate} engine \\
${engine_args_block}
  - path: /etc/systemd/system/kvgate-engine.service
    permissions: "0644"
    content: |
      [Unit]
      Description=kvgate engine replica (${model})
      After=network-online.target
      Wants=network-online.target

      [Service]
      ExecStart=/usr/local/bin/kvgate-engine
      KillSignal=SIGTERM
      TimeoutStopSec=${stop_timeout_s}
      Restart=on-failure
      RestartSec=5

      [Install]
      WantedBy=multi-user.target
  - path: /usr/local/bin/kvgate-register
    permissions: "0755"
    content: |
      #!/bin/bash
      # Wait for the engine's /health, then tag this instance ${ready_tag}=ready (or =failed).
      set -u
      deadline=$$(( $$(date +%s) + ${health_deadline_s} ))
      state=failed
      while [ "$$(date +%s)" -lt "$$deadline" ]; do
        if curl -fsS -o /dev/null "http://127.0.0.1:${port}/health"; then state=ready; break; fi
        sleep 5
      done
      token=$$(curl -fsS -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 300" \\
        http://169.254.169.254/latest/api/token) || exit 0
      meta() { curl -fsS -H "X-aws-ec2-metadata-token: $$token" "http://169.254.169.254/latest/meta-data/$$1"; }
      instance_id=$$(meta instance-id) || exit 0
      region=$$(meta placement/region) || exit 0
      aws ec2 create-tags --region "$$region" --resources "$$instance_id" \\
        --tags "Key=${ready_tag},Value=$$state" || echo "kvgate-register: could not tag $$instance_id" >&2
runcmd:
  - [bash, -c, "command -v aws >/dev/null || (apt-get update -q && apt-get install -y -q awscli) || true"]
${install_step}  - [systemctl, daemon-reload]
  - [systemctl, enable, --now, kvgate-engine.service]
  # in the background: the wait for /health may take as long as a weights download
  - [bash, -c, "nohup /usr/local/bin/kvgate-register >/var/log/kvgate-register.log 2>&1 &"]
""")


VENV = "/opt/kvgate"  # where a wheel or an index install goes on the node


def install_step(install: KvgateInstall, version: str) -> tuple[str, str]:
    """(the runcmd line that installs kvgate, or "" for none; the path of the `kvgate` command).

    `version` pins an index install when the pool names none: nodes run the release that bought them."""
    if install.preinstalled:
        return "", install.preinstalled
    if install.wheel_url:
        requirement = f"kvgate[engine] @ {install.wheel_url}"
        pip_args = ["--quiet", requirement]
    else:
        pip_args = ["--quiet", "--index-url", str(install.index_url), f"kvgate[engine]=={install.version or version}"]
    command = f"python3 -m venv {VENV} && {VENV}/bin/pip install {' '.join(shlex.quote(a) for a in pip_args)}"
    # A YAML flow sequence item in double quotes: the registry refuses quotes and backslashes in these values.
    return f'  - [bash, -c, "{command}"]\n', f"{VENV}/bin/kvgate"


def render_user_data(spec: ReplicaSpec, *, claim_id: str, pool: str, cluster: str, install: KvgateInstall,
                     version: str, drain_timeout_s: float = 30.0, health_deadline_s: int = 1800) -> str:
    """The `#cloud-config` text that starts `spec` on boot and registers it (see the module docstring).

    `install` is the pool's `aws.install` (where kvgate comes from) and `version` the release an index
    install pins when the pool names none; `health_deadline_s` is how long the register script waits
    for /health before tagging the replica failed (30 min covers a weights download).
    Raises ValueError for names that could break the document (newlines, quotes): ids come from kvgate,
    but a pool name is typed by a person."""
    for label, value in (("claim_id", claim_id), ("pool", pool), ("cluster", cluster), ("version", version)):
        if not value or any(ch in value for ch in "\n\r\"'`$\\"):
            raise ValueError(f"{label} {value!r} is empty or holds a quote, '$', '\\\\' or newline")
    args = engine_args(spec, host="0.0.0.0", port=ENGINE_PORT, grpc_port=ENGINE_GRPC_PORT,
                       replica_id=claim_id, cache_dir="/var/cache/kvgate", drain_timeout_s=drain_timeout_s)
    # One flag and its value per line, shell-quoted and continued with backslashes: readable, and exact.
    lines: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append([arg])
        else:
            lines[-1].append(arg)
    block = " \\\n".join(" " * 8 + " ".join(shlex.quote(a) for a in line) for line in lines)
    step, kvgate = install_step(install, version)
    return _TEMPLATE.substitute(
        claim_id=claim_id, pool=pool, cluster=cluster, model=spec.model, engine_args_block=block,
        stop_timeout_s=int(drain_timeout_s) + 5, health_deadline_s=int(health_deadline_s), port=ENGINE_PORT,
        ready_tag=READY_TAG, install_step=step, kvgate=shlex.quote(kvgate))
