"""CI's run measures the times README states: `.ci/run` runs each step through `step`,
which prints the step's elapsed time, and README quotes those figures as the CI
machine's."""

import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CI_RUN = os.path.join(REPO, ".ci", "run")


def _ci_script() -> str:
    with open(CI_RUN) as f:
        return f.read()


def _run_step(*command: str) -> subprocess.CompletedProcess:
    """`step` of .ci/run (with its helper `elapsed`), run alone on `command`."""
    functions = re.findall(r"^(?:elapsed|step)\(\) \{\n.*?^\}\n", _ci_script(),
                           re.MULTILINE | re.DOTALL)
    assert len(functions) == 2, "cannot find elapsed() and step() in .ci/run"
    script = "".join(functions) + 'step "$@"\n'
    return subprocess.run(["bash", "-c", script, "bash", *command], capture_output=True,
                          text=True, timeout=60)


def test_ci_runs_every_command_as_a_timed_step():
    commands = []
    for line in re.sub(r"\s*\\\n\s*", " ", _ci_script()).splitlines():
        line = line.strip()
        if re.match(r"(step \"[^\"]*\" )?(make|apt_install) ", line):
            commands.append(line)
    assert any("make test-vllm" in c for c in commands) , commands
    assert any("make test-sglang" in c for c in commands), commands
    untimed = [c for c in commands if not c.startswith("step ")]
    assert not untimed, f".ci/run runs these without `step` (no elapsed time): {untimed}"
    assert 'echo "ci: all steps done in $(elapsed "$SECONDS")"' in _ci_script()


def test_step_prints_the_elapsed_time_and_keeps_the_status():
    done = _run_step("sleeping", "sleep", "1")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["ci: sleeping", "ci: done in 0:01: sleeping"]
    failed = _run_step("failing", "sh", "-c", "exit 3")
    assert failed.returncode == 3
    assert failed.stdout.splitlines() == [
        "ci: failing", "ci: failed (status 3) after 0:00: failing"]


def test_readme_states_the_test_time_as_measured_on_the_ci_machine():
    with open(os.path.join(REPO, "README.md")) as f:
        (development,) = re.findall(r"^## Development\n(.*?)^## ", f.read(),
                                    re.MULTILINE | re.DOTALL)
    text = " ".join(development.split())
    assert "on the 2-core CI machine" in text and "`.ci/run`" in text, text
    for target in ("`make test`", "`make test-vllm`"):
        assert re.search(re.escape(target) + r"[^.;]*?\d+:\d\d", text), (target, text)
