"""Cloud-init user data for an EC2 node that boots straight into one `kvgate engine` replica.

A pure function of the claim's `ReplicaSpec` and a few settings: no I/O, no boto3. The output is a
`#cloud-config` document (YAML) that

1. writes `/usr/local/bin/kvgate-engine` (a bash script that execs `kvgate engine` with the arguments
   of `base.engine_args`, shell-quoted), a systemd unit `kvgate-engine.service` that runs it,
   `/usr/local/bin/kvgate-install` and `/usr/local/bin/kvgate-register`;
2. runs `kvgate-install`, which gets kvgate from where the pool's `aws.install` says (`install_script`):
   already on the image, a wheel URL, or a package index that serves it (kvgate is not on PyPI: never a
   bare `pip install kvgate`), into a venv of a Python >= 3.11 (installing python3.11 where the image's
   python3 is older, as on Ubuntu 22.04), and starts the unit;
3. runs `kvgate-register`, which waits for the engine's `/health` and then *registers the replica* by
   tagging its own instance `kvgate:replica-state=ready` (or `failed` after the boot deadline, or at once
   when the install failed) through
   the instance metadata service (IMDSv2) and the AWS CLI. The provider's `list_replicas()` reads that
   tag, so the autoscaler learns readiness without reaching into the VPC. It needs an instance profile
   allowing `ec2:CreateTags` on the instance itself; without one the tag stays unset and the replica is
   reported STARTING until the router's own health checks take over.

The systemd unit stops the engine with SIGTERM and gives it `drain_timeout_s` (+5 s) before SIGKILL,
so an EC2 terminate (an ACPI shutdown) drains in-flight requests.

Every value is checked before it is written (no line breaks or control characters anywhere; no quotes,
`$`, `\\` or spaces in the fields that sit unquoted in a script), and the rendered document is parsed back
and compared with what it must say, so a registry value can never add a cloud-init key or a command.
"""

from __future__ import annotations

import gzip
import shlex
import textwrap
from string import Template

import yaml

from kvgate.providers.base import ReplicaSpec, engine_args
from kvgate.registry.schema import SHELL_SPECIAL, KvgateInstall, unprintable

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
  - path: /usr/local/bin/kvgate-install
    permissions: "0755"
    content: |
      #!/bin/bash
      # Get kvgate (the pool's aws.install). A failure leaves ${install_failed}, so that kvgate-register
      # reports the replica failed at once rather than after its deadline.
      set -euo pipefail
      trap 'touch ${install_failed}' ERR
${install_block}
  - path: /usr/local/bin/kvgate-register
    permissions: "0755"
    content: |
      #!/bin/bash
      # Wait for the engine's /health, then tag this instance ${ready_tag}=ready (or =failed).
      set -u
      deadline=$$(( $$(date +%s) + ${health_deadline_s} ))
      state=failed
      while [ "$$(date +%s)" -lt "$$deadline" ]; do
        if [ -e ${install_failed} ]; then break; fi
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
  - [bash, /usr/local/bin/kvgate-install]
  - [systemctl, daemon-reload]
  - [systemctl, enable, --now, kvgate-engine.service]
  # in the background: the wait for /health may take as long as a weights download
  - [bash, -c, "nohup /usr/local/bin/kvgate-register >/var/log/kvgate-register.log 2>&1 &"]
""")


VENV = "/opt/kvgate"  # where a wheel or an index install goes on the node
INSTALL_FAILED = "/run/kvgate-install-failed"
EC2_USER_DATA_MAX_BYTES = 16_384  # RunInstances refuses more (before base64)

# Finds a Python >= 3.11 (kvgate's requires-python) or installs python3.11, makes the venv (installing the
# interpreter's venv package where Debian and Ubuntu split it off), then pip installs `$requirement`.
_VENV_INSTALL = Template("""\
py=""
for candidate in python3.13 python3.12 python3.11 python3; do
  if command -v "$$candidate" >/dev/null && "$$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    py=$$candidate; break
  fi
done
if [ -z "$$py" ]; then  # e.g. Ubuntu 22.04, whose python3 is 3.10
  apt-get update -q && apt-get install -y -q python3.11 python3.11-venv
  py=python3.11
fi
"$$py" -m venv $venv || { apt-get update -q && apt-get install -y -q "$$py-venv" && "$$py" -m venv $venv; }
$venv/bin/pip install --quiet $pip_args
""")


def install_script(install: KvgateInstall, version: str | None) -> tuple[str, str]:
    """(the body of /usr/local/bin/kvgate-install, the path of the `kvgate` command on the node).

    `version` pins an index install when the pool names none: nodes run the release that bought them.
    ValueError for an index install with neither."""
    if install.preinstalled:
        return f"test -x {shlex.quote(install.preinstalled)}  # the image's kvgate\n", install.preinstalled
    if install.wheel_url:
        pip_args = [f"kvgate[engine] @ {install.wheel_url}"]
    else:
        pinned = install.version or version
        if not pinned:
            raise ValueError("an index install needs a version to pin (aws.install.version, or the autoscaler's)")
        pip_args = ["--index-url", str(install.index_url), f"kvgate[engine]=={pinned}"]
    body = _VENV_INSTALL.substitute(venv=VENV, pip_args=" ".join(shlex.quote(a) for a in pip_args))
    return body, f"{VENV}/bin/kvgate"


def _refuse_unsafe(label: str, value: str, *, in_script: bool) -> None:
    """ValueError for a line break or control character anywhere (YAML and bash would both split on it), and
    for quotes, `$`, `\\`, backticks and spaces in values written unquoted (`in_script`)."""
    bad = unprintable(value) + ("".join(sorted({ch for ch in value if ch in SHELL_SPECIAL})) if in_script else "")
    if not value or bad:
        allowed = "no quote, '$', '\\\\', space, " if in_script else "no "
        raise ValueError(f"{label} {value!r} is empty or holds {bad!r}: {allowed}line break "
                         "or control character may reach a node's cloud-init")


def render_user_data(spec: ReplicaSpec, *, claim_id: str, pool: str, cluster: str, install: KvgateInstall,
                     version: str | None, drain_timeout_s: float = 30.0, health_deadline_s: int = 1800) -> str:
    """The `#cloud-config` text that starts `spec` on boot and registers it (see the module docstring).

    `install` is the pool's `aws.install` (where kvgate comes from) and `version` the release an index
    install pins when the pool names none; `health_deadline_s` is how long the register script waits
    for /health before tagging the replica failed (30 min covers a weights download).
    Raises ValueError for a value that could change the document's meaning (see `_refuse_unsafe`): ids come
    from kvgate, but pool names, sources and install locations are typed by a person."""
    checked = (("claim_id", claim_id), ("pool", pool), ("cluster", cluster), ("version", version),
               *((f"install.{k}", v) for k, v in install.model_dump().items()))
    for label, value in checked:
        if value is not None or label in ("claim_id", "pool", "cluster"):
            _refuse_unsafe(label, value or "", in_script=True)
    args = engine_args(spec, host="0.0.0.0", port=ENGINE_PORT, grpc_port=ENGINE_GRPC_PORT,
                       replica_id=claim_id, cache_dir="/var/cache/kvgate", drain_timeout_s=drain_timeout_s)
    for arg in args:
        _refuse_unsafe(f"engine argument of model {spec.model!r}", arg, in_script=False)
    # One flag and its value per line, shell-quoted and continued with backslashes: readable, and exact.
    lines: list[list[str]] = []
    for arg in args:
        if arg.startswith("--") or not lines:
            lines.append([arg])
        else:
            lines[-1].append(arg)
    block = " \\\n".join(" " * 8 + " ".join(shlex.quote(a) for a in line) for line in lines)
    body, kvgate = install_script(install, version)
    text = _TEMPLATE.substitute(
        claim_id=claim_id, pool=pool, cluster=cluster, model=spec.model, engine_args_block=block,
        stop_timeout_s=int(drain_timeout_s) + 5, health_deadline_s=int(health_deadline_s), port=ENGINE_PORT,
        ready_tag=READY_TAG, install_block=textwrap.indent(body, " " * 6), install_failed=INSTALL_FAILED,
        kvgate=shlex.quote(kvgate))
    _check_round_trip(text, [kvgate, "engine", *args], body)
    return text


def _check_round_trip(text: str, argv: list[str], install_body: str) -> None:
    """The document, parsed back, holds exactly what was meant: these files, these runcmd steps, this engine
    command and this install script. A value that got past `_refuse_unsafe` and still changed it fails here."""
    document = yaml.safe_load(text)
    files = {f["path"]: f["content"] for f in document.get("write_files", ())}
    engine = files.get("/usr/local/bin/kvgate-engine", "").split("exec ", 1)[-1]
    if (set(document) != {"write_files", "runcmd"} or len(files) != 4
            or shlex.split(engine.replace("\\\n", " ")) != argv
            or not files.get("/usr/local/bin/kvgate-install", "").endswith(install_body)):
        raise ValueError("the rendered user data does not parse back to what it must say; a value in the pool "
                         "or model reshaped it")


def user_data_payload(text: str) -> str | bytes:
    """What RunInstances gets: `text` as is when it fits EC2's 16,384 bytes (readable in the console and in
    /var/lib/cloud), else gzipped, which cloud-init reads as well (a model with ~130 adapters needs it).
    ValueError when even that does not fit."""
    raw = text.encode()
    if len(raw) <= EC2_USER_DATA_MAX_BYTES:
        return text
    packed = gzip.compress(raw, mtime=0)
    if len(packed) > EC2_USER_DATA_MAX_BYTES:
        raise ValueError(f"the node's user data is {len(raw):,} bytes ({len(packed):,} gzipped), over EC2's "
                         f"{EC2_USER_DATA_MAX_BYTES:,}; give the model fewer adapters at boot")
    return packed
