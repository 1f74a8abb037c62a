"""bench/ as an instrument: the device scripts (bash -n, their headers, the commands they would run, the A/B's
old tree), and the results kept under bench/results agreeing with the tables of bench/README.md and README.md
(each device's table is its JSON rendered, so a figure cannot come from another run)."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from specdec_tools.bench import report

REPO = Path(__file__).resolve().parents[1]
DEVICE = REPO / "bench" / "device"
SCRIPTS = sorted(DEVICE.glob("*.sh"))
RESULTS = REPO / "bench" / "results"


def dry_run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.isupper() or k in ("PATH", "HOME", "LANG", "TMPDIR")}
    full.update(DRY_RUN="1", OUT="/tmp/specdec-dry-run", **env)
    return subprocess.run(["bash", str(DEVICE / script), *args], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=60)


def test_at_most_three_device_scripts_each_parses_and_says_what_it_takes():
    assert [p.name for p in SCRIPTS] == ["ab.sh", "gpu_tests.sh", "table.sh"]
    assert not list((REPO / "bench").glob("*.sh")), "device scripts live in bench/device/"
    for script in SCRIPTS:
        subprocess.run(["bash", "-n", str(script)], check=True)
        header = "".join(line for line in script.read_text().splitlines(keepends=True)[:45] if line.startswith("#"))
        assert f"bench/device/{script.name}" in header
        assert "Parameters" in header and "Example" in header, script.name


def test_table_defaults_are_the_h100_tables_workloads_and_env_narrows_them():
    default = dry_run("table.sh")
    assert default.returncode == 0, default.stderr
    cmd = default.stdout.split()
    record = json.loads((RESULTS / "h100" / "bench_baseline_h100.json").read_text())
    recorded = record["command"].split()
    for flag in ("--preset", "--make-tiny", "--layers", "--max-tokens", "--repeats"):
        assert cmd[cmd.index(flag) + 1] == recorded[recorded.index(flag) + 1], flag
    for flag, values in (("--paths", ["gateway", "peer"]), ("--drafters", ["none", "mtp@3.39"]),
                         ("--concurrency", ["1", "16", "64"])):
        i, j = cmd.index(flag), recorded.index(flag)
        assert cmd[i + 1:i + 1 + len(values)] == recorded[j + 1:j + 1 + len(values)] == values
    assert "--draft-vocab" in cmd and "--trace-steps" not in cmd
    narrowed = dry_run("table.sh", PATHS="inproc peer", CONC="1 64", DV="0", TRACE="1", TAG="x").stdout.split()
    assert narrowed[narrowed.index("--paths") + 1:narrowed.index("--paths") + 3] == ["inproc", "peer"]
    assert narrowed[narrowed.index("--concurrency") + 1:narrowed.index("--concurrency") + 3] == ["1", "64"]
    assert "--draft-vocab" not in narrowed and "--trace-steps" in narrowed
    assert narrowed[narrowed.index("--tag") + 1] == "x"


def test_ab_runs_the_same_command_on_both_trees_in_the_given_order():
    run = dry_run("ab.sh", PASSES="old new new2 old2", CONC="16")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["old", "new", "new2", "old2"]
    trees = [line.split()[2].rstrip(":") for line in lines]
    assert trees == [f"{REPO}/.ab/old", str(REPO), str(REPO), f"{REPO}/.ab/old"]
    commands = [" ".join(re.sub(r"--(tag|out|time-budget) \S+", "", line.split(": ", 1)[1]).split())
                for line in lines]
    assert len(set(commands)) == 1 and "--concurrency 16 " in commands[0]
    assert dry_run("ab.sh", PASSES="old old").returncode == 2          # a pass's name names its files
    assert dry_run("ab.sh", PASSES="old new x").returncode == 2


def test_ab_prepare_puts_the_old_commit_without_tests_and_weights_in_a_side_folder(tmp_path):
    if shutil.which("git") is None or subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO,
                                                     capture_output=True).returncode:
        pytest.skip("not a git checkout")
    subprocess.run(["bash", str(DEVICE / "ab.sh"), "prepare", "HEAD"], cwd=REPO, check=True, capture_output=True,
                   env={**os.environ, "AB_DIR": str(tmp_path)}, timeout=120)
    old = tmp_path / "old"
    assert (old / "specdec" / "__main__.py").exists() and (old / "pyproject.toml").exists()
    assert not (old / "tests").exists() and not (old / "bench" / "results").exists()
    assert not list((old / "specdec" / "demo_model").glob("*.safetensors"))
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert (old / ".commit").read_text().strip() == head


def test_gpu_test_groups_name_existing_files_with_gpu_tests():
    def files(group: str) -> list[str]:
        run = dry_run("gpu_tests.sh", GROUP=group)
        assert run.returncode == 0, run.stderr
        return [w for w in run.stdout.split() if w.startswith("tests/")]
    with_gpu = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py") if "pytest.mark.gpu" in p.read_text()}
    engine, startup, rest, everything = (files(g) for g in ("engine", "startup", "rest", "all"))
    assert set(engine) <= with_gpu and set(startup) <= with_gpu
    assert set(engine) | set(startup) | set(rest) == set(everything) == with_gpu
    assert not set(rest) & (set(engine) | set(startup))
    assert dry_run("gpu_tests.sh", GROUP="nope").returncode == 2
    picked = dry_run("gpu_tests.sh", TESTS="tests/test_gpu.py", K="fast_path").stdout.split()
    assert picked[-3:] == ["tests/test_gpu.py", "-k", "fast_path"]


@pytest.mark.parametrize("device", ["h100", "h200", "h100x2", "h200x2"])
def test_each_devices_table_in_bench_readme_is_its_kept_json(device):
    """One run per preset and device (and shape / tensor-parallel size on several GPUs) is kept (JSON, its table,
    its plot); bench/README.md shows each table."""
    folder = RESULTS / device
    kept = sorted({p.stem for p in folder.iterdir()})
    files = sorted(p.name for p in folder.iterdir())
    assert kept and files == sorted(f"{s}.{e}" for s in kept for e in ("json", "png", "txt"))
    assert all(re.fullmatch(rf"bench_[a-z]+_{device}(-[a-z0-9]+)*", s) for s in kept), kept
    readme = (REPO / "bench" / "README.md").read_text()
    for stem in kept:
        record = json.loads((folder / f"{stem}.json").read_text())
        assert report.render_table(record).strip() == (folder / f"{stem}.txt").read_text().strip()
        for line in report.render_table(record, markdown=True).splitlines()[1:]:
            assert line in readme, line


def test_readme_speed_table_is_the_h100_runs_gateway_rows():
    record = json.loads((RESULTS / "h100" / "bench_baseline_h100.json").read_text())
    text = (REPO / "README.md").read_text()
    speed = text[text.index("## Speed on a GPU"):]
    speed = speed[:speed.index("\n## ", 1)]
    for r in record["results"]:
        w, m = r["workload"], r["metrics"]
        if w["path"] == "gateway":
            assert f"{m['output_tokens_per_s']:.1f}" in speed and f"{m['ttft_ms_p50']:.1f}" in speed, r["name"]


def test_bench_docs_name_only_files_the_repository_has():
    for doc in (REPO / "bench" / "README.md", REPO / "bench" / "gdn_state_traffic.md", *SCRIPTS):
        text = doc.read_text()
        for path in set(re.findall(r"(?<![\w/.])bench/[\w./{},-]*[\w}]", text)):
            if "results/h100_" in path:            # a folder of an old commit, named with `git show`
                continue
            for one in expand(path):
                assert (REPO / one).exists(), f"{doc.name} names {one}"


def expand(path: str) -> list[str]:
    """bench/results/{h100,h200}/x.{json,txt} -> every combination."""
    m = re.search(r"\{([^}]*)\}", path)
    if not m:
        return [path]
    return [p for alt in m.group(1).split(",") for p in expand(path[:m.start()] + alt + path[m.end():])]
