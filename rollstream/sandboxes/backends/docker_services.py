"""A docker sandbox with services (a Harbor compose task's sidecars): the shell script that starts
them and the main container, and the one that removes them all.

Every container sits on a network of the sandbox's own at an address fixed before any starts, and
each is told every other's by name (``--add-host``, main's ``main`` included): podman 4.3's Docker
API gives its networks no DNS, and a sidecar started before main could not learn main's address
later. The containers start in the order their ``depends_on`` asks (sidecars in the spec's order,
main last, unless a sidecar depends on main), each once its dependencies are started, healthy or
completed. rollstream runs a service's healthcheck itself (``docker exec``, at once, then every
interval): podman runs none without systemd. What a service does on its own (it exits, its
healthcheck gives up) fails the start marked as the service's (errors.SERVICE_FAILED_MARK, the
task's fault); running out of the spec's ``setup_timeout_s`` while waiting is the node's.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from typing import Protocol

from rollstream.sandbox_spec import HealthCheck, SandboxSpec, SidecarSpec

from ..errors import SERVICE_FAILED_MARK

MAIN = "main"
# The docker commands around the waits: network, address and container starts.
START_OVERHEAD_S = 120.0

_STATE = "{{.State.Running}} {{.State.ExitCode}}"
_SUBNET = "{{range .IPAM.Config}}{{.Subnet}} {{end}}"

# Bash functions the start script calls (time in ms; $1 a container, $2 its service's name).
_FUNCTIONS = r"""
rs_now() { local t=${EPOCHREALTIME/[.,]/}; echo $((10#$t / 1000)); }
rs_seconds() { printf '%d.%03d' $(($1 / 1000)) $(($1 % 1000)); }
rs_fail() { echo "$RS_MARK$*" | tr '\n' ' ' >&2; echo >&2; exit 1; }
rs_late() { echo "$* within the sandbox's setup timeout ($RS_BUDGET s)" >&2; exit 1; }
rs_logs() { "$RS_DOCKER" logs --tail 20 "$1" 2>&1 | tail -c 1500 | tr '\n' ' '; }
rs_state() { "$RS_DOCKER" inspect --format '%(state)s' "$1"; }
rs_running() {
  local running code
  read -r running code < <(rs_state "$1")
  [ "$running" = true ] || rs_fail "service $2 exited (exit code $code)$3; its last output: $(rs_logs "$1")"
}
rs_ip() {
  local n=$((RS_BASE + $1))
  echo "$((n >> 24 & 255)).$((n >> 16 & 255)).$((n >> 8 & 255)).$((n & 255))"
}
rs_healthy() {
  local c=$1 s=$2 every=$3 limit=$4 retries=$5 grace=$6 early=$7 began failed=0 probes=0 out now pause
  shift 7
  began=$(rs_now)
  while :; do
    if out=$(timeout -k 2 "$limit" "$RS_DOCKER" exec "$c" "$@" 2>&1); then return 0; fi
    rs_running "$c" "$s" " before it became healthy"
    now=$(rs_now)
    probes=$((probes + 1))
    # The probe at start is one Docker does not make (its first waits an interval): it never counts.
    if ((probes > 1 && now - began >= grace)); then failed=$((failed + 1)); fi
    ((failed < retries)) || rs_fail "service $s is unhealthy: its healthcheck failed $retries times in a row;" \
      "its last output: $(printf %s "$out" | tail -c 500)"
    pause=$every
    if ((now - began < grace)); then pause=$early; fi
    ((now + pause < RS_DEADLINE)) || rs_late "service $s did not become healthy"
    sleep "$(rs_seconds "$pause")"
  done
}
rs_completed() {
  local running code
  while :; do
    read -r running code < <(rs_state "$1")
    [ "$running" = true ] || break
    (($(rs_now) + 200 < RS_DEADLINE)) || rs_late "service $2 did not complete"
    sleep 0.2
  done
  [ "$code" = 0 ] || rs_fail "service $2 exited with code $code, where what depends on it needs it to complete" \
    "successfully; its last output: $(rs_logs "$1")"
}
""".replace("%(state)s", _STATE)


class Dependent(Protocol):
    """What the start order reads of a service (a spec's SidecarSpec, a compose file's service)."""

    @property
    def name(self) -> str: ...
    @property
    def depends_on(self) -> Mapping[str, str]: ...
    @property
    def healthcheck(self) -> HealthCheck | None: ...


def start_order(services: Sequence[Dependent], main_depends_on: Mapping[str, str]) -> list[str]:
    """The containers' start order (service names, ``main`` for the sandbox's own): each after what
    it depends on, else in the services' order, main last; ValueError on names that are not
    distinct, a name that is not another container, a circle, a wait for health without a
    healthcheck, or a wait main cannot satisfy (it runs the sandbox's own command, no service of
    the task's)."""
    needs: dict[str, Mapping[str, str]] = {**{s.name: s.depends_on for s in services}, MAIN: main_depends_on}
    if len(needs) != len(services) + 1:
        raise ValueError(f"services must have distinct names other than {MAIN!r}: {[s.name for s in services]}")
    healthchecked = {s.name for s in services if s.healthcheck is not None}
    for name, deps in needs.items():
        for dep, condition in deps.items():
            if dep not in needs or dep == name:
                raise ValueError(f"{name} depends on {dep!r}, which is not another service of the sandbox")
            if dep == MAIN and condition != "service_started":
                raise ValueError(f"{name} waits for {MAIN} to be {condition}; {MAIN} runs the sandbox's own command, "
                                 "so only service_started can be waited for")
            if condition == "service_healthy" and dep not in healthchecked:
                raise ValueError(f"{name} waits for {dep} to be healthy, but {dep} has no healthcheck")
    order: list[str] = []
    waiting = list(needs)
    while waiting:
        ready = next((n for n in waiting if set(needs[n]) <= set(order)), None)
        if ready is None:
            raise ValueError(f"the services' depends_on make a circle among {sorted(waiting)}")
        order.append(ready)
        waiting.remove(ready)
    return order


def _ms(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))


def _health_wait(container: str, service: str, check: HealthCheck) -> str:
    q = shlex.quote
    return " ".join(["rs_healthy", q(container), q(service), _ms(check.interval_s), f"{check.timeout_s:g}",
                     str(check.retries), str(round(check.start_period_s * 1000)), _ms(check.start_interval_s),
                     *map(q, check.test)])


def services_script(docker: str, spec: SandboxSpec, containers: dict[str, str], network: str, label: str,
                    policy: list[str], main_argv: list[str]) -> tuple[list[str], list[str], float]:
    """(start, cleanup, start timeout) of a sandbox with services. ``containers`` names each
    service's container (``main`` the sandbox's), ``policy`` the flags every one gets, ``main_argv``
    the sandbox's own ``docker run``. A failed start removes what it made; the cleanup (the
    supervisor's stop, the reaper's after a killed worker) removes it all."""
    q = shlex.quote
    order = start_order(spec.services, spec.depends_on)
    services = {s.name: s for s in spec.services}
    cleanup = (f"{q(docker)} rm --force {' '.join(q(containers[n]) for n in order)} >/dev/null 2>&1; "
               f"{q(docker)} network rm {q(network)} >/dev/null 2>&1; true")
    # Addresses from .2 (.1 is the network's gateway), in start order.
    address = {name: index + 2 for index, name in enumerate(order)}
    hosts = " ".join(f"--add-host {q(name)}:$(rs_ip {address[name]})" for name in order)
    lines = ["set -e", _FUNCTIONS,
             f"RS_DOCKER={q(docker)} RS_MARK={q(SERVICE_FAILED_MARK)} RS_BUDGET={spec.setup_timeout_s:g}",
             f"RS_DEADLINE=$(($(rs_now) + {_ms(spec.setup_timeout_s)}))",
             f"trap 'status=$?; if [ $status != 0 ]; then {cleanup}; fi' EXIT",
             f"{q(docker)} network create {'' if spec.network else '--internal '}--label {q(label)} {q(network)} "
             ">/dev/null",
             f"read -r subnet _ < <({q(docker)} network inspect --format {q(_SUBNET)} {q(network)})",
             f'case "$subnet" in *.*.*.*/*) ;; *) echo "network {network} has no IPv4 subnet: $subnet" >&2; exit 1;; '
             "esac",
             'IFS=./ read -r a b c d bits <<<"$subnet"',
             f'(((1 << (32 - bits)) > {len(order) + 2})) || {{ echo "network {network} ($subnet) is too small" >&2; '
             "exit 1; }",
             "RS_BASE=$(((a << 24) | (b << 16) | (c << 8) | d))",
             f"RS_HOSTS=\"{hosts}\""]
    awaited_exit = set()
    waited: set[tuple[str, str]] = set()
    for name in order:
        deps = spec.depends_on if name == MAIN else services[name].depends_on
        for dep, condition in deps.items():
            if condition == "service_started" or (dep, condition) in waited:
                continue  # `docker run --detach` returns once the container started
            waited.add((dep, condition))
            if condition == "service_healthy":
                check = services[dep].healthcheck
                assert check is not None  # start_order refused a wait for a healthcheck that is not there
                lines.append(_health_wait(containers[dep], dep, check))
            else:
                awaited_exit.add(dep)
                lines.append(f"rs_completed {q(containers[dep])} {q(dep)}")
        argv = main_argv if name == MAIN else _sidecar_argv(docker, services[name], containers[name], policy)
        lines.append(_run_line(argv, network, address[name]) + " >/dev/null")
    for name in order:  # a sidecar that has exited by now, unless something waited for it to complete
        if name != MAIN and name not in awaited_exit:
            lines.append(f"rs_running {q(containers[name])} {q(name)}")
    timeout = spec.setup_timeout_s + START_OVERHEAD_S
    return ["bash", "-c", "\n".join(lines), "rs-start"], ["bash", "-c", cleanup, "rs-cleanup"], timeout


def _sidecar_argv(docker: str, service: SidecarSpec, container: str, policy: list[str]) -> list[str]:
    argv = [docker, "run", "--detach", "--name", container, "--hostname", service.name, "--network", "none",
            *policy]
    for key, value in service.env.items():
        argv += ["--env", f"{key}={value}"]
    return argv + ["--", service.image, *(service.command or [])]


def _run_line(argv: list[str], network: str, address: int) -> str:
    """``docker run`` as shell text on the sandbox's network at its address, every name known."""
    at = argv.index("--network")
    argv = argv[:at] + ["--network", network] + argv[at + 2:]
    return f'{shlex.join(argv[:2])} $RS_HOSTS --ip "$(rs_ip {address})" {shlex.join(argv[2:])}'
